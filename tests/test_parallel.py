"""Sharded training on simulated CPU devices (subprocesses: the device count is fixed at JAX
start): meshes agree with one device, ZeRO-1 shards optimizer state, checkpoints move between
meshes, and two jax.distributed processes agree with one."""

import concurrent.futures
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
CLI = ["--config=tiny", "--config.model.num_hidden_layers=2", "--config.train.batch_size=8",
       "--config.train.seq_len=32", "--config.train.log_every=1", "--config.train.steps=4",
       "--config.train.eval_batches=0", "--config.data.max_corpus_bytes=300000",
       "--config.optimizer.warmup_steps=1", "--config.optimizer.decay_steps=0",
       "--config.train.async_checkpoint=False"]
NO_CHECKPOINTS = ["--config.train.checkpoint_every=0"]


def env(devices, cache=True):
  e = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
  if not cache:
    # Pipelined steps put collectives inside conditionals. Loaded from the persistent
    # compilation cache (tests/conftest.py), such a step has deadlocked XLA:CPU 0.10
    # (pipeline 2 x data 2 x expert 2: four devices at the ring's collective-permute, four at
    # an all-gather inside a branch) where the fresh compile of the same step runs.
    e.pop("JAX_COMPILATION_CACHE_DIR", None)
  e["PYTHONPATH"] = REPO + os.pathsep + e.get("PYTHONPATH", "")
  return e


def start_worker(devices, *args, cache=True):
  return subprocess.Popen([sys.executable, "-m", "tests.parallel_worker", *args], cwd=REPO,
                          env=env(devices, cache), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)


def result(proc):
  out, err = proc.communicate(timeout=900)
  assert proc.returncode == 0, err[-3000:]
  return json.loads(next(l for l in out.splitlines() if l.startswith("RESULT "))[7:])


def worker(devices, *args):
  return result(start_worker(devices, *args))


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
  """One device, and 8-device meshes, trained for 4 steps: {mesh: {step: [loss, max]}}; the
  /b16 runs use 16-row batches, /a2 two microbatches."""
  out = tmp_path_factory.mktemp("meshes")
  one = start_worker(1, "meshes", str(out / "one"), "1x1", "1x1/b16", "--", *CLI,
                     *NO_CHECKPOINTS)
  eight = start_worker(8, "meshes", str(out / "eight"), "2x4", "8x1", "1x8", "4x2", "2x4/b16/a2",
                       "--", *CLI, *NO_CHECKPOINTS)
  return {**result(one), **result(eight)}  # the two compile concurrently, one per core


def test_meshes_match_one_device(runs):
  for mesh in ("2x4", "8x1", "1x8", "4x2"):
    assert_close(runs[mesh], runs["1x1"])  # loss and max logit of each step, rel < 1e-5


def test_grad_accumulation_on_a_sharded_mesh_matches_one_device(runs):
  """data=2 x expert=4 with two microbatches (each spanning all 8 devices) gives the losses
  and max logits of one device with the whole batch at once."""
  assert_close(runs["2x4/b16/a2"], runs["1x1/b16"])


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
  for devices, data, expert in ((8, 4, 2), (1, 1, 1)):
    dst = tmp_path / f"to_{data}x{expert}"
    shutil.copytree(src, dst)
    shutil.rmtree(dst / "checkpoints" / "4")   # resume from step 2 on the new mesh
    err = finish(cli(devices, dst, "--config.train.checkpoint_every=2",
                     f"--config.mesh.data={data}", f"--config.mesh.expert={expert}"))
    assert "resumed from checkpoint step 2" in err
    assert_close(losses(dst), runs["2x4"])


# Deep enough to split: 1 dense + 8 MoE layers, 16-row batches, with the aux balance loss on
# so its token weighting across microbatches is checked too.
# A vocabulary of 266 (the byte tokenizer's 264 ids + 2 never seen) is not a multiple of 4
# or 8: the head's columns are padded to split over those pipelines.
# A dense layer 32 wide (not 384) so that the embedding and dense layer's residuals fit a
# one-layer stage's slot: the 4 x 3 mesh below runs the prefix overlay.
PIPE_CLI = [a.replace("num_hidden_layers=2", "num_hidden_layers=9").replace(
    "batch_size=8", "batch_size=16").replace("steps=4", "steps=3") for a in CLI] + [
    "--config.model.aux_loss_alpha=0.01", "--config.model.vocab_size=266",
    "--config.model.intermediate_size=32"]


