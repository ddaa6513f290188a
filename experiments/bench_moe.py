"""MoE dispatch speed: routed experts and grouped matmuls per implementation, vs the machine.

    python experiments/bench_moe.py [--quick]      # CPU: layer, 8 -> 256 experts, train step vs PyTorch
    python experiments/bench_moe.py --gpu          # GPU: K2 expert shapes, TFLOP/s per impl

CPU (the bench config of issue 8: hidden 256, experts of width 256, 16 experts top-2, 1024
tokens per MoE layer, float32):
  * ceilings measured in the same run: a 1024^3 matmul, a plain matmul with the layer's
    FLOPs (the rate its grouped matmuls could reach), and a memory copy;
  * one MoE layer's routed experts (k2jax.kernels.routed_experts) forward and forward +
    backward per impl, with GFLOP/s and the fraction of the plain-matmul rate;
  * the same with 8, 16, 64, 256 experts at equal tokens (FLOPs equal; weight bytes grow);
  * one full train step (AdamW) against transformers' DeepseekV3 in eager PyTorch on the
    same weights (2 threads), when torch is installed.
GPU: d 7168, f 2048, 384 experts, top-8, bf16: grouped-matmul TFLOP/s per impl (after a
correctness check against a float32 reference) against one dense matmul of the same FLOPs,
and the fused routed-experts layer (pallas_gpu vs ragged_dot) forward and forward+backward.
Tables print last; CSVs go to experiments/results/moe/ (or --out).
"""

import argparse
import contextlib
import csv
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
# k2jax when not installed; last, so that the root's kernels/ hides no installed package
sys.path.append(os.path.dirname(HERE))

from k2jax.kernels import gmm as gm, moe  # noqa: E402

BENCH = dict(vocab_size=512, hidden_size=256, intermediate_size=768, moe_intermediate_size=256,
             num_hidden_layers=4, first_k_dense_replace=1, num_attention_heads=8, q_lora_rank=128,
             kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
             n_routed_experts=16, num_experts_per_tok=2, n_shared_experts=1,
             routed_scaling_factor=2.827)


def timeit(fn, *args, reps=10, warmup=2):
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  ts = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    ts.append(time.perf_counter() - t0)
  return float(np.median(ts))


def write(path, rows):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
    w.writeheader()
    w.writerows(rows)


def layer_inputs(N, d, f, E, k, dtype=jnp.float32, seed=0):
  ks = jax.random.split(jax.random.key(seed), 6)
  w = lambda key, s: (jax.random.normal(key, s, jnp.float32) * s[-2] ** -0.5).astype(dtype)
  gate, up, down = w(ks[0], (E, d, f)), w(ks[1], (E, d, f)), w(ks[2], (E, f, d))
  x = jax.random.normal(ks[3], (N, d), dtype)
  scores = jax.nn.sigmoid(jax.random.normal(ks[4], (N, E)))
  combine, ids = jax.lax.top_k(scores, k)
  return x, ids, combine, gate, up, down


def layer_fns(impl):
  fwd = jax.jit(lambda x, i, c, g, u, d: moe.routed_experts(x, i, c, g, u, d, impl=impl))
  loss = lambda x, i, c, g, u, d: jnp.sum(moe.routed_experts(x, i, c, g, u, d, impl=impl)
                                          .astype(jnp.float32) ** 2)
  grad = jax.jit(jax.grad(loss, argnums=(0, 2, 3, 4, 5)))
  return fwd, grad


# ------------------------------------------------------------------------------------- CPU

def ceilings():
  a = jax.random.normal(jax.random.key(0), (1024, 1024))
  mm = 2 * 1024 ** 3 / timeit(jax.jit(lambda a: a @ a), a) / 1e9
  big = jnp.ones((64 * 2 ** 20,), jnp.float32)
  bw = 2 * big.nbytes / timeit(jax.jit(lambda b: b + 1.0), big) / 1e9
  return mm, bw


def cpu(args):
  out = args.out or os.path.join(HERE, "results", "moe")
  reps = 3 if args.quick else 10
  mm_rate, bw = ceilings()
  N, d, f, E, k = 1024, 256, 256, 16, 2
  flops = 2 * N * k * 3 * d * f                                      # gate, up, down
  xa = jax.random.normal(jax.random.key(1), (N * k, d))
  wa = jax.random.normal(jax.random.key(2), (d, f))
  plain = flops / (3 * timeit(jax.jit(lambda a, b: a @ b), xa, wa, reps=reps)) / 1e9
  layer = []
  args_ = layer_inputs(N, d, f, E, k)
  for impl in ("dense", "blocked", "ragged", "capacity"):
    fwd, grad = layer_fns(impl)
    tf, tb = timeit(fwd, *args_, reps=reps), timeit(grad, *args_, reps=reps)
    fl = flops * (E / k if impl == "dense" else 1)
    layer.append(dict(impl=impl, fwd_ms=1e3 * tf, fwd_bwd_ms=1e3 * tb,
                      fwd_GFLOPs=flops / tf / 1e9, fwd_bwd_GFLOPs=3 * flops / tb / 1e9,
                      frac_of_plain=3 * flops / tb / 1e9 / plain, executed_GFLOP=fl / 1e9))
    print(layer[-1], flush=True)
  sweep = []
  for E_ in (8, 16, 64, 256):
    a = layer_inputs(N, d, f, E_, k, seed=E_)
    for impl in ("blocked", "ragged", "capacity"):
      _, grad = layer_fns(impl)
      sweep.append(dict(experts=E_, impl=impl, fwd_bwd_ms=1e3 * timeit(grad, *a, reps=reps)))
      print(sweep[-1], flush=True)
  for r in sweep:
    r["vs_8"] = r["fwd_bwd_ms"] / next(s["fwd_bwd_ms"] for s in sweep
                                       if s["experts"] == 8 and s["impl"] == r["impl"])
  blocks = []   # the blocked layer at each block size: where gmm._ROW_COST comes from
  for E_ in (8, 16, 64, 256):
    x_, i_, c_, g_, u_, d_ = layer_inputs(N, d, f, E_, k, seed=E_)
    for b in (32, 64, 128, 256):
      L = lambda x, g, u, dn, b=b: jnp.sum(moe._blocked(x, i_, c_, g, u, dn, block=b) ** 2)
      ms = 1e3 * timeit(jax.jit(jax.grad(L, (0, 1, 2, 3))), x_, g_, u_, d_, reps=reps)
      blocks.append(dict(rows=N * k, groups=E_, block=b,
                         picked=gm.blocked_block_size(N * k, E_) == b, fwd_bwd_ms=ms))
      print(blocks[-1], flush=True)
  step = [] if args.quick else train_step_vs_torch()
  write(os.path.join(out, "cpu_layer.csv"), layer)
  write(os.path.join(out, "cpu_experts_sweep.csv"), sweep)
  write(os.path.join(out, "cpu_blocked_blocks.csv"), blocks)
  if step:
    write(os.path.join(out, "cpu_train_step.csv"), step)
  print(f"\nceilings: 1024^3 f32 matmul {mm_rate:.0f} GFLOP/s; plain matmul of the layer's shape "
        f"{plain:.0f} GFLOP/s; memory copy {bw:.1f} GB/s")
  print(f"one MoE layer's routed experts: {N} tokens, d {d}, f {f}, {E} experts top-{k}, f32")
  print(f"{'impl':<10}{'fwd ms':>9}{'fwd+bwd ms':>12}{'GFLOP/s':>9}{'of plain':>10}")
  for r in layer:
    print(f"{r['impl']:<10}{r['fwd_ms']:>9.1f}{r['fwd_bwd_ms']:>12.1f}{r['fwd_bwd_GFLOPs']:>9.1f}"
          f"{r['frac_of_plain']:>10.0%}")
  print("experts at equal tokens (forward + backward, relative to 8 experts)")
  for r in sweep:
    print(f"  {r['impl']:<10}{r['experts']:>5} experts {r['fwd_bwd_ms']:>8.1f} ms  {r['vs_8']:.2f}x")
  print("blocked block sweep: layer fwd + bwd ms by block size (* = blocked_block_size)")
  for M_, G_ in sorted({(r["rows"], r["groups"]) for r in blocks}):
    cells = [f"{r['block']}{'*' if r['picked'] else ' '} {r['fwd_bwd_ms']:6.1f}" for r in blocks
             if (r["rows"], r["groups"]) == (M_, G_)]
    print(f"  rows {M_} groups {G_:>3}: " + "   ".join(cells))
  for r in step:
    print(f"train step ({r['what']}): k2jax {r['k2jax_ms']:.0f} ms (moe_impl ragged "
          f"{r['k2jax_ragged_ms']:.0f}, capacity {r['k2jax_capacity_ms']:.0f}), PyTorch "
          f"{r['torch_ms']:.0f} ms -> k2jax is "
          f"{r['torch_ms'] / r['k2jax_ms']:.2f}x as fast; router load max / mean at the first "
          f"step {r['first_step_load_imbalance']:.1f}")


