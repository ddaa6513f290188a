"""Sharded training on simulated CPU devices (subprocesses: the device count is fixed at JAX
start): meshes agree with one device, ZeRO-1 shards optimizer state, checkpoints move between
meshes, and two jax.distributed processes agree with one."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A constant learning rate from step 1 (warmup 1, no decay): every update matters, and the
# first steps do not depend on train.steps, so a long run's prefix equals a short run.
CLI = ["--config=tiny", "--config.model.num_hidden_layers=3", "--config.train.batch_size=8",
       "--config.train.seq_len=32", "--config.train.log_every=1", "--config.train.steps=4",
       "--config.train.eval_batches=0", "--config.data.max_corpus_bytes=300000",
       "--config.optimizer.warmup_steps=1", "--config.optimizer.decay_steps=0",
       "--config.train.async_checkpoint=False"]
NO_CHECKPOINTS = ["--config.train.checkpoint_every=0"]


def env(devices):
  e = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
  e["PYTHONPATH"] = REPO + os.pathsep + e.get("PYTHONPATH", "")
  return e


def worker(devices, *args):
  p = subprocess.run([sys.executable, "-m", "tests.parallel_worker", *args], cwd=REPO,
                     env=env(devices), capture_output=True, text=True, timeout=900)
  assert p.returncode == 0, p.stderr[-3000:]
  return json.loads(next(l for l in p.stdout.splitlines() if l.startswith("RESULT "))[7:])


def cli(devices, workdir, *extra):
  return subprocess.Popen([sys.executable, "-m", "k2jax.train", *CLI, f"--workdir={workdir}",
                           *extra], cwd=REPO, env=env(devices), stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)


def finish(proc, timeout=900):
  _, err = proc.communicate(timeout=timeout)
  assert proc.returncode == 0, err[-3000:]
  return err


def losses(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return {str(r["step"]): [r["loss"], r["max_logit"]] for r in map(json.loads, f)}


def assert_close(got, want, rtol=1e-5, steps=None):
  steps = steps or sorted(want, key=int)
  np.testing.assert_allclose([got[s] for s in steps], [want[s] for s in steps], rtol=rtol)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """One device, and four 8-device meshes, trained for 4 steps: {mesh: {step: [loss, max]}}."""
  out = tmp_path_factory.mktemp("meshes")
  r = worker(1, "meshes", str(out / "one"), "1x1", "--", *CLI, *NO_CHECKPOINTS)
  r.update(worker(8, "meshes", str(out / "eight"), "2x4", "8x1", "1x8", "4x2", "--", *CLI,
                  *NO_CHECKPOINTS))
  return r


def test_meshes_match_one_device(runs):
  for mesh in ("2x4", "8x1", "1x8", "4x2"):
    assert_close(runs[mesh], runs["1x1"])  # loss and max logit of each step, rel < 1e-5


def test_zero1_shards_optimizer_state_not_params():
  r = worker(8, "zero1")
  assert r["params_per_device"] == r["params_total"]      # params replicated over data
  assert not r["param_specs_mention_data"]
  # Muon momentum and Adam moments split 8 ways (tiny leaves that 8 does not divide stay whole).
  assert r["opt_per_device"] < 0.2 * r["opt_total"]


def test_checkpoint_moves_between_meshes(tmp_path, runs):
  src = tmp_path / "2x4"
  finish(cli(8, src, "--config.train.checkpoint_every=2", "--config.mesh.data=2",
             "--config.mesh.expert=4"))
  assert_close(losses(src), runs["2x4"])
  for devices, data, expert in ((8, 4, 2), (1, 1, 1)):
    dst = tmp_path / f"to_{data}x{expert}"
    shutil.copytree(src, dst)
    shutil.rmtree(dst / "checkpoints" / "4")   # resume from step 2 on the new mesh
    err = finish(cli(devices, dst, "--config.train.checkpoint_every=2",
                     f"--config.mesh.data={data}", f"--config.mesh.expert={expert}"))
    assert "resumed from checkpoint step 2" in err
    assert_close(losses(dst), runs["2x4"])


def _free_port():
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_match_one_and_a_dead_peer_ends_the_run(tmp_path, runs):
  """2 processes x 4 devices train like one process with 8; then SIGKILL one of them: the
  other must exit with an error in bounded time instead of hanging in a collective."""
  port = _free_port()
  procs = [cli(4, tmp_path, f"--coordinator_address=localhost:{port}", "--num_processes=2",
               f"--process_id={i}", "--heartbeat_timeout=10", "--config.mesh.data=2",
               "--config.mesh.expert=4", "--config.train.steps=100000", *NO_CHECKPOINTS)
           for i in range(2)]
  metrics = tmp_path / "metrics.jsonl"
  deadline = time.time() + 600
  while time.time() < deadline and not (metrics.exists()
                                        and len(metrics.read_text().splitlines()) >= 5):
    assert all(p.poll() is None for p in procs), procs[0].stderr.read()[-3000:]
    time.sleep(0.2)
  procs[1].send_signal(signal.SIGKILL)
  t0 = time.time()
  _, err = procs[0].communicate(timeout=120)
  elapsed = time.time() - t0
  procs[1].communicate()
  assert_close(losses(tmp_path), runs["2x4"], steps=["1", "2", "3", "4"])
  assert procs[0].returncode != 0 and elapsed < 60, (elapsed, err[-2000:])
  assert "another process of the run died" in err or "heartbeat" in err, err[-2000:]
