"""Ctrl-C / SIGTERM for the commands without a train loop (synth, serve, generate).

The trainers (train, sft, rl) set a flag (`train._StopFlag`) and stop at the next step with a
checkpoint. These commands have no step to finish: the signal raises `Interrupted` where the
main thread is, their `main` says in one line what was kept and exits 128 + signal (130 for
SIGINT, 143 for SIGTERM), as a shell reports a process ended by that signal.
"""

import contextlib
import signal
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):
  """SIGINT or SIGTERM arrived. A BaseException, as KeyboardInterrupt is, so the `except
  Exception` of code on the way up (an item's error handler) does not swallow it."""

  def __init__(self, signum: int):
    super().__init__(signum)
    self.signum = signum

  @property
  def name(self) -> str:
    return signal.Signals(self.signum).name

  @property
  def exit_code(self) -> int:
    return 128 + self.signum


def _raise(signum, frame):
  raise Interrupted(signum)


@contextlib.contextmanager
def raising():
  """Within: SIGINT and SIGTERM raise Interrupted in the main thread (SIGTERM would otherwise
  end the process with no word, SIGINT with a KeyboardInterrupt traceback)."""
  if threading.current_thread() is not threading.main_thread():
    yield         # only the main thread may set handlers; a caller's thread keeps its own
    return
  old = {s: signal.signal(s, _raise) for s in SIGNALS}
  try:
    yield
  finally:
    for s, h in old.items():
      signal.signal(s, h)