def train_step_vs_torch(steps=10):
  """One AdamW train step of the bench config, k2jax vs transformers on the same weights."""
  try:
    import torch
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
    import hf_reference as ref
  except Exception as e:  # torch is optional here
    print(f"train step vs PyTorch skipped: {e}")
    return []
  import functools
  import tempfile
  from k2jax import configs, optim
  from k2jax.interop import hf
  from k2jax.training.step import TrainState, train_step
  torch.set_num_threads(2)
  arch = {k: v for k, v in BENCH.items()}
  arch.update(n_group=1, topk_group=1, norm_topk_prob=True, rms_norm_eps=1e-6,
              initializer_range=0.02, aux_loss_alpha=0.0, max_position_embeddings=512)
  cj = ref.hf_config_dict(arch, None, 10000.0)
  tmodel = ref.make_model(cj, seed=0)
  B, T = 4, 256
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, arch["vocab_size"], (B, T + 1))
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    ref.write_dir(tmp, cj, ref.published_tensors(tmodel))
    mcfg, params = hf.load_checkpoint(tmp)
  batch = {"inputs": tokens[:, :-1].astype(np.int32), "targets": tokens[:, 1:].astype(np.int32),
           "loss_mask": np.ones((B, T), np.float32),
           "positions": np.tile(np.arange(T, dtype=np.int32), (B, 1)),
           "segment_ids": np.ones((B, T), np.int32)}
  steps_, imbalance = {}, None
  for impl in ("blocked", "ragged", "capacity"):  # blocked is the CPU default (moe.auto_impl)
    config = configs.get_config("tiny")
    config.model = mcfg
    config.model.moe_impl = impl
    config.optimizer.update(dict(name="adamw", learning_rate=1e-4, warmup_steps=0,
                                 decay_steps=0, weight_decay=0.0))
    config.train.update(dict(batch_size=B, seq_len=T))
    tx, schedule = optim.optimizer(config), optim.learning_rate_schedule(config)
    p = jax.tree.map(jnp.array, params)
    state = TrainState(jnp.zeros((), jnp.int32), p, tx.init(p), jnp.zeros((), jnp.int32),
                       jnp.zeros((), jnp.int32))
    step = jax.jit(functools.partial(train_step, config, tx, schedule), donate_argnums=0)
    state, m = step(state, batch)
    jax.block_until_ready(state)
    imbalance = imbalance or float(m["expert_load_imbalance"])
    steps_[impl] = [step, state]
  tmodel.train()
  for n, p in tmodel.named_parameters():
    p.requires_grad_("e_score_correction_bias" not in n)
  opt = torch.optim.AdamW([p for p in tmodel.parameters() if p.requires_grad], lr=1e-4,
                          weight_decay=0.0)
  tmodel.config._attn_implementation = "sdpa"
  inp = torch.as_tensor(tokens[:, :-1]); tgt = torch.as_tensor(tokens[:, 1:])

  def torch_step():
    logits = tmodel(input_ids=inp, use_cache=False).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             tgt.reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()

  torch_step()
  # Rounds interleave every candidate, so load on a shared machine hits them alike.
  ts = {name: [] for name in (*steps_, "torch")}
  for _ in range(steps):
    for impl, s in steps_.items():
      t0 = time.perf_counter()
      s[1], m = s[0](s[1], batch)
      jax.block_until_ready(m["loss"])
      ts[impl].append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    torch_step()
    ts["torch"].append(time.perf_counter() - t0)
  k2 = {name: 1e3 * float(np.median(t)) for name, t in ts.items()}
  th = k2.pop("torch")
  rows.append(dict(what=f"bench config, batch {B} x {T}, AdamW, f32", k2jax_ms=k2["blocked"],
                   k2jax_ragged_ms=k2["ragged"], k2jax_capacity_ms=k2["capacity"], torch_ms=th,
                   first_step_load_imbalance=imbalance))
  print(rows[-1], flush=True)
  return rows


# ------------------------------------------------------------------------------------- GPU

