"""End-to-end training speed of a ~1B-activated K2-shaped model on one device: tokens/s, MFU.

    python experiments/bench_train.py                 # GPU: the 1B model, auto kernels
    python experiments/bench_train.py --kernels auto,tokamax
    python experiments/bench_train.py --tiny          # CPU: the same code at toy size

The model is K2's architecture scaled down (MLA with K2's head dims, 32 routed experts top-8
plus one shared (64 did not fit 80 GB with the float32 state: 4.4B parameters), the sigmoid router with bias balancing, one dense layer first), bf16
compute, selective recomputation, trained with the trainer's own step (`k2jax.training.step.
train_step`: forward, backward, MuonClip with QK-Clip on, router-bias balancing, the
non-finite gate). Parameters are float32 (no master copy needed: 12 bytes per parameter
with gradients and momentum) so the ~4B total parameters fit one 80 GB device.

Reported per kernel choice (`--kernels`: a comma list of names from KERNELS):
  * step time, tokens/s, model TFLOP/s (k2jax.model.flops_per_token: 6 N + attention) and
    MFU against the device's dense bf16 peak (PEAK_TFLOPS, the datasheet) and against the
    matmul rate measured in the same run;
  * a breakdown: each part jitted alone at the step's shapes (forward + backward), times
    the number of layers it runs in: attention core, the MLA projections, routed experts
    (dispatch + grouped matmuls + combine), shared / dense MLPs, router, head + loss, the
    Muon update (momentum + Newton-Schulz), QK-Clip, and the rest (norms, embedding,
    recomputation, launch gaps) as the step minus their sum;
  * Newton-Schulz's share at K2's own size, from the parameter table
    (k2jax.optim.newton_schulz_flops) against K2's step FLOPs.
Tables print last; CSVs go to --out (default $OUT or experiments/results/train).
"""

import argparse
import functools
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# k2jax when not installed; last, so that the root's kernels/ hides no installed package
sys.path.append(os.path.dirname(HERE))
sys.path.insert(0, HERE)

try:
  import k2jax.kernels  # noqa: F401  (installed: pip install -e .)
except ImportError:        # a plain checkout (the GPU machine): map kernels/ as pyproject does
  from kernels_map import map_kernels
  map_kernels()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import bench_moe  # noqa: E402  (timeit, write: one copy for the benchmarks)
from bench_moe import write  # noqa: E402

# Datasheet dense bf16 peaks (no sparsity), TFLOP/s, by jax device_kind prefix.
PEAK_TFLOPS = {"NVIDIA H100 80GB HBM3": 989.4, "NVIDIA H100": 989.4, "NVIDIA H200": 989.4,
               "NVIDIA B200": 2250.0, "TPU v5p": 459.0, "TPU v6": 918.0, "TPU7x": 2307.0}

# Kernel choices: model.attention_impl, model.moe_impl.
KERNELS = {"auto": ("auto", "auto"), "tokamax": ("tokamax", "tokamax"),
           "tokamax_moe": ("auto", "tokamax"), "tokamax_attention": ("tokamax", "auto"),
           "xla": ("xla", "ragged"),
           "tokamax_attention_triton_bwd": ("tokamax", "auto")}
# Kernel choices that also force kernels/moe_gpu's kernels per role (moe_gpu.FORCE; the
# others leave them to its MGPU table).
MOE_FORCE = {"tokamax_attention_triton_bwd": {"backward": "triton"}}

GPU_MODEL = dict(vocab_size=32768, hidden_size=2048, intermediate_size=8192,
                 moe_intermediate_size=768, num_hidden_layers=14, first_k_dense_replace=1,
                 num_attention_heads=16, q_lora_rank=1536, kv_lora_rank=512,
                 qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                 n_routed_experts=32, num_experts_per_tok=8, n_shared_experts=1,
                 routed_scaling_factor=2.827, max_position_embeddings=4096,
                 dtype="bfloat16", param_dtype="float32", remat="selective",
                 aux_loss_alpha=0.0)
TINY_MODEL = dict(GPU_MODEL, vocab_size=512, hidden_size=128, intermediate_size=256,
                  moe_intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                  q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                  v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, dtype="float32")


def timeit(fn, *args, reps=5, warmup=2):
  return bench_moe.timeit(fn, *args, reps=reps, warmup=warmup)


