"""Sharded training on simulated CPU devices (subprocesses: the device count is fixed at JAX
start): meshes agree with one device, ZeRO-1 shards optimizer state, checkpoints move between
meshes, and two jax.distributed processes agree with one. The pipeline's meshes are in
test_pipeline_meshes.py."""

import concurrent.futures
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.multidevice import (CLI, NO_CHECKPOINTS, REPO, assert_close, assert_states_close,
                               cli, cores_to_itself, env, finish, free_port, losses, result,
                               start_worker, worker)


@pytest.fixture
def cores():
  """The machine's cores to this test alone among the multi-device ones (cores_to_itself)."""
  with cores_to_itself():
    yield


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """One device, and 8-device meshes, trained for 4 steps: {mesh: {step: [loss, max]}}; the
  /b16 runs use 16-row batches, /a2 two microbatches."""
  out = tmp_path_factory.mktemp("meshes")
  one = start_worker(1, "meshes", str(out / "one"), "1x1", "1x1/b16", "--", *CLI,
                     *NO_CHECKPOINTS)
  eight = start_worker(8, "meshes", str(out / "eight"), "2x4", "8x1", "1x8", "4x2", "2x4/b16/a2",
                       "2x2/c2", "1x1x1/c8", "--", *CLI, *NO_CHECKPOINTS)
  runs = {**result(one), **result(eight)}  # the two compile concurrently, one per core
  runs["dirs"] = {m: out / ("one" if m in ("1x1", "1x1/b16") else "eight") / m.replace("/", "_")
                  for m in runs}
  return runs


def test_meshes_match_one_device(runs):
  """Losses and max logits of each step (rel < 1e-5), and every leaf of the final train
  state: the optimizer's moments sum the gradients, so every gradient leaf is compared
  (test_pipeline_meshes shows the comparison failing on a wrong leaf)."""
  for mesh in ("2x4", "8x1", "1x8", "4x2"):
    assert_close(runs[mesh], runs["1x1"])
    assert_states_close(runs["dirs"][mesh], runs["dirs"]["1x1"])


def test_context_parallel_training_matches_one_device(runs):
  """The trainer (MuonClip, ZeRO-1, packed documents) with each sequence split over context
  devices: data 2 x context 2 x expert 2 and context 8 (chunks of 2 tokens) give one
  device's losses, max logits and final train state (every gradient leaf: see above)."""
  for mesh in ("2x2/c2", "1x1x1/c8"):
    assert_close(runs[mesh], runs["1x1"])
    assert_states_close(runs["dirs"][mesh], runs["dirs"]["1x1"])


def test_grad_accumulation_on_a_sharded_mesh_matches_one_device(runs):
  """data=2 x expert=4 with two microbatches (each spanning all 8 devices) gives the losses,
  max logits and final train state of one device with the whole batch at once."""
  assert_close(runs["2x4/b16/a2"], runs["1x1/b16"])
  assert_states_close(runs["dirs"]["2x4/b16/a2"], runs["dirs"]["1x1/b16"])


def test_expert_parallel_transports_equal_a_float64_reference():
  """Padded, bucketed and ragged (emulated on CPU) all-to-all dispatch give every token
  sum_k w_k expert_k(x) and the gradients of x, the combine weights and the expert matrices
  for even, random, skewed and all-to-one routing (dropless everywhere), with the residuals
  the forward kept (even; padded keeps its one worst-case size) and with the exchange
  recomputed in the backward pass (skewed, all-to-one), under every remat policy; FP8
  storage equals a reference that rounds the same saved values through E4M3."""
  shares = [start_worker(8, "ep_transports", f"{i}/2") for i in (0, 1)]   # one per core
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    errors = {k: v for part in pool.map(result, shares) for k, v in part.items()}
  assert len(errors) == 11
  for case, err in errors.items():
    if case.endswith("/rounded"):
      # FP8: each gradient's entries equal a reference that rounds the same values through
      # E4M3, but for the few fed by a value f32 and f64 round to neighbouring numbers
      assert max(err.values()) < 0.05, (case, err)
      continue
    if case.endswith("/unrounded"):       # what skipping the rounding would give: fails
      assert min(err.values()) > 0.5, (case, err)
      continue
    assert err["y"] < 1e-5, (case, err)       # FP8 storage never changes the forward pass
    if "fp8" not in case:
      assert max(err.values()) < 1e-5, (case, err)
  # the even routing took the stored path: its FP8 residuals are what moved the gradients
  assert min(v for n, v in errors["even/bucketed/selective/fp8"].items() if n != "y") > 1e-4


