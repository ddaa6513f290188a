"""Context parallelism (k2jax.model.context): balance, bytes moved, step time and memory.

    python experiments/bench_context.py            (8 simulated CPU devices; tables + CSV)

1. Causal work per context device, worst over mean, at 32k tokens: striped head-tail
   placement with the default 128-token chunks, one head and one tail chunk of the row
   (T / 2C), and contiguous chunks. Two measures: the causal block pairs of each device's
   query blocks (512 tokens, or the chunk where smaller: what the flash loop runs, documents
   or not) and the valid (same document, causal) token pairs of random-length packed
   documents (what a kernel that skips other documents' blocks runs; 200 packings, lengths
   log-uniform from 64 to 32k).
2. Bytes a device receives per layer per token of its own, read from the compiled HLO of
   the context-parallel attention core (k2jax.model.context.attend: latent all-gather,
   keys / values up-projected, flash over the device's query blocks) forward + backward at
   K2's widths (64 heads, kv_lora 512, rope 64, nope / v 128; bf16; 4k tokens over C
   devices), against gathering the per-head keys and values instead and reduce-scattering
   their cotangents, 2 (C - 1) H (nope + rope + v) 2 B.
3. The train step's forward + backward of a small model (hidden 256, 8 heads, 4 layers,
   16 experts) on the same tokens (8 sequences of 2048) on data 8 (CP = 1) and on
   data x context = 4 x 2, 2 x 4, 1 x 8: time (median of 3 after a warm-up) as a ratio to
   CP = 1 in the same run, and XLA's temporary bytes per device (memory_analysis of the
   compiled step). The machine's 1024^3 f32 matmul rate is printed beside it: 8 simulated
   devices share this machine's cores, so the ratio says what the split adds in work (the
   whole sequence's key / value up-projection on every context device, the collectives),
   not what a pod would gain.

Rows go to experiments/results/context/bench_context.csv (one per measurement).
"""

import csv
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# k2jax when not installed; last, so that the root's kernels/ hides no installed package
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from k2jax import configs, model, parallel  # noqa: E402
from k2jax.model import attention, context  # noqa: E402
from k2jax.training.step import lm_loss  # noqa: E402
from bench_pipeline import matmul_rate  # noqa: E402  (the same ceiling the pipeline bench prints)

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "context")
T_BALANCE, BLOCK = 32768, 512