def ceilings():
  """(dense bf16 matmul TFLOP/s, device copy GB/s counting read + write), measured now."""
  n = 8192 if jax.default_backend() != "cpu" else 1024
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
  b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
  mm = 2 * n ** 3 / timeit(jax.jit(lambda a, b: a @ b), a, b, reps=10) / 1e12
  big = jax.random.normal(jax.random.key(2), (64 * 2 ** 20 if n > 1024 else 2 ** 22,),
                          jnp.float32)
  t = timeit(jax.jit(lambda x: x * 2), big, reps=10)
  return mm, 2 * big.nbytes / t / 1e9


def make_config(model_kw, batch, seq, attention_impl, moe_impl, grad_accum=1,
                ns_dtype="float32", remat=None, cast_once=True):
  from k2jax import configs
  c = configs.get_config("tiny")
  c.model.update(model_kw)
  c.model.update(dict(attention_impl=attention_impl, moe_impl=moe_impl))
  if remat:
    c.model.remat = remat
  c.optimizer.update(dict(name="muonclip", tau=100.0, learning_rate=1e-4, warmup_steps=10,
                          ns_dtype=ns_dtype))
  c.train.update(dict(batch_size=batch, seq_len=seq, grad_accum=grad_accum,
                      cast_once=cast_once))
  return c


def random_batch(cfg, B, T, seed=0):
  rng = np.random.default_rng(seed)
  tok = jnp.asarray(rng.integers(2, cfg.vocab_size, (B, T + 1)), jnp.int32)
  return {"inputs": tok[:, :-1], "targets": tok[:, 1:],
          "positions": jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)),
          "segment_ids": jnp.ones((B, T), jnp.int32), "loss_mask": jnp.ones((B, T), jnp.int32)}


def step_time(config, reps):
  """(seconds per train step, train state, metrics): the trainer's jitted step."""
  from k2jax import optim
  from k2jax import kernels
  from k2jax.training.step import init_state, train_step
  kernels.prepare(config.model.attention_impl, config.model.moe_impl)
  tx = optim.optimizer(config)
  schedule = optim.learning_rate_schedule(config)
  state = jax.jit(functools.partial(init_state, config, tx))(jax.random.key(0))
  batch = random_batch(config.model, config.train.batch_size, config.train.seq_len)
  step = jax.jit(functools.partial(train_step, config, tx, schedule), donate_argnums=0)
  # two untimed steps first: the first compiles; on the H100 (2026-11-26) the second compiled
  # train_step again (same avals), which the 256K-token rows had counted as step time
  ts = []
  for _ in range(2 + reps):
    t0 = time.perf_counter()
    state, metrics = step(state, batch)
    jax.block_until_ready(state)
    ts.append(time.perf_counter() - t0)
  warm, ts = ts[:2], ts[2:]
  # each timed step, so a fixed cost in some steps (a recompile, a stall) shows as such
  print(f"untimed steps (s): {', '.join(f'{t:.3f}' for t in warm)}; timed steps (s): "
        f"{', '.join(f'{t:.3f}' for t in ts)}", flush=True)
  return float(np.median(ts)), state, jax.device_get(metrics)


def _grad_time(f, *args, reps=5):
  """Seconds of forward + backward of f (summed against a fixed cotangent) w.r.t. args."""
  def loss(*a):
    out = f(*a)
    leaves = [o for o in jax.tree.leaves(out) if jnp.issubdtype(o.dtype, jnp.floating)]
    return sum(jnp.sum(o.astype(jnp.float32) * 1e-3) for o in leaves)
  return timeit(jax.jit(jax.grad(loss, argnums=tuple(range(len(args))))), *args, reps=reps)


