"""Compile time vs depth: the layer stacks are scanned, so a 24-layer model should compile in
about the time of a 2-layer one.

    python experiments/bench_compile.py [--out experiments/results/compile]

Compiles forward + backward (jax.grad of the LM loss) of the tiny config at several depths,
each in a fresh subprocess so no compilation cache is shared, and reports the ratios to the
2-layer model. The tiny preset's 2-layer model has one layer per stack (1 dense + 1 MoE) and
XLA removes one-trip loops, so it compiles faster than any deeper one; the all-MoE rows
(first_k_dense_replace = 0) compare two real scans.
"""

import argparse
import csv
import json
import os
import subprocess
import sys
import time

DEPTHS = ((2, 1), (4, 1), (8, 1), (16, 1), (24, 1), (2, 0), (24, 0))  # (layers, dense layers)


def child(layers: int, dense: int) -> dict:
  import jax
  import jax.numpy as jnp
  from k2jax import configs, model
  cfg = configs.get_config("tiny").model
  cfg.num_hidden_layers = layers
  cfg.first_k_dense_replace = dense
  params = jax.eval_shape(lambda k: model.init(cfg, k), jax.random.key(0))
  tokens = jax.ShapeDtypeStruct((8, 128), jnp.int32)

  def loss(p, t):
    logits, aux = model.forward(cfg, p, t)
    return jnp.mean(jax.nn.logsumexp(logits, -1)) + aux.aux_loss

  t0 = time.perf_counter()
  lowered = jax.jit(jax.grad(loss)).lower(params, tokens)
  lower_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  lowered.compile()
  return {"layers": layers, "dense_layers": dense, "lower_s": lower_s,
          "compile_s": time.perf_counter() - t0}


def main():
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--out", default="experiments/results/compile")
  p.add_argument("--child", default=None, help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.child:
    print("RESULT " + json.dumps(child(*map(int, args.child.split(",")))))
    return
  env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  rows = []
  for layers, dense in DEPTHS:
    r = subprocess.run([sys.executable, __file__, "--child", f"{layers},{dense}"], env=env,
                       capture_output=True, text=True)
    if r.returncode:
      sys.exit(r.stderr[-3000:])
    rows.append(json.loads(next(l for l in r.stdout.splitlines() if l.startswith("RESULT"))[7:]))
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "bench_compile.csv"), "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows(rows)
  base = {r["dense_layers"]: r["compile_s"] + r["lower_s"] for r in rows if r["layers"] == 2}
  print(f"{'layers':>6}{'dense':>6}{'trace+lower s':>15}{'compile s':>11}{'vs 2 layers':>13}")
  for r in rows:
    print(f"{r['layers']:>6}{r['dense_layers']:>6}{r['lower_s']:>15.2f}{r['compile_s']:>11.2f}"
          f"{(r['lower_s'] + r['compile_s']) / base[r['dense_layers']]:>12.2f}x")


if __name__ == "__main__":
  main()
