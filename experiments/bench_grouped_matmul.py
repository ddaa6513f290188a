"""Grouped-matmul implementations (k2jax.kernels.gmm), forward and forward+backward,
at MoE shapes, as ratios to `ragged_dot` measured in the same process.

    python experiments/bench_grouped_matmul.py [--out experiments/results/grouped_matmul]

On CPU `lax.ragged_dot` runs every group over every row; `blocked` pads groups to blocks
and gathers each block's weight matrix. On a GPU run it there too: ragged_dot is native.
"""

import argparse
import csv
import os
import time

import jax
import jax.numpy as jnp

from k2jax.kernels.gmm import IMPLS

SHAPES = [  # (rows M = tokens * top-k, K, N, groups G)
    (4096, 128, 64, 16),      # tiny config, one MoE layer's up-projection
    (8192, 256, 128, 32),
    (16384, 512, 256, 64),
]


def timed(f, *args, reps=5):
  jax.block_until_ready(f(*args))
  t0 = time.perf_counter()
  for _ in range(reps):
    jax.block_until_ready(f(*args))
  return (time.perf_counter() - t0) / reps


def main():
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--out", default="experiments/results/grouped_matmul")
  args = p.parse_args()
  rows = []
  for M, K, N, G in SHAPES:
    x = jax.random.normal(jax.random.key(0), (M, K))
    w = jax.random.normal(jax.random.key(1), (G, K, N))
    ids = jnp.sort(jax.random.randint(jax.random.key(2), (M,), 0, G))
    sizes = jnp.bincount(ids, length=G).astype(jnp.int32)
    for name, fn in sorted(IMPLS.items()):
      fwd = jax.jit(lambda x, w, fn=fn: fn(x, w, sizes))
      bwd = jax.jit(jax.grad(lambda x, w, fn=fn: jnp.sum(fn(x, w, sizes) ** 2), (0, 1)))
      rows.append(dict(backend=jax.default_backend(), M=M, K=K, N=N, G=G, impl=name,
                       fwd_ms=timed(fwd, x, w) * 1e3, fwd_bwd_ms=timed(bwd, x, w) * 1e3))
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "bench_grouped_matmul.csv"), "w", newline="") as f:
    wr = csv.DictWriter(f, fieldnames=list(rows[0]))
    wr.writeheader()
    wr.writerows(rows)
  ref = {(r["M"], r["G"]): r for r in rows if r["impl"] == "ragged_dot"}
  print(f"{'M x K x N, G':<24}{'impl':<12}{'fwd ms':>9}{'fwd+bwd ms':>12}{'speed-up vs ragged_dot':>24}")
  for r in rows:
    b = ref[(r["M"], r["G"])]
    print(f"{r['M']}x{r['K']}x{r['N']}, {r['G']:<8}{r['impl']:<12}{r['fwd_ms']:>9.2f}"
          f"{r['fwd_bwd_ms']:>12.2f}{b['fwd_bwd_ms'] / r['fwd_bwd_ms']:>23.1f}x")


if __name__ == "__main__":
  main()
