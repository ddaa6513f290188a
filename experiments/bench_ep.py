"""Expert-parallel dispatch: bytes moved per device vs the ideal, and time, per transport.

    python experiments/bench_ep.py [--devices 8] [--mesh 2x4] [--tokens 4096] [--experts 64]

Runs itself in a subprocess with simulated CPU devices. For a MoE layer of the tiny model
with `--experts` experts (top-2) on a data x expert mesh, it routes `--tokens` tokens
through the router (random init, then with a trained-like balanced bias) and reports, per
transport (padded / bucketed / ragged):
  bytes     sent per device per layer, there and back (k2jax.model.expert_parallel.bytes_moved)
  x ideal   over the ideal 2 * (N k / devices) * d * itemsize
  saved     what the backward pass keeps from the forward, per device: the smallest
            capacity's residuals (`kept`, the default) or none (`recomputed`: every
            backward pass runs its exchange again; keep=False)
  fwd+bwd   time of the layer's routed experts under shard_map, relative to `padded`
            recomputed (simulated devices share this machine's cores: ratios show the
            work each transport does, not network time; ragged is emulated here, XLA:CPU
            has none).
Writes experiments/results/ep/ep.csv. `--part residuals`: XLA's temporary memory per MoE
layer of the model's forward + backward on the mesh against plan's per-layer count
(experiments/results/ep/residuals_vs_xla.csv).
"""

import argparse
import csv
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "results", "ep")