def gpu(args):
  out = args.out or os.path.join(HERE, "results", "moe")
  d, f, E, k = 7168, 2048, 384, 8
  N = args.tokens
  M = N * k
  dt = jnp.bfloat16
  ks = jax.random.split(jax.random.key(0), 4)
  x = jax.random.normal(ks[0], (M, d), dt)
  w = (jax.random.normal(ks[1], (E, d, f), jnp.float32) * d ** -0.5).astype(dt)
  # Routing-like group sizes: Poisson-ish around M / E, a few empty experts.
  sizes = np.random.default_rng(0).multinomial(M, np.random.default_rng(1).dirichlet(np.ones(E) * 4))
  gs = jnp.asarray(sizes, jnp.int32)
  flops = 2 * M * d * f
  a, b = jax.random.normal(ks[2], (M, d), dt), jax.random.normal(ks[3], (d, f), dt)
  dense_t = timeit(jax.jit(lambda a, b: a @ b), a, b, reps=20)
  rows = [dict(impl="dense matmul (same FLOPs)", fwd_ms=1e3 * dense_t, fwd_TFLOPs=flops / dense_t / 1e12,
               ok=True)]
  # correctness on a slice against float32 math on the host, group by group (XLA:GPU lowers an
  # f32 ragged_dot of this size densely: 84 GB)
  xs = x[:4096]
  gss = np.random.default_rng(2).multinomial(4096, np.ones(E) / E)
  xs_h, w_h = np.asarray(xs, np.float32), np.asarray(w, np.float32)
  want, start = np.zeros((4096, f), np.float32), 0
  for g, n in enumerate(gss):
    want[start:start + n] = xs_h[start:start + n] @ w_h[g]
    start += n
  want, gss = jnp.asarray(want), jnp.asarray(gss, jnp.int32)
  for impl in ("pallas_gpu", "ragged_dot", "tokamax"):
    row = dict(impl=impl)
    try:
      got = gm.grouped_matmul(xs, w, gss, impl=impl).astype(jnp.float32)
      err = float(jnp.abs(got - want).max() / jnp.abs(want).max())
      row.update(rel_err=err, ok=bool(err < 2e-2))
      fwd = jax.jit(lambda x, w: gm.grouped_matmul(x, w, gs, impl=impl))
      t = timeit(fwd, x, w, reps=10)
      row.update(fwd_ms=1e3 * t, fwd_TFLOPs=flops / t / 1e12, vs_dense=dense_t / t)
      g = jax.jit(jax.grad(lambda x, w: jnp.sum(gm.grouped_matmul(x, w, gs, impl=impl)
                                                .astype(jnp.float32)), argnums=(0, 1)))
      tb = timeit(g, x, w, reps=5)
      row.update(fwd_bwd_ms=1e3 * tb, fwd_bwd_TFLOPs=3 * flops / tb / 1e12)
    except Exception as e:
      row.update(note=f"FAILED {type(e).__name__}: {str(e).splitlines()[0][:160]}")
    rows.append(row)
    print(row, flush=True)
  # tile sweep of the gate / up kernel (forward), then of the backward's tgmm
  from k2jax.kernels import moe_gpu
  tuning_rows = []
  with swept_tiles():   # the sweeps time what they set in TUNING
    for cfg_ in [(128, 256, 64, 8, 3), (64, 256, 64, 8, 3), (128, 256, 64, 8, 4)]:
      moe_gpu.TUNING["gmm"] = cfg_
      try:
        t = timeit(jax.jit(lambda x, w: gm.grouped_matmul(x, w, gs, impl="pallas_gpu")), x, w, reps=5)
        tuning_rows.append(dict(kernel="gmm", tiles=str(cfg_), ms=1e3 * t, TFLOPs=flops / t / 1e12))
      except Exception as e:
        tuning_rows.append(dict(kernel="gmm", tiles=str(cfg_), note=str(e).splitlines()[0][:120]))
      print(tuning_rows[-1], flush=True)
    ok = [r for r in tuning_rows if "ms" in r]
    if ok:
      best = min(ok, key=lambda r: r["ms"])
      moe_gpu.TUNING["gmm"] = eval(best["tiles"])
      row = dict(impl="pallas_gpu (best tiles)", ok=True, tiles=best["tiles"])
      t = timeit(jax.jit(lambda x, w: gm.grouped_matmul(x, w, gs, impl="pallas_gpu")), x, w, reps=10)
      g = jax.jit(jax.grad(lambda x, w: jnp.sum(gm.grouped_matmul(x, w, gs, impl="pallas_gpu")
                                                .astype(jnp.float32)), argnums=(0, 1)))
      tb = timeit(g, x, w, reps=5)
      row.update(fwd_ms=1e3 * t, fwd_TFLOPs=flops / t / 1e12, vs_dense=dense_t / t,
                 fwd_bwd_ms=1e3 * tb, fwd_bwd_TFLOPs=3 * flops / tb / 1e12)
      rows.append(row)
      print(row, flush=True)
    # tgmm (the backward's dW) at the chosen row tile
    xt, dyt = x, jax.random.normal(ks[2], (M, f), dt)
    for cfg_ in [(moe_gpu.TUNING["gmm"][0], 128, 64, 8, 2), (moe_gpu.TUNING["gmm"][0], 128, 128, 8, 3),
                 (moe_gpu.TUNING["gmm"][0], 64, 128, 4, 3)]:
      moe_gpu.TUNING["tgmm"] = cfg_
      try:
        tiles = moe_gpu.Tiles(gs, M, moe_gpu.TUNING["gmm"][0])
        fn = jax.jit(lambda a, b: moe_gpu.tgmm(a, b, tiles, tiles.row, tiles.row, E))
        t = timeit(fn, xt, dyt, reps=3)
        tuning_rows.append(dict(kernel="tgmm", tiles=str(cfg_), ms=1e3 * t, TFLOPs=flops / t / 1e12))
      except Exception as e:
        tuning_rows.append(dict(kernel="tgmm", tiles=str(cfg_), note=str(e).splitlines()[0][:120]))
      print(tuning_rows[-1], flush=True)
    ok = [r for r in tuning_rows if r["kernel"] == "tgmm" and "ms" in r]
    if ok:
      moe_gpu.TUNING["tgmm"] = eval(min(ok, key=lambda r: r["ms"])["tiles"])
  write(os.path.join(out, "gpu_gmm_tuning.csv"), tuning_rows)
  del w
  # the fused layer, scaled to fit: all 384 experts would need 3 x 11 GB of weights + grads
  E2 = args.layer_experts
  layer = []
  li = layer_inputs(N, d, f, E2, k, dtype=dt)
  lflops = 2 * N * k * 3 * d * f
  for impl in ("pallas_gpu", "ragged"):
    row = dict(impl=impl, experts=E2, tokens=N)
    try:
      fwd, grad = layer_fns(impl)
      tf, tb = timeit(fwd, *li, reps=5), timeit(grad, *li, reps=3)
      row.update(fwd_ms=1e3 * tf, fwd_bwd_ms=1e3 * tb, fwd_TFLOPs=lflops / tf / 1e12,
                 fwd_bwd_TFLOPs=3 * lflops / tb / 1e12)
    except Exception as e:
      row.update(note=f"FAILED {type(e).__name__}: {str(e).splitlines()[0][:160]}")
    layer.append(row)
    print(row, flush=True)
  write(os.path.join(out, "gpu_grouped_matmul.csv"), rows)
  write(os.path.join(out, "gpu_layer.csv"), layer)
  print(f"\n{jax.devices()[0].device_kind}: grouped matmul {M} rows x {d} -> {f}, {E} experts "
        f"(top-{k} of {N} tokens), bf16")
  print(f"{'impl':<28}{'ok':>5}{'fwd ms':>9}{'TFLOP/s':>9}{'vs dense':>10}{'f+b ms':>9}{'TFLOP/s':>9}")
  for r in rows:
    print(f"{r['impl']:<28}{str(r.get('ok', '')):>5}{r.get('fwd_ms', float('nan')):>9.2f}"
          f"{r.get('fwd_TFLOPs', float('nan')):>9.0f}{r.get('vs_dense', float('nan')):>10.0%}"
          f"{r.get('fwd_bwd_ms', float('nan')):>9.2f}{r.get('fwd_bwd_TFLOPs', float('nan')):>9.0f}"
          f"  {r.get('note', '')}")
  print(f"routed experts layer ({E2} experts, {N} tokens top-{k}, gate + up + down)")
  for r in layer:
    print(f"  {r['impl']:<12} fwd {r.get('fwd_ms', float('nan')):8.2f} ms "
          f"({r.get('fwd_TFLOPs', float('nan')):.0f} TFLOP/s)  fwd+bwd "
          f"{r.get('fwd_bwd_ms', float('nan')):8.2f} ms ({r.get('fwd_bwd_TFLOPs', float('nan')):.0f})"
          f"  {r.get('note', '')}")


