"""Decoding speed over the MLA latent cache (k2jax.generate), against transformers and the roofline.

    python experiments/bench_decode.py          # CPU: tokens/s at batch 1 and 8 vs transformers
    python experiments/bench_decode.py --gpu    # GPU: a ~1B-activated K2-shaped model, batch 1 / 32

CPU: the issue-8 bench config (hidden 256, 4 layers, 16 experts top-2) with the same random
weights in both (written in the published layout, read by k2jax.interop.hf); greedy decoding
of new tokens after a 32-token prompt, steady state (compiled programs reused; transformers
with its own KV cache, 2 threads), by k2jax.generate and by k2jax.serving.engine (the server's
continuous batcher, the rows submitted together), plus cache bytes per token: ours (latent +
rope key) vs a naive per-head K/V cache.
GPU: a random bf16 model with K2's attention shapes scaled to ~1B activated parameters;
decode tokens/s at batch 1 and 32, and the fraction of the memory-bandwidth roofline:
(activated weights read per step + cache read) / step time vs a measured device copy.
Tables print last; CSVs go to experiments/results/decode/ (or --out).
"""

import argparse
import csv
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
# k2jax when not installed; last, so that the root's kernels/ hides no installed package
sys.path.append(os.path.dirname(HERE))

from k2jax.serving import generate  # noqa: E402
from k2jax.model import decode  # noqa: E402


def write(path, rows):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
    w.writeheader()
    w.writerows(rows)


def ours_tokens_per_s(cfg, params, prompts, new):
  generate.generate(cfg, params, prompts, max_new_tokens=new)             # compile
  t0 = time.perf_counter()
  out = generate.generate(cfg, params, prompts, max_new_tokens=new)
  return sum(len(o) for o in out) / (time.perf_counter() - t0)


class _Ids:
  """A tokenizer for k2jax.serving.engine over random ids: no stop token, no text."""
  eos_id, bos_id, pad_id, special_ids = -1, 0, 0, {}

  def decode(self, ids):
    return ""

  def text_bytes(self, i):
    return b""


def engine_tokens_per_s(cfg, params, prompts, new):
  """The same prompts through k2jax.serving.engine (what k2jax.serve runs: continuous batching over
  a slotted cache), submitted together, greedy, steady state."""
  import threading
  from k2jax.serving.engine import Engine, Job
  engine = Engine(cfg, params, _Ids(), max_batch=len(prompts), max_len=len(prompts[0]) + new,
                  window_s=0.05, reuse_min=None)

  def run():
    done = threading.Semaphore(0)
    t0 = time.perf_counter()
    for p in prompts:
      engine.submit(Job(prompt=[int(t) for t in p], max_tokens=new, temperature=0.0,
                        emit=lambda e: e.kind in ("done", "error") and done.release()))
    for _ in prompts:
      done.acquire()
    return len(prompts) * new / (time.perf_counter() - t0)
  try:
    run()                                                                # compile
    return run()
  finally:
    engine.close()


def naive_cache_bytes(cfg, itemsize):
  return cfg.num_hidden_layers * cfg.num_attention_heads * (
      cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) * itemsize


def bench_model(**arch):
  """The bench config (bench_moe.BENCH, with `arch`'s changes) with random weights, written in
  the published layout and read back by k2jax.interop.hf: (k2jax cfg, params, the
  transformers DeepseekV3 model with the same weights, its config dict)."""
  import torch
  sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
  import hf_reference as ref
  from bench_moe import BENCH
  from k2jax.interop import hf
  torch.set_num_threads(2)
  arch = {**BENCH, **dict(n_group=1, topk_group=1, norm_topk_prob=True, rms_norm_eps=1e-6,
                          initializer_range=0.02, aux_loss_alpha=0.0,
                          max_position_embeddings=512, bos_token_id=0, eos_token_id=1), **arch}
  cj = ref.hf_config_dict(arch, None, 10000.0)
  tmodel = ref.make_model(cj, seed=0)
  with tempfile.TemporaryDirectory() as tmp:
    ref.write_dir(tmp, cj, ref.published_tensors(tmodel))
    cfg, params = hf.load_checkpoint(tmp)
  tmodel.config._attn_implementation = "sdpa"
  tmodel.generation_config.eos_token_id = None
  tmodel.generation_config.pad_token_id = 0
  return cfg, params, tmodel, arch


