"""Pipeline parallelism and activation reduction, measured on 8 simulated CPU devices.

    python experiments/bench_pipeline.py [--loss-steps 200] [--only a,b,...]

Tables (printed, and CSV under experiments/results/pipeline/):
  params       parameter bytes per device for pipeline = 1, 2, 4, 8 (1 dense + 8 MoE
               layers), the pipelined stack in its stored layout (k2jax.parallel.layout);
  bubble       idle device time of each schedule table (k2jax.parallel.schedules) with idle
               phases skipped, against the interleaved-1F1B closed form and against the
               previous loop, which computed every masked slot;
  collectives  bytes a compiled train step moves between pipeline devices, outside the tick
               loop (weights, gradients, statistics) and inside it (stage activations and
               their cotangents), against the pipelined stack's parameter bytes
               (experiments/pipeline_hlo.py; run it on an older commit for the "before" row);
  offload      the residual slots in host memory (model.offload) against device memory on
               one device: gradients, device / host temp bytes, step time (gpu_check runs
               it on a GPU, where the slots really move);
  zero_bubble  zbh1 against 1f1b: idle time at equal stages and at K2's stage costs (the
               head's W deferred or not), residual / cut / head-cut slots, plan's activations;
  plan_vs_xla  plan's per-device states against the compiled step's argument bytes;
  plan_vs_xla_activations  what zbh1 keeps beyond 1f1b (cut and head-cut buffers) as plan
               counts it and as the compiled steps' temp bytes differ (XLA's difference
               also holds the W phase's own temporaries);
  step_time    the pipelined step's wall time over the same model and batch on pipeline=1 x
               data=8 (8 simulated devices share 2 cores: wall time is total work, so
               skipped work shows up), for both ways of skipping idle phases;
  memory       activation memory (compiled memory analysis, temp bytes of one device's
               gradient program) vs microbatches M at a fixed microbatch size: pipeline=2 with
               the 1f1b schedule (flat in M) and the gpipe schedule (linear in M), and the
               unpipelined accumulation loop beside;
  storage      saved-activation bytes of one training step with model.activation_storage =
               model / fp8 and model.offload (host bytes are what moved off the device);
  loss         --loss-steps steps of the tiny config in bfloat16 with model / fp8 activation
               storage: final losses (the report: FP8 storage costs no measurable loss).
The matmul rate of this machine is printed for scale.
"""