def test_embedding_exchange_equals_take_and_its_autodiff():
  """The embedding lookup with its rows read on the expert shard that holds them, and its
  written backward (k2jax.model.embedding: each token's cotangent row sent to that shard,
  summed there and over data), equal jnp.take bit for bit and jax.grad of it on one device
  to float64 rounding, on data 2 x expert 4, expert 8 and inside the pipeline's shard_map
  (pipeline 2 x expert 4), for a vocabulary the expert group divides and one it does not,
  ids repeated within and across devices, one device's tokens all one id, in 1, 5 and ep
  rounds, and with bf16 cotangents; the gradient is stored as the table is. A wrong routing
  (each row to the next shard) is far off both ways: the test can fail."""
  got = worker(8, "embedding")
  cases = got["cases"]
  assert len(cases) == 11
  for case, r in cases.items():
    assert r["exchanged"] and r["stored_as_table"] and r["forward_equal"], (case, r, got)
    assert r["err"] < (1e-14 if case.endswith("float64") else 1e-6), (case, r, got["seed"])
  wrong = cases["2x4/V264/r0/float64"]
  assert wrong["wrong_routing_err"] > 0.1 and not wrong["wrong_routing_forward_equal"]


def test_gradient_sums_reduce_into_zero1_slices():
  """pipeline._reduce: sums unreduced over the lead axes come out summed (against numpy on
  fresh random values) and in the target sharding, reduce-scattered where the target splits
  over a lead axis (onto a larger dimension first, then moved by an all-to-all, where one
  divides: the first and last cases); a target whose entry puts a lead axis before another
  axis is refused
  (None: the caller sums). The trainer's grad_shardings are the master weights' shardings."""
  r = worker(8, "reduce_into")
  for name in ("scatter_on_expert_dim", "scatter_on_free_dim", "both_leads",
               "both_leads_moved", "summed_not_scattered"):
    assert r[name]["spec_ok"], (name, r[name])
    assert r[name]["rel"] <= 1e-5, (name, r[name])
  assert r["lead_not_last"] is None
  assert r["grad_equals_master"] and r["grad_split_over_data"] > 0


def test_zero1_shards_optimizer_state_not_params():
  r = worker(8, "zero1")
  assert r["params_per_device"] == r["params_total"]      # params replicated over data
  assert not r["param_specs_mention_data"]
  # Muon momentum and Adam moments split 8 ways (tiny leaves that 8 does not divide stay whole).
  assert r["opt_per_device"] < 0.2 * r["opt_total"]


def test_muon_orthogonalizes_on_the_devices_holding_the_matrices_split_over_data():
  """Issue 22: with two MoE layers on every device holding the stack (pipeline 2 x expert 4,
  and data 4 x expert 2), Muon's compiled update gathers no expert stack (optax merges the
  [layers, experts] batch axes, which cost a full stack on every device before): no
  all-gather is larger than the largest whole-matrix stack a device holds; the routed
  experts' Newton-Schulz runs on the device's own matrices, 1 / data of them per data rank
  (ZeRO-1); and the sharded update equals the single-device one."""
  r = worker(8, "muon_local", "2x1x4", "1x4x2")
  for mesh, m in r.items():
    assert max(m["all_gathers"], default=0) <= m["whole_local"], (mesh, m)
    assert m["ns_batches"] == [m["share"]], (mesh, m)
    assert m["rel_err"] < 1e-5, (mesh, m)
  assert r["2x1x4"]["share"] == 8 and r["1x4x2"]["share"] == 4   # 2 layers x 4 or 8 / 4 experts


def test_checkpoint_moves_between_meshes(tmp_path, runs):
  src = tmp_path / "2x4"
  finish(cli(8, src, "--config.train.checkpoint_every=2", "--config.mesh.data=2",
             "--config.mesh.expert=4"))
  assert_close(losses(src), runs["2x4"])
  # ... onto data 2 x context 2 x expert 2 too: optimizer states split over data x context
  for devices, data, expert, context in ((8, 4, 2, 1), (1, 1, 1, 1), (8, 2, 2, 2)):
    dst = tmp_path / f"to_{data}x{expert}x{context}"
    shutil.copytree(src, dst)
    shutil.rmtree(dst / "checkpoints" / "4")   # resume from step 2 on the new mesh
    err = finish(cli(devices, dst, "--config.train.checkpoint_every=2",
                     f"--config.mesh.data={data}", f"--config.mesh.expert={expert}",
                     f"--config.mesh.context={context}"))
    assert "resumed from checkpoint step 2" in err
    assert_close(losses(dst), runs["2x4"])


def test_pallas_attention_per_batch_shard_equals_the_whole_batch():
  """Under a data 2 x expert 4 mesh the Pallas kernels (interpret mode) run per batch shard
  in shard_map and S_max is the pmax of the shards': output, S_max and dq / dk / dv equal
  the XLA attention over the whole batch."""
  errors = worker(8, "attend_shards")
  assert max(errors.values()) < 1e-5, errors