def breakdown(config, params, state_opt, tx, step_s, reps):
  """Each part of the step jitted alone at its shapes -> rows {part, ms, count, share}."""
  from k2jax import model, optim
  from k2jax.kernels import attention as attention_kernel, routed_experts
  from k2jax.model import attention as attn_mod, moe as moe_mod, rope, stacks
  from k2jax.model.layers import mlp
  m = config.model
  B, T = config.train.batch_size, config.train.seq_len
  dt = jnp.dtype(m.dtype)
  st = {s.ffn: s for s in stacks(m)}
  n_moe = st["moe"].size if "moe" in st else 0
  n_dense = st["mlp"].size if "mlp" in st else 0
  L = m.num_hidden_layers
  key = jax.random.key(1)
  x = (jax.random.normal(key, (B, T, m.hidden_size), jnp.float32)).astype(dt)
  pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  layer = lambda name: jax.tree.map(lambda a: a[0], params[name])
  p_moe = layer(st["moe"].name)
  H, dq, dv = m.num_attention_heads, m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim
  q = jax.random.normal(key, (B, T, H, dq), jnp.float32).astype(dt)
  kk = jax.random.normal(jax.random.key(2), (B, T, H, dq), jnp.float32).astype(dt)
  v = jax.random.normal(jax.random.key(3), (B, T, H, dv), jnp.float32).astype(dt)
  impl = m.attention_impl
  core = _grad_time(lambda q, k, v: attention_kernel(
      q, k, v, scale=rope.softmax_scale(m), impl=impl)[0], q, kk, v, reps=reps)
  full_mla = _grad_time(lambda x, p: attn_mod.mla(m, p, x, pos)[0], x, p_moe["attn"], reps=reps)
  x2d = x.reshape(B * T, -1)
  w, idx, _ = moe_mod.route(m, p_moe["moe"], x2d)
  router = _grad_time(lambda x, r: moe_mod.route(m, {**p_moe["moe"], "router": r}, x)[0],
                      x2d, p_moe["moe"]["router"], reps=reps)
  e = p_moe["moe"]["experts"]
  routed = _grad_time(lambda x, w, g, u, d: routed_experts(
      x, idx, w, g, u, d, impl=m.moe_impl, fp8_storage=m.activation_storage == "fp8"),
      x2d, w, e["gate"], e["up"], e["down"], reps=reps)
  shared = _grad_time(lambda x, p: mlp(p, x), x2d, p_moe["moe"]["shared"], reps=reps) \
      if "shared" in p_moe["moe"] else 0.0
  dense = _grad_time(lambda x, p: mlp(p, x), x2d, layer(st["mlp"].name)["mlp"], reps=reps) \
      if n_dense else 0.0
  tgt = jax.random.randint(key, (B, T), 0, m.vocab_size)

  def head(x, wh):
    import optax
    logits = jnp.einsum("btd,dv->btv", x, wh.astype(dt), preferred_element_type=jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tgt).mean()
  head_s = _grad_time(head, x, params["lm_head"], reps=reps)
  # The optimizer: the whole MuonClip update, and the same chain without QK-Clip.
  grads = jax.tree.map(lambda p: jnp.full(p.shape, 1e-3, jnp.float32), params)
  max_logits = jnp.full((L, H), 150.0, jnp.float32)        # above tau: every head clips
  load = jnp.ones((n_moe, m.n_routed_experts), jnp.float32)

  def upd(tx):
    s = tx.init(params)
    f = jax.jit(lambda g, s, p: tx.update(g, s, p, max_logits=max_logits, expert_load=load)[0])
    return timeit(f, grads, s, params, reps=reps)
  sched = optim.learning_rate_schedule(config)
  t_muon = upd(optim.muon(m, sched, ns_dtype=config.optimizer.ns_dtype))
  # the same chain with no Newton-Schulz iteration: momentum, normalisation, AdamW
  t_rest = min(upd(optim.muon(m, sched, ns_dtype=config.optimizer.ns_dtype, ns_steps=0)),
               t_muon)
  t_clip = upd(optim.qk_clip(m, tau=100.0))
  # the other Newton-Schulz dtype (optimizer.ns_dtype), for comparison: not in the step
  other = "float32" if config.optimizer.ns_dtype == "bfloat16" else "bfloat16"
  t_other = upd(optim.muon(m, sched, ns_dtype=other))
  parts = [("attention core (flash, S_max)", core, L),
           ("MLA projections", max(full_mla - core, 0.0), L),
           ("routed experts", routed, n_moe), ("shared experts", shared, n_moe),
           ("dense MLP", dense, n_dense), ("router", router, n_moe),
           ("head + loss", head_s, 1),
           ("Muon: Newton-Schulz (5 iterations)", t_muon - t_rest, 1),
           ("Muon momentum + AdamW (the update without Newton-Schulz)", t_rest, 1),
           ("QK-Clip", t_clip, 1)]
  rows = [dict(part=n, ms_each=1e3 * t, count=c, ms=1e3 * t * c, share=t * c / step_s)
          for n, t, c in parts]
  rest = step_s - sum(t * c for _, t, c in parts)
  rows.append(dict(part="rest (norms, embedding, recompute, gaps)", ms_each=1e3 * rest, count=1,
                   ms=1e3 * rest, share=rest / step_s))
  rows.append(dict(part=f"(not in the step) the optimizer with Newton-Schulz in {other}",
                   ms_each=1e3 * t_other, count=1, ms=1e3 * t_other, share=t_other / step_s))
  return rows


