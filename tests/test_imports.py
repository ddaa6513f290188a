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
  assert len(graph) > 50
  assert graph["k2jax.tools.compile"] >= {"k2jax.tools.plan", "k2jax.tools.xla_target"}
  assert circles(graph) == []


def _part(module: str) -> str:
  """The part of the package a module belongs to: k2jax.X for a subpackage X or a module
  at the top (k2jax.sft), k2jax.kernels for the kernels."""
  return ".".join(module.split(".")[:2])


def test_each_part_imports_only_what_its_docstring_allows():
  """Every subpackage's `__init__` (and sft.py, the one module at the top) ends its
  docstring's account with "May import: ..."; what its modules import (inside functions
  too) is within that, and no two parts import each other."""
  import ast
  import re
  files = _module_files()
  graph = import_graph(files)
  parts = sorted({_part(m) for m in files} - {"k2jax", "k2jax._moved"})
  assert {"k2jax.training", "k2jax.serving", "k2jax.tools", "k2jax.kernels"} <= set(parts)
  uses = {p: set() for p in parts}
  for mod, deps in graph.items():
    if _part(mod) in uses:
      uses[_part(mod)] |= {_part(d) for d in deps} - {_part(mod), "k2jax"}
  wrong = {}
  for p in parts:
    doc = ast.get_docstring(ast.parse(open(files[p]).read())) or ""
    said = re.search(r"May import: (.*?)(?:\n\n|$)", doc, re.S)
    assert said, f"{files[p]}: its docstring does not say what it may import"
    allowed = set(re.findall(r"k2jax\.\w+", said.group(1)))
    assert allowed <= set(parts), (p, allowed - set(parts))
    if uses[p] - allowed:
      wrong[p] = sorted(uses[p] - allowed)
  assert wrong == {}
  assert circles(uses) == []


def test_old_module_names_are_the_moved_modules_and_old_commands_run():
  """`from k2jax import checkpoint` still works and is the very module at its new place
  (one module state: patching one patches both); `python -m k2jax.params` still runs."""
  import importlib
  import warnings
  from k2jax import _moved
  for old, new in _moved.MOVED.items():
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      assert importlib.import_module(old) is importlib.import_module(new), old
    assert importlib.import_module(new).__spec__.name == new
    assert os.path.exists(os.path.join(REPO, *new.split(".")) + ".py")
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import k2jax
    sys.modules.pop("k2jax.closing", None)
    vars(k2jax).pop("closing", None)      # as in a fresh process
    from k2jax import closing
  assert closing is sys.modules["k2jax.serving.closing"]
  assert any("k2jax.serving.closing" in str(w.message) for w in caught)
  r = subprocess.run([sys.executable, "-m", "k2jax.params", "--config", "tiny"], cwd=REPO,
                     capture_output=True, text=True, timeout=300)
  assert r.returncode == 0 and "total" in r.stdout.lower(), r.stderr[-2000:]


def test_a_circle_through_a_function_level_import_is_found(tmp_path):
  (tmp_path / "a.py").write_text("import k2jax.b\n")
  (tmp_path / "b.py").write_text("def f():\n  from k2jax import a\n")
  (tmp_path / "c.py").write_text("from k2jax import a\n")
  graph = import_graph({f"k2jax.{n}": str(tmp_path / f"{n}.py") for n in "abc"})
  assert circles(graph) == [["k2jax.a", "k2jax.b"]]
