"""Old module names that still import and still run: `k2jax.engine` is `k2jax.serving.engine`.

When the package's top was grouped into subpackages (training/, serving/, tools/), the
commands users type kept their names (`python -m k2jax.train`, `k2jax.compile`, ...) and so
did the imports users wrote (`from k2jax import checkpoint`). A finder on `sys.meta_path`
answers for each old name with the module itself, not a copy: `k2jax.checkpoint is
k2jax.training.checkpoint`, so patching one patches the other and there is one set of
module state. Under `python -m` (runpy) it hands over the new module's code, which runs as
`__main__` exactly as the old file did. Importing an old name warns (DeprecationWarning);
running a command by its old name does not: the command names are the interface.

(A file left at each old name, a shim, would do the same, at the price of putting back on
the package's top the 23 files the grouping took off it.)
"""

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

# old name -> where the module lives now
MOVED = {
    "k2jax.train": "k2jax.training.train",
    "k2jax.step": "k2jax.training.step",
    "k2jax.checkpoint": "k2jax.training.checkpoint",
    "k2jax.resume": "k2jax.training.resume",
    "k2jax.runlock": "k2jax.training.runlock",
    "k2jax.metrics": "k2jax.training.metrics",
    "k2jax.console": "k2jax.training.console",
    "k2jax.interrupt": "k2jax.training.interrupt",
    "k2jax.weights": "k2jax.training.weights",
    "k2jax.serve": "k2jax.serving.serve",
    "k2jax.generate": "k2jax.serving.generate",
    "k2jax.chat": "k2jax.serving.chat",
    "k2jax.engine": "k2jax.serving.engine",
    "k2jax.closing": "k2jax.serving.closing",
    "k2jax.plan": "k2jax.tools.plan",
    "k2jax.compile": "k2jax.tools.compile",
    "k2jax.compile_programs": "k2jax.tools.compile_programs",
    "k2jax.xla_heap": "k2jax.tools.xla_heap",
    "k2jax.xla_target": "k2jax.tools.xla_target",
    "k2jax.params": "k2jax.tools.params",
    "k2jax.plot": "k2jax.tools.plot",
    "k2jax.convert": "k2jax.tools.convert",
    "k2jax.export": "k2jax.tools.export_run",
}


class MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
  """Finds and loads each old name of `MOVED` as the module at its new name."""

  def __init__(self):
    self._specs = {}

  def find_spec(self, name, path=None, target=None):
    if name not in MOVED:
      return None
    real = importlib.util.find_spec(MOVED[name])   # imports the new parent, not the module
    return importlib.util.spec_from_loader(name, self, origin=real.origin)

  def create_module(self, spec):
    warnings.warn(f"{spec.name} is now {MOVED[spec.name]}", DeprecationWarning, stacklevel=2)
    module = importlib.import_module(MOVED[spec.name])
    self._specs[spec.name] = module.__spec__   # the machinery sets the alias's spec next
    return module

  def exec_module(self, module):
    # the module keeps its own name's spec (reload, pickle by reference, runpy)
    module.__spec__ = self._specs.pop(module.__spec__.name)

  def get_code(self, name):
    """The new module's code, for runpy (`python -m k2jax.compile`)."""
    real = importlib.util.find_spec(MOVED[name])
    return real.loader.get_code(MOVED[name])


def install() -> None:
  """First on `sys.meta_path`: an old name is always the moved module, even where a stale
  file of that name is left on the path (an editable install of an older checkout)."""
  if not any(isinstance(f, MovedFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, MovedFinder())