@pytest.fixture(scope="module")
def pipeline_runs(tmp_path_factory):
  """One device with the whole batch, and pipelined meshes on 8 devices: PxDxE/aM/vV."""
  out = tmp_path_factory.mktemp("pipeline")
  one = start_worker(1, "meshes", str(out / "one"), "1x1", "--", *PIPE_CLI, *NO_CHECKPOINTS)
  # Two 8-device workers at once: each mesh's run is mostly its (single-threaded) compile,
  # so on CI's 2 cores the halves take about half the time one worker took (426 s).
  halves = [start_worker(8, "meshes", str(out / f"eight{i}"), *PIPELINE_MESHES[i::2], "--",
                         *PIPE_CLI, *NO_CHECKPOINTS, cache=False) for i in (0, 1)]
  # read all three at once: a worker blocked on a full stderr pipe would wait for the others
  with concurrent.futures.ThreadPoolExecutor(3) as pool:
    parts = list(pool.map(result, [one, *halves]))
  return {k: v for part in parts for k, v in part.items()}


# PxDxE/aM/vV/sSCHEDULE; the 1f1b schedule unless named. Each mesh compiles its own
# pipelined step (the fixture is the suite's longest), so each covers something the others
# do not: V = 1 with data and expert nested; V = 3 over an uneven split; V = 2 with data and
# expert; GPipe; pipeline 4 and 8 with per-device skipping; the B/W-split zbh1 schedule
# (k2jax.parallel.bwsplit) over the uneven V = 3 split with data and expert (the MoE's
# shard_map cut in two, the experts' weight gradients W's), and on pipeline 8 with
# per-device skipping.
# "kdevice": idle phases skipped per device, as on GPU / TPU (CPU's default skips per tick);
# on meshes where XLA:CPU places no collective-permute inside a branch, so it runs here
# (4 x 3 stages of 1 for 8 layers: stage 0 and the last stages are padding, skipped per
# layer; stage 0 keeps the embedding and dense layer's residuals in its slot,
# pipeline._Overlay, under expert parallelism: with the expert exchange's residuals as bins
# this mesh's third loss was 7.7e-4 off). "o": model.offload, the residual (and
# zbh1's cut) slots in host memory (pipeline._Slots; the transfers are no-ops on CPU, the
# slot logic with its write-only slot is what runs). "g": zbh1 on its grid of one task per
# device and tick (schedules._grid: the table stages of equal cost get; the tiny model's
# traced costs, W 4-7x B, pick 1F1B's ticks with the W's placed in them, which the V = 3
# mesh runs): stage outputs wait in slots for ticks, B's and W's run ticks apart.
PIPELINE_MESHES = ("2x2x2/a2", "2x2x2/v3/a4/szbh1/o", "2x2x2/v2/a4",
                   "4x1x2/v2/a4/sgpipe", "4x1x2/v3/a4/kdevice/o", "8x1x1/a8/kdevice/szbh1/g")


@pytest.mark.parametrize("mesh", PIPELINE_MESHES)
def test_pipeline_matches_one_device(pipeline_runs, mesh):
  """pipeline=2 x data=2 x expert=2; 8 MoE layers over 2 x 3 = 6 stages (2 per stage, the
  last two stages padding; zbh1); two groups of microbatches through 2 x 2 stages over data and
  expert; the GPipe schedule on pipeline=4 x 2 virtual over expert=2; idle phases skipped
  per device on pipeline 4 and 8: losses and max logits of one device with the whole batch
  (rel < 1e-5)."""
  assert_close(pipeline_runs[mesh], pipeline_runs["1x1"])


def test_the_pipeline_fixture_runs_the_prefix_overlay_under_expert_parallelism():
  """The check the pipeline runs (pipeline.keeps_prefix, traced) says the fixture's
  4 x 3 stage, expert 2 mesh keeps the prefix, so its equality with one device covers the
  overlay on 8 devices; at the tiny preset's dense width (384) it would not fit."""
  from k2jax import configs
  from k2jax.parallel import pipeline
  # PIPE_CLI's model overrides applied here (train.parse defines absl flags: once per process)
  m = configs.get_config("tiny").model
  for a in PIPE_CLI:
    if a.startswith("--config.model."):
      key, value = a[len("--config.model."):].split("=")
      m[key] = type(m[key])(float(value)) if isinstance(m[key], float) else int(value)
  assert (m.num_hidden_layers, m.intermediate_size) == (9, 32)
  seq_len = 32
  assert f"--config.train.seq_len={seq_len}" in PIPE_CLI
  assert pipeline.keeps_prefix(m, 4, 3, 1, 2, seq_len)
  m.intermediate_size = 384
  assert not pipeline.keeps_prefix(m, 4, 3, 1, 2, seq_len)


