"""Faults around a run, injected: a second trainer on the workdir, a lock left by a killed
process, transient and persistent restore errors, damaged and repeatedly damaged checkpoints,
a full disk and a directory that stops taking writes. Each must leave the user one line to
act on and the run's last good checkpoint where it was."""

import errno
import json
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k2jax import configs, data as data_lib
from k2jax.training import checkpoint as ckpt_lib, runlock, train
from k2jax.training.checkpoint import (Checkpointer, CheckpointUnreadable, CheckpointWriteFailed)

from tests.test_train import SMALL


# --- one trainer per workdir ------------------------------------------------------------------

HOLD = ("import sys, time; from k2jax.training import runlock; runlock.RunLock(sys.argv[1]).acquire(); "
        "print('held', flush=True); time.sleep(600)")


def _holder(workdir):
  """A process holding workdir's lock, as a running trainer does."""
  os.makedirs(workdir, exist_ok=True)
  p = subprocess.Popen([sys.executable, "-c", HOLD, str(workdir)], stdout=subprocess.PIPE,
                       text=True)
  assert p.stdout.readline().strip() == "held"
  return p


@pytest.mark.parametrize("module", ["k2jax.train", "k2jax.sft", "k2jax.rl"])
def test_a_second_run_on_a_workdir_in_use_is_refused_and_writes_nothing(tmp_path, module):
  config = {"k2jax.train": "tiny", "k2jax.sft": "tiny_sft", "k2jax.rl": "tiny_rl"}[module]
  holder = _holder(tmp_path / "w")
  try:
    before = sorted(os.listdir(tmp_path / "w"))
    p = subprocess.run([sys.executable, "-m", module, "--config", config,
                        f"--workdir={tmp_path / 'w'}"], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 2, p.stderr[-2000:]
    (line,) = [l for l in p.stderr.splitlines() if "error:" in l]
    assert f"is in use by another run (pid {holder.pid} on " in line, line
    assert "Traceback" not in p.stderr
    assert sorted(os.listdir(tmp_path / "w")) == before    # no config.json, log or metrics
    assert holder.poll() is None                            # the first run goes on
  finally:
    holder.kill()
    holder.wait()


def test_a_lock_left_by_a_killed_process_does_not_block_a_rerun(tmp_path):
  holder = _holder(tmp_path)
  holder.send_signal(signal.SIGKILL)
  holder.wait()
  with open(tmp_path / runlock.NAME) as f:      # its record is still there ...
    assert json.load(f)["pid"] == holder.pid
  lock = runlock.RunLock(str(tmp_path)).acquire()   # ... but the kernel dropped its lock
  lock.release()


def test_two_trainers_started_apart_the_second_refused_the_first_finishes(tmp_path):
  cmd = [sys.executable, "-m", "k2jax.train", "--config", "tiny", f"--workdir={tmp_path}",
         *SMALL, "--config.train.steps=12"]
  first = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  deadline = time.time() + 120
  while not (tmp_path / "config.json").exists() and time.time() < deadline:
    time.sleep(0.1)
  second = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
  assert second.returncode == 2 and f"(pid {first.pid} on " in second.stderr, second.stderr
  _, err = first.communicate(timeout=300)
  assert first.returncode == 0, err[-2000:]
  rows = [json.loads(l)["step"] for l in open(tmp_path / "metrics.jsonl")]
  assert rows == list(range(1, 13))             # one writer: no interleaved steps


# --- restore: retry, quarantine only what is provably damaged, never start over -------------

def _small():
  cfg = configs.get_config("tiny")
  cfg.train.update(batch_size=4, seq_len=32)
  cfg.data.max_corpus_bytes = 100_000
  return data_lib.build(cfg.data, cfg.train, cfg.model.vocab_size)


def _state(step):
  return {"w": jnp.full((64, 33), float(step)), "b": jnp.arange(7.0) + step}


@pytest.fixture
def saved(tmp_path):
  """A workdir with sealed checkpoints at steps 1, 2, 3; returns (Checkpointer, data)."""
  data = _small()
  c = Checkpointer(str(tmp_path), keep=5, use_async=False, backoff_s=0.0)
  it = data.train_iter()
  for s in (1, 2, 3):
    c.save(s, _state(s), it, {"step": s})
  c.wait()
  for s in (1, 2, 3):
    assert os.path.exists(tmp_path / "checkpoints" / str(s) / ckpt_lib.MANIFEST)
  return c, data


def _abstract():
  return jax.eval_shape(lambda: _state(0))


def _truncate_data(step_dir):
  for root, _, files in os.walk(step_dir / "state"):
    for f in files:
      if os.sep + "d" in root:
        with open(os.path.join(root, f), "r+b") as fh:
          fh.truncate(3)


def test_a_transient_read_error_is_retried_and_costs_nothing(tmp_path, saved):
  c, data = saved
  real, calls = c.manager.restore, []

  def flaky(*a, **k):
    calls.append(1)
    if len(calls) <= 2:
      raise OSError(errno.EIO, "Input/output error")
    return real(*a, **k)
  c.manager.restore = flaky
  state, _, meta = c.restore_latest(_abstract(), data.train_iter)
  assert meta["step"] == 3 and len(calls) == 3
  np.testing.assert_array_equal(state["b"], _state(3)["b"])
  assert not os.path.exists(tmp_path / "corrupt_checkpoints")


def test_a_persistent_error_on_intact_files_moves_nothing_and_stops(tmp_path, saved):
  c, data = saved

  def denied(*a, **k):
    raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "checkpoints"))
  c.manager.restore = denied
  with pytest.raises(CheckpointUnreadable, match=r"checkpoint step 3 .* could not be read in 3 "
                     r"attempts \(PermissionError: .*nothing was moved"):
    c.restore_latest(_abstract(), data.train_iter)
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["1", "2", "3"]
  assert not os.path.exists(tmp_path / "corrupt_checkpoints")


