"""Our code is importable only as k2jax.*: no top-level folder of the repository hides an
installed package of the same name, in the test process or in the processes the tests start
(tests/conftest.py says how; kernels/ once hid Hugging Face's `kernels` from transformers)."""

import importlib.machinery
import importlib.metadata
import json
import os
import site
import subprocess
import sys

import pytest

from tests.multidevice import REPO, python_module

# Every top-level folder an import could name, but k2jax itself (installed under that name)
TOP = sorted(n for n in os.listdir(REPO) if n.isidentifier() and n != "k2jax"
             and os.path.isdir(os.path.join(REPO, n)))


def hidden(path: list, tmp_path) -> dict:
  """{name: the folder found instead} for each of TOP that a process with this sys.path
  would not import from a package of that name installed in site-packages (empty: none)."""
  installed = tmp_path / "site-packages"
  for name in TOP:
    os.makedirs(installed / name, exist_ok=True)
    (installed / name / "__init__.py").write_text("")
  sites = {os.path.realpath(p) for p in site.getsitepackages() + [site.getusersitepackages()]}
  at = next(i for i, p in enumerate(path) if os.path.realpath(p or os.curdir) in sites)
  path = path[:at] + [str(installed)] + path[at:]      # where pip puts installed packages
  found = {n: importlib.machinery.PathFinder.find_spec(n, path) for n in TOP}
  where = {n: os.path.dirname(s.origin) if s.origin else list(s.submodule_search_locations)[0]
           for n, s in found.items()}
  return {n: w for n, w in where.items() if os.path.dirname(w) != str(installed)}


def _sys_path(cmd) -> list:
  p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
  assert p.returncode == 0, p.stderr[-2000:]
  return json.loads(next(l for l in p.stdout.splitlines() if l.startswith("RESULT "))[7:])


def test_no_repository_folder_hides_an_installed_package(tmp_path):
  """In this process (started by `python -m pytest` in the repository), in `python -m` /
  `-c` processes the tests start there, and in tests/ modules run as scripts."""
  assert "kernels" in TOP and "tests" in TOP
  assert not hidden(sys.path, tmp_path)
  printed = "import json, sys; print('RESULT', json.dumps(sys.path))"
  assert not hidden(_sys_path([sys.executable, "-c", printed]), tmp_path)
  assert not hidden(_sys_path(python_module("tests.test_imports")), tmp_path)


def test_installed_kernels_is_hugging_faces():
  """transformers imports Hugging Face's `kernels`, which the test extra installs with it."""
  try:
    importlib.metadata.distribution("kernels")
  except importlib.metadata.PackageNotFoundError:
    pytest.skip("Hugging Face's kernels is not installed")
  import kernels
  assert os.path.realpath(os.path.dirname(kernels.__file__)) != os.path.realpath(
      os.path.join(REPO, "kernels"))
  assert hasattr(kernels, "get_kernel")   # its API, which transformers' hub_kernels uses


if __name__ == "__main__":
  print("RESULT", json.dumps(sys.path))
