"""The pipeline on simulated CPU devices (subprocesses; test_pipeline.py has the in-process
tests): every schedule and layout equals one device, checkpoints move between pipeline sizes,
no weight crosses pipeline devices, and the pipelined step lowers for GPU and TPU. A file of
its own so that pytest-xdist's two workers (`--dist loadfile`) share the multi-device tests
with test_parallel.py."""

import concurrent.futures
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from tests.multidevice import (CLI, NO_CHECKPOINTS, REPO, assert_close, assert_states_close,
                               cores_to_itself, env, finish, free_port, losses, result,
                               start_worker, worker)


@pytest.fixture(autouse=True)
def cores():
  """Every test here runs multi-device subprocesses: none beside test_parallel's two-process
  runs (multidevice.cores_to_itself)."""
  with cores_to_itself():
    yield


# Deep enough to split: 1 dense + 8 MoE layers, 16-row batches, with the aux balance loss on
# so its token weighting across microbatches is checked too. A vocabulary of 266 (the byte
# tokenizer's 264 ids + 2 never seen) is not a multiple of 4 or 8: the head's columns are
# padded to split over those pipelines. A dense layer 32 wide (not 384): a faster compile.
PIPE_CLI = [a.replace("num_hidden_layers=2", "num_hidden_layers=9").replace(
    "batch_size=8", "batch_size=16").replace("steps=4", "steps=3") for a in CLI] + [
    "--config.model.aux_loss_alpha=0.01", "--config.model.vocab_size=266",
    "--config.model.intermediate_size=32"]


@pytest.fixture(scope="module")
def pipeline_runs(tmp_path_factory):
  """One device with the whole batch (and with a gradient fault, FAULTS), and pipelined
  meshes on 8 devices: PxDxE/aM/vV. {mesh: {step: [loss, max]}}, and "dirs": {mesh: the
  run's directory, with its final state.npz}."""
  out = tmp_path_factory.mktemp("pipeline")
  # set up before the autouse `cores` of the test that asks for it: takes the lock itself
  with cores_to_itself():
    one = start_worker(1, "meshes", str(out / "one"), "1x1", *FAULTS, "--", *PIPE_CLI,
                       *NO_CHECKPOINTS)
    # Two 8-device workers at once: each mesh's run is mostly its (single-threaded) compile,
    # so on CI's 2 cores the halves take about half the time one worker took (426 s).
    halves = [start_worker(8, "meshes", str(out / f"eight{i}"), *PIPELINE_MESHES[i::2], "--",
                           *PIPE_CLI, *NO_CHECKPOINTS, cache=False) for i in (0, 1)]
    # read all three at once: a worker blocked on a full stderr pipe would wait for others
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
      parts = list(pool.map(result, [one, *halves]))
  runs = {k: v for part in parts for k, v in part.items()}
  runs["dirs"] = {m: out / where / m.replace("/", "_") for where, names in [
      ("one", ("1x1", *FAULTS)), ("eight0", PIPELINE_MESHES[0::2]),
      ("eight1", PIPELINE_MESHES[1::2])] for m in names}
  return runs


# One device with a fault a pipeline bug could make in the gradient (parallel_worker.
# _faulty_grads): the experts' down-projection gradient doubled, the first of two
# microbatches left out of it.
FAULTS = ("1x1/f2x", "1x1/a2/fdrop")


# PxDxE/aM/vV/sSCHEDULE; the 1f1b schedule unless named. Each mesh compiles its own
# pipelined step (the fixture is the suite's longest), so each covers something the others
# do not: V = 1 with data and expert nested; V = 3 over an uneven split; V = 2 with data and
# expert, phases skipped per device as on GPU / TPU and offload on (data > 1 deadlocked
# XLA:CPU here while the partitioner reduced weight gradients over `data` inside the
# branches; now `data` is manual and reduced once, after the loop); GPipe; pipeline 4 and 8
# with per-device skipping; the B/W-split zbh1 schedule (k2jax.parallel.bwsplit) over the uneven V = 3 split with data and expert (the MoE's
# shard_map cut in two, the experts' weight gradients W's), and on pipeline 8 with
# per-device skipping.
# "kdevice": idle phases skipped per device, as on GPU / TPU (CPU's default skips per tick);
# on meshes where XLA:CPU places no collective-permute inside a branch, so it runs here
# (4 x 3 stages of 1 for 8 layers: stage 0 and the last stages are padding, skipped per
# layer). "o": model.offload, the residual (and
# zbh1's cut) slots in host memory (executor.Slots; the transfers are no-ops on CPU, the
# slot logic with its write-only slot is what runs). "g": zbh1 on its grid of one task per
# device and tick (schedules._grid: the table stages of equal cost get; the tiny model's
# traced costs, W 4-7x B, pick 1F1B's ticks with the W's placed in them, which the V = 3
# mesh runs): stage outputs wait in slots for ticks, B's and W's run ticks apart.
PIPELINE_MESHES = ("2x2x2/a2", "2x2x2/v3/a4/szbh1/o", "2x2x2/v2/a4/kdevice/o",
                   "4x1x2/v2/a4/sgpipe", "4x1x2/v3/a4/kdevice/o", "8x1x1/a8/kdevice/szbh1/g",
                   "2x1x2/a2/c2", "2x2x1/v2/a4/kdevice/o/c2")