def child(args):
  import jax
  import jax.numpy as jnp
  import numpy as np

  sys.path.append(os.path.dirname(HERE))
  from k2jax import configs, parallel
  from k2jax.model import expert_parallel as xp, moe
  from tests.parallel_worker import ep_layer

  cfg = configs.get_config("tiny")
  d_, e_ = map(int, args.mesh.split("x"))
  cfg.mesh.update(dict(data=d_, expert=e_))
  m = cfg.model
  m.n_routed_experts = args.experts
  mesh = parallel.make_mesh(cfg.mesh)
  E, d, f, k, N = m.n_routed_experts, m.hidden_size, m.moe_intermediate_size, m.num_experts_per_tok, args.tokens
  keys = jax.random.split(jax.random.key(0), 5)
  p = {"router": 0.02 * jax.random.normal(keys[0], (d, E)), "router_bias": jnp.zeros((E,)),
       "experts": {n: 0.02 * jax.random.normal(kk, s) for n, kk, s in (
           ("gate", keys[1], (E, d, f)), ("up", keys[2], (E, d, f)), ("down", keys[3], (E, f, d)))}}
  x = jax.random.normal(keys[4], (N, d))
  w, idx, _ = moe.route(m, p, x)
  devices = d_ * e_
  idx_np = np.asarray(idx).reshape(devices, -1, k)         # rows are sharded in blocks
  # counts matrix of each expert group: [ep_src, ep_dst] from the shards' own assignments
  e_loc = E // e_
  rows = []
  ideal = 2 * (N * k // devices) * d * 4
  balance = 0.0
  for g in range(d_):
    group = idx_np[g * e_:(g + 1) * e_]
    counts = np.stack([np.bincount(a.reshape(-1) // e_loc, minlength=e_) for a in group])
    balance = max(balance, counts.sum(0).max() / (N * k / devices))
  for transport in ("padded", "bucketed", "ragged"):
    worst = 0
    for g in range(d_):
      group = idx_np[g * e_:(g + 1) * e_]
      counts = np.stack([np.bincount(a.reshape(-1) // e_loc, minlength=e_) for a in group])
      worst = max(worst, xp.bytes_moved(counts, d, 4, transport))
    for keep in (True, False):
      run = ep_layer(mesh, transport=transport, keep=keep)
      loss = jax.jit(jax.value_and_grad(lambda pe, x: jnp.sum(run(pe, x, idx, w) ** 2),
                                        argnums=(0, 1)))
      # what the backward pass keeps from the forward: the vjp's leaves besides its inputs
      ins = {id(a) for a in jax.tree.leaves((p["experts"], x))}
      kept = jax.eval_shape(lambda pe, x: [a for a in jax.tree.leaves(
          jax.vjp(lambda pe, x: run(pe, x, idx, w), pe, x)[1]) if id(a) not in ins],
          p["experts"], x)
      jax.block_until_ready(loss(p["experts"], x))
      times = []
      for _ in range(args.repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(loss(p["experts"], x))
        times.append(time.perf_counter() - t0)
      rows.append(dict(transport=transport, residuals="kept" if keep else "recomputed",
                       bytes_per_device=worst, x_ideal=worst / ideal,
                       saved_MB_per_device=sum(a.size * a.dtype.itemsize for a in kept)
                       / devices / 1e6, fwd_bwd_ms=1e3 * float(np.median(times))))
  print("RESULT " + json.dumps(dict(rows=rows, ideal=ideal, balance=balance)))


def layer_growth(args):
  """What one more MoE layer adds to XLA's temporary memory for the model's forward + backward
  on the data x expert mesh (temp at 5 layers - temp at 3, over 2: a scanned stack's
  residuals are [layers, ...] buffers) against what plan counts per layer
  (transformer.layer_residual_bytes on the same mesh, the expert-parallel path)."""
  import jax
  import jax.numpy as jnp
  import optax
  from jax.sharding import NamedSharding, PartitionSpec as P

  sys.path.append(os.path.dirname(HERE))
  from k2jax import configs, model, parallel
  from k2jax.model import transformer

  cfg = configs.get_config("tiny")
  d_, e_ = map(int, args.mesh.split("x"))
  cfg.mesh.update(dict(data=d_, expert=e_))
  mesh = parallel.make_mesh(cfg.mesh)
  m = cfg.model
  T, b = 256, 2                                  # sequences per device
  B = b * d_ * e_
  rows = []
  for remat in ("none", "selective", "full"):
    temp = {}
    for L in (3, 5):
      m.update(dict(num_hidden_layers=L, remat=remat, max_position_embeddings=T))
      specs = model.param_specs(m)
      shard = parallel.param_shardings(specs, mesh)
      params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            jax.eval_shape(lambda: model.init(m, jax.random.key(0))), shard)
      tokens = jax.ShapeDtypeStruct((B, T), jnp.int32,
                                    sharding=NamedSharding(mesh, P(("data", "expert"))))

      def loss(p, t):
        logits, _ = model.forward(m, p, t)
        return optax.softmax_cross_entropy_with_integer_labels(logits, t).mean()
      with jax.set_mesh(mesh):
        compiled = jax.jit(jax.grad(loss)).lower(params, tokens).compile()
      temp[L] = compiled.memory_analysis().temp_size_in_bytes
    xla = (temp[5] - temp[3]) / 2
    planned = transformer.layer_residual_bytes(m, "moe", T, b, d_, e_)
    rows.append(dict(remat=remat, xla_temp_per_layer=xla, plan_per_layer=planned,
                     plan_over_xla=planned / xla))
  return rows


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--devices", type=int, default=8)
  ap.add_argument("--mesh", default="2x4", help="data x expert")
  ap.add_argument("--tokens", type=int, default=4096)
  ap.add_argument("--experts", type=int, default=64)
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--child", action="store_true")
  ap.add_argument("--part", default="transports", choices=("transports", "residuals"),
                  help="transports: bytes and time per transport (ep.csv); residuals: XLA's "
                  "temp memory per MoE layer on the mesh against plan's count "
                  "(residuals_vs_xla.csv)")
  args = ap.parse_args()
  if args.child:
    if args.part == "residuals":
      print("RESULT " + json.dumps(layer_growth(args)))
      return
    return child(args)
  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={args.devices}")
  p = subprocess.run([sys.executable, __file__, "--child", *sys.argv[1:]], env=env,
                     capture_output=True, text=True, cwd=os.path.dirname(HERE))
  if p.returncode:
    sys.exit(p.stderr[-3000:])
  res = json.loads(next(l for l in p.stdout.splitlines() if l.startswith("RESULT "))[7:])
  os.makedirs(OUT, exist_ok=True)
  if args.part == "residuals":
    with open(os.path.join(OUT, "residuals_vs_xla.csv"), "w", newline="") as fh:
      wr = csv.DictWriter(fh, fieldnames=list(res[0]))
      wr.writeheader()
      print(f"tiny model, mesh data x expert = {args.mesh}, 2 x 256 tokens per device: one "
            "more MoE layer adds")
      print(f"{'remat':<11}{'XLA temp MB':>12}{'plan MB':>10}{'plan / XLA':>12}")
      for r in res:
        wr.writerow(r)
        print(f"{r['remat']:<11}{r['xla_temp_per_layer'] / 1e6:>12.3f}"
              f"{r['plan_per_layer'] / 1e6:>10.3f}{r['plan_over_xla']:>12.2f}")
    return
  base = next(r["fwd_bwd_ms"] for r in res["rows"]
              if r["transport"] == "padded" and r["residuals"] == "recomputed")
  os.makedirs(OUT, exist_ok=True)
  with open(os.path.join(OUT, "ep.csv"), "w", newline="") as fh:
    wr = csv.DictWriter(fh, fieldnames=["transport", "residuals", "bytes_per_device",
                                        "x_ideal", "saved_MB_per_device", "fwd_bwd_ms",
                                        "time_vs_padded_recomputed"])
    wr.writeheader()
    print(f"mesh data x expert = {args.mesh}, {args.tokens} tokens, {args.experts} experts top-2,"
          f" ideal {res['ideal'] / 1e6:.2f} MB per device per layer (there and back); the "
          f"busiest shard receives {res['balance']:.2f}x the balanced load")
    print(f"{'transport':<10}{'residuals':>12}{'MB/device':>11}{'x ideal':>9}{'saved MB':>10}"
          f"{'fwd+bwd ms':>12}{'vs padded':>11}")
    for r in res["rows"]:
      r["time_vs_padded_recomputed"] = r["fwd_bwd_ms"] / base
      wr.writerow(r)
      print(f"{r['transport']:<10}{r['residuals']:>12}{r['bytes_per_device'] / 1e6:>11.2f}"
            f"{r['x_ideal']:>9.2f}{r['saved_MB_per_device']:>10.2f}{r['fwd_bwd_ms']:>12.1f}"
            f"{r['time_vs_padded_recomputed']:>11.2f}")


if __name__ == "__main__":
  main()