def test_pipeline_checkpoint_moves_to_one_device_and_back(tmp_path, pipeline_runs):
  """Checkpoints hold the logical layer order: 8 MoE layers stored as 2 x 3 stages of 2 (4
  padding rows, stages round-robin) resume on one device and back."""
  src = tmp_path / "p2"
  pipe = ["--config.mesh.pipeline=2", "--config.mesh.data=4", "--config.train.grad_accum=4",
          "--config.mesh.virtual_stages=3"]
  run = lambda devices, wd, *extra: subprocess.Popen(
      [sys.executable, "-m", "k2jax.train", *PIPE_CLI, f"--workdir={wd}",
       "--config.train.checkpoint_every=1", *extra], cwd=REPO, env=env(devices, cache=False),
      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  err = finish(run(8, src, *pipe))
  assert "pipeline: 8 moe_layers over 2 devices x 3 virtual" in err
  assert_close(losses(src), pipeline_runs["1x1"])
  one = tmp_path / "p1"
  shutil.copytree(src, one)
  for step in ("2", "3"):
    shutil.rmtree(one / "checkpoints" / step)   # resume from step 1 on one device
  assert "resumed from checkpoint step 1" in finish(run(1, one))
  assert_close(losses(one), pipeline_runs["1x1"])
  back = tmp_path / "back"
  shutil.copytree(one, back)
  shutil.rmtree(back / "checkpoints" / "3")     # and from step 2 on the pipeline again
  assert "resumed from checkpoint step 2" in finish(run(8, back, *pipe))
  assert_close(losses(back), pipeline_runs["1x1"])


def test_no_weight_moves_between_pipeline_devices():
  """(And evaluation through the pipeline, which did not run before, equals the unpipelined
  loss of the same params.) The compiled step of pipeline 4 x 2 virtual x expert 2 (stack stored in schedule order):
  outside the tick loop, what crosses pipeline devices is the gradient reduction of the
  parameters every pipeline device holds (embedding, dense layer, final norm; the head's
  columns are split over them) and statistics, never the stack (0.80x its bytes per step
  before the stored layout); inside, the ring transfers of stage activations and their
  cotangents, and the head phase's sums (the last stage's output to every device, the
  log-sum-exp's pieces, the cotangent back)."""
  r = worker(8, "pipeline_collectives")
  # evaluation through the pipeline (forward phases only) = the unpipelined loss
  np.testing.assert_allclose(r["eval"], r["eval_ref"], rtol=1e-5)
  assert r["outside"] <= 1.02 * r["rest"], r
  assert r["outside"] < 0.1 * r["stack"], r
  assert r["loop_ops"] == ["all-reduce", "collective-permute"], r
  assert 0 < r["loop"] < 0.1 * r["stack"] * r["ticks"], r


def test_stage_zero_keeps_its_prefix_without_moving_bytes_between_devices():
  """Stage 0 keeping its prefix's residuals as bytes in its unused slot (pipeline._Overlay,
  over data 2 x expert 2: 4 batch shards) compiles to no collective of any kind more than
  recomputing the prefix does (fewer: the recomputation's own are gone): every byte view
  stays on its device."""
  # compiled fresh: steps with collectives inside conditionals stay out of the persistent
  # cache (see `env`)
  r = result(start_worker(8, "overlay_collectives", cache=False))
  assert r["True"]["kept"] and not r["False"]["kept"], r
  kept, recomputed = r["True"]["ops"], r["False"]["ops"]
  assert set(kept) <= set(recomputed), r
  assert all(kept[k] <= recomputed[k] for k in kept), r
  assert sum(kept.values()) < sum(recomputed.values()), r


@pytest.mark.parametrize("platform,moe_impl,attention_impl,shape", [
    ("cuda", "pallas_gpu", "pallas_gpu", "tiny"), ("tpu", "ragged", "chunked", "tiny"),
    ("cuda", "auto", "auto", "k2"), ("tpu", "auto", "auto", "k2")])
def test_pipelined_step_lowers_for_accelerators(platform, moe_impl, attention_impl, shape):
  """The pipelined bf16 MuonClip step with per-device skipping (the GPU / TPU default),
  expert parallelism and the accelerator kernels lowers for CUDA / TPU on this CPU, also at
  K2's widths with each platform's `auto` kernels (kernels.platform.target: Pallas attention
  per batch shard, the Triton MoE on GPU, ragged dispatch on TPU), the optimizer states
  in host memory and, at K2's widths, data 2 (ZeRO-1 and Muon's per-device update); the
  pipeline's residual slots in host memory (model.offload, as the preset)."""
  r = worker(8, "lower", platform, moe_impl, attention_impl, shape)
  assert r["ppermute"] > 0 and r["chars"] > 0
  # the residual slots (and at K2's widths the preset's optimizer.host_state) annotated for
  # host memory; the tiny shape keeps its optimizer states on the device
  assert r["host"] > 0, r
  if attention_impl == "auto":   # the platform's own kernels, not the CPU's picks
    assert r["kernels"] == ({"triton": True, "mosaic": False} if platform == "cuda"
                            else {"triton": False, "mosaic": True}), r


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
for name, shape in (("pipeline", (2, 2, 2)), ("data", (1, 2, 4))):
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


@pytest.mark.skipif(not os.environ.get("K2JAX_TEST_MULTIPROCESS_PIPELINE"),
                    reason="hangs on a loaded XLA:CPU (gloo collective-permutes share one "
                           "tag); set K2JAX_TEST_MULTIPROCESS_PIPELINE=1 to run it")
def test_pipeline_across_two_processes_matches_one_device(tmp_path, pipeline_runs):
  """2 processes x 4 devices, the pipeline axis across them (stage 0 on process 0): both
  feed the same rows (k2jax.parallel.process_batch_slice) and the run equals one device.
  Passes on an idle machine; hung in CI twice, with process 0 done and process 1 waiting
  in a collective-permute, so it is opt-in."""
  port = _free_port()
  procs = [subprocess.Popen(
      [sys.executable, "-m", "k2jax.train", *PIPE_CLI, *NO_CHECKPOINTS, f"--workdir={tmp_path}",
       "--config.mesh.pipeline=2", "--config.mesh.data=2", "--config.mesh.expert=2",
       "--config.train.grad_accum=2", f"--coordinator_address=localhost:{port}",
       "--num_processes=2", f"--process_id={i}"], cwd=REPO, env=env(4),
      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for i in range(2)]
  for p in procs:
    finish(p)
  assert_close(losses(tmp_path), pipeline_runs["1x1"])


def _free_port():
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _wait_for_rows(path, n, procs, timeout=600):
  deadline = time.time() + timeout
  while time.time() < deadline:
    if path.exists() and len(path.read_text().splitlines()) >= n:
      return
    for p in procs:
      if p.poll() is not None:
        raise AssertionError(f"process exited early: {p.stderr.read()[-3000:]}")
    time.sleep(0.2)
  raise AssertionError(f"{path} did not reach {n} rows")


@pytest.mark.slow
def test_two_processes_match_one_stop_together_and_survive_a_dead_peer(tmp_path, runs):
  """2 processes x 4 devices train like one process with 8. SIGTERM to one process stops both
  at the same step with one checkpoint; the same command resumes both; SIGKILL of one then
  ends the other with an error in bounded time instead of a hang in a collective."""
  port = _free_port()

  def launch():
    return [cli(4, tmp_path, f"--coordinator_address=localhost:{port}", "--num_processes=2",
                f"--process_id={i}", "--heartbeat_timeout=10", "--config.mesh.data=2",
                "--config.mesh.expert=4", "--config.train.steps=100000",
                "--config.train.checkpoint_every=100000") for i in range(2)]

  metrics = tmp_path / "metrics.jsonl"
  procs = launch()
  _wait_for_rows(metrics, 5, procs)
  procs[0].send_signal(signal.SIGTERM)          # only one host gets the signal
  errs = [p.communicate(timeout=300)[1] for p in procs]
  assert [p.returncode for p in procs] == [128 + signal.SIGTERM] * 2, errs[1][-2000:]
  saved = [d for d in os.listdir(tmp_path / "checkpoints") if d.isdigit()]
  assert len(saved) == 1
  assert sorted(os.listdir(tmp_path / "checkpoints" / saved[0] / "data")) == [
      "commit_success.txt", "process_0-of-2.json", "process_1-of-2.json"]
  assert_close(losses(tmp_path), runs["2x4"], steps=["1", "2", "3", "4"])

  procs = launch()                              # same command: both resume
  _wait_for_rows(metrics, int(saved[0]) + 3, procs)
  procs[1].send_signal(signal.SIGKILL)
  t0 = time.time()
  _, err = procs[0].communicate(timeout=120)
  elapsed = time.time() - t0
  procs[1].communicate()
  assert f"resumed from checkpoint step {saved[0]}" in err
  assert procs[0].returncode != 0 and elapsed < 60, (elapsed, err[-2000:])
  assert "another process of the run died" in err or "heartbeat" in err, err[-2000:]


def test_two_processes_agree_on_a_damaged_checkpoint(tmp_path, runs):
  """2 processes x 4 devices: a truncated newest checkpoint is quarantined once (by process
  0, behind a barrier) and both processes resume from the same earlier step, matching the
  one-process run."""
  def launch(steps):
    port = _free_port()
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
