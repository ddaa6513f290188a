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


# -- dependencies run one way ----------------------------------------------------------------

def _module_files() -> dict:
  """{module name: file} of k2jax and its kernels (installed as k2jax.kernels)."""
  out = {}
  for base, prefix in ((os.path.join(REPO, "k2jax"), "k2jax"),
                       (os.path.join(REPO, "kernels"), "k2jax.kernels")):
    for dirpath, _, names in os.walk(base):
      for name in names:
        if name.endswith(".py") and name != "__main__.py":
          rel = os.path.relpath(os.path.join(dirpath, name), base)[:-3].replace(os.sep, ".")
          mod = prefix if rel == "__init__" else f"{prefix}.{rel.removesuffix('.__init__')}"
          out[mod] = os.path.join(dirpath, name)
  return out


def import_graph(files: dict) -> dict:
  """{module: the k2jax modules it imports}, imports inside functions included (they hide a
  circle from Python, not from a reader). A package's `__init__` importing its own modules
  and a module importing its own package are not edges."""
  import ast

  def owner(name):
    while name and name not in files:
      name = name.rpartition(".")[0]
    return name

  graph = {}
  for mod, path in files.items():
    deps = set()
    for node in ast.walk(ast.parse(open(path).read())):
      names = []
      if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        names = [f"{node.module}.{a.name}" for a in node.names]
      deps |= {owner(n) for n in names if n.startswith("k2jax")}
    graph[mod] = {d for d in deps if d and d != mod and not mod.startswith(d + ".")
                  and not d.startswith(mod + ".")}
  return graph


def circles(graph: dict) -> list[list[str]]:
  """The strongly connected components of more than one module (Tarjan's algorithm)."""
  index, low, stack, on, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in sorted(graph.get(v, ())):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while not comp or comp[-1] != v:
        comp.append(stack.pop())
        on.discard(comp[-1])
      if len(comp) > 1:
        out.append(sorted(comp))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out


def test_no_import_circles():
  graph = import_graph(_module_files())
  assert len(graph) > 50 and graph["k2jax.compile"] >= {"k2jax.plan", "k2jax.xla_target"}
  assert circles(graph) == []


def test_a_circle_through_a_function_level_import_is_found(tmp_path):
  (tmp_path / "a.py").write_text("import k2jax.b\n")
  (tmp_path / "b.py").write_text("def f():\n  from k2jax import a\n")
  (tmp_path / "c.py").write_text("from k2jax import a\n")
  graph = import_graph({f"k2jax.{n}": str(tmp_path / f"{n}.py") for n in "abc"})
  assert circles(graph) == [["k2jax.a", "k2jax.b"]]