# tokamax Mosaic GPU tile candidates for the role sweep (Config kwargs; block_n 64 = one
# 128-byte swizzle of bf16 output, as tokamax's own sm90 search space): its H100 cache's
# winners at DeepSeek-V3 / K2 expert shapes, and its sm90 heuristic for comparison.
TOKAMAX_CANDIDATES = [
    dict(block_m=128, block_n=64, block_k=128, num_stages=4, split_k=1, persistent=True,
         grid_minor_dim="N", grid_tile_width=4),
    dict(block_m=128, block_n=64, block_k=128, num_stages=4, split_k=1, persistent=True,
         grid_minor_dim="N", grid_tile_width=8),
    dict(block_m=128, block_n=64, block_k=128, num_stages=4, split_k=1, persistent=True,
         grid_minor_dim="M", grid_tile_width=1),
    dict(block_m=128, block_n=64, block_k=128, num_stages=2, split_k=1, persistent=False,
         grid_minor_dim="M", grid_tile_width=1),
]


@contextlib.contextmanager
def swept_tiles():
  """moe_gpu.TUNING alone decides the tiles inside (a sweep sets it; the size table,
  moe_gpu.TUNING_BY_SIZE, would override it at K2's sizes); the table is back after."""
  from k2jax.kernels import moe_gpu
  table = dict(moe_gpu.TUNING_BY_SIZE)
  moe_gpu.TUNING_BY_SIZE.clear()
  try:
    yield
  finally:
    moe_gpu.TUNING_BY_SIZE.update(table)


def role_operands(d, f, E, k, tokens, seed):
  """The operands of an MoE layer's grouped matmuls in bf16: (M rows = tokens x k, x [M, d],
  h [M, f], w_up [E, d, f], w_down [E, f, d], group sizes (numpy and jnp; routing-like:
  multinomial over Dirichlet(4) expert shares, a few near empty), FLOPs of one product)."""
  M, dt = tokens * k, jnp.bfloat16
  ks = jax.random.split(jax.random.key(seed), 4)
  x = jax.random.normal(ks[0], (M, d), dt)
  h = jax.random.normal(ks[1], (M, f), dt)
  w_up = (jax.random.normal(ks[2], (E, d, f), jnp.float32) * d ** -0.5).astype(dt)
  w_dn = (jax.random.normal(ks[3], (E, f, d), jnp.float32) * f ** -0.5).astype(dt)
  sizes = np.random.default_rng(0).multinomial(M, np.random.default_rng(1).dirichlet(
      np.ones(E) * 4))
  return M, x, h, w_up, w_dn, sizes, jnp.asarray(sizes, jnp.int32), 2 * M * d * f


def gpu_roles(args):
  """Each grouped matmul of an MoE layer's training step timed alone at K2's expert shapes
  (d 7168, f 2048, 384 experts, top-8 of args.tokens tokens, bf16), per implementation:

    up    y = x w_g        [M, d] x [E, d, f]      (gate / up projections)
    down  y = h w_g        [M, f] x [E, f, d]
    dlhs  dx = dy w_g^T    [M, f] x [E, d, f]^T    (input gradient of up)
    drhs  dw_g = x_g^T dy  [M, d]^T x [M, f]       (weight gradient of up)

  ours (Pallas Triton kernels, kernels/moe_gpu.py), XLA's ragged_dot, tokamax with its own
  tile choice and with each TOKAMAX_CANDIDATES entry; each checked against float32 math on
  a slice first. Writes gpu_gmm_roles.csv and the best tokamax tiles per role
  (tokamax_tiles.json: what kernels/gmm.TOKAMAX_TILES takes)."""
  import json
  from k2jax.kernels import moe_gpu, platform
  out = args.out or os.path.join(HERE, "results", "moe")
  d, f, E, k, *tokens = getattr(args, "shape", None) or (7168, 2048, 384, 8)
  M, x, h, w_up, w_dn, sizes, gs, flops = role_operands(d, f, E, k, (tokens or [args.tokens])[0],
                                                        seed=7)
  only = getattr(args, "impls", None)
  dt = jnp.bfloat16
  ks = jax.random.split(jax.random.key(7), 5)
  a, b = jax.random.normal(ks[2], (M, d), dt), jax.random.normal(ks[3], (d, f), dt)
  dense_t = timeit(jax.jit(lambda a, b: a @ b), a, b, reps=20)
  del a, b
  rows = [dict(role="all", impl="dense matmul (same FLOPs)", ms=1e3 * dense_t,
               TFLOPs=flops / dense_t / 1e12)]
  print(rows[-1], flush=True)

  # Arrays go in as arguments: closed over, jit would embed 12 GB of constants.
  operands = {"up": (x, w_up), "down": (h, w_dn), "dlhs": (h, w_up), "drhs": (x, h)}

  def ours(role):
    tiles = lambda kernel: moe_gpu.Tiles(gs, M, moe_gpu._bm(kernel, d, f))
    if role in ("up", "down"):
      return lambda a, w: gm.grouped_matmul(a, w, gs, impl="pallas_gpu")
    if role == "dlhs":
      def dl(a, w):
        t = tiles("gmm")
        return moe_gpu.gmm(a, w, t, t.row, t.row, M, transpose_w=True)
      return dl

    def dr(a, b):
      t = tiles("tgmm")
      return moe_gpu.tgmm(a, b, t, t.row, t.row, E, out_dtype=dt)
    return dr

  def lax_or_tokamax(role, impl, op=None):
    """ragged_dot_general in the role's dimension numbers: lax's or tokamax's."""
    dn = {"up": ((([1], [1]), ([], [])), [0], [0]), "down": ((([1], [1]), ([], [])), [0], [0]),
          "dlhs": ((([1], [2]), ([], [])), [0], [0]), "drhs": ((([0], [0]), ([], [])), [0], [])}
    (dims, lr, rg) = dn[role]
    rdn = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=dims,
                                            lhs_ragged_dimensions=lr, rhs_group_dimensions=rg)
    if impl == "ragged_dot":
      return lambda a, b: jax.lax.ragged_dot_general(a, b, gs, rdn)
    tk = platform.tokamax()
    return lambda a, b: tk.ragged_dot_general(a, b, gs, rdn,
                                              implementation=None if op is None else [op])

  def reference(role):
    """float32 host math on the first 4096 rows (groups cut there)."""
    n = 4096
    gsl = np.minimum(np.cumsum(sizes), n)
    bounds = np.concatenate([[0], gsl])
    xs, hs = np.asarray(x[:n], np.float32), np.asarray(h[:n], np.float32)
    out_ = []
    for g in range(E):
      lo, hi = bounds[g], bounds[g + 1]
      if role == "up":
        out_.append(xs[lo:hi] @ np.asarray(w_up[g], np.float32))
      elif role == "down":
        out_.append(hs[lo:hi] @ np.asarray(w_dn[g], np.float32))
      elif role == "dlhs":
        out_.append(hs[lo:hi] @ np.asarray(w_up[g], np.float32).T)
      if hi >= n:
        break
    if role == "drhs":
      g0 = int(np.argmax(sizes > 0))
      return g0, xs[:sizes[g0]].T @ hs[:sizes[g0]]
    return None, np.concatenate(out_)

  refs = {}

  def check(role, fn):
    if role not in refs:
      refs[role] = reference(role)
    g0, want = refs[role]
    got = np.asarray(jax.jit(fn)(*operands[role]), np.float32)
    got = got[g0] if role == "drhs" else got[:want.shape[0]]
    return float(np.abs(got - want).max() / np.abs(want).max())

  from tokamax._src.ops.ragged_dot import pallas_mosaic_gpu as mgpu  # noqa (needs tokamax)
  best = {}
  for role in ("up", "down", "dlhs", "drhs"):
    cands = [("ours (pallas_gpu)", ours(role)), ("ragged_dot", lax_or_tokamax(role, "ragged_dot")),
             ("tokamax (its choice)", lax_or_tokamax(role, "tokamax"))]
    for i, tiles in enumerate(TOKAMAX_CANDIDATES if not only else ()):
      kw = dict(tiles)
      from tokamax._src.ops.ragged_dot.pallas_mosaic_gpu_common import Config, MatmulDimension
      kw["grid_minor_dim"] = MatmulDimension[kw["grid_minor_dim"]]
      cands.append((f"tokamax tiles {i}", lax_or_tokamax(
          role, "tokamax", mgpu.PallasMosaicGpuRaggedDot(config=Config(**kw)))))
    for name, fn in cands:
      if only and name not in only:
        continue
      row = dict(role=role, impl=name)
      try:
        t0 = time.perf_counter()
        row["rel_err"] = check(role, fn)
        row["check_s"] = time.perf_counter() - t0
        t = timeit(jax.jit(fn), *operands[role], reps=10)
        row.update(ms=1e3 * t, TFLOPs=flops / t / 1e12, vs_dense=dense_t / t,
                   ok=bool(row["rel_err"] < 2e-2))
      except Exception as e:
        row["note"] = f"FAILED {type(e).__name__}: {str(e).splitlines()[0][:160]}"
      rows.append(row)
      print(row, flush=True)
    tk_rows = [r for r in rows if r["role"] == role and r["impl"].startswith("tokamax tiles")
               and r.get("ok")]
    if tk_rows:
      win = min(tk_rows, key=lambda r: r["ms"])
      best[{"up": "fwd", "down": "fwd_down"}.get(role, role)] = dict(
          TOKAMAX_CANDIDATES[int(win["impl"].split()[-1])], TFLOPs=round(win["TFLOPs"], 1))
  write(os.path.join(out, "gpu_gmm_roles.csv"), rows)
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "tokamax_tiles.json"), "w") as fh:
    json.dump({jax.devices()[0].device_kind: best}, fh, indent=1)
  print(f"\n{jax.devices()[0].device_kind}: grouped matmuls at K2 expert shapes ({M} rows, "
        f"{E} experts, d {d}, f {f}, bf16); dense matmul of the same FLOPs "
        f"{flops / dense_t / 1e12:.0f} TFLOP/s")
  print(f"{'role':<6}{'impl':<24}{'ms':>8}{'TFLOP/s':>9}{'vs dense':>9}{'rel err':>9}")
  for r in rows[1:]:
    print(f"{r['role']:<6}{r['impl']:<24}{r.get('ms', float('nan')):>8.2f}"
          f"{r.get('TFLOPs', float('nan')):>9.0f}{r.get('vs_dense', float('nan')):>9.0%}"
          f"{r.get('rel_err', float('nan')):>9.1e}  {r.get('note', '')}")
  print("best tokamax tiles per role:", json.dumps(best))