def test_a_damaged_step_is_moved_aside_without_touching_an_earlier_quarantine(tmp_path, saved):
  c, data = saved
  earlier = tmp_path / "corrupt_checkpoints" / "3"
  os.makedirs(earlier)
  (earlier / "kept").write_text("an earlier quarantine of step 3")
  _truncate_data(tmp_path / "checkpoints" / "3")
  state, _, meta = c.restore_latest(_abstract(), data.train_iter)
  assert meta["step"] == 2
  np.testing.assert_array_equal(state["w"], _state(2)["w"])
  assert (earlier / "kept").read_text() == "an earlier quarantine of step 3"
  assert os.path.isdir(tmp_path / "corrupt_checkpoints" / "3.1" / "state")


def test_a_run_whose_every_checkpoint_is_damaged_stops_instead_of_starting_over(tmp_path, saved):
  c, data = saved
  for s in (1, 2, 3):
    _truncate_data(tmp_path / "checkpoints" / str(s))
  for _ in range(2):    # and again on the rerun, with nothing left in checkpoints/
    with pytest.raises(CheckpointUnreadable, match="no checkpoint of the run .* is left to "
                                                   "resume from"):
      c.restore_latest(_abstract(), data.train_iter)
  assert sorted(os.listdir(tmp_path / "corrupt_checkpoints")) == ["1", "2", "3"]


def test_a_missing_file_or_unreadable_record_is_damage_a_missing_record_is_not(tmp_path, saved):
  step = tmp_path / "checkpoints" / "2"
  assert ckpt_lib.damage(str(step)) is None
  os.remove(step / "meta" / "metadata")
  assert ckpt_lib.damage(str(step)) == "meta/metadata is missing"
  (step / ckpt_lib.MANIFEST).write_text('{"files": {')
  assert "integrity record" in ckpt_lib.damage(str(step))
  os.remove(step / ckpt_lib.MANIFEST)
  assert ckpt_lib.damage(str(step)) is None


# --- saving: a full disk or a directory that stops taking writes -----------------------------

def _enospc(*a, **k):
  try:  # orbax wraps the OSError of the write that failed
    raise OSError(errno.ENOSPC, "No space left on device")
  except OSError as e:
    raise RuntimeError("an orbax save error") from e


@pytest.mark.parametrize("use_async", [False, True])
def test_a_full_disk_names_the_path_and_space_and_keeps_the_last_checkpoint(tmp_path,
                                                                           use_async):
  data = _small()
  c = Checkpointer(str(tmp_path), keep=1, use_async=use_async)
  it = data.train_iter()
  c.save(1, _state(1), it, {"step": 1})
  c.wait()
  if use_async:   # the failure surfaces when the background save is waited for
    c.manager.wait_until_finished = _enospc
  else:
    c.manager.save = _enospc
  with pytest.raises(CheckpointWriteFailed, match=r"no space left on the device of "
                     rf"{tmp_path}/checkpoints while saving step 2: it needs about 0\.0 MB, "
                     r"[\d.]+ [MG]B are free; .*step 1 is the last good checkpoint"):
    c.save(2, _state(2), it, {"step": 2})
    c.wait()
  fresh = Checkpointer(str(tmp_path), keep=1, use_async=False)
  _, _, meta = fresh.restore_latest(_abstract(), data.train_iter)
  assert meta["step"] == 1


