"""Test session setup: one persistent XLA compilation cache for the whole session.

Many tests compile the same small programs (in-process and in subprocesses, which inherit
the environment); the cache turns repeated compiles into lookups."""

import os
import shutil
import sys
import tempfile

import pytest

# Our code is importable as k2jax.* only (the editable install maps k2jax.kernels onto the
# top-level kernels/ folder). The repository root itself must not be on sys.path: its
# kernels/ (and tests/, experiments/, ...) would hide installed packages of the same name
# from third-party imports, as kernels/ hid Hugging Face's `kernels` from transformers 5.25
# (issue 61). `python -m pytest` puts the working directory first, and pytest-xdist copies
# that sys.path to its workers; pyproject's --import-mode=importlib keeps pytest from adding
# the root again, and registers tests/ as the package `tests` by its path, so `from tests
# import ...` still works. Python processes the tests start inherit PYTHONSAFEPATH, which
# stops `python -m` / `-c` / a script from putting their directory first; tests/ modules
# run as scripts through `tests.multidevice.python_module`.
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != os.path.realpath(REPO)]
os.environ["PYTHONSAFEPATH"] = "1"

# A cache of this run only: a fixed directory kept programs from earlier runs (an earlier
# checkout's included), so a run's time and what it compiled depended on what ran before it.
# Made where the session starts (pytest-xdist's workers start after, and inherit it; so do
# the tests' subprocesses) and removed when it ends; JAX_COMPILATION_CACHE_DIR set by the
# caller is kept.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _OWN_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(
      prefix="k2jax-test-xla-cache-")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
# The test extra installs libtpu so XLA:TPU can compile for TPU topologies (compile only,
# tests/test_tpu_*.py); with it installed JAX would also try to start a TPU backend here and
# print its failure in every process. CPU is the backend the suite runs on.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# libtpu lets one process per machine load it unless told otherwise; pytest-xdist's workers
# and the tests' subprocesses each compile for TPU
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def pytest_unconfigure(config):
  if "_OWN_CACHE" in globals() and not hasattr(config, "workerinput"):
    shutil.rmtree(_OWN_CACHE, ignore_errors=True)


@pytest.fixture(autouse=True, scope="module")
def _release_executables():
  """Every compiled executable of a test module is freed when the module ends.

  XLA:CPU maps each loaded executable's code into the process (about 6 memory maps for a
  small one, hundreds for a train step), and jit caches keep them as long as the jitted
  function lives (module-level functions, configs' cached closures). Over the suite's one
  process the maps passed 10,000 within the first 133 tests; Linux refuses a process more
  than vm.max_map_count (65,530) and LLVM's loader then crashed: twice a fresh-clone run
  died with a segmentation fault inside `backend.deserialize_executable` at 85% of the
  suite, on whichever thread loaded the next executable. jax.clear_caches() drops them."""
  yield
  import gc
  import jax
  jax.clear_caches()
  gc.collect()


@pytest.fixture(scope="module")
def no_persistent_cache():
  """For modules that compile for TPU topologies (tests/test_tpu_*.py: compile only). The
  session's persistent cache would store their TPU executables, and reading one back needs a
  TPU client: each later read fails with a warning ("PjRtCompiler must be constructed with a
  Client", libtpu 0.0.42.1) and compiles again. Nothing there is worth storing, so nothing is
  (k2jax.compile turns the cache off for topologies for the same reason)."""
  import jax
  key = "jax_persistent_cache_min_compile_time_secs"
  old = jax.config.values[key]
  jax.config.update(key, 1e9)
  yield
  jax.config.update(key, old)
