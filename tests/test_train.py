"""The training CLI end to end: errors, resume exactness after SIGTERM and after a corrupt
checkpoint, NaN skipping, learning on the embedded corpus."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax.numpy as jnp
import numpy as np
import pytest

from k2jax import configs, metrics, step as step_lib, train

# A small, fast variant of the tiny preset (one dense + one MoE layer, short rows).
SMALL = ["--config.model.num_hidden_layers=2", "--config.train.batch_size=4",
         "--config.train.seq_len=32", "--config.train.log_every=1",
         "--config.data.max_corpus_bytes=400000", "--config.train.eval_batches=2",
         "--config.optimizer.warmup_steps=5", "--config.optimizer.decay_steps=10"]


def small_config(**train_kw):
  cfg = configs.get_config("tiny")
  cfg.model.num_hidden_layers = 2
  cfg.train.update(dict(batch_size=4, seq_len=32, log_every=1, eval_batches=2, **train_kw))
  cfg.data.max_corpus_bytes = 400_000
  cfg.optimizer.update(dict(warmup_steps=5, decay_steps=10))
  return cfg


def run_cli(workdir, *extra, check=True, timeout=600):
  cmd = [sys.executable, "-m", "k2jax.train", "--config", "tiny", f"--workdir={workdir}",
         *SMALL, *extra]
  p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
  if check and p.returncode != 0:
    raise AssertionError(f"rc={p.returncode}\n{p.stderr[-3000:]}")
  return p


def losses(workdir):
  return {r["step"]: r["loss"] for r in metrics.read(str(workdir)) if "loss" in r}


@pytest.mark.parametrize("args,fragment", [
    (["--config.train.nosuchkey=3"], "unknown config key in --config.train.nosuchkey=3"),
    (["--config.train.steps=abc"], "--config.train.steps=abc"),
    (["--config.model.num_experts_per_tok=99"],
     "model.num_experts_per_tok = 99: must be <= n_routed_experts (16)"),
    (["--config.mesh.data=3"], "mesh pipeline x data x expert = 1 x 3 x 1 = 3 devices"),
    (["--config.data.files=/nonexistent/*.txt"], "data.files"),
    (["--no-workdir"], "--workdir is required"),
])
def test_bad_input_is_one_line_and_exit_code_2(tmp_path, args, fragment):
  if args == ["--no-workdir"]:
    cmd = [sys.executable, "-m", "k2jax.train", "--config", "tiny"]
  else:
    cmd = [sys.executable, "-m", "k2jax.train", "--config", "tiny", f"--workdir={tmp_path}", *args]
  p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
  assert p.returncode == 2, p.stderr[-2000:]
  err_lines = [l for l in p.stderr.splitlines() if l.startswith("k2jax.train: error:")]
  assert len(err_lines) == 1 and fragment in err_lines[0], p.stderr[-2000:]


def test_sigterm_then_resume_reproduces_the_uninterrupted_run(tmp_path):
  steps = ["--config.train.steps=24", "--config.train.checkpoint_every=8",
           "--config.train.eval_every=12"]
  run_cli(tmp_path / "straight", *steps)
  want = losses(tmp_path / "straight")

  # Interrupt a second run with SIGTERM once it has logged a few steps.
  cmd = [sys.executable, "-m", "k2jax.train", "--config", "tiny",
         f"--workdir={tmp_path / 'stopped'}", *SMALL, *steps]
  proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  path = tmp_path / "stopped" / "metrics.jsonl"
  deadline = time.time() + 300
  while time.time() < deadline and proc.poll() is None:
    if path.exists() and len(path.read_text().splitlines()) >= 3:
      proc.send_signal(signal.SIGTERM)
      break
    time.sleep(0.05)
  _, err = proc.communicate(timeout=300)
  assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
  stopped_at = max(losses(tmp_path / "stopped"))
  assert 3 <= stopped_at < 24
  saved = sorted(int(d) for d in os.listdir(tmp_path / "stopped" / "checkpoints") if d.isdigit())
  assert saved[-1] == stopped_at  # the signal saved the step it stopped at

  run_cli(tmp_path / "stopped", *steps)  # same command: resumes
  got = losses(tmp_path / "stopped")
  assert sorted(got) == sorted(want)
  assert got == want  # bit-exact on CPU


def test_corrupt_latest_checkpoint_falls_back_to_previous(tmp_path):
  steps = ["--config.train.steps=12", "--config.train.checkpoint_every=6",
           "--config.train.eval_every=6"]
  run_cli(tmp_path, *steps)
  want = losses(tmp_path)
  # Damage the newest checkpoint's array data: truncate every data file of step 12.
  for root, _, files in os.walk(tmp_path / "checkpoints" / "12" / "state"):
    for f in files:
      if os.sep + "d" in root:
        with open(os.path.join(root, f), "r+b") as fh:
          fh.truncate(10)
  p = run_cli(tmp_path, *steps)
  assert "checkpoint step 12 is corrupt or partial" in p.stderr
  assert os.path.isdir(tmp_path / "corrupt_checkpoints" / "12")
  assert "resumed from checkpoint step 6" in p.stderr
  assert losses(tmp_path) == want


def test_nan_steps_are_skipped_and_counted(tmp_path, monkeypatch):
  original = step_lib.lm_loss

  def flaky(mcfg, params, batch):  # NaN on every third batch (by content), else normal
    ce, n, aux = original(mcfg, params, batch)
    bad = jnp.sum(batch["inputs"]) % 3 == 0
    return jnp.where(bad, jnp.nan, ce), n, aux

  monkeypatch.setattr(step_lib, "lm_loss", flaky)
  summary = train.train(small_config(steps=12, checkpoint_every=12, eval_every=12), str(tmp_path))
  rows = metrics.read(str(tmp_path))
  assert summary["step"] == 12 and rows[-1]["skipped_steps"] > 0
  finite = [r["loss"] for r in rows if np.isfinite(r["loss"])]
  assert len(finite) == 12 - rows[-1]["skipped_steps"]
  assert finite[-1] < finite[0]  # the skipped updates left the params intact: it still learns


def test_persistent_nan_stops_with_a_clear_message(tmp_path, monkeypatch):
  original = step_lib.lm_loss
  monkeypatch.setattr(step_lib, "lm_loss",
                      lambda *a: (lambda ce, n, aux: (ce * jnp.nan, n, aux))(*original(*a)))
  with pytest.raises(train.TrainingDiverged, match="NaN/Inf for 3 consecutive steps"):
    train.train(small_config(steps=20, max_nan_steps=3), str(tmp_path))


def test_learns_below_the_unigram_baseline(tmp_path):
  cfg = small_config(steps=80, eval_every=80, checkpoint_every=80)
  cfg.train.update(dict(batch_size=8, seq_len=64))
  cfg.data.max_corpus_bytes = 4_000_000  # enough files for a representative held-out split
  summary = train.train(cfg, str(tmp_path))
  assert summary["eval_loss"] < summary["unigram_baseline"] - 0.2
  from k2jax import plot
  assert os.path.getsize(plot.plot(str(tmp_path))) > 10_000