@pytest.mark.parametrize("mesh", PIPELINE_MESHES)
def test_pipeline_matches_one_device(pipeline_runs, mesh):
  """pipeline=2 x data=2 x expert=2; 8 MoE layers over 2 x 3 = 6 stages (2 per stage, the
  last two stages padding; zbh1); two groups of microbatches through 2 x 2 stages over data and
  expert, idle phases skipped per device and the residuals in host memory; the GPipe
  schedule on pipeline=4 x 2 virtual over expert=2; idle phases skipped per device on
  pipeline 4 and 8; each sequence split over context = 2 (k2jax.model.context) with
  expert and with data (the balance loss's per-sequence counts summed over context), the
  latter on 2 virtual stages with host slots: losses and max logits of one device with the
  whole batch
  (rel < 1e-5), and so does every leaf of the final train state: the optimizer's moments sum
  each step's gradients, so every gradient leaf of every step is compared."""
  assert_close(pipeline_runs[mesh], pipeline_runs["1x1"])
  dirs = pipeline_runs["dirs"]
  assert_states_close(dirs[mesh], dirs["1x1"])


def test_the_state_comparison_sees_a_gradient_fault_the_losses_do_not(pipeline_runs):
  """The comparison above fails on a run whose gradient is wrong: one leaf doubled (the
  experts' down-projection; its losses and max logits still equal one device's, as
  MuonClip's update ignores the gradient's scale: the check the losses alone gave), or a
  microbatch left out."""
  dirs = pipeline_runs["dirs"]
  assert_close(pipeline_runs["1x1/f2x"], pipeline_runs["1x1"])
  with pytest.raises(AssertionError, match=r"1 of \d+ state leaves differ: .*experts.*down"):
    assert_states_close(dirs["1x1/f2x"], dirs["1x1"])
  with pytest.raises(AssertionError, match="state leaves differ"):
    assert_states_close(dirs["1x1/a2/fdrop"], dirs["1x1"])


