"""Test session setup: one persistent XLA compilation cache for the whole session.

Many tests compile the same small programs (in-process and in subprocesses, which inherit
the environment); the cache turns repeated compiles into lookups."""

import contextlib
import os
import tempfile

os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), f"k2jax-test-xla-cache-{os.getuid()}"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")


@contextlib.contextmanager
def persistent_cache_off():
  """No persistent-cache reads or writes while a k2jax.engine decode thread compiles.

  Twice in full fresh-clone runs (2026-11-26) the process died with a segmentation fault
  inside jax's cache read (`compilation_cache.get_executable_and_time`) on the engine's
  decode thread, in tests/test_synth.py's LocalClient test, after the rest of the suite had
  filled the shared cache; the same test alone with a warm cache passed 6 of 6. The
  served CLIs (serve, synth) never turn the cache on, so users do not take this path;
  the tests that run an engine in process compile fresh instead."""
  import jax
  from jax.experimental.compilation_cache import compilation_cache as cc
  before = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  cc.reset_cache()
  try:
    yield
  finally:
    jax.config.update("jax_enable_compilation_cache", before)
    cc.reset_cache()
