"""One process per run directory.

Two trainers on one workdir interleave metrics and overwrite each other's checkpoints, so
`k2jax.train`, `k2jax.sft` and `k2jax.rl` hold WORKDIR/.lock while they run. The lock is an
exclusive `fcntl.flock` on that file: the kernel drops it when its holder exits however it
exits (kill -9 included), so a dead run never blocks a rerun and there is no staleness to
guess (a pid file would need one). The file also records who holds it, for the message the
second process prints. On NFS, Linux maps flock onto POSIX byte-range locks, which the lock
server shares between clients; Lustre needs its `flock` mount option.

In a multi-host run process 0 alone takes the lock (a run is one lock, not one per host),
and every process learns the outcome, so all of them stop together.
"""

import datetime
import fcntl
import json
import os
import socket
import sys

import jax
import numpy as np

NAME = ".lock"


class RunBusy(RuntimeError):
  """Another live process holds the run directory."""


def _holder(path: str) -> str:
  try:
    with open(path) as f:
      h = json.load(f)
    return (f"pid {h['pid']} on {h['host']}, started {h['started']}: "
            f"{' '.join(h['argv'])[:160]}")
  except (OSError, ValueError, KeyError, TypeError):
    return "a process whose record could not be read"


class RunLock:
  """Held from `acquire` until `release` or the process's end.

  Args:
    workdir: the run directory (it must exist).
  """

  def __init__(self, workdir: str):
    self.path = os.path.join(workdir, NAME)
    self._fd = None

  def acquire(self) -> "RunLock":
    """Takes the lock on process 0; raises RunBusy (on every process) if it is held."""
    busy = ""
    if jax.process_index() == 0:
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        os.close(fd)
        busy = _holder(self.path)
      else:
        self._fd = fd
        record = {"pid": os.getpid(), "host": socket.gethostname(), "argv": sys.argv,
                  "started": datetime.datetime.now().isoformat(timespec="seconds")}
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(record).encode())
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils
      held = multihost_utils.broadcast_one_to_all(np.asarray(bool(busy)))
      busy = busy or ("process 0 found the run directory in use" if held else "")
    if busy:
      raise RunBusy(f"{os.path.dirname(self.path)} is in use by another run ({busy}); wait "
                    "for it to finish or stop it, or choose another --workdir")
    return self

  def release(self) -> None:
    if self._fd is not None:
      fcntl.flock(self._fd, fcntl.LOCK_UN)
      os.close(self._fd)
      self._fd = None

  def __enter__(self):
    return self.acquire()

  def __exit__(self, *exc):
    self.release()