def balance(rng):
  rows = []
  n = T_BALANCE // BLOCK
  docs = []
  for _ in range(200):
    # packed documents: log-uniform lengths, the last one cut at the row's end
    lengths = []
    while sum(lengths) < T_BALANCE:
      lengths.append(int(np.exp(rng.uniform(np.log(64), np.log(T_BALANCE)))))
    docs.append(np.concatenate([np.arange(k) + 1 for k in lengths])[:T_BALANCE])
  for C in (2, 4, 8):
    for name, chunk in (("striped 128 (default)", 128), ("head-tail (T / 2C)", T_BALANCE // (2 * C)),
                        ("contiguous", None)):
      tok = np.arange(T_BALANCE) if chunk is None else context.placement(T_BALANCE, C, chunk)
      # blocks of 512 (or the chunk if smaller): the causal block pairs of each device's
      # query blocks, what the flash loop runs whatever the documents
      b = min(BLOCK, chunk or BLOCK)
      nb = T_BALANCE // b
      first = tok.reshape(-1, b)[:, 0] // b
      blocks = (first + 1).reshape(C, -1).sum(1)
      ratios = [(w := d[tok].reshape(C, -1).sum(1)).max() / w.mean() for d in docs]
      rows.append(dict(table="balance", C=C, placement=name, chunk=chunk or T_BALANCE // C,
                       blocks_worst_over_mean=blocks.max() / blocks.mean(),
                       pairs_worst_over_mean_mean=float(np.mean(ratios)),
                       pairs_worst_over_mean_max=float(np.max(ratios)), key_blocks=nb))
  return rows


def _collectives(hlo: str):
  """[(kind, bytes of one device's result)] of every collective in an optimized HLO module
  (a tuple result counts each of its arrays; an async -start op its last, the result)."""
  import re
  size = {"bf16": 2, "f32": 4, "s32": 4, "u32": 4, "f16": 2, "s8": 1, "u8": 1, "pred": 1}
  kinds = "all-gather|reduce-scatter|all-reduce|all-to-all|collective-permute"
  out = []
  for line in hlo.splitlines():
    m = re.search(r"= (\(?[^=]*?\)?) (" + kinds + r")(-start)?\(", line)
    if not m:
      continue
    arrays = [(dt, [int(d) for d in dims.split(",") if d])
              for dt, dims in re.findall(r"([a-z]+[0-9]*)\[([\d,]*)\]", m.group(1))]
    if m.group(3):
      arrays = arrays[-1:]
    out.append((m.group(2), sum(int(np.prod(d)) * size.get(dt, 4) for dt, d in arrays)))
  return out


def _received(kind, nbytes, C):
  """Bytes one device receives for a collective over C devices whose result is `nbytes`
  on each (ring algorithms)."""
  return {"all-gather": nbytes * (C - 1) / C, "reduce-scatter": nbytes * (C - 1),
          "all-reduce": 2 * nbytes * (C - 1) / C, "all-to-all": nbytes * (C - 1) / C,
          "collective-permute": nbytes}[kind]


def layer_bytes():
  """Collectives of the context-parallel attention core (k2jax.model.context.attend) at K2's
  widths, forward + backward with respect to its activations (q, latent, k_rope): what the
  split moves. The weights' gradients are left out: their reduction is the data-parallel
  one every layout pays, once a step. Compiled by XLA:TPU for v5p 2x2x2 where libtpu is
  installed (`pip install -e ".[tpu]"`), else by XLA:CPU, which runs bf16 collectives in
  float32 (twice the bytes)."""
  from k2jax.tools import compile as k2compile
  cfg = configs.get_config("kimi_k2").model
  cfg.update(dtype="bfloat16", param_dtype="bfloat16", attention_impl="chunked")
  H, T = cfg.num_attention_heads, 4096
  nope, r, v = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
  kv_b = jnp.zeros((cfg.kv_lora_rank, H, nope + v), jnp.bfloat16)
  try:
    devices, backend = k2compile.topology_devices("v5p:2x2x2"), "XLA:TPU v5p 2x2x2"
  except ValueError:
    devices, backend = jax.devices(), "XLA:CPU (bf16 collectives run in f32)"
  rows = []
  for C in (2, 4, 8):
    mc = configs.get_config("tiny").mesh
    mc.update(data=8 // C, context=C)
    mesh = parallel.make_mesh(mc, devices)
    shapes = [jax.ShapeDtypeStruct((8 // C, T) + tail, jnp.bfloat16)   # a sequence per row
              for tail in ((H, nope + r), (cfg.kv_lora_rank,), (r,))]

    def f(q, latent, k_rope):
      out, _ = context.attend(cfg, q, latent, k_rope, kv_b, None)
      return jnp.sum(out.astype(jnp.float32))
    with jax.set_mesh(mesh):
      sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", "context"))
      hlo = jax.jit(jax.grad(f, argnums=(0, 1, 2)), in_shardings=(sh,) * 3).lower(
          *shapes).compile().as_text()
    ops = _collectives(hlo)
    local = T // C                          # this device's tokens of its sequence
    received = sum(_received(k, n, C) for k, n in ops)
    kv = (C - 1) * H * (nope + r + v) * 2                   # bf16 keys and values
    rows.append(dict(table="bytes", C=C, backend=backend, bytes_per_token=received / local,
                     kv_gather_bytes_per_token=2 * kv,      # forward gather + backward
                     latent_over_kv=received / local / (2 * kv),
                     ops=" ".join(f"{k}:{n}" for k, n in ops)))
  return rows


def step_time():
  cfg = configs.get_config("tiny").model
  cfg.update(hidden_size=256, num_attention_heads=8, num_hidden_layers=4, n_routed_experts=16,
             moe_intermediate_size=128, q_lora_rank=128, kv_lora_rank=64,
             qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
             max_position_embeddings=4096, dtype="float32", param_dtype="float32",
             attention_impl="chunked")
  B, T = 8, 2048
  rng = np.random.default_rng(0)
  batch = dict(inputs=rng.integers(0, cfg.vocab_size, (B, T)),
               targets=rng.integers(0, cfg.vocab_size, (B, T)),
               positions=np.tile(np.arange(T), (B, 1)), segment_ids=np.ones((B, T)),
               loss_mask=np.ones((B, T), np.float32))
  batch = {k: jnp.asarray(v, jnp.float32 if k == "loss_mask" else jnp.int32)
           for k, v in batch.items()}
  params = model.init(cfg, jax.random.key(0))
  rows, base = [], None
  for C in (1, 2, 4, 8):
    mc = configs.get_config("tiny").mesh
    mc.update(data=8 // C, context=C)
    mesh = parallel.make_mesh(mc)
    grad = jax.jit(jax.grad(lambda p, b: lm_loss(cfg, p, b)[0]))
    with jax.set_mesh(mesh):
      p = jax.device_put(params, parallel.param_shardings(model.param_specs(cfg), mesh))
      b = jax.device_put(batch, parallel.batch_sharding(mesh, B))
      compiled = grad.lower(p, b).compile()
      temp = compiled.memory_analysis().temp_size_in_bytes
      jax.block_until_ready(compiled(p, b))
      times = []
      for _ in range(3):
        t = time.perf_counter()
        jax.block_until_ready(compiled(p, b))
        times.append(time.perf_counter() - t)
    s = float(np.median(times))
    base = base or (s, temp)
    rows.append(dict(table="step", C=C, data=8 // C, seconds=s, vs_cp1=s / base[0],
                     temp_bytes_per_device=temp, temp_vs_cp1=temp / base[1]))
  return rows


def main():
  rows = balance(np.random.default_rng(0)) + layer_bytes() + step_time()
  rate = matmul_rate()                    # GFLOP/s
  os.makedirs(OUT, exist_ok=True)
  print(f"{'C':>3} {'placement':<22} {'blocks worst/mean':>18} "
        f"{'pairs worst/mean (mean, max over packings)':>44}")
  for r in rows:
    if r["table"] == "balance":
      print(f"{r['C']:>3} {r['placement']:<22} {r['blocks_worst_over_mean']:>18.3f} "
            f"{r['pairs_worst_over_mean_mean']:>30.3f} {r['pairs_worst_over_mean_max']:>13.3f}")
  print(f"\n{'C':>3} {'bytes/token/layer':>18} {'K/V gather would':>17} {'ratio':>7}"
        f"   (received per device, forward + backward; "
        f"{next(r['backend'] for r in rows if r['table'] == 'bytes')})")
  for r in rows:
    if r["table"] == "bytes":
      print(f"{r['C']:>3} {r['bytes_per_token']:>18,.0f} {r['kv_gather_bytes_per_token']:>17,} "
            f"{r['latent_over_kv']:>7.3f}")
  print(f"\n{'C':>3} {'data':>5} {'step s':>8} {'vs CP=1':>8} {'temp MB/device':>15} "
        f"{'vs CP=1':>8}   (this CPU: {rate:.0f} GFLOP/s f32 matmul)")
  for r in rows:
    if r["table"] == "step":
      r["matmul_gflops"] = rate
      print(f"{r['C']:>3} {r['data']:>5} {r['seconds']:>8.3f} {r['vs_cp1']:>8.2f} "
            f"{r['temp_bytes_per_device'] / 1e6:>15.1f} {r['temp_vs_cp1']:>8.2f}")
  keys = sorted({k for r in rows for k in r})
  with open(os.path.join(OUT, "bench_context.csv"), "w", newline="") as f:
    w = csv.DictWriter(f, keys)
    w.writeheader()
    w.writerows(rows)


if __name__ == "__main__":
  main()