def test_pipeline_checkpoint_moves_to_one_device_and_back(tmp_path, pipeline_runs):
  """Checkpoints hold the logical layer order: 8 MoE layers stored as 2 x 3 stages of 2 (4
  padding rows, stages round-robin) resume on one device and back. The session's
  compilation cache (tests/conftest.py), as the other CLI runs: without it the trainer
  fell back to its own in the home directory (`--compilation_cache`), kept between runs."""
  src = tmp_path / "p2"
  pipe = ["--config.mesh.pipeline=2", "--config.mesh.data=4", "--config.train.grad_accum=4",
          "--config.mesh.virtual_stages=3"]
  run = lambda devices, wd, *extra: subprocess.Popen(
      [sys.executable, "-m", "k2jax.train", *PIPE_CLI, f"--workdir={wd}",
       "--config.train.checkpoint_every=1", *extra], cwd=REPO, env=env(devices),
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


def test_no_weight_shaped_collective_inside_the_tick_loop():
  """Pipeline 2 x data 2 x expert 2, phases skipped per device as on GPU / TPU: no
  collective inside the tick loop has an operand shaped like a parameter: any leaf of the
  whole parameter tree (embedding, dense layers, MoE stack, final norm, head), whole, as
  stored on a device, one layer or row of it, or split as the mesh could split it
  (parallel_worker.param_forms). Each device sums its own tokens' weight gradients through
  the loop, reduced over data x expert once, after it, and holds the weights stored split
  only for memory whole, gathered once as the pipeline's shard_map opens
  (pipeline.replica_axes, inner_specs). At 176a819 the experts' gradients were all-reduced
  over `data` in every backward phase; at 181fb95 the weights split over `expert` were still
  gathered, and their gradients reduced, in every phase (24 weight-shaped ops here). What is
  left: the ring transfers over `pipeline`, the MoE's exchange over `expert`, the head's
  sums, statistics. The same reading sees the reductions after the loop as weight-shaped,
  the embedding gradient's over `data` among them. Checked by a fault: that psum made
  inside the pipeline's shard_map as well (embedding._scatter summing over the token axes
  it does not own when `plan.manual`), this test failed on its all-reduce of f32[132, 128]
  over data in the loop, which a reading of the MoE stack's shapes alone did not flag."""
  r = worker(8, "tick_collectives")
  rows, after = r["rows"], r["after"]
  assert {p.split("]")[0] + "]" for p in r["params"]} == {
      "['embed']", "['dense_layers']", "['moe_layers']", "['final_norm']", "['lm_head']"}, r
  assert not [x for x in rows if x[2]], [x for x in rows if x[2]]
  assert any(x[0] == "collective-permute" and x[3] == ["pipeline"] for x in rows), rows
  assert any(x[0] == "all-to-all" and x[3] == ["expert"] for x in rows), rows
  # the shapes do match weight collectives: the gradient reductions after the loop
  reduced = [x for x in after if x[0] in ("all-reduce", "reduce-scatter") and x[2]]
  assert any("data" in x[3] and "['embed']" in x[2] for x in reduced), after
  assert any(any(n.startswith("['moe_layers']") for n in x[2]) for x in reduced), after


def test_no_weight_moves_between_pipeline_devices():
  """(And evaluation through the pipeline, which did not run before, equals the unpipelined
  loss of the same params.) The compiled step of pipeline 4 x 2 virtual x expert 2 (stack stored in schedule order):
  outside the tick loop, what crosses pipeline devices is the gradient reduction of the
  parameters every pipeline device holds (embedding, dense layer, final norm; the head's
  columns are split over them) and statistics, never the stack (0.80x its bytes per step
  before the stored layout); inside, the ring transfers of stage activations and their
  cotangents, and the head phase's sums (the last stage's output to every device, the
  log-sum-exp's pieces, the cotangent reduce-scattered over tokens and the stage's input
  cotangent all-gathered: stage.head)."""
  r = worker(8, "pipeline_collectives")
  # evaluation through the pipeline (forward phases only) = the unpipelined loss
  np.testing.assert_allclose(r["eval"], r["eval_ref"], rtol=1e-5)
  assert r["outside"] <= 1.02 * r["rest"], r
  assert r["outside"] < 0.1 * r["stack"], r
  assert r["loop_ops"] == ["all-gather", "all-reduce", "collective-permute",
                           "reduce-scatter"], r
  assert 0 < r["loop"] < 0.1 * r["stack"] * r["ticks"], r


@pytest.mark.parametrize("platform,moe_impl,attention_impl,shape", [
    ("cuda", "pallas_gpu", "pallas_gpu", "tiny"), ("tpu", "ragged", "chunked", "tiny"),
    ("cuda", "auto", "auto", "k2"), ("tpu", "auto", "auto", "k2"),
    ("tpu", "auto", "auto", "data")])
def test_pipelined_step_lowers_for_accelerators(platform, moe_impl, attention_impl, shape):
  """The pipelined bf16 MuonClip step with per-device skipping (the GPU / TPU default),
  expert parallelism and the accelerator kernels lowers for CUDA / TPU on this CPU, also at
  K2's widths with each platform's `auto` kernels (kernels.platform.target: Pallas attention
  per batch shard, the Triton MoE on GPU, ragged dispatch on TPU), the optimizer states
  in host memory and, at K2's widths, data 2 (ZeRO-1 and Muon's per-device update); the
  pipeline's residual slots in host memory (model.offload, as the preset); and on pipeline x
  data with expert 1, where the Mosaic attention kernel needs its own shard_map over the
  one automatic axis left (XLA refused it when none was opened)."""
  r = worker(8, "lower", platform, moe_impl, attention_impl, shape)
  assert r["ppermute"] > 0 and r["chars"] > 0
  # the residual slots (and at K2's widths the preset's optimizer.host_state) annotated for
  # host memory; the tiny shape keeps its optimizer states on the device
  assert r["host"] > 0, r
  if attention_impl == "auto":   # the platform's own kernels, not the CPU's picks
    assert r["kernels"] == ({"triton": True, "mosaic": False} if platform == "cuda"
                            else {"triton": False, "mosaic": True}), r


@pytest.mark.skipif(not os.environ.get("K2JAX_TEST_MULTIPROCESS_PIPELINE"),
                    reason="hangs on a loaded XLA:CPU (gloo collective-permutes share one "
                           "tag); set K2JAX_TEST_MULTIPROCESS_PIPELINE=1 to run it")
def test_pipeline_across_two_processes_matches_one_device(tmp_path, pipeline_runs):
  """2 processes x 4 devices, the pipeline axis across them (stage 0 on process 0): both
  feed the same rows (k2jax.parallel.process_batch_slice) and the run equals one device.
  Passes on an idle machine; hung in CI twice, with process 0 done and process 1 waiting
  in a collective-permute, so it is opt-in."""
  port = free_port()
  procs = [subprocess.Popen(
      [sys.executable, "-m", "k2jax.train", *PIPE_CLI, *NO_CHECKPOINTS, f"--workdir={tmp_path}",
       "--config.mesh.pipeline=2", "--config.mesh.data=2", "--config.mesh.expert=2",
       "--config.train.grad_accum=2", f"--coordinator_address=localhost:{port}",
       "--num_processes=2", f"--process_id={i}"], cwd=REPO, env=env(4),
      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for i in range(2)]
  for p in procs:
    finish(p)
  assert_close(losses(tmp_path), pipeline_runs["1x1"])
