"""The train step as XLA:TPU compiles it (compile only, on this CPU: libtpu through
jax.experimental.topologies), through the user's command `python -m k2jax.compile`.

What these add to the CPU suite: XLA:TPU's own passes (layout tiling, host offloading's
async copies, memory-space assignment, its out-of-memory check) see the step; lowering text
never reaches them. They caught a host-slot write XLA:TPU refuses ("Lane slice updating is
not supported in async dynamic update slice") and one its DMA emitter aborts on
(k2jax.parallel.executor.Slots). Each compile runs in a subprocess: a libtpu abort must not
take a pytest worker with it."""

import json
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("libtpu")
pytestmark = pytest.mark.usefixtures("no_persistent_cache")   # the in-process compile below

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def compile_cli(tmp_path, *args, timeout=900):
  out = tmp_path / "figures.json"
  env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
  r = subprocess.run([sys.executable, "-m", "k2jax.compile", *args, "--json", str(out)],
                     capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout)
  return r, (json.loads(out.read_text()) if out.exists() else None)


def batch_bytes(rows, seq_len):
  return 5 * 4 * rows * seq_len     # inputs, targets, positions, segment ids (int32), mask (f32)


def test_tiny_step_compiles_for_one_v5e_chip_as_colab_gives_it(tmp_path):
  """The README's tiny config (the notebook's) on a single v5e chip: it compiles, fits, and
  XLA's count of the step's arguments is the trainer's state as plan shards it (params and
  optimizer state on the device) plus the batch: an independent check of
  parallel.state_shardings against the compiler's own buffer sizes."""
  r, fig = compile_cli(tmp_path, "--config", "tiny", "--topology", "v5e:1x1")
  assert r.returncode == 0, r.stderr[-2000:]
  assert "train step compiled for v5e:1x1 (1 x TPU v5 lite" in r.stdout
  assert fig["compiled"] and fig["fits"] and fig["kind"] == "TPU v5 lite"
  st = fig["plan_states"]
  state = st["params"] + st["optimizer"]
  args = fig["xla_device"]["arguments"]
  # XLA:TPU stores each array in (8, 128) tiles: the tiny model's small leaves (norms of 64,
  # 4 heads) pad 5.2% onto the logical bytes (measured, libtpu 0.0.42.1); nothing else
  # (counters, flags: a few int32 scalars) is an argument
  expect = state + batch_bytes(8, 128)
  assert expect <= args <= 1.06 * expect + 4096
  # the donated state comes back in place: outputs beyond it are the metrics
  assert fig["xla_device"]["outputs"] - fig["xla_device"]["aliased"] < 1 << 16
  assert fig["xla_device"]["peak"] >= args + st["grads"]   # the f32 gradients exist at once


def test_a_step_xla_refuses_ends_in_one_line_with_its_reason(tmp_path):
  """Out of memory on the chip: XLA's reason in one line, exit 1, before any code is made."""
  r, fig = compile_cli(tmp_path, "--config", "tiny", "--topology", "v5e:1x1", "--no_plan",
                       "--config.train.batch_size=512", "--config.train.seq_len=1024",
                       "--config.model.hidden_size=2048")
  assert r.returncode == 1
  lines = [ln for ln in r.stderr.splitlines() if ln.startswith("k2jax.compile")]
  assert len(lines) == 1 and "Ran out of memory" in lines[0], r.stderr[-2000:]
  assert fig == dict(config="tiny", topology="v5e:1x1", compiled=False,
                     refusal=lines[0].removeprefix("k2jax.compile: "))


def test_a_topology_libtpu_does_not_know_is_a_user_error(tmp_path):
  r, _ = compile_cli(tmp_path, "--config", "tiny", "--topology", "v5q:3x3")
  assert r.returncode == 2
  assert r.stderr.strip().splitlines()[-1].startswith("k2jax.compile: error: --topology 'v5q:3x3'")


