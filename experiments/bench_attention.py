"""Attention with S_max: time and memory per implementation (k2jax.kernels.attention).

    python experiments/bench_attention.py            # CPU: impls vs T, and the model's memory vs T
    python experiments/bench_attention.py --gpu      # GPU: TFLOP/s at MLA dims vs cuDNN and xla

CPU: for each impl, forward and forward+backward time of one attention call at the tiny
model's dims (4 heads, 48 / 32) and XLA's compiled temporary memory, T = 256 ... 8192 (the
materialized `xla` impl up to 2048); then the tiny model's whole forward+backward
temporaries vs T per impl (the number issue 9 asks to grow ~linearly).
GPU: correctness of pallas_gpu against xla (f32 and bf16, values, S_max, gradients), then
forward and forward+backward TFLOP/s at MLA dims (192 / 128, bf16, causal, T 4096 and 8192)
for pallas_gpu, cuDNN (jax.nn.dot_product_attention, no S_max; its v is padded to 192 when
it insists on equal head dims), xla, and pallas_gpu without the S_max store, with the
device's measured bf16 matmul rate as the ceiling. Tables print last; CSVs go under
experiments/results/attention/ (or --out).
"""

import argparse
import csv
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
# k2jax when not installed; last, so that the root's kernels/ hides no installed package
sys.path.append(os.path.dirname(HERE))

from k2jax.kernels import flash  # noqa: E402


def timeit(fn, *args, reps=5, warmup=1):
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  ts = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    ts.append(time.perf_counter() - t0)
  return float(np.median(ts))


def temp_bytes(fn, *args):
  return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def fwd_and_grad(impl, scale, tuning=None, **kw):
  if tuning:
    kw["tuning"] = tuning
  def fwd(q, k, v):   # output and S_max, so neither can be dropped as dead code
    return flash.attention(q, k, v, scale=scale, impl=impl, **kw)

  def loss(q, k, v):
    return jnp.sum(fwd(q, k, v)[0].astype(jnp.float32))

  return jax.jit(fwd), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def inputs(B, T, H, D, Dv, dtype, seed=0):
  ks = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(ks[0], (B, T, H, D), dtype), jax.random.normal(ks[1], (B, T, H, D), dtype),
          jax.random.normal(ks[2], (B, T, H, Dv), dtype))


def write(path, rows):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
    w.writeheader()
    w.writerows(rows)


# ------------------------------------------------------------------------------------- CPU

def cpu(args):
  from k2jax import configs, model
  import optax
  H, D, Dv = 4, 48, 32
  rows = []
  for T in args.lengths:
    for impl in ("xla", "chunked"):
      if impl == "xla" and T > 2048:
        continue
      q, k, v = inputs(1, T, H, D, Dv, jnp.float32)
      f, g = fwd_and_grad(impl, D ** -0.5)
      reps = 3 if T <= 2048 else 1
      rows.append(dict(impl=impl, T=T, fwd_ms=1e3 * timeit(f, q, k, v, reps=reps),
                       fwd_bwd_ms=1e3 * timeit(g, q, k, v, reps=reps),
                       temp_MB=temp_bytes(lambda q, k, v: g(q, k, v), q, k, v) / 1e6))
      print(rows[-1], flush=True)
  model_rows = []
  for T in args.lengths:
    for impl in ("xla", "chunked"):
      if impl == "xla" and T > 2048:
        continue
      cfg = configs.get_config("tiny").model
      cfg.update(dict(max_position_embeddings=max(args.lengths), attention_impl=impl))
      params = jax.eval_shape(lambda: model.init(cfg, jax.random.key(0)))

      def loss(p, t, cfg=cfg):
        logits, _ = model.forward(cfg, p, t)
        return optax.softmax_cross_entropy_with_integer_labels(logits, t).mean()
      temp = temp_bytes(jax.grad(loss), params, jax.ShapeDtypeStruct((1, T), jnp.int32))
      model_rows.append(dict(impl=impl, T=T, model_temp_MB=temp / 1e6, per_token_KB=temp / T / 1e3))
      print(model_rows[-1], flush=True)
  out = args.out or os.path.join(HERE, "results", "attention")
  write(os.path.join(out, "cpu_attention.csv"), rows)
  write(os.path.join(out, "cpu_model_memory.csv"), model_rows)
  print(f"\none attention call, 1 x T x {H} heads x {D}/{Dv}, f32, this CPU")
  print(f"{'impl':<9}{'T':>6}{'fwd ms':>9}{'fwd+bwd ms':>12}{'temp MB':>10}")
  for r in rows:
    print(f"{r['impl']:<9}{r['T']:>6}{r['fwd_ms']:>9.1f}{r['fwd_bwd_ms']:>12.1f}{r['temp_MB']:>10.1f}")
  print("\ntiny model forward + backward temporaries (XLA memory analysis), batch 1")
  print(f"{'impl':<9}{'T':>6}{'temp MB':>10}{'KB/token':>10}")
  for r in model_rows:
    print(f"{r['impl']:<9}{r['T']:>6}{r['model_temp_MB']:>10.1f}{r['per_token_KB']:>10.1f}")


