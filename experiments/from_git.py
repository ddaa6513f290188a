"""A module as it was at a git revision, imported under a name of its own: the baseline a
benchmark measures beside today's code in the same run (an engine, a loader a change
replaced)."""

import importlib.util
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def module_at(rev: str, path: str, name: str, replace: tuple = ()):
  """The repository's file `path` at `rev` (or the first of several paths that rev has: a
  module that moved), imported as module `name` (registered in
  sys.modules, so another old module can import it by that name); `replace`: (old, new)
  pairs applied to its source first, e.g. to point its imports at other old modules."""
  for where in ([path] if isinstance(path, str) else path):   # the first that rev has
    r = subprocess.run(["git", "-C", ROOT, "show", f"{rev}:{where}"], capture_output=True,
                       text=True)
    if r.returncode == 0:
      break
  r.check_returncode()
  src = r.stdout
  for old, new in replace:
    src = src.replace(old, new)
  file = os.path.join(tempfile.mkdtemp(), f"{name}.py")
  with open(file, "w") as f:
    f.write(src)
  spec = importlib.util.spec_from_file_location(name, file)
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module
  spec.loader.exec_module(module)
  return module