def test_host_residual_slots_compile_for_tpu_and_live_in_host_memory():
  """The pipeline's residual slots with model.offload (executor.Slots) in the loop form the
  step uses, with the leaf kinds a K2 stage keeps: a scalar, routing integers, a flag, a
  small float row (all under Slots.HOST_MIN: device slots) and bf16 / FP8 activations
  (host slots). XLA:TPU refused the scalar's [slots] host buffer ("Lane slice updating is
  not supported in async dynamic update slice") and aborted on the small leaves in host
  memory. XLA's own count puts every slot of the large leaves in host memory, and none of
  them on the device."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  from k2jax.tools import compile as kc
  from k2jax.parallel import executor

  devices = kc.topology_devices("v5p:2x2x1")
  mesh = Mesh(np.asarray(devices[:1]), ("x",))
  avals = [jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct((2, 1), jnp.int32),
           jax.ShapeDtypeStruct((1, 2), jnp.bool_), jax.ShapeDtypeStruct((2, 4096), jnp.float32),
           jax.ShapeDtypeStruct((2, 1, 1024, 2048), jnp.bfloat16),
           jax.ShapeDtypeStruct((2, 1280, 1024), jnp.float8_e4m3fn)]
  store, n, ticks = executor.Slots(True), 5, 9
  big = [a for a in avals if store.on_host(a)]
  assert [a.shape for a in big] == [(2, 1, 1024, 2048), (2, 1280, 1024)]

  def loop(xs):
    def tick(carry, t):
      buf, acc = carry
      write = jnp.where(t < ticks - 2, t % n, -1)          # idle ticks write nowhere
      buf = store.put(buf, write, xs)
      got = store.get(buf, (t + 3) % n, avals)
      return (buf, acc + sum(g.reshape(-1)[0].astype(jnp.float32) for g in got)), None
    (buf, acc), _ = jax.lax.scan(tick, (store.zeros(n, avals), jnp.zeros(())),
                                 jnp.arange(ticks))
    return acc

  args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, P()))
          for a in avals]
  compiled = jax.jit(loop).trace(args).lower().compile()
  device, host = kc.memory(compiled.memory_analysis())
  slot_bytes = sum(np.prod(a.shape) * a.dtype.itemsize for a in big)
  assert host["temporaries"] >= (n + 1) * slot_bytes        # every slot, + the idle one
  # on the device: what one tick writes and reads (and XLA's staging of them), not the slots
  assert device["temporaries"] < 3 * slot_bytes


def test_buffer_assignment_is_read_by_memory_space_and_kind():
  """The parser of XLA's dumped buffer assignment: entry parameters, the preallocated heap
  and thread-local buffers, in HBM (color 0) and host memory (color 5); on-chip scratch
  (other colors), constants and outputs are not counted."""
  from k2jax.tools import compile as kc
  text = "\n".join([
      "allocation 0: size 100, thread-local:",
      "allocation 1: size 1000, parameter 3, shape |bf16[4,8]| at ShapeIndex {}, maybe-live-out:",
      " value: <1 param.1 @0> (size=1000,offset=0): bf16[4,8]",
      "allocation 2: size 70, color 5, parameter 9, shape |f32[4]| at ShapeIndex {}:",
      "allocation 3: size 5000, preallocated-temp:",
      "allocation 4: size 300, color 5, preallocated-temp:",
      "allocation 5: size 40, color 1, preallocated-temp:",
      "allocation 6: size 8, constant:",
      "allocation 7: size 20, color 6, thread-local:"])
  device, host = kc.buffer_assignment(text)
  assert device == dict(arguments=1000, heap=5000, thread_local=100, check=6000, peak=6100)
  assert host == dict(arguments=70, heap=300, thread_local=0, check=370, peak=370)


def test_memory_only_stops_at_the_buffer_assignment_with_xlas_own_counts(tmp_path):
  """--memory_only reads the figures where XLA's out-of-memory check runs, without code
  generation: its arguments are the same bytes the full compile's memory analysis counts
  (the tiny step's state and batch on one v5e chip). --explain prints that heap by line."""
  r, fig = compile_cli(tmp_path, "--config", "tiny", "--topology", "v5e:1x1", "--memory_only",
                       "--explain", "4")
  assert r.returncode == 0, r.stderr[-2000:]
  assert "(code generation not run)" in r.stdout
  assert fig["stage"] == "buffer assignment" and fig["fits"]
  d, st = fig["xla_device"], fig["plan_states"]
  expect = st["params"] + st["optimizer"] + batch_bytes(8, 128)
  assert expect <= d["arguments"] <= 1.06 * expect + 4096
  assert d["heap"] >= st["grads"] and d["check"] == d["arguments"] + d["heap"]
  assert d["peak"] == d["check"] + d["thread_local"]
  # --explain: the same heap, its fullest moment charged to the step's own lines
  lines = r.stdout.split("XLA's device heap ", 1)[1].splitlines()
  assert float(lines[0].split()[0]) == pytest.approx(d["heap"] / 1e9, abs=0.006)
  end = next(i for i, ln in enumerate(lines) if "packing:" in ln)
  rows = lines[1:end]
  assert 4 <= len(rows) <= 5 and all(re.search(r" (k2jax|kernels)/\S+\.py:\d+ ", ln)
                                     or "copy of state." in ln or "more sources" in ln
                                     for ln in rows), r.stdout
  # what is live then in all device memory (the params at least), under XLA's check, and
  # plan's figure over it
  assert lines[end + 1].startswith("live in all device memory then")
  assert st["params"] <= fig["xla_live"] <= d["check"]
  assert f"XLA's live bytes at its fullest / plan: {fig['xla_live'] / fig['plan_device']:.2f}" \
      in r.stdout


def test_memory_only_reports_xlas_refusal_in_one_line(tmp_path):
  r, fig = compile_cli(tmp_path, "--config", "tiny", "--topology", "v5e:1x1", "--no_plan",
                       "--memory_only", "--config.train.batch_size=512",
                       "--config.train.seq_len=1024", "--config.model.hidden_size=2048")
  assert r.returncode == 1
  lines = [ln for ln in r.stderr.splitlines() if ln.startswith("k2jax.compile")]
  assert len(lines) == 1 and "Ran out of memory" in lines[0], r.stderr[-2000:]
  assert fig["compiled"] is False and fig["refusal"] == lines[0].removeprefix("k2jax.compile: ")


def assert_plan_counts_what_xla_holds(fig):
  """plan's device figure within 10% of the bytes XLA's program holds live at its fullest
  moment (`--explain`: arguments + heap), and XLA's check, which adds its packing, within
  1.25x of plan."""
  plan, live, check = fig["plan_device"], fig["xla_live"], fig["xla_device"]["check"]
  assert 0.9 * plan <= live <= 1.1 * plan, (live, plan)
  assert live <= check <= 1.25 * plan, (check, plan)


# K2's widths (hidden 7168, MLA ranks, 2048-wide experts, K2's vocabulary), 5 layers and 16
# experts, on v5p 2x2x2: pipeline 2 x data 2 x expert 2
K2_SHAPED = ["--config", "kimi_k2", "--topology", "v5p:2x2x2", "--memory_only",
             "--config.model.num_hidden_layers=5", "--config.model.n_routed_experts=16",
             "--config.mesh.pipeline=2", "--config.mesh.expert=2", "--config.mesh.data=2",
             "--config.train.batch_size=16", "--config.train.seq_len=1024"]


@pytest.mark.parametrize("schedule,virtual,offload,host_state", [
    ("1f1b", 1, True, True), ("zbh1", 1, False, False), ("gpipe", 2, True, False)])
def test_k2_shaped_pipelined_step_passes_xlas_memory_check(tmp_path, schedule, virtual,
                                                           offload, host_state):
  """The pipelined step at K2's widths through XLA:TPU's passes to its buffer assignment:
  1f1b with the residual slots and the ZeRO-1 optimizer states in host memory (the preset's
  offload and optimizer.host_state), zbh1 with device slots and states, gpipe on two
  virtual stages a device (the preset's V) with host slots. The step's arguments are plan's
  device states and XLA's host memory holds plan's host bytes; no part of the step runs on
  the host (the host states' update once did: XLA:TPU gathered Muon's momenta in host
  memory, 2.5 GB of host heap and 3.9 GB of thread-local buffers, until step.split_as_stored);
  the bytes XLA's program holds live at its fullest moment (arguments + heap, `--explain`)
  are plan's device figure within 10% (measured 2026-11-29: 1.01x / 1.00x / 1.02x), and
  XLA's check, which adds the heap's packing, within 1.25x (1.22x / 1.06x / 1.04x)."""
  r, fig = compile_cli(tmp_path, *K2_SHAPED, "--explain", "1",
                       f"--config.mesh.pipeline_schedule={schedule}",
                       f"--config.mesh.virtual_stages={virtual}",
                       f"--config.model.offload={offload}",
                       f"--config.optimizer.host_state={host_state}")
  assert r.returncode == 0, r.stderr[-2000:]
  d, h, st = fig["xla_device"], fig["xla_host"], fig["plan_states"]
  on_device = st["params"] + st["optimizer"]
  assert bool(st["optimizer_host"]) == host_state
  assert on_device <= d["arguments"] <= 1.02 * on_device + (8 << 20)   # + the batch
  assert 0.95 * fig["plan_host"] <= h["peak"] <= 1.05 * fig["plan_host"] + (64 << 20)
  assert d["thread_local"] <= 64 << 20, d   # host-run code's buffers
  assert_plan_counts_what_xla_holds(fig)
  assert fig["fits"]


def test_k2_shaped_context_parallel_step_passes_xlas_memory_check(tmp_path):
  """Each 2,048-token sequence split over context 2 inside the pipeline (pipeline 2 x context
  2 x expert 2, the long-context preset's layout in small: k2jax.model.context), the
  preset's offload and host states, through XLA:TPU to its buffer assignment: arguments are
  plan's device states, host memory plan's host bytes, XLA's live bytes at its fullest
  moment plan's device figure within 10% and its check within 1.25x."""
  args = [a for a in K2_SHAPED if not a.startswith(("--config.mesh.", "--config.train."))]
  r, fig = compile_cli(tmp_path, *args, "--explain", "1", "--config.mesh.pipeline=2",
                       "--config.mesh.data=1",
                       "--config.mesh.context=2", "--config.mesh.expert=2",
                       "--config.mesh.virtual_stages=1", "--config.train.batch_size=8",
                       "--config.train.seq_len=2048")
  assert r.returncode == 0, r.stderr[-2000:]
  d, h, st = fig["xla_device"], fig["xla_host"], fig["plan_states"]
  on_device = st["params"] + st["optimizer"]
  assert on_device <= d["arguments"] <= 1.02 * on_device + (8 << 20)
  assert 0.95 * fig["plan_host"] <= h["peak"] <= 1.2 * fig["plan_host"] + (64 << 20)
  assert_plan_counts_what_xla_holds(fig)
  assert fig["fits"]


def test_k2_shaped_expert_parallel_step_without_a_pipeline_passes_xlas_memory_check(tmp_path):
  """The same K2-shaped layers with no pipeline: data 2 x expert 4 on v5p 2x2x2 (the
  microbatches in the trainer's scan, the expert exchange nested in the data x expert
  shard_map, ZeRO-1 over data), through XLA:TPU to its buffer assignment: arguments are
  plan's device states, XLA's live bytes at its fullest moment plan's device figure within
  10% (measured 2026-11-29: 1.08x) and its check within 1.25x (1.11x)."""
  args = [a for a in K2_SHAPED if not a.startswith("--config.mesh.")]
  r, fig = compile_cli(tmp_path, *args, "--explain", "1", "--config.mesh.pipeline=1",
                       "--config.mesh.data=2",
                       "--config.mesh.expert=4", "--config.model.offload=False",
                       "--config.optimizer.host_state=False", "--config.train.grad_accum=2")
  assert r.returncode == 0, r.stderr[-2000:]
  d, st = fig["xla_device"], fig["plan_states"]
  on_device = st["params"] + st["optimizer"]
  assert on_device <= d["arguments"] <= 1.02 * on_device + (8 << 20)
  assert_plan_counts_what_xla_holds(fig)
  assert fig["fits"]


def test_plan_asks_the_compiler_and_prints_its_peak_beside_its_own(tmp_path):
  """`python -m k2jax.plan --compile TOPOLOGY`: the same config's step through XLA:TPU to its
  buffer assignment, on the topology's chips (the mesh fitted as k2jax.compile fits it), with
  XLA's peak beside plan's count and the chip's HBM; a topology libtpu does not know is one
  line and exit 2."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
  run = lambda *a: subprocess.run([sys.executable, "-m", "k2jax.plan", "--config", "tiny", *a],
                                  capture_output=True, text=True, cwd=ROOT, env=env,
                                  timeout=900)
  r = run("--compile", "v5e:1x1")
  assert r.returncode == 0, r.stderr[-2000:]
  assert "compiled for v5e:1x1 (TPU v5 lite), XLA's buffer assignment" in r.stdout
  row = next(ln for ln in r.stdout.splitlines() if "peak (its OOM check)" in ln).split()
  xla, planned, ratio = map(float, row[-3:])
  total = float(next(ln for ln in r.stdout.splitlines() if ln.strip().startswith("total"))
                .split()[1])
  # (the table prints two decimals: the ratio is of the unrounded figures)
  assert planned == pytest.approx(total, abs=0.01) and ratio == pytest.approx(xla / planned,
                                                                             rel=0.1)
  assert 0.5 < ratio < 3, r.stdout
  assert "HBM 16.9 GB per chip" in r.stdout
  bad = run("--compile", "v9z:3x3")
  ours = [ln for ln in bad.stderr.splitlines() if ln.startswith("k2jax.plan")]  # libtpu's aside
  assert bad.returncode == 2 and len(ours) == 1, bad.stderr
  assert ours[0].startswith("k2jax.plan: error: --compile 'v9z:3x3'")


def test_explain_charges_the_heap_to_the_lines_that_made_it(tmp_path):
  """A program compiled for one v5e chip, dumped: the loop's float32 accumulator (its carry,
  made by jnp.zeros before the loop) is charged to the line of that jnp.zeros through the
  while loop's body parameter and its initial tuple; the rows add up to the bytes live at the
  heap's fullest moment, which is no more than the heap the buffer assignment reports."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import SingleDeviceSharding
  from k2jax.tools import compile as kc, xla_heap

  dev = kc.topology_devices("v5e:1x1")[0]
  n, k = 2048, 16            # 256 MB: not in the chip's 128 MiB of on-chip memory

  def accumulate(x):
    acc = jnp.zeros((k, n, n), jnp.float32)                      # the accumulator's line
    def body(i, acc):
      return acc.at[i % k].add(jnp.tanh(x * i.astype(x.dtype)) @ x)
    return jax.lax.fori_loop(0, 7, body, acc).sum()

  line = accumulate.__code__.co_firstlineno + 1
  arg = jax.ShapeDtypeStruct((n, n), jnp.float32, sharding=SingleDeviceSharding(dev))
  jax.jit(accumulate).trace(arg).lower().compile(
      compiler_options={"xla_dump_to": str(tmp_path)})
  tests = os.path.dirname(os.path.abspath(__file__))
  peak = xla_heap.explain(str(tmp_path), top=50, roots=(tests,))
  rows = {r.source.split()[0]: r for r in peak.rows}
  where = f"tests/test_tpu_compile.py:{line}"
  mine = rows.get(where)
  assert mine is not None and mine.bytes >= k * n * n * 4, xla_heap.table(peak)
  assert mine.example.startswith(f"f32[{k},{n},{n}]")
  # every name the carry has (the loop's output, its body's and condition's parameter) is
  # charged there, not to the loop's own line
  src = xla_heap.Sources(xla_heap._one(str(tmp_path), "after_optimizations.txt"), (tests,))
  _, values = xla_heap.heap_values(xla_heap._one(
      str(tmp_path), "after_optimizations-buffer-assignment.txt"))
  carried = [v for v, (_, _, shape) in values.items() if shape == f"f32[{k},{n},{n}]"
             and src.inst[v.split("{")[0]][0] in ("while", "parameter")]
  assert any(src.inst[v.split("{")[0]][0] == "while" for v in carried), carried
  assert all(src.of(v).startswith(where) for v in carried), [(v, src.of(v)) for v in carried]
  ba = open(next(tmp_path.glob("*jit_accumulate*after_optimizations-buffer-assignment.txt")))
  assert peak.heap == kc.buffer_assignment(ba.read())[0]["heap"]
  assert peak.live <= peak.heap and sum(r.bytes for r in peak.rows) >= peak.live
  assert np.isclose(sum(r.bytes for r in peak.rows), peak.live, rtol=0.05)