# ------------------------------------------------------------------------------------- GPU

def matmul_tflops():
  a = jax.random.normal(jax.random.key(0), (8192, 8192), jnp.bfloat16)
  f = jax.jit(lambda a: a @ a)
  return 2 * 8192 ** 3 / timeit(f, a, reps=10) / 1e12


def gpu_check():
  """pallas_gpu vs xla on the device: values, S_max and gradients, f32 and bf16."""
  rows = []
  for dtype, tol in ((jnp.float32, 2e-3), (jnp.bfloat16, 3e-2)):
    for T, seg in ((1000, False), (777, True)):
      B, H, D, Dv = 2, 4, 192, 128
      q, k, v = inputs(B, T, H, D, Dv, dtype, seed=T)
      segment_ids = None
      if seg:
        segment_ids = jnp.asarray(np.repeat([[1, 2, 3, 0]], B, 0).repeat(-(-T // 4), 1)[:, :T])
      res = {}
      for impl in ("xla", "pallas_gpu", *tokamax_checked()):
        # The reference in full f32 (XLA's GPU default for f32 matmuls is TF32).
        with jax.default_matmul_precision("highest" if impl == "xla" else "default"):
          try:
            run = _attention_fn(impl, D ** -0.5, segment_ids)
            out, smax = run(q, k, v)
            grads = jax.grad(lambda q, k, v: jnp.sum(run(q, k, v)[0].astype(
                jnp.float32) * jnp.cos(jnp.arange(Dv))), argnums=(0, 1, 2))(q, k, v)
          except Exception as e:   # one kernel failing must not hide the others
            rows.append(dict(impl=impl, dtype=jnp.dtype(dtype).name, T=T, segments=seg,
                             ok=False, note=f"FAILED {type(e).__name__}: "
                             f"{str(e).splitlines()[0][:160]}"))
            print(rows[-1], flush=True)
            continue
        res[impl] = [out, *grads, smax]
      for impl in res:
        if impl == "xla":
          continue
        errs = {name: float(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max()
                            / (float(jnp.abs(b.astype(jnp.float32)).max()) + 1e-30))
                for name, a, b in zip(("out", "dq", "dk", "dv", "smax"), res[impl], res["xla"])}
        ok = all(np.isfinite(list(errs.values()))) and max(errs.values()) < tol
        rows.append(dict(impl=impl, dtype=jnp.dtype(dtype).name, T=T, segments=seg, ok=ok,
                         **errs))
        print(rows[-1], flush=True)
  return rows


def tokamax_checked():
  """tokamax attention kernels whose residual row max has a checked factor (kernels/
  flash_tokamax.RESIDUAL_MAX), as impl names "tokamax:<name>"; none without tokamax."""
  try:
    from k2jax.kernels import flash_tokamax
    ops, _ = flash_tokamax._ops()
  except ImportError:
    return ()
  return tuple(f"tokamax:{n}" for n in flash_tokamax.RESIDUAL_MAX if n in ops and n != "xla")


def _attention_fn(impl, scale, segment_ids=None):
  """(q, k, v) -> (out, S_max) for an impl name or "tokamax:<implementation>"."""
  if impl.startswith("tokamax:"):
    from k2jax.kernels import flash_tokamax
    name = impl.split(":", 1)[1]
    return lambda q, k, v: flash_tokamax.attention(q, k, v, scale=scale,
                                                   segment_ids=segment_ids, name=name)
  return lambda q, k, v: flash.attention(q, k, v, scale=scale, segment_ids=segment_ids,
                                         impl=impl)


TUNINGS = [(64, 128, 4, 2), (128, 64, 8, 2), (128, 128, 8, 3), (64, 64, 4, 3)]


def gpu_tune(T=4096, heads=16):
  """Time pallas_gpu's forward and backward over (block_q, block_k, warps, stages)."""
  from k2jax.kernels import flash_gpu
  D, Dv = 192, 128
  B = max(1, 16384 // T)
  q, k, v = inputs(B, T, heads, D, Dv, jnp.bfloat16)
  rows, best = [], {}
  for part in ("fwd", "bwd"):
    for t in TUNINGS:
      tun = {part: t, **({"fwd": best["fwd"]} if part == "bwd" else {})}
      f = jax.jit(lambda q, k, v: flash_gpu.attention(q, k, v, scale=D ** -0.5, tuning=tun)[0])
      g = jax.jit(jax.grad(lambda q, k, v: jnp.sum(flash_gpu.attention(
          q, k, v, scale=D ** -0.5, tuning=tun)[0].astype(jnp.float32)), argnums=(0, 1, 2)))
      try:
        ms = 1e3 * timeit(f if part == "fwd" else g, q, k, v, reps=5)
      except Exception as e:
        ms = float("inf")
        print(f"tuning {part} {t} failed: {str(e).splitlines()[0][:120]}")
      rows.append(dict(part=part, block_q=t[0], block_k=t[1], warps=t[2], stages=t[3], ms=ms))
      print(rows[-1], flush=True)
    best[part] = min((r for r in rows if r["part"] == part), key=lambda r: r["ms"])
    best[part] = (best[part]["block_q"], best[part]["block_k"], best[part]["warps"],
                  best[part]["stages"])
  return rows, best


def tokamax_tune(out, T=4096, heads=16, budget=300.0, name="mosaic_gpu", tokens=65536,
                 lengths=()):
  """tokamax's own candidate tiles for its `name` attention (forward, then backward with the
  best forward) at MLA's training shape, timed the way k2jax calls it (causal mask,
  residuals returned for S_max); then k2jax's `impl="tokamax"` with the best pair put in
  kernels/flash_tokamax.TILES against tokamax's own choice (its cache or heuristics), at
  T and every length of `lengths`. `tokens` per call (B = tokens / T): at 16K tokens a call
  takes under a millisecond and the host's dispatch shows in the timing. Writes
  tokamax_tune.csv (every candidate) and tokamax_tiles.json (the TILES entry to commit)."""
  import dataclasses
  import json
  from k2jax.kernels import flash_tokamax as ft
  ops, Mask = ft._ops()
  op = ops[name]
  kind = jax.devices()[0].device_kind
  peak = matmul_tflops()
  D, Dv = 192, 128
  B = max(1, tokens // T)
  scale = D ** -0.5
  q, k, v = inputs(B, T, heads, D, Dv, jnp.bfloat16)
  fl = flash.flops(B, T, heads, D, Dv, causal=True)
  mask = Mask(is_causal=True)

  def call(o):
    return lambda q, k, v: o(q, k, v, logits_scale=scale, mask=mask, return_residuals=True)

  def grad(o):
    f = call(o)
    return jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v)[0].astype(jnp.float32)),
                            argnums=(0, 1, 2)))
  ba = op.bind(q, k, v, logits_scale=scale, mask=mask, return_residuals=True)
  print(f"tokamax_tune: tokamax's own choice here is {ba.default_config}", flush=True)
  fwd_cands = [None] + sorted(ba.autotuning_configs, key=str) + [None]   # its choice twice: drift
  from tokamax._src.ops.attention import pallas_mosaic_gpu_vjp_kernel_sm90 as vjp90
  bwd_cands = [None] + sorted(vjp90.get_autotuning_configs(None), key=str)
  rows, t_start = [], time.time()
  best = {}
  for phase, cands in (("fwd", fwd_cands), ("fwd+bwd", bwd_cands)):
    for cfg in cands:
      if time.time() - t_start > budget:
        print(f"tokamax_tune: budget of {budget:.0f}s spent, {phase} {cfg} and later untried")
        break
      try:
        if phase == "fwd":
          o = op if cfg is None else op.replace(config=cfg)
          t = timeit(jax.jit(call(o)), q, k, v, reps=10)
          tf = fl / t / 1e12
        else:
          o = op if best.get("fwd") is None else op.replace(config=best["fwd"][1])
          if cfg is not None:
            o = o.replace(vjp=o.vjp.replace(config=cfg))
          t = timeit(grad(o), q, k, v, reps=5)
          tf = 3.5 * fl / t / 1e12
        rows.append(dict(device=kind, phase=phase, config=str(cfg or "tokamax's choice"),
                         ms=1e3 * t, TFLOPs=tf, matmul_peak_TFLOPs=peak, T=T, B=B,
                         heads=heads, note=""))
        if cfg is not None and tf > best.get(phase, (0.0, None))[0]:
          best[phase] = (tf, cfg)
      except Exception as e:  # a candidate the kernel refuses: report, go on
        rows.append(dict(device=kind, phase=phase, config=str(cfg), ms=float("nan"),
                         TFLOPs=float("nan"), matmul_peak_TFLOPs=peak, T=T, B=B, heads=heads,
                         note=f"FAILED {type(e).__name__}: {str(e).splitlines()[0][:120]}"))
      print(rows[-1], flush=True)
  entry = None
  if "fwd" in best and "fwd+bwd" in best:
    entry = (dataclasses.asdict(best["fwd"][1]), dataclasses.asdict(best["fwd+bwd"][1]))
  # Through k2jax's own call, tokamax's choice vs the tuned pair, same inputs and S_max.
  for lengths_T in sorted({T, *lengths}):
    Bt = max(1, tokens // lengths_T)
    qt, kt, vt = inputs(Bt, lengths_T, heads, D, Dv, jnp.bfloat16)
    flt = flash.flops(Bt, lengths_T, heads, D, Dv, causal=True)
    outs = {}
    for label, tiles in (("k2jax tokamax, tokamax's choice", None), ("k2jax tokamax, tuned", entry)):
      if label.endswith("tuned") and entry is None:
        continue
      ft.TILES.pop((kind, name, D, Dv), None)
      if tiles is not None:
        ft.TILES[(kind, name, D, Dv)] = tiles
      f, g = fwd_and_grad("tokamax", scale)
      outs[label] = f(qt, kt, vt)
      tf_, tb_ = timeit(f, qt, kt, vt, reps=10), timeit(g, qt, kt, vt, reps=5)
      rows.append(dict(device=kind, phase="k2jax fwd / fwd+bwd", config=label,
                       ms=1e3 * tf_, TFLOPs=flt / tf_ / 1e12, fwd_bwd_ms=1e3 * tb_,
                       fwd_bwd_TFLOPs=3.5 * flt / tb_ / 1e12, matmul_peak_TFLOPs=peak,
                       T=lengths_T, B=Bt, heads=heads, note=""))
      print(rows[-1], flush=True)
    if len(outs) == 2:
      (o1, m1), (o2, m2) = outs.values()
      rows[-1]["note"] = (f"vs tokamax's choice: out max |diff| "
                          f"{float(jnp.max(jnp.abs(o1.astype(jnp.float32) - o2.astype(jnp.float32)))):.3g}, "
                          f"S_max max |diff| {float(jnp.max(jnp.abs(m1 - m2))):.3g}")
  ft.TILES.pop((kind, name, D, Dv), None)
  write(os.path.join(out, "tokamax_tune.csv"), rows)
  with open(os.path.join(out, "tokamax_tiles.json"), "w") as f:
    json.dump(dict(device=kind, name=name, D=D, Dv=Dv, T=T, heads=heads, entry=entry,
                   best_TFLOPs={p: b[0] for p, b in best.items()}), f, indent=1)
  print(f"tokamax_tune ({kind}): TILES[{(kind, name, D, Dv)!r}] = {entry!r}")
  return rows


def gpu_bench(lengths, heads, tuning=None, only=None, tokens=16384):
  peak = matmul_tflops()
  rows = []
  D, Dv = 192, 128
  for T in lengths:
    B = max(1, tokens // T)
    q, k, v = inputs(B, T, heads, D, Dv, jnp.bfloat16)
    fl = flash.flops(B, T, heads, D, Dv, causal=True)
    cands = {"pallas_gpu": lambda: fwd_and_grad("pallas_gpu", D ** -0.5, tuning=tuning)}
    if T <= 4096:
      cands["xla"] = lambda: fwd_and_grad("xla", D ** -0.5)

    def cudnn():
      vv = v

      def fwd(q, k, v):
        try:
          return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn",
                                              scale=D ** -0.5)
        except Exception:
          raise
      try:
        jax.jit(fwd).lower(q, k, vv).compile()
        note = "v 128"
      except Exception:  # cuDNN wants equal q/k and v head dims here: pad v to 192
        note = "v padded to 192"
      pad = note != "v 128"

      def f(q, k, v):
        if pad:
          v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, D - Dv)))
        return fwd(q, k, v)

      def loss(q, k, v):
        return jnp.sum(f(q, k, v).astype(jnp.float32))
      return jax.jit(f), jax.jit(jax.grad(loss, argnums=(0, 1, 2))), note

    def no_max():
      from k2jax.kernels import flash_gpu
      seg = jnp.ones((B, T), jnp.int32)
      fwd_t = (tuning or flash_gpu.TUNING)["fwd"]
      return (jax.jit(lambda q, k, v: flash_gpu._forward(
          q, k, v, seg, D ** -0.5, True, fwd_t, False, segmented=False, write_max=False)[0]),
          None)
    def tokamax_impl(impl):
      """tokamax's public attention (output only) with one of its implementations: the
      field's kernels at the same shape, for the table README's `auto` choice reads."""
      def make():
        from k2jax.kernels import platform
        tk = platform.tokamax()

        def f(q, k, v):
          return tk.dot_product_attention(q, k, v, is_causal=True, scale=D ** -0.5,
                                          implementation=impl)

        def loss(q, k, v):
          return jnp.sum(f(q, k, v).astype(jnp.float32))
        return jax.jit(f), jax.jit(jax.grad(loss, argnums=(0, 1, 2))), "no S_max"
      return make
    tk = [(f"tokamax_{i} (no S_max)", tokamax_impl(i)) for i in ("mosaic", "triton")]

    def with_smax(impl):
      def make():
        f = _attention_fn(impl, D ** -0.5)
        return (jax.jit(f), jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v)[0].astype(
            jnp.float32)), argnums=(0, 1, 2))), "S_max from its residuals")
      return make
    tk += [(f"{i} + S_max", with_smax(i)) for i in tokamax_checked()]
    runs = [*cands.items(), ("cudnn", cudnn), ("pallas_gpu_no_smax", no_max), *tk]
    if only:
      runs = [(n, m) for n, m in runs if n in only]
    for name, make in runs:
      try:
        made = make()
        f, g = made[0], made[1]
        note = made[2] if len(made) > 2 else ""
        tf = timeit(f, q, k, v, reps=10)
        tb = timeit(g, q, k, v, reps=5) if g is not None else float("nan")
        rows.append(dict(impl=name, T=T, B=B, heads=heads, fwd_ms=1e3 * tf, fwd_bwd_ms=1e3 * tb,
                         fwd_TFLOPs=fl / tf / 1e12, fwd_bwd_TFLOPs=3.5 * fl / tb / 1e12,
                         matmul_peak_TFLOPs=peak, note=note))
      except Exception as e:  # report and go on: one impl failing must not hide the others
        rows.append(dict(impl=name, T=T, B=B, heads=heads, note=f"FAILED {type(e).__name__}: "
                         f"{str(e).splitlines()[0][:160]}"))
      print(rows[-1], flush=True)
  return rows