def test_a_tmpfs_that_fills_mid_run_ends_in_one_line_and_the_run_resumes(tmp_path):
  """A real full disk: a 24 MB tmpfs holds a few checkpoints of the small model, not all."""
  mnt = tmp_path / "mnt"
  mnt.mkdir()
  if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mnt)],
                    capture_output=True).returncode:
    pytest.skip("cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN)")
  try:
    cmd = [sys.executable, "-m", "k2jax.train", "--config", "tiny", f"--workdir={mnt}/w",
           *SMALL, "--config.train.steps=8", "--config.train.checkpoint_every=1",
           "--config.train.keep_checkpoints=100"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert p.returncode == 2, p.stderr[-3000:]
    (line,) = [l for l in p.stderr.splitlines() if l.startswith("k2jax.train: error:")]
    assert "no space left on the device of" in line and "B are free" in line, line
    assert "Traceback" not in p.stderr
    after = p.stderr.splitlines()[p.stderr.splitlines().index(line) + 1:]
    assert all(l.endswith("(traceback in train.log)") for l in after), after  # asyncio at exit
    done = sorted(int(d) for d in os.listdir(mnt / "w" / "checkpoints") if d.isdigit())
    assert done and f"step {done[-1]} is the last good checkpoint" in line
    assert ckpt_lib.damage(str(mnt / "w" / "checkpoints" / str(done[-1]))) is None
    assert len(p.stderr.splitlines()) < 60, p.stderr[-5000:]   # no pages of tracebacks
    # a library's line once (asyncio logged one per pending write: 35 alike, 61 lines in all)
    shown = [l.split(" ", 1)[1] for l in after if l.strip()]
    assert len(shown) == len(set(shown)), after
    for d in done[:-1]:   # the user frees space: older checkpoints go
      subprocess.run(["rm", "-rf", str(mnt / "w" / "checkpoints" / str(d))], check=True)
    p = subprocess.run(cmd[:-2] + ["--config.train.checkpoint_every=4",
                                   "--config.train.keep_checkpoints=1"],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and f"resumed from checkpoint step {done[-1]}" in p.stderr, \
        p.stderr[-3000:]
  finally:
    subprocess.run(["umount", "-l", str(mnt)])


def test_a_workdir_that_stops_taking_writes_mid_run_ends_in_one_line(tmp_path, monkeypatch,
                                                                   capsys):
  """Read-only storage (injected: root ignores file modes) at the second checkpoint."""
  import orbax.checkpoint as ocp
  real, saves = ocp.CheckpointManager.save, []

  def save(self, step, *a, **k):
    saves.append(step)
    if len(saves) > 1:
      raise PermissionError(errno.EROFS, "Read-only file system", f"{tmp_path}/checkpoints")
    return real(self, step, *a, **k)
  monkeypatch.setattr(ocp.CheckpointManager, "save", save)
  with pytest.raises(SystemExit) as e:
    train.main(["k2jax.train", "--config", "tiny", f"--workdir={tmp_path}", *SMALL,
                "--config.train.steps=4", "--config.train.checkpoint_every=2"])
  assert e.value.code == 2
  err = capsys.readouterr().err
  (line,) = [l for l in err.splitlines() if l.startswith("k2jax.train: error:")]
  assert ("saving checkpoint step 4 " in line and "Read-only file system" in line
          and "step 2 is the last good checkpoint" in line), line
  assert ckpt_lib.damage(str(tmp_path / "checkpoints" / "2")) is None


def test_train_log_on_a_full_disk_stays_quiet(tmp_path, capsys):
  """A record train.log cannot write (ENOSPC) is dropped silently: logging's default prints
  a '--- Logging error ---' traceback per record, burying the disk-full line (seen when the
  tmpfs above filled while the trainer logged). Other errors are still reported."""
  import logging

  class Full:
    def write(self, _):
      raise OSError(errno.ENOSPC, "No space left on device")

    def flush(self):
      pass
  handler = train._LogFile(str(tmp_path / "train.log"))
  handler.stream = Full()
  record = logging.LogRecord("k2jax.train", logging.INFO, __file__, 1, "step 5", None, None)
  handler.emit(record)
  assert "Logging error" not in capsys.readouterr().err
  Full.write = lambda self, _: (_ for _ in ()).throw(ValueError("not a disk problem"))
  handler.emit(record)
  assert "Logging error" in capsys.readouterr().err