import argparse
import csv
import functools
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# k2jax when not installed; last, so that the root's kernels/ hides no installed package
sys.path.append(os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from k2jax import configs, model, parallel  # noqa: E402
from k2jax.parallel import layout, schedules  # noqa: E402
from k2jax.training.step import _grads  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import pipeline_hlo  # noqa: E402

OUT = os.path.join(os.path.dirname(__file__), "results", "pipeline")


def write(name, rows):
  os.makedirs(OUT, exist_ok=True)
  with open(os.path.join(OUT, name), "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows(rows)
  keys = list(rows[0])
  print(" | ".join(keys))
  for r in rows:
    print(" | ".join(f"{r[k]:.4g}" if isinstance(r[k], float) else str(r[k]) for k in keys))
  print()


def matmul_rate():
  a = jnp.ones((1024, 1024), jnp.float32)
  f = jax.jit(lambda a: a @ a)
  f(a).block_until_ready()
  t = time.perf_counter()
  for _ in range(5):
    f(a).block_until_ready()
  return 5 * 2 * 1024 ** 3 / (time.perf_counter() - t) / 1e9


def deep_config(layers=9):
  c = configs.get_config("tiny")
  c.model.num_hidden_layers = layers
  c.model.aux_loss_alpha = 0.01
  return c


def param_bytes():
  m = deep_config().model
  total = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(
      jax.eval_shape(functools.partial(model.init, m), jax.random.key(0))))
  rows = []
  for P in (1, 2, 4, 8):
    mesh = parallel.make_mesh(dict(pipeline=P, data=8 // P, expert=1))
    sm = layout.stored_model(m, layout.split(m, P)) if P > 1 else m
    abstract = jax.eval_shape(functools.partial(model.init, sm), jax.random.key(0))
    sh = parallel.param_shardings(model.param_specs(sm), mesh)
    per = sum(int(np.prod(s.shard_shape(a.shape))) * a.dtype.itemsize
              for a, s in zip(jax.tree.leaves(abstract), jax.tree.leaves(sh)))
    rows.append(dict(pipeline=P, param_bytes_per_device=per, total_param_bytes=total,
                     fraction=per / total, ideal=1 / P))
  write("param_bytes.csv", rows)


def bubbles():
  """Idle device time from each schedule's table (idle phases skipped), the interleaved
  closed form (P - 1) / (M V + P - 1), and the previous loop's, which computed its masked
  slots: (P V + P - 1) / (M V + P V + P - 1)."""
  rows = []
  for P, V, M in ((2, 1, 2), (2, 1, 8), (4, 1, 4), (4, 2, 4), (4, 2, 16), (8, 1, 8),
                  (16, 1, 16), (16, 2, 32), (16, 4, 32)):
    f1b, gp = schedules.build("1f1b", P, V, M), schedules.build("gpipe", P, V, M)
    rows.append(dict(pipeline=P, virtual=V, microbatches=M,
                     f1b_idle=f1b.idle_fraction(), closed_form=(P - 1) / (M * V + P - 1),
                     previous_loop=(P * V + P - 1) / (M * V + P * V + P - 1),
                     f1b_in_flight=f1b.in_flight, gpipe_idle=gp.idle_fraction(),
                     gpipe_in_flight=gp.in_flight))
  write("bubble.csv", rows)


def zero_bubble():
  """zbh1 (B/W split, k2jax.parallel.bwsplit) against interleaved 1F1B: idle device time
  with stages of equal work (F = B = W) and at K2's stage costs (W's share of a layer's
  backward traced from the split on K2's mesh; the head split over the pipeline devices),
  the stage residuals alive per device, the slots for what B hands W, and plan's activation
  figure without offload (all of it on the device). K2 at 2 and 4 virtual stages (stages of
  2 and 1 layers)."""
  from k2jax import configs
  from k2jax.tools import plan
  from k2jax.parallel import layout, pipeline
  k2 = configs.get_config("kimi_k2")
  mesh = dict(pipeline=16, data=8, expert=16)
  w, cut = pipeline.split_cost(k2.model, mesh["data"], mesh["expert"], k2.train.seq_len)
  blank = dict(w_share=1.0, cut_gb_per_layer="",
               f1b_activations_gb="", zbh1_activations_gb="")
  rows = []
  for P, V, M in ((4, 1, 8), (4, 2, 8), (8, 1, 16), (16, 1, 32), (16, 2, 32)):
    f1b, zb = schedules.build("1f1b", P, V, M), schedules.build("zbh1", P, V, M)
    rows.append(dict(stages="equal", pipeline=P, virtual=V, microbatches=M,
                     f1b_idle=f1b.idle_fraction(), zbh1_idle=zb.idle_fraction(),
                     f1b_in_flight=f1b.in_flight, zbh1_in_flight=zb.in_flight,
                     zbh1_cut_slots=zb.sizes["cut"], **blank))
  # 32 microbatches (the preset's old setting: 32 sequences per device at data = 1) and the
  # preset's one sequence per device per microbatch: 128 on PP16 x EP16 x DP8, 1024 on
  # data = 1. 1F1B's activations in flight do not depend on M.
  for V in (2, 4):
    sp = layout.split(k2.model, 16, V)
    # 1f1b's costs as the pipeline runs it
    plain = pipeline.schedule_costs(k2.model, 16, V, "1f1b", mesh["data"], mesh["expert"],
                                    k2.train.seq_len)
    split = schedules.stage_costs(k2.model, sp, k2.train.seq_len, w)
    for M in (32, 128, 1024):
      act = {s: plan.activation_bytes(k2.model, mesh, k2.train.seq_len, virtual_stages=V,
                                      microbatches=M, schedule=s, offload=False).device / 1e9
             for s in ("1f1b", "zbh1")}
      f1b = schedules.build("1f1b", 16, V, M)
      zb = schedules.build("zbh1", 16, V, M, schedules.frozen(split))
      rows.append(dict(stages="k2", pipeline=16, virtual=V, microbatches=M,
                       f1b_idle=f1b.idle_fraction(plain), zbh1_idle=zb.idle_fraction(split),
                       f1b_in_flight=f1b.in_flight, zbh1_in_flight=zb.in_flight,
                       zbh1_cut_slots=zb.sizes["cut"], w_share=w,
                       cut_gb_per_layer=cut / 1e9, f1b_activations_gb=act["1f1b"],
                       zbh1_activations_gb=act["zbh1"]))
  write("zero_bubble.csv", rows)


def _host_link(nbytes, reps=5):
  """(device -> host, host -> device) bytes/s of copies of `nbytes` to / from pinned host
  memory, each the mean of `reps` after one warm-up."""
  dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  on_device = jax.device_put(jnp.ones((max(int(nbytes) // 4, 1),), jnp.float32), dev)

  def rate(x, kind):
    jax.block_until_ready(jax.device_put(x, dev.with_memory_kind(kind)))
    t = time.perf_counter()
    for _ in range(reps):
      y = jax.block_until_ready(jax.device_put(x, dev.with_memory_kind(kind)))
    return on_device.nbytes * reps / (time.perf_counter() - t), y

  down, on_host = rate(on_device, "pinned_host")
  up, _ = rate(on_host, "device")
  return down, up


def offload(name="offload.csv", tiny=True, reps=3):
  """The pipeline's stage residuals in host memory (model.offload, executor.Slots) against
  device memory, on one device (pipeline 1 x 8 virtual stages of one layer, 1f1b, 8
  microbatches): the largest gradient difference (relative to the gradient leaf's largest
  entry), the compiled step's device and host temp bytes, step time. On a GPU / TPU XLA's
  host offloading puts the slots in pinned host memory; on CPU the transfers are no-ops
  and the row shows what the slot logic costs. `tiny`: the tiny model's widths, else
  hidden 1024, 16 heads, 16 experts of 512 (top-2 + shared), 2048 tokens x 4 sequences."""
  from k2jax import configs, model as k2model
  from k2jax.parallel import pipeline
  from k2jax.training.step import microbatches
  cfg = configs.get_config("tiny").model
  cfg.num_hidden_layers = 9
  B, T, M, V = (4, 64, 8, 8) if tiny else (4, 2048, 8, 8)
  if not tiny:
    cfg.update(dict(hidden_size=1024, num_attention_heads=16, moe_intermediate_size=512,
                    intermediate_size=2816, n_routed_experts=16, num_experts_per_tok=2,
                    max_position_embeddings=T, dtype="bfloat16", remat="selective"))
  sp = layout.split(cfg, 1, V)
  params = layout.convert_params(sp, k2model.init(cfg, jax.random.key(0)), layout.to_stored)
  b = batch(B * M, T, cfg.vocab_size)
  mbs = microbatches(b, M)
  tab = pipeline.schedule_table(cfg, 1, V, M, "1f1b")
  mesh = jax.make_mesh((1, 1, 1), ("pipeline", "data", "expert"), devices=jax.devices()[:1],
                       axis_types=(jax.sharding.AxisType.Auto,) * 3)
  rows, grads = [], {}
  for off in (False, True):
    cfg.offload = off
    c = cfg.copy_and_resolve_references()
    f = jax.jit(lambda p, c=c: pipeline.loss_and_grads(c, p, mbs, tab, skip="device")[4])
    with jax.set_mesh(mesh):
      compiled = f.lower(params).compile()
      g = jax.block_until_ready(compiled(params))
      t = time.perf_counter()
      for _ in range(reps):
        g = jax.block_until_ready(compiled(params))
      dt = (time.perf_counter() - t) / reps
    grads[off] = g
    if off and jax.default_backend() != "cpu":
      # what XLA made of the host slots, for whoever profiles why the copies are not hidden:
      # the compiled program, and its host <-> device copies and host-side ops counted
      hlo = compiled.as_text()
      os.makedirs(OUT, exist_ok=True)
      with open(os.path.join(OUT, f"{os.path.splitext(name)[0]}_hlo.txt"), "w") as f:
        f.write(hlo)
      print("offload HLO:", {k: hlo.count(k) for k in (
          "copy-start", "copy-done", "S(5)", "MoveToHost", "MoveToDevice",
          "dynamic-update-slice", "dynamic-slice", "_xla_stream_annotation")}, flush=True)
    ma = compiled.memory_analysis()
    host = getattr(ma, "host_temp_size_in_bytes", 0)
    row = dict(device=jax.devices()[0].device_kind, offload=off,
               device_temp_GB=ma.temp_size_in_bytes / 1e9, host_temp_GB=host / 1e9,
               step_s=dt, time_ratio=dt / rows[0]["step_s"] if rows else 1.0)
    if off and host:
      # The floor the copies set: every stage visit's residuals go to the host and back
      # (M x V each way; a slot's bytes are the host buffers over their slots + the spare),
      # at the link's measured rates. A step can hide them behind compute at best.
      visit = host / (tab.sizes["res"] + 1)
      down, up = _host_link(visit)
      row.update(moved_GB_each_way=M * V * visit / 1e9, d2h_GBps=down / 1e9,
                 h2d_GBps=up / 1e9, copies_s=M * V * visit * (1 / down + 1 / up))
      row["best_ratio"] = max(1.0, row["copies_s"] / rows[0]["step_s"])
    rows.append(row)
  worst = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
              / max(float(jnp.max(jnp.abs(a.astype(jnp.float32)))), 1e-30)
              for a, b in zip(jax.tree.leaves(grads[False]), jax.tree.leaves(grads[True])))
  keys = {k: "" for r in rows for k in r}
  rows = [dict(keys, **r, max_grad_rel_diff=worst) for r in rows]
  write(name, rows)
  return rows


def collectives():
  rows = [pipeline_hlo.measure(s) for s in ((4, 1, 2), (4, 2, 1))]
  write("collectives.csv", [{k: v for k, v in r.items() if k != "step_s"} for r in rows])


def plan_vs_xla():
  """plan's per-device params + optimizer state against the argument bytes XLA's memory
  analysis gives the compiled train step (minus the batch), bf16 params, on 8 devices."""
  from k2jax.tools import plan
  rows = []
  for shape in ((4, 1, 2), (4, 2, 1), (1, 2, 4)):
    compiled, _, _, batch, _, _ = pipeline_hlo.build(shape, param_dtype="bfloat16")
    xla = compiled.memory_analysis().argument_size_in_bytes - sum(
        a.addressable_shards[0].data.nbytes for a in batch.values())
    c = pipeline_hlo.tiny_config(shape, param_dtype="bfloat16")
    st = plan.state_bytes(c, dict(zip(("pipeline", "data", "expert"), shape)))
    rows.append(dict(mesh="x".join(map(str, shape)), plan_states=st["params"] + st["optimizer"],
                     xla_arguments=xla, ratio=(st["params"] + st["optimizer"]) / xla))
  write("plan_vs_xla.csv", rows)


def plan_vs_xla_activations():
  """What zbh1 keeps beyond 1f1b for its W tasks (the cut and the head's cut), as plan counts
  it (activation_bytes) and as XLA allocates it: the temp bytes of the two compiled train
  steps (pipeline 4 x 2 virtual x expert 2, 8 microbatches of 4 sequences per device).
  Their absolute temp bytes also hold the gradient buffers and the update's temporaries,
  which plan counts as states, so the rows compare the difference."""
  from k2jax.tools import plan
  rows = []
  for remat in ("none", "full"):
    got = {}
    for sched in ("1f1b", "zbh1"):
      compiled = pipeline_hlo.build((4, 1, 2), schedule=sched, remat=remat)[0]
      c = pipeline_hlo.tiny_config((4, 1, 2), schedule=sched, remat=remat)
      act = plan.activation_bytes(c.model, dict(pipeline=4, data=1, expert=2), c.train.seq_len,
                                  micro_batch=4, virtual_stages=2, microbatches=8,
                                  schedule=sched, platform="cpu")[0]
      got[sched] = (compiled.memory_analysis().temp_size_in_bytes, act)
    dx, dp = (got["zbh1"][i] - got["1f1b"][i] for i in (0, 1))
    rows.append(dict(remat=remat, xla_temp_1f1b=got["1f1b"][0], xla_temp_zbh1=got["zbh1"][0],
                     plan_activations_1f1b=got["1f1b"][1], plan_activations_zbh1=got["zbh1"][1],
                     xla_zbh1_extra=dx, plan_zbh1_extra=dp, plan_over_xla=dp / dx))
  write("plan_vs_xla_activations.csv", rows)


def step_time():
  """Same model (1 dense + 8 MoE layers), batch and microbatches on 8 devices."""
  rows = []
  plain = pipeline_hlo.measure((1, 8, 1), steps=3)["step_s"]
  for shape, skip, sched in (((4, 2, 1), "tick", "1f1b"), ((4, 1, 2), "tick", "1f1b"),
                             ((4, 1, 2), "device", "1f1b"), ((4, 1, 2), "tick", "zbh1")):
    r = pipeline_hlo.measure(shape, steps=3, skip=skip, schedule=sched)
    rows.append(dict(mesh=r["mesh"], virtual=2, microbatches=8, skip=skip, schedule=sched,
                     pipelined_s=r["step_s"], plain_1x8x1_s=plain,
                     ratio=r["step_s"] / plain))
  write("step_time.csv", rows)


def batch(B, T, vocab, seed=0):
  toks = np.random.default_rng(seed).integers(0, vocab, (B, T + 1))
  return dict(inputs=jnp.asarray(toks[:, :-1]), targets=jnp.asarray(toks[:, 1:]),
              positions=jnp.broadcast_to(jnp.arange(T), (B, T)),
              segment_ids=jnp.ones((B, T), jnp.int32), loss_mask=jnp.ones((B, T), jnp.float32))


def temp_bytes(m, mesh_shape, B, T, M, P, V=1, schedule="1f1b"):
  n = mesh_shape["pipeline"] * mesh_shape["data"] * mesh_shape["expert"]
  mesh = parallel.make_mesh(mesh_shape, jax.devices()[:n])
  sm = layout.stored_model(m, layout.split(m, P, V)) if P > 1 else m
  tab = schedules.build(schedule, P, V, M) if P > 1 else None
  with jax.set_mesh(mesh):
    sh = parallel.param_shardings(model.param_specs(sm), mesh)
    abstract = jax.eval_shape(functools.partial(model.init, sm), jax.random.key(0))
    params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          abstract, sh)
    bs = parallel.batch_sharding(mesh, B, M)
    b = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=bs),
                     batch(B, T, m.vocab_size))
    c = jax.jit(lambda p, b: _grads(m, p, b, M, tab)).lower(params, b).compile()
    return c.memory_analysis()


def memory_vs_microbatches():
  m = deep_config().model
  m.remat = "selective"
  rows = []
  mb, T = 2, 64
  for M in (2, 4, 8, 16):
    f1b = temp_bytes(m, dict(pipeline=2, data=4, expert=1), mb * 4 * M, T, M, 2, 1, "1f1b")
    pipe = temp_bytes(m, dict(pipeline=2, data=4, expert=1), mb * 4 * M, T, M, 2, 1, "gpipe")
    loop = temp_bytes(m, dict(pipeline=1, data=8, expert=1), mb * 8 * M, T, M, 1)
    rows.append(dict(microbatches=M, rows_per_microbatch_per_device=mb,
                     pipeline2_1f1b_temp_MB=f1b.temp_size_in_bytes / 1e6,
                     pipeline2_gpipe_temp_MB=pipe.temp_size_in_bytes / 1e6,
                     accumulation_loop_temp_MB=loop.temp_size_in_bytes / 1e6))
  write("memory_vs_microbatches.csv", rows)


def storage():
  rows = []
  for remat in ("none", "selective"):
    for store, offload in (("model", False), ("fp8", False), ("model", True)):
      if remat == "none" and offload:
        continue
      c = deep_config(4)
      m = c.model
      m.update(dict(dtype="bfloat16", remat=remat, activation_storage=store, offload=offload,
                    n_routed_experts=16, moe_intermediate_size=256, intermediate_size=512))
      ma = temp_bytes(m, dict(pipeline=1, data=1, expert=1), 4, 512, 1, 1)
      rows.append(dict(remat=remat, activation_storage=store, offload=offload,
                       device_temp_MB=ma.temp_size_in_bytes / 1e6,
                       host_temp_MB=ma.host_temp_size_in_bytes / 1e6))
  base = {r["remat"]: r["device_temp_MB"] for r in rows
          if r["activation_storage"] == "model" and not r["offload"]}
  for r in rows:
    r["device_vs_model_storage"] = r["device_temp_MB"] / base[r["remat"]]
  write("activation_storage.csv", rows)


def loss_fp8(steps):
  """Each run in its own process: one device, the tiny preset's own mesh."""
  import json
  import shutil
  import subprocess
  rows = []
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  repo = os.path.join(os.path.dirname(__file__), "..")
  env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
  for store in ("model", "fp8"):
    wd = os.path.join("/tmp", f"k2jax_bench_pipeline_{store}")
    shutil.rmtree(wd, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "k2jax.train", "--config=tiny", f"--workdir={wd}",
                    "--config.model.dtype=bfloat16",
                    f"--config.model.activation_storage={store}",
                    f"--config.train.steps={steps}", "--config.train.checkpoint_every=0",
                    f"--config.train.eval_every={steps}", "--config.train.log_every=10",
                    f"--config.optimizer.warmup_steps={steps // 10}",
                    f"--config.optimizer.decay_steps={steps // 4}"],
                   check=True, env=env, cwd=repo, stderr=subprocess.DEVNULL)
    with open(os.path.join(wd, "metrics.jsonl")) as f:
      last = [json.loads(line) for line in f][-1]
    rows.append(dict(activation_storage=store, steps=steps, final_train_loss=last["loss"],
                     eval_loss=last.get("eval_loss", float("nan"))))
  for r in rows:
    r["eval_vs_model_storage"] = r["eval_loss"] / rows[0]["eval_loss"] - 1
  write("fp8_loss.csv", rows)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--loss-steps", type=int, default=200)
  ap.add_argument("--only",
                  default="params,bubble,zero_bubble,offload,collectives,plan_vs_xla,"
                          "plan_vs_xla_activations,step_time,memory,storage,loss")
  a = ap.parse_args()
  only = a.only.split(",")
  print(f"{jax.device_count()} simulated devices; 1024^3 f32 matmul {matmul_rate():.0f} "
        "GFLOP/s on this machine\n")
  steps = {"params": param_bytes, "bubble": bubbles, "zero_bubble": zero_bubble,
           "collectives": collectives, "offload": offload,
           "plan_vs_xla": plan_vs_xla, "plan_vs_xla_activations": plan_vs_xla_activations,
           "step_time": step_time, "memory": memory_vs_microbatches,
           "storage": storage, "loss": lambda: loss_fp8(a.loss_steps)}
  unknown = [n for n in only if n not in steps]
  if unknown:
    ap.error(f"--only: unknown part(s) {', '.join(unknown)}; choose from {', '.join(steps)}")
  for name in only:
    steps[name]()


if __name__ == "__main__":
  main()