def gpu(args):
  out = args.out or os.path.join(HERE, "results", "attention")
  check = gpu_check() if getattr(args, "check", True) else []
  if check:
    write(os.path.join(out, "gpu_check.csv"), check)
  best = None
  if getattr(args, "tune", True):
    tune_rows, best = gpu_tune(heads=args.heads)
    write(os.path.join(out, "gpu_tuning.csv"), tune_rows)
    print(f"best tuning (block_q, block_k, warps, stages): {best}", flush=True)
  rows = gpu_bench(args.gpu_lengths, args.heads, tuning=best, only=getattr(args, "only", None),
                   tokens=getattr(args, "tokens", 16384))
  write(os.path.join(out, "gpu_attention.csv"), rows)
  print(f"\ncorrectness on {jax.devices()[0].device_kind}: pallas_gpu vs xla (max rel error)")
  for r in check:
    print(f"  {r['impl']:<20} {r['dtype']:<9} T={r['T']:<5} segments={r['segments']!s:<6} "
          f"ok={r['ok']!s:<6} " + (" ".join(f"{k}={r[k]:.1e}" for k in ("out", "dq", "dk", "dv",
                                                                        "smax"))
                                   if "out" in r else r.get("note", "")))
  print(f"\nMLA attention 192/128, bf16, causal, {args.heads} heads, 16K tokens per call; "
        f"bf16 matmul ceiling {rows[0].get('matmul_peak_TFLOPs', float('nan')):.0f} TFLOP/s")
  print(f"{'impl':<20}{'T':>6}{'fwd ms':>9}{'fwd TF/s':>10}{'f+b ms':>9}{'f+b TF/s':>10}  note")
  for r in rows:
    print(f"{r['impl']:<20}{r['T']:>6}{r.get('fwd_ms', float('nan')):>9.2f}"
          f"{r.get('fwd_TFLOPs', float('nan')):>10.1f}{r.get('fwd_bwd_ms', float('nan')):>9.2f}"
          f"{r.get('fwd_bwd_TFLOPs', float('nan')):>10.1f}  {r.get('note', '')}")
  for T in args.gpu_lengths:
    by = {r["impl"]: r for r in rows if r["T"] == T and "fwd_ms" in r}
    if "pallas_gpu" in by and "cudnn" in by:
      print(f"T={T}: pallas_gpu / cuDNN speed: fwd {by['cudnn']['fwd_ms'] / by['pallas_gpu']['fwd_ms']:.2f}x,"
            f" fwd+bwd {by['cudnn']['fwd_bwd_ms'] / by['pallas_gpu']['fwd_bwd_ms']:.2f}x")
    if "pallas_gpu" in by and "pallas_gpu_no_smax" in by:
      print(f"T={T}: S_max output costs "
            f"{by['pallas_gpu']['fwd_ms'] / by['pallas_gpu_no_smax']['fwd_ms'] - 1:+.1%} of the forward")


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--gpu", action="store_true")
  p.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048, 4096, 8192])
  p.add_argument("--gpu-lengths", type=int, nargs="+", default=[4096, 8192])
  p.add_argument("--heads", type=int, default=16)
  p.add_argument("--out", default=None)
  args = p.parse_args()
  gpu(args) if args.gpu else cpu(args)


if __name__ == "__main__":
  main()