def test_explain_names_temporaries_in_a_donated_arguments_buffer(tmp_path):
  """A donated argument read only before a loop: XLA:TPU keeps the loop's carry (made from it
  by the line below) in the argument's own buffer, so the heap holds nothing of it. explain
  finds it there, charged to that line, and does not count the argument itself."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import SingleDeviceSharding
  from k2jax.tools import compile as kc, xla_heap

  dev = kc.topology_devices("v5e:1x1")[0]
  n, k = 2048, 16            # 256 MB: not in the chip's 128 MiB of on-chip memory

  def update(p, x):
    acc = p * 2.0                                                 # p's last reader
    def body(i, acc):
      return acc.at[i % k].add(jnp.tanh(acc[(i + 1) % k]) @ x)
    return jnp.tanh(jax.lax.fori_loop(0, 7, body, acc)) + 1.0

  line = update.__code__.co_firstlineno + 1
  on = SingleDeviceSharding(dev)
  jax.jit(update, donate_argnums=0).trace(
      jax.ShapeDtypeStruct((k, n, n), jnp.float32, sharding=on),
      jax.ShapeDtypeStruct((n, n), jnp.float32, sharding=on)).lower().compile(
          compiler_options={"xla_dump_to": str(tmp_path)})
  tests = os.path.dirname(os.path.abspath(__file__))
  peak = xla_heap.explain(str(tmp_path), top=50, roots=(tests,))
  there = {r.source.split()[0]: r for r in peak.in_arguments}
  mine = there.get(f"tests/test_tpu_compile.py:{line}")
  assert mine is not None and mine.bytes >= k * n * n * 4, xla_heap.table(peak)
  assert not any(r.source.startswith("argument ") for r in peak.in_arguments)
  assert peak.heap < k * n * n * 4 and "donated arguments' own buffers" in xla_heap.table(peak)
  # the arguments' buffers: p's and x's; the carry live in p's at the heap's fullest moment
  assert peak.arguments >= (k + 1) * n * n * 4
  assert k * n * n * 4 <= peak.arguments_live <= peak.arguments
  assert peak.all_live == peak.live + peak.arguments_live