def test_each_process_feeds_the_rows_its_devices_hold():
  """process_batch_slice on 8 devices split into two 'processes' of 4: a pipeline axis
  across the processes means both feed every row; a data axis across them halves it."""
  code = """
import numpy as np, jax
from jax.sharding import Mesh
from k2jax import parallel
d = np.array(jax.devices())
out = {}
for name, shape in (("pipeline", (2, 2, 1, 2)), ("data", (1, 2, 1, 4))):
  sh = parallel.batch_sharding(Mesh(d.reshape(shape), parallel.MESH_AXES), 16)
  out[name] = [parallel.process_batch_slice(sh, 16, devices=list(d[4 * i:4 * i + 4]))
               for i in range(2)]
print("RESULT", out)
"""
  proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env(8),
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  got = eval(next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))[7:])
  assert got == {"pipeline": [(0, 1), (0, 1)], "data": [(0, 2), (1, 2)]}


def _wait_for_rows(path, n, procs, logs, timeout=600):
  deadline = time.time() + timeout
  while time.time() < deadline:
    if path.exists() and len(path.read_text().splitlines()) >= n:
      return
    if any(p.poll() is not None for p in procs):
      raise AssertionError(f"process exited early: {_tails(logs)}")
    time.sleep(0.2)
  for p in procs:
    p.kill()
  raise AssertionError(f"{path} did not reach {n} rows: {_tails(logs)}")


def _tails(logs):
  return " | ".join(f"{f.name}: {f.read_text()[-1500:]}" for f in logs)


@pytest.mark.slow
def test_two_processes_match_one_stop_together_and_survive_a_dead_peer(tmp_path, runs, cores):
  """2 processes x 4 devices train like one process with 8. SIGTERM to one process stops both
  at the same step with one checkpoint; the same command resumes both; SIGKILL of one then
  ends the other with an error in bounded time instead of a hang in a collective.

  On a loaded machine (CI's other worker beside it) the processes' compiles ended more than
  gloo's 30 s apart, and the run failed or hung at its first collective: the trainer now
  waits for every process's compile (train._compiled_on_every_process). Each process's
  stderr goes to a file, whose tail a failure shows."""
  port = free_port()
  run = tmp_path / "run"

  def launch(tag):
    logs = [tmp_path / f"{tag}{i}.stderr" for i in range(2)]
    procs = [cli(4, run, f"--coordinator_address=localhost:{port}", "--num_processes=2",
                 f"--process_id={i}", "--heartbeat_timeout=10", "--config.mesh.data=2",
                 "--config.mesh.expert=4", "--config.train.steps=100000",
                 "--config.train.checkpoint_every=100000", stderr=open(log, "w"))
             for i, log in enumerate(logs)]
    return procs, logs

  metrics = run / "metrics.jsonl"
  procs, logs = launch("first")
  _wait_for_rows(metrics, 5, procs, logs)
  procs[0].send_signal(signal.SIGTERM)          # only one host gets the signal
  for p in procs:
    p.wait(timeout=300)
  errs = [f.read_text() for f in logs]
  assert [p.returncode for p in procs] == [128 + signal.SIGTERM] * 2, errs[1][-2000:]
  saved = [d for d in os.listdir(run / "checkpoints") if d.isdigit()]
  assert len(saved) == 1
  assert sorted(os.listdir(run / "checkpoints" / saved[0] / "data")) == [
      "commit_success.txt", "process_0-of-2.json", "process_1-of-2.json"]
  assert_close(losses(run), runs["2x4"], steps=["1", "2", "3", "4"])

  procs, logs = launch("again")                 # same command: both resume
  _wait_for_rows(metrics, int(saved[0]) + 3, procs, logs)
  procs[1].send_signal(signal.SIGKILL)
  t0 = time.time()
  procs[0].wait(timeout=120)
  elapsed = time.time() - t0
  procs[1].wait()
  err = logs[0].read_text()
  assert f"resumed from checkpoint step {saved[0]}" in err
  assert procs[0].returncode != 0 and elapsed < 60, (elapsed, err[-2000:])
  assert "another process of the run died" in err or "heartbeat" in err, err[-2000:]


def test_two_processes_agree_on_a_damaged_checkpoint(tmp_path, runs, cores):
  """2 processes x 4 devices: a truncated newest checkpoint is quarantined once (by process
  0, behind a barrier) and both processes resume from the same earlier step, matching the
  one-process run."""
  def launch(steps):
    port = free_port()
    return [cli(4, tmp_path, f"--coordinator_address=localhost:{port}", "--num_processes=2",
                f"--process_id={i}", "--heartbeat_timeout=30", "--config.mesh.data=2",
                "--config.mesh.expert=4", f"--config.train.steps={steps}",
                "--config.train.checkpoint_every=2") for i in range(2)]
  for p in launch(4):
    finish(p)
  for root, _, files in os.walk(tmp_path / "checkpoints" / "4" / "state"):
    for f in files:
      if os.sep + "d" in root:
        with open(os.path.join(root, f), "r+b") as fh:
          fh.truncate(3)
  errs = [finish(p) for p in launch(4)]
  for err in errs:
    assert "checkpoint step 4 is damaged" in err and "resumed from checkpoint step 2" in err
  assert sorted(os.listdir(tmp_path / "corrupt_checkpoints")) == ["4"]
  assert_close(losses(tmp_path), runs["2x4"])