# Our Triton kernels' tile candidates (kernels/moe_gpu.TUNING entries: row tile, the two
# other tile dims, warps, stages), swept by gpu_tune. Shared memory per stage is
# (bm bk + bk bn) 2 bytes (gmm) or bm (bk + bn) 2 bytes (tgmm): all fit Hopper's 227 KB.
GMM_CANDIDATES = [(128, 256, 64, 8, 3), (128, 128, 64, 4, 4), (128, 128, 128, 8, 3),
                  (64, 256, 64, 8, 4), (64, 128, 64, 4, 4)]
TGMM_CANDIDATES = [(128, 64, 128, 4, 3), (64, 128, 128, 4, 3), (64, 128, 256, 8, 3),
                   (128, 128, 128, 8, 3), (64, 256, 128, 8, 3), (32, 128, 128, 4, 4),
                   (64, 128, 128, 8, 4), (128, 128, 256, 8, 2)]
# (d, f, experts, top-k): the bench_train model's MoE layer and K2's.
# "k2_ep16": one device's share on K2's layout (report 2.4: 16-way expert parallelism), 384 /
# 16 = 24 experts receiving 4096 tokens x top-8 = 32,768 rows (1,365 per expert when
# balanced); "k2" puts all 384 experts on one device, so the same rows give each ~170.
# A fifth entry sets the tokens (else the caller's).
TUNE_SHAPES = {"bench_train": (2048, 768, 32, 8), "k2": (7168, 2048, 384, 8),
               "k2_ep16": (7168, 2048, 24, 8, 4096)}


