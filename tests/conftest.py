"""Test session setup: one persistent XLA compilation cache for the whole session.

Many tests compile the same small programs (in-process and in subprocesses, which inherit
the environment); the cache turns repeated compiles into lookups."""

import os
import tempfile

os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), f"k2jax-test-xla-cache-{os.getuid()}"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