def _moe_tiles():
  """pallas_gpu's grouped-matmul tiles in this process (gpu_check may have tuned them), and
  who runs its backward and combine (moe_gpu.FORCE, else the MGPU table)."""
  from k2jax.kernels import moe_gpu
  return str(dict(moe_gpu.TUNING, by_size=moe_gpu.TUNING_BY_SIZE,
                  force=moe_gpu.FORCE, mgpu=moe_gpu.MGPU))


def k2_newton_schulz_share():
  """Newton-Schulz FLOPs per step over model FLOPs per step at K2's own size."""
  from k2jax import configs, model, optim
  c = configs.get_config("kimi_k2")
  tokens = c.train.batch_size * c.train.seq_len
  ns = optim.newton_schulz_flops(c.model, c.optimizer.ns_steps)
  step = model.flops_per_token(c.model, c.train.seq_len) * tokens
  return dict(ns_PFLOP=ns / 1e15, step_PFLOP=step / 1e15, share=ns / step,
              tokens_per_step=tokens)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--kernels", default="auto", help=f"comma list of {', '.join(KERNELS)}")
  p.add_argument("--batch", type=int, default=2)
  p.add_argument("--seq", type=int, default=4096)
  p.add_argument("--grad-accum", type=int, default=1,
                 help="microbatches per optimizer step (--batch is the whole step's)")
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--ns-dtype", default="float32", choices=("float32", "bfloat16"),
                 help="optimizer.ns_dtype: Newton-Schulz's dtype in the step")
  p.add_argument("--remat", default=None, choices=("none", "selective", "full"),
                 help="model.remat (default the model's: selective, report 2.4.3)")
  p.add_argument("--cast-once", default="on", choices=("on", "off", "both"),
                 help="train.cast_once (weights cast to bf16 once per step, not per "
                      "microbatch); both: each kernel choice with and without, same process")
  p.add_argument("--tag", default="", help="suffix of the CSV names (several runs, one folder)")
  p.add_argument("--tiny", action="store_true", help="toy sizes (CPU smoke run)")
  p.add_argument("--no-breakdown", action="store_true")
  p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(HERE, "results"))
  args = p.parse_args(argv)
  bad = [k for k in args.kernels.split(",") if k not in KERNELS]
  if bad:
    p.error(f"--kernels {','.join(bad)}: unknown kernel choice; choose from {', '.join(KERNELS)}")
  from k2jax import model
  model_kw = TINY_MODEL if args.tiny else GPU_MODEL
  if args.tiny:
    args.batch, args.seq = 2, 64
  dev = jax.devices()[0]
  peak = next((v for k, v in PEAK_TFLOPS.items() if dev.device_kind.startswith(k)), None)
  mm, bw = ceilings()
  print(f"{dev.device_kind}: measured bf16 matmul {mm:.0f} TFLOP/s, copy {bw:.0f} GB/s; "
        f"datasheet dense bf16 peak {peak or float('nan')} TFLOP/s", flush=True)
  rows, parts_rows = [], []
  casts = {"on": (True,), "off": (False,), "both": (False, True)}[args.cast_once]
  for name, cast_once in [(n, c) for n in args.kernels.split(",") for c in casts]:
    attn_impl, moe_impl = KERNELS[name]
    from k2jax.kernels import moe_gpu
    moe_gpu.FORCE = dict(MOE_FORCE.get(name, {}))
    batch = args.batch
    while True:
      config = make_config(model_kw, batch, args.seq, attn_impl, moe_impl,
                           min(args.grad_accum, batch), args.ns_dtype, args.remat, cast_once)
      try:
        step_s, state, metrics = step_time(config, args.reps)
        break
      except Exception as e:   # out of memory: halve the batch and say so in the row
        if "RESOURCE_EXHAUSTED" not in str(e) or batch == 1:
          rows.append(dict(kernels=name, note=f"FAILED {type(e).__name__}: "
                           f"{str(e).splitlines()[0][:200]}"))
          print(rows[-1], flush=True)
          step_s = None
          break
        batch //= 2
        print(f"{name}: out of memory at batch {batch * 2}, trying {batch}", flush=True)
    if step_s is None:
      continue
    m = config.model
    counts = model.count_params(m)
    tokens = batch * args.seq
    flops = model.flops_per_token(m, args.seq) * tokens
    tf = flops / step_s / 1e12
    mem = dev.memory_stats() or {}     # None on CPU
    rows.append(dict(kernels=name, attention_impl=attn_impl, moe_impl=moe_impl,
                     peak_GB=mem.get("peak_bytes_in_use", float("nan")) / 1e9,
                     limit_GB=mem.get("bytes_limit", float("nan")) / 1e9,
                     grad_accum=config.train.grad_accum, cast_once=cast_once,
                     ns_dtype=args.ns_dtype,
                     remat=m.remat, moe_tiles=_moe_tiles(),
                     activated_B=counts["activated"] / 1e9, total_B=counts["total"] / 1e9,
                     batch=batch, seq=args.seq, step_ms=1e3 * step_s, tokens_per_s=tokens / step_s,
                     model_TFLOPs=tf, MFU_datasheet=tf / peak if peak else float("nan"),
                     MFU_measured_matmul=tf / mm, matmul_TFLOPs=mm, copy_GBps=bw,
                     loss=float(metrics["loss"]), max_logit=float(metrics["max_logit"]),
                     device=dev.device_kind))
    print(rows[-1], flush=True)
    if not args.no_breakdown:
      from k2jax import optim
      tx = optim.optimizer(config)
      params = state.params
      del state                     # the optimizer state's memory, for the parts' own
      try:
        br = breakdown(config, params, None, tx, step_s, args.reps)
      except Exception as e:
        br = [dict(part=f"FAILED {type(e).__name__}: {str(e).splitlines()[0][:200]}")]
      for r in br:
        parts_rows.append(dict(kernels=name, cast_once=cast_once, **r))
        print(parts_rows[-1], flush=True)
    state = params = None
  ns = k2_newton_schulz_share()
  out = os.path.join(args.out, "train")
  suffix = ("_tiny" if args.tiny else "") + (f"_{args.tag}" if args.tag else "")
  write(os.path.join(out, f"bench_train{suffix}.csv"), rows)
  if parts_rows:
    write(os.path.join(out, f"bench_train_parts{suffix}.csv"), parts_rows)
  print(f"\n{dev.device_kind}: ceilings measured now: bf16 matmul {mm:.0f} TFLOP/s, copy "
        f"{bw:.0f} GB/s; MFU against the datasheet's {peak} TFLOP/s")
  print(f"{'kernels':<18}{'act B':>6}{'tot B':>6}{'batch':>6}{'accum':>6}{'remat':>10}"
        f"{'NS':>6}{'cast1':>6}{'step ms':>9}{'tok/s':>9}{'TFLOP/s':>9}{'MFU':>7}{'/matmul':>8}"
        f"{'peak GB':>9}{'of':>6}")
  for r in rows:
    if "step_ms" not in r:
      print(f"{r['kernels']:<18} {r['note']}")
      continue
    print(f"{r['kernels']:<18}{r['activated_B']:>6.2f}{r['total_B']:>6.2f}{r['batch']:>6}"
          f"{r['grad_accum']:>6}{r['remat']:>10}{'f32' if r['ns_dtype'] == 'float32' else 'bf16':>6}{'yes' if r['cast_once'] else 'no':>6}{r['step_ms']:>9.1f}{r['tokens_per_s']:>9.0f}{r['model_TFLOPs']:>9.1f}"
          f"{r['MFU_datasheet']:>7.1%}{r['MFU_measured_matmul']:>8.1%}{r['peak_GB']:>9.1f}"
          f"{r['limit_GB']:>6.0f}")
  if parts_rows:
    print(f"\n{'kernels':<18}{'part':<58}{'ms each':>9}{'x':>4}{'ms':>9}{'share':>7}")
    for r in parts_rows:
      if "ms" not in r:
        print(f"{r['kernels']:<18}{r['part']}")
        continue
      print(f"{r['kernels']:<18}{r['part']:<58}{r['ms_each']:>9.2f}{r['count']:>4}{r['ms']:>9.1f}"
            f"{r['share']:>7.1%}")
  print(f"\nK2 (kimi_k2 preset, {ns['tokens_per_step']:,} tokens per step): Newton-Schulz "
        f"{ns['ns_PFLOP']:.1f} PFLOP per step = {ns['share']:.2%} of the step's "
        f"{ns['step_PFLOP']:.0f} PFLOP, in total over the devices: each orthogonalizes the "
        f"matrices it holds (1 / data of them per data rank where data divides them); the "
        f"non-expert matrices are repeated over the expert group")
  return rows


if __name__ == "__main__":
  main()
