"""Map `k2jax.kernels` onto the repository's kernels/ in a plain checkout (no pip install).

pyproject.toml installs kernels/ as `k2jax.kernels`; on a machine that only has the checkout
(a rented GPU) the scripts here call `map_kernels()` to get the same package without
installing. The caller puts the repository root on sys.path first (k2jax itself). Its own
module so that a script needs no other script for it.
"""

import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def map_kernels():
  """`k2jax.kernels` lives in kernels/ (pyproject maps it); map it without installing."""
  import k2jax  # noqa: F401
  if "k2jax.kernels" in sys.modules:
    return
  spec = importlib.util.spec_from_file_location(
      "k2jax.kernels", os.path.join(ROOT, "kernels", "__init__.py"),
      submodule_search_locations=[os.path.join(ROOT, "kernels")])
  mod = importlib.util.module_from_spec(spec)
  sys.modules["k2jax.kernels"] = mod
  spec.loader.exec_module(mod)