def _tgmm_scaled_kernel(lo_ref, hi_ref, src_l_ref, src_r_ref, scale_ref, lhs_ref, rhs_ref,
                        out_ref, *, bm, bk, bn):
  """The weight-gradient kernel before 2026-11-26 (the combine weight multiplied inside the
  row loop), kept here only as the same-run baseline of gpu_tune."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as plgpu
  from k2jax.kernels.moe_gpu import _dot, _rows
  g, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)

  def body(t, acc):
    rows = pl.ds(t * bm, bm)
    sl, sr = src_l_ref[rows], src_r_ref[rows]
    a = plgpu.load(_rows(lhs_ref, sl, i * bk, bk), mask=(sl >= 0)[:, None], other=0.0)
    a = (a.astype(jnp.float32) * scale_ref[rows][:, None]).astype(rhs_ref.dtype)
    b = plgpu.load(_rows(rhs_ref, sr, j * bn, bn), mask=(sr >= 0)[:, None], other=0.0)
    return acc + _dot(a.T, b)

  acc = jax.lax.fori_loop(lo_ref[g], hi_ref[g], body, jnp.zeros((bk, bn), jnp.float32))
  out_ref[g, pl.ds(i * bk, bk), pl.ds(j * bn, bn)] = acc.astype(out_ref.dtype)


def _tgmm_scaled(lhs, rhs, tiles, num_groups, tiling, interpret=False):
  import functools
  from jax.experimental.pallas import triton as plgpu
  from k2jax.kernels.moe_gpu import _full, _tile_size
  from k2jax.kernels.pallas_utils import pallas_call
  K, N = lhs.shape[1], rhs.shape[1]
  _, bk, bn, warps, stages = tiling
  bk, bn = _tile_size(K, bk), _tile_size(N, bn)
  meta = (tiles.tile_lo.astype(jnp.int32), tiles.tile_hi.astype(jnp.int32), tiles.row,
          tiles.row, jnp.ones(tiles.row.shape, jnp.float32))
  return pallas_call(
      functools.partial(_tgmm_scaled_kernel, bm=tiles.bm, bk=bk, bn=bn),
      grid=(num_groups, K // bk, N // bn),
      in_specs=[_full(a.shape) for a in (*meta, lhs, rhs)],
      out_specs=_full((num_groups, K, N)),
      out_shape=jax.ShapeDtypeStruct((num_groups, K, N), rhs.dtype),
      compiler_params=None if interpret else plgpu.CompilerParams(num_warps=warps,
                                                                  num_stages=stages),
      interpret=interpret, name="moe_tgmm_scaled")(*meta, lhs, rhs)


def gpu_tune(args):
  """Tile sweep of our two grouped-matmul kernels at each TUNE_SHAPES shape (bf16, top-k of
  args.tokens tokens, routing-like group sizes; at most args.budget seconds per kernel and
  shape), every role of an MoE training step:

    gmm   up    y = x W_up        [M, d] x [E, d, f]
          down  y = h W_down      [M, f] x [E, f, d]
          dlhs  dx = dy W_up^T    [M, f] x [E, d, f]^T
    tgmm  dw_up   = x_g^T dy_g    [M, d]^T x [M, f]
          dw_down = h_g^T dy_g    [M, f]^T x [M, d]

  Each candidate's output is checked against the default tiles' on a slice. The previous
  tgmm kernel (scale in the loop) runs at the default tiles as the baseline. The winners at
  args.apply's shape (summed over roles) are set in moe_gpu.TUNING for the rest of this
  process, so a train step timed afterwards uses them. Rows -> gpu_moe_tune.csv."""
  with swept_tiles():
    return _gpu_tune(args)


def _gpu_tune(args):
  from k2jax.kernels import moe_gpu
  interpret = getattr(args, "interpret", False)
  out = args.out or os.path.join(HERE, "results", "moe")
  default = dict(moe_gpu.TUNING)
  rows, best = [], {}
  for shape_name, (d, f, E, k, *tokens) in args.shapes.items():
    M, x, h, w_up, w_dn, _, gs, flops = role_operands(d, f, E, k, (tokens or [args.tokens])[0],
                                                      seed=3)
    dt = jnp.bfloat16
    dense_t = timeit(jax.jit(lambda a, b: a @ b), x, w_up[0], reps=10)
    rows.append(dict(shape=shape_name, kernel="dense", role="x @ W (same FLOPs)",
                     ms=1e3 * dense_t, TFLOPs=flops / dense_t / 1e12))
    print(rows[-1], flush=True)

    def gmm_role(role):
      def fn(tiling, a, w):
        moe_gpu.TUNING["gmm"] = tiling
        t = moe_gpu.Tiles(gs, M, tiling[0])
        return moe_gpu.gmm(a, w, t, t.row, t.row, M, transpose_w=role == "dlhs",
                           interpret=interpret)
      return fn, {"up": (x, w_up), "down": (h, w_dn), "dlhs": (h, w_up)}[role]

    def tgmm_role(role):
      def fn(tiling, a, b):
        moe_gpu.TUNING["tgmm"] = tiling
        t = moe_gpu.Tiles(gs, M, tiling[0])
        return moe_gpu.tgmm(a, b, t, t.row, t.row, E, interpret=interpret, out_dtype=dt)
      return fn, {"dw_up": (x, h), "dw_down": (h, x)}[role]

    cut = lambda y: y[:4096] if y.ndim == 2 else y[:4]
    for kernel, roles, cands in (("tgmm", ("dw_up", "dw_down"), TGMM_CANDIDATES),
                                 ("gmm", ("up", "down", "dlhs"), GMM_CANDIDATES)):
      make = gmm_role if kernel == "gmm" else tgmm_role
      t_start = time.time()
      totals = {}
      for role in roles:
        fn, ops = make(role)
        ref = None
        for tiling in cands:
          row = dict(shape=shape_name, kernel=kernel, role=role, tiles=str(tiling))
          if time.time() - t_start > args.budget:
            row.update(note="skipped: time budget")
            rows.append(row)
            continue
          try:
            f_ = jax.jit(functools.partial(fn, tiling))
            y = f_(*ops)
            if ref is None:
              ref = cut(y).astype(jnp.float32)
            err = float(jnp.abs(cut(y).astype(jnp.float32) - ref).max()
                        / jnp.maximum(jnp.abs(ref).max(), 1e-30))
            del y
            t = timeit(f_, *ops, reps=args.reps, warmup=1)
            row.update(ms=1e3 * t, TFLOPs=flops / t / 1e12, vs_dense=dense_t / t,
                       rel_err_vs_default=err, ok=err < 2e-2)
            if err < 2e-2:
              totals[str(tiling)] = totals.get(str(tiling), 0.0) + t
            else:
              totals[str(tiling)] = float("inf")
          except Exception as e:   # e.g. a tile set over shared memory: the others still run
            row.update(note=f"FAILED {type(e).__name__}: {str(e).splitlines()[0][:120]}")
            totals[str(tiling)] = float("inf")
          rows.append(row)
          print(row, flush=True)
        if kernel == "tgmm":     # the previous kernel, default tiles
          row = dict(shape=shape_name, kernel="tgmm before", role=role,
                     tiles=str(default["tgmm"]))
          try:
            t_ = moe_gpu.Tiles(gs, M, default["tgmm"][0])
            f_ = jax.jit(lambda a, b: _tgmm_scaled(a, b, t_, E, default["tgmm"], interpret))
            t = timeit(f_, *ops, reps=args.reps, warmup=1)
            row.update(ms=1e3 * t, TFLOPs=flops / t / 1e12, vs_dense=dense_t / t)
          except Exception as e:
            row.update(note=f"FAILED {type(e).__name__}: {str(e).splitlines()[0][:120]}")
          rows.append(row)
          print(row, flush=True)
      full = {c: v for c, v in totals.items() if v != float("inf")
              and all(r.get("ms") is not None for r in rows if r["shape"] == shape_name
                      and r["kernel"] == kernel and r["tiles"] == c)}
      if full:
        win = min(full, key=full.get)
        best[(shape_name, kernel)] = eval(win)
        print(f"{shape_name} {kernel}: best {win} ({1e3 * full[win]:.2f} ms over "
              f"{', '.join(roles)})", flush=True)
    del x, h, w_up, w_dn
  moe_gpu.TUNING.update(default)
  for kernel in ("gmm", "tgmm"):
    if (args.apply, kernel) in best:
      moe_gpu.TUNING[kernel] = best[(args.apply, kernel)]
  print(f"moe_gpu.TUNING for the rest of this run: {moe_gpu.TUNING}", flush=True)
  write(os.path.join(out, "gpu_moe_tune.csv"), rows)
  print(f"\n{jax.devices()[0].device_kind}: our grouped matmuls, {args.tokens} tokens top-k "
        "(unless the shape sets its own)")
  print(f"{'shape':<12}{'kernel':<12}{'role':<20}{'tiles':<24}{'ms':>8}{'TFLOP/s':>9}"
        f"{'vs dense':>9}")
  for r in rows:
    print(f"{r['shape']:<12}{r['kernel']:<12}{r['role']:<20}{r.get('tiles', ''):<24}"
          f"{r.get('ms', float('nan')):>8.2f}{r.get('TFLOPs', float('nan')):>9.0f}"
          f"{r.get('vs_dense', float('nan')):>9.0%}  {r.get('note', '')}")
  return rows


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--gpu", action="store_true")
  p.add_argument("--quick", action="store_true", help="CPU: fewer repeats, no train step")
  p.add_argument("--tokens", type=int, default=8192, help="GPU: tokens (x top-8 rows)")
  p.add_argument("--layer-experts", type=int, default=96, help="GPU: experts in the layer test")
  p.add_argument("--out", default=None)
  args = p.parse_args()
  gpu(args) if args.gpu else cpu(args)


if __name__ == "__main__":
  main()


# jax's own Mosaic GPU grouped-matmul kernels (jax.experimental.pallas.ops.gpu: wgmma with
# TMA pipelines, persistent over the SMs; rows must be sorted and contiguous). Configs:
# (block_m, block_n, block_k, max_concurrent_steps, grid_block_n).
MGPU_TGMM_CANDIDATES = [(128, 128, 64, 4, 1), (128, 128, 64, 4, 4), (128, 128, 64, 4, 16),
                        (128, 128, 64, 2, 4), (128, 128, 64, 6, 4), (128, 128, 128, 2, 4),
                        (128, 128, 128, 3, 4), (64, 256, 64, 4, 4), (64, 128, 64, 4, 4)]
MGPU_GMM_CANDIDATES = [(128, 128, 64, 4, 4), (128, 128, 64, 4, 1), (128, 128, 64, 6, 4),
                       (64, 256, 64, 4, 4), (128, 128, 128, 2, 4)]
# More tiles for our weight-gradient kernel: fewer stages / smaller tiles let 2-3 blocks
# share an SM, overlapping one block's prologue and store with another's loop (a group's
# ~1,365 rows give each block only ~21 steps of 64).
TGMM_MORE = [(64, 128, 128, 4, 2), (64, 128, 128, 4, 4), (32, 128, 128, 4, 3),
             (32, 128, 128, 4, 2), (64, 128, 64, 4, 3), (64, 64, 128, 4, 3),
             (64, 128, 128, 4, 5), (32, 128, 256, 8, 3), (32, 256, 128, 8, 3)]


def gpu_wgrad(args):
  """The MoE weight gradient dW_g = a_g^T b_g (a, b: the rows of group g) at one TUNE_SHAPES
  shape, every way at hand, each checked against float32 math on its first two groups:

    ours        moe_gpu.tgmm (Triton; rows gathered inside) at TGMM_CANDIDATES + TGMM_MORE
    mgpu        jax's Mosaic GPU transposed_ragged_dot on contiguous sorted rows (the up
                projection's x[rows] gathered first by XLA: timed alone and with it)
    ragged_dot  XLA's ragged_dot_general
    batched     equal groups of M / E rows through one batched dot (cuBLAS): the same FLOPs
                and reduction length without raggedness, the ceiling to compare with

  and the down / input-gradient products through ours and jax's Mosaic GPU ragged_dot.
  Rows -> gpu_wgrad.csv (args.out)."""
  import functools
  from k2jax.kernels import moe_gpu
  try:
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu
  except ImportError as e:
    ragged_dot_mgpu = transposed_ragged_dot_mgpu = None
    print(f"jax's Mosaic GPU ragged dots unavailable: {e}", flush=True)
  out = args.out or os.path.join(HERE, "results", "moe")
  d, f, E, k, *tokens = args.shape
  M, x, h, w_up, w_dn, sizes, gs, flops = role_operands(d, f, E, k, (tokens or [args.tokens])[0],
                                                        seed=11)
  dt = jnp.bfloat16
  rows = []
  interpret = getattr(args, "interpret", False)   # a CPU smoke run: ours only, interpreted
  if interpret:
    ragged_dot_mgpu = transposed_ragged_dot_mgpu = None
  default = dict(moe_gpu.TUNING)

  def record(row, fn=None, ops=(), check=None):
    """Times fn(*ops) into row (after checking it when `check` is given); never raises."""
    try:
      if check is not None:
        row["rel_err"] = check(jax.jit(fn)(*ops))
        row["ok"] = bool(row["rel_err"] < 2e-2)
      t = timeit(jax.jit(fn), *ops, reps=args.reps, warmup=1)
      row.update(ms=1e3 * t, TFLOPs=flops / t / 1e12)
    except Exception as e:
      row["note"] = f"FAILED {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    rows.append(row)
    print(row, flush=True)
    return row

  a_b = jax.random.normal(jax.random.key(5), (d, f), dt)
  record(dict(role="all", impl="dense matmul (same FLOPs)"), lambda a, b: a @ b, (x, a_b))
  del a_b
  bounds = np.concatenate([[0], np.cumsum(sizes)])

  def wgrad_check(a, b):
    """rel. error of a dW [E, K, N] on its first two non-empty groups, float32 on the host."""
    gids = [g for g in range(E) if sizes[g]][:2]
    want = [np.asarray(a[bounds[g]:bounds[g + 1]], np.float32).T
            @ np.asarray(b[bounds[g]:bounds[g + 1]], np.float32) for g in gids]

    def err(got):
      got = np.asarray(got[np.asarray(gids)], np.float32)
      return float(max(np.abs(g_ - w_).max() / np.abs(w_).max() for g_, w_ in zip(got, want)))
    return err

  perm = jax.random.permutation(jax.random.key(6), M).astype(jnp.int32)
  inv = jnp.argsort(perm).astype(jnp.int32)
  x_tok = x[inv]                     # token-major rows: x_tok[perm] == x (the sorted rows)
  t0 = time.time()
  for role, (a, b) in (("dw_up", (x, h)), ("dw_down", (h, x))):
    check = wgrad_check(a, b)
    # ours: the up projection's rows come through the permutation, as in training
    gather_a = role == "dw_up"
    for tiling in TGMM_CANDIDATES + TGMM_MORE:
      if time.time() - t0 > args.budget:
        break

      def ours(a_, b_, tiling=tiling):
        moe_gpu.TUNING["tgmm"] = tiling
        t = moe_gpu.Tiles(gs, M, tiling[0])
        src = t.at(perm) if gather_a else t.row
        return moe_gpu.tgmm(a_, b_, t, src, t.row, E, out_dtype=dt, interpret=interpret)
      with swept_tiles():
        record(dict(role=role, impl="ours (tgmm)", tiles=str(tiling)), ours,
               (x_tok if gather_a else a, b), check)
    record(dict(role=role, impl="ragged_dot (XLA)"), lambda a_, b_: jax.lax.ragged_dot_general(
        a_, b_, gs, jax.lax.RaggedDotDimensionNumbers(
            dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0],
            rhs_group_dimensions=[])), (a, b), check)
    n = M // E * E
    record(dict(role=role, impl=f"batched dense ({E} x {M // E} rows)"),
           lambda a_, b_: jnp.einsum("grk,grn->gkn", a_[:n].reshape(E, -1, a_.shape[1]),
                                     b_[:n].reshape(E, -1, b_.shape[1])), (a, b))
    if gather_a:
      record(dict(role=role, impl="gather x[rows] alone (XLA)"), lambda a_: a_[perm], (x_tok,))
    if transposed_ragged_dot_mgpu is None:
      continue
    for cfg in MGPU_TGMM_CANDIDATES:
      kw = dict(zip(("block_m", "block_n", "block_k", "max_concurrent_steps", "grid_block_n"),
                    cfg))
      mg = functools.partial(transposed_ragged_dot_mgpu.transposed_ragged_dot, group_sizes=gs,
                             **kw)
      r = record(dict(role=role, impl="mgpu (jax)", tiles=str(cfg)), mg, (a, b), check)
      if gather_a and r.get("ok"):
        record(dict(role=role, impl="gather + mgpu (jax)", tiles=str(cfg)),
               lambda a_, b_, mg=mg: mg(a_[perm], b_), (x_tok, b))
  # the forward's down projection and the input gradient, for the same comparison
  for role, (a, w, tr) in (("down", (h, w_dn, False)), ("dlhs", (h, w_up, True))):
    def ours(a_, w_, tr=tr):
      t = moe_gpu.Tiles(gs, M, moe_gpu._bm("gmm", *w_.shape[1:]))
      return moe_gpu.gmm(a_, w_, t, t.row, t.row, M, transpose_w=tr, interpret=interpret)
    ref = record(dict(role=role, impl="ours (gmm)", tiles=str(moe_gpu.tiles_for(
        "gmm", *w.shape[1:]))), ours, (a, w))
    if ragged_dot_mgpu is None:
      continue
    want = jax.jit(ours)(a, w)[:4096].astype(jnp.float32)
    for cfg in MGPU_GMM_CANDIDATES:
      kw = dict(zip(("block_m", "block_n", "block_k", "max_concurrent_steps", "grid_block_n"),
                    cfg))
      mg = functools.partial(ragged_dot_mgpu.ragged_dot, group_sizes=gs, transpose_rhs=tr, **kw)
      record(dict(role=role, impl="mgpu (jax)", tiles=str(cfg)), mg, (a, w),
             lambda y: float(jnp.abs(y[:4096].astype(jnp.float32) - want).max()
                             / jnp.abs(want).max()))
    del ref
  moe_gpu.TUNING.update(default)
  write(os.path.join(out, "gpu_wgrad.csv"), rows)
  dense = rows[0].get("TFLOPs", float("nan"))
  print(f"\n{jax.devices()[0].device_kind}: MoE products at d {d}, f {f}, {E} experts, {M} rows "
        f"(bf16, TFLOP/s; dense matmul of the same FLOPs {dense:.0f})")
  for r in rows[1:]:
    print(f"{r['role']:<8}{r['impl']:<30}{str(r.get('tiles', '')):<24}"
          f"{r.get('TFLOPs', float('nan')):>6.0f}{r.get('rel_err', float('nan')):>9.1e}  "
          f"{r.get('note', '')}")


def gpu_backward(args):
  """The routed-expert layer's forward + backward (pallas_gpu) under each kernel choice of
  kernels/moe_gpu.py (moe_gpu.FORCE per role, see moe_gpu.MGPU): all Triton; `auto` (the
  table: on Hopper the backward on jax's Mosaic GPU ragged dots); and `auto` with the
  forward's down projection ("combine") on jax's kernel too, at each args.shapes entry
  (bf16, routed as a top-k of random sigmoid scores). Every gradient (x, the combine
  weights, gate, up, down) and the output against float32 XLA (impl="blocked", dense dots
  per block of rows, on float32 copies; XLA's float32 ragged_dot asked for more shared
  memory than an H200 has at K2's shape): max |error| over max |reference|. Rows ->
  gpu_moe_backward.csv."""
  from k2jax.kernels import moe_gpu
  out = args.out or os.path.join(HERE, "results", "moe")
  interpret = getattr(args, "interpret", False)      # a CPU smoke run
  rows = []
  for shape_name, (d, f, E, k, *tokens) in args.shapes.items():
    N = (tokens or [args.tokens])[0]
    x, ids, comb, gate, up, down = layer_inputs(N, d, f, E, k, dtype=jnp.bfloat16, seed=3)
    cot = jax.random.normal(jax.random.key(4), (N, d), jnp.bfloat16)
    flops = 3 * 3 * 2 * N * k * d * f      # three products forward, twice that backward

    def loss(impl):
      def fn(x, comb, gate, up, down, cot):
        y = moe.routed_experts(x, ids, comb, gate, up, down, impl=impl, interpret=interpret)
        return jnp.sum(y.astype(jnp.float32) * cot.astype(jnp.float32)), y
      return jax.jit(jax.grad(fn, argnums=(0, 1, 2, 3, 4), has_aux=True))
    f32 = lambda a: a.astype(jnp.float32)
    ops = (x, comb, gate, up, down, cot)
    want_g, want_y = loss("blocked")(*map(f32, ops))
    want = [f32(g) for g in want_g] + [want_y]
    for name_, force in (("triton", {"backward": "triton", "combine": "triton"}), ("auto", {}),
                         ("auto + mgpu combine", {"combine": "mgpu"})):
      if interpret and force.get("combine") == "mgpu":
        continue          # jax's Mosaic GPU kernels have no interpret mode
      moe_gpu.FORCE = force
      row = dict(shape=shape_name, tokens=N, kernels=name_,
                 picks="/".join(moe_gpu.kernels_for(r, gate, x, x) for r in ("combine", "backward")))
      try:
        fn = loss("pallas_gpu")
        got_g, got_y = fn(*ops)
        for name, g, w in zip(("dx", "dcombine", "dgate", "dup", "ddown", "y"),
                              (*got_g, got_y), want):
          row[f"rel_{name}"] = float(jnp.abs(f32(g) - w).max() / jnp.abs(w).max())
        t = timeit(fn, *ops, reps=args.reps)
        row.update(ms=1e3 * t, TFLOPs=flops / t / 1e12)
      except Exception as e:
        row["note"] = f"FAILED {type(e).__name__}: {str(e).splitlines()[0][:160]}"
      rows.append(row)
      print(row, flush=True)
    moe_gpu.FORCE = {}
    del x, gate, up, down, want
  write(os.path.join(out, "gpu_moe_backward.csv"), rows)
  print(f"\n{jax.devices()[0].device_kind}: routed experts, forward + backward (TFLOP/s of the "
        "nine grouped products)")
  print(f"{'shape':<12}{'kernels':<21}{'combine/backward':<18}{'ms':>9}   {'TFLOP/s':>7}  "
        "rel. error of dx dcombine dgate dup ddown y")
  for r in rows:
    errs = " ".join(f"{r.get('rel_' + n, float('nan')):.1e}" for n in
                    ("dx", "dcombine", "dgate", "dup", "ddown", "y"))
    print(f"{r['shape']:<12}{r['kernels']:<21}{r.get('picks', ''):<18}"
          f"{r.get('ms', float('nan')):>9.2f} ms{r.get('TFLOPs', float('nan')):>7.0f}  {errs}  "
          f"{r.get('note', '')}")