def cpu(args):
  import torch
  import transformers
  cfg, params, tmodel, arch = bench_model()
  rng = np.random.default_rng(0)
  rows = []
  for batch in (1, 8):
    prompts = [list(rng.integers(2, arch["vocab_size"], 32)) for _ in range(batch)]
    ours = ours_tokens_per_s(cfg, params, prompts, args.new_tokens)
    served = engine_tokens_per_s(cfg, params, prompts, args.new_tokens)
    inp = torch.as_tensor(prompts)
    with torch.no_grad():
      tmodel.generate(inp, max_new_tokens=4, do_sample=False)
      t0 = time.perf_counter()
      out = tmodel.generate(inp, max_new_tokens=args.new_tokens, do_sample=False)
      theirs = (out.shape[1] - 32) * batch / (time.perf_counter() - t0)
    rows.append(dict(batch=batch, k2jax_tokens_per_s=ours, engine_tokens_per_s=served,
                     transformers_tokens_per_s=theirs, speedup=ours / theirs,
                     engine_speedup=served / theirs,
                     # the reference's speed moves with its release (5.x sped up CPU decoding)
                     transformers_version=transformers.__version__,
                     torch_version=torch.__version__))
    print(rows[-1], flush=True)
  cache = dict(ours_bytes_per_token=decode.cache_bytes_per_token(cfg, "float32"),
               naive_bytes_per_token=naive_cache_bytes(cfg, 4))
  from k2jax import configs
  k2 = configs.get_config("kimi_k2").model
  k2_cache = dict(ours=decode.cache_bytes_per_token(k2, "bfloat16"),
                  naive=naive_cache_bytes(k2, 2))
  out = args.out or os.path.join(HERE, "results", "decode")
  write(os.path.join(out, "cpu_decode.csv"), [dict(r, **cache) for r in rows])
  print(f"\ngreedy decoding, bench config, {args.new_tokens} new tokens after 32, f32, this CPU; "
        f"transformers {transformers.__version__}, torch {torch.__version__}")
  print(f"{'batch':>6}{'k2jax tok/s':>13}{'engine tok/s':>14}{'transformers':>14}{'speedup':>9}"
        f"{'engine':>8}")
  for r in rows:
    print(f"{r['batch']:>6}{r['k2jax_tokens_per_s']:>13.1f}{r['engine_tokens_per_s']:>14.1f}"
          f"{r['transformers_tokens_per_s']:>14.1f}{r['speedup']:>8.2f}x"
          f"{r['engine_speedup']:>7.2f}x")
  print(f"cache per token: ours {cache['ours_bytes_per_token']} B vs naive "
        f"{cache['naive_bytes_per_token']} B (f32, bench config); K2 bf16: {k2_cache['ours']} B "
        f"({k2_cache['ours'] // 2 // 61} values per layer) vs {k2_cache['naive']} B")


def gpu(args):
  from k2jax import configs, model
  cfg = configs.get_config("kimi_k2").model
  cfg.update(dict(hidden_size=2048, num_hidden_layers=14, num_attention_heads=16,
                  q_lora_rank=1536, kv_lora_rank=512, n_routed_experts=64,
                  num_experts_per_tok=8, moe_intermediate_size=1024, intermediate_size=8192,
                  vocab_size=32768, dtype="bfloat16", param_dtype="bfloat16",
                  max_position_embeddings=8192))
  counts = model.count_params(cfg)
  params = model.init(cfg, jax.random.key(0))
  big = jnp.ones((256 * 2 ** 20,), jnp.bfloat16)
  copy = jax.jit(lambda b: b * 2)
  jax.block_until_ready(copy(big))
  t0 = time.perf_counter()
  for _ in range(10):
    jax.block_until_ready(copy(big))
  bw = 2 * big.nbytes * 10 / (time.perf_counter() - t0)
  rows = []
  rng = np.random.default_rng(0)
  E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
  expert_bytes = counts["routed_experts"] * 2 / (E * (cfg.num_hidden_layers - 1))
  fixed_bytes = (counts["activated"] - counts["routed_experts_activated"] - counts["embedding"]) * 2
  for batch in (1, 32):
    prompts = [list(rng.integers(2, cfg.vocab_size, 128)) for _ in range(batch)]
    tps = ours_tokens_per_s(cfg, params, prompts, args.new_tokens)
    step_s = batch / tps
    unique = E * (1 - (1 - k / E) ** batch)              # experts a step reads per MoE layer
    weights = fixed_bytes + unique * expert_bytes * (cfg.num_hidden_layers - 1)
    ctx = 128 + args.new_tokens / 2
    cache_read = batch * ctx * decode.cache_bytes_per_token(cfg)
    rows.append(dict(batch=batch, tokens_per_s=tps, step_ms=1e3 * step_s,
                     bytes_per_step_GB=(weights + cache_read) / 1e9,
                     achieved_GBps=(weights + cache_read) / step_s / 1e9,
                     copy_GBps=bw / 1e9, roofline_fraction=(weights + cache_read) / step_s / bw,
                     activated_B=counts["activated"] / 1e9, total_B=counts["total"] / 1e9))
    print(rows[-1], flush=True)
  out = args.out or os.path.join(HERE, "results", "decode")
  write(os.path.join(out, "gpu_decode.csv"), rows)
  print(f"\n{jax.devices()[0].device_kind}: K2-shaped model, {rows[0]['activated_B']:.2f}B "
        f"activated / {rows[0]['total_B']:.1f}B total, bf16; device copy {bw / 1e9:.0f} GB/s")
  print(f"{'batch':>6}{'tok/s':>10}{'step ms':>9}{'GB/step':>9}{'GB/s':>8}{'roofline':>10}")
  for r in rows:
    print(f"{r['batch']:>6}{r['tokens_per_s']:>10.1f}{r['step_ms']:>9.2f}"
          f"{r['bytes_per_step_GB']:>9.2f}{r['achieved_GBps']:>8.0f}{r['roofline_fraction']:>10.0%}")


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--gpu", action="store_true")
  p.add_argument("--new-tokens", type=int, default=64)
  p.add_argument("--out", default=None)
  args = p.parse_args()
  gpu(args) if args.gpu else cpu(args)


if __name__ == "__main__":
  main()
