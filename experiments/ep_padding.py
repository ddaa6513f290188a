"""Padding through the expert exchange (k2jax.model.expert_parallel, issue 63): the rows each
shard receives and the buffer and rounds the exchange picks for a half-padded batch, with
and without the validity mask, counted by the exchange's own code on simulated CPU devices.

    python experiments/ep_padding.py [--ep 16] [--tokens 4096] [--width 64]

K2's routing (384 experts, top-8, one group) with a random router of `--width` inputs on
`--ep` expert shards (one expert group), `--tokens` tokens per device of which the second
half is padding: one embedding for all of it, so it all routes to the same top-8 experts,
as right-padded RL rows do. Per device, `expert_parallel.sort_assignments` sorts its
assignments with and without the mask; the counts are all-gathered as the exchange does.
Reported, in units of A (a device's balanced load, tokens x 8): the most rows a shard
receives, the ragged transport's capacity for it, whether that capacity keeps its residuals
and how many rounds of model.ep_round_load x A (2) it runs in; and the largest
(sender, receiver) slice, which sizes the bucketed transport's slots. The padded transport's
buffers are the worst case whatever the load. Writes experiments/results/ep/padding.csv.
"""

import argparse
import csv
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "results", "ep")


def measure(ep: int, tokens: int, width: int, seed: int = 0):
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, PartitionSpec as P

  sys.path.insert(0, os.path.dirname(HERE))
  from k2jax import configs
  from k2jax.kernels.buckets import capacities
  from k2jax.model import expert_parallel as xp, moe

  m = configs.get_config("kimi_k2").model
  E, k = m.n_routed_experts, m.num_experts_per_tok
  keys = jax.random.split(jax.random.key(seed), 3)
  p = {"router": jax.random.normal(keys[0], (width, E)) / width ** 0.5,
       "router_bias": jnp.zeros((E,))}
  x = jax.random.normal(keys[1], (ep, tokens, width))
  valid = jnp.broadcast_to(jnp.arange(tokens) < tokens // 2, (ep, tokens))
  x = jnp.where(valid[..., None], x, jax.random.normal(keys[2], (width,)))   # one embedding
  _, idx, _ = moe.route(m, p, x.reshape(-1, width))
  mesh = Mesh(np.array(jax.devices()[:ep]), ("expert",))

  def counts(masked):
    def fn(i, v):
      c = xp.sort_assignments(i, v if masked else None, ep, E // ep)[-1]
      return jax.lax.all_gather(c, "expert")[None]
    run = jax.shard_map(fn, mesh=mesh, in_specs=(P("expert"), P("expert")),
                        out_specs=P("expert"))
    return np.asarray(jax.jit(run)(idx, valid.reshape(-1)))[0]       # [ep_src, ep_dst]

  A = tokens * k
  caps = capacities(ep * A, ep)
  bound = capacities(ep * A, ep, (m.get("ep_round_load", 2.0),))[0]
  rows = []
  for masked in (False, True):
    c = counts(masked)
    recv = c.sum(0)
    need = int(recv.max())
    cap = next(x for x in caps if x >= need)
    rows.append(dict(
        mask="valid only" if masked else "none (before)", ep=ep, tokens=tokens,
        sent_rows_per_device=int(c.sum(1).max()),
        most_received_xA=round(need / A, 3),
        shards_over_1_25A=int((recv > caps[0]).sum()),
        received_xA_per_shard=" ".join(f"{r / A:.2f}" for r in recv),
        ragged_capacity_xA=round(cap / A, 3), kept=cap == caps[0],
        rounds=-(-cap // bound) if cap > bound else 1,
        largest_slice_xbalanced=round(int(c.max()) / (A / ep), 2),
        bucketed_slot_xbalanced=round(next(x for x in capacities(A, ep) if x >= c.max())
                                      / (A / ep), 2)))
  return rows


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--ep", type=int, default=16)
  ap.add_argument("--tokens", type=int, default=4096)
  ap.add_argument("--width", type=int, default=64)
  args = ap.parse_args()
  flags = os.environ.get("XLA_FLAGS", "")
  if "device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.ep}"
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  rows = measure(args.ep, args.tokens, args.width)
  keys = [k for k in rows[0] if k != "received_xA_per_shard"]
  print(" | ".join(keys))
  for r in rows:
    print(" | ".join(str(r[k]) for k in keys))
    print("  received per shard (x A):", r["received_xA_per_shard"])
  os.makedirs(OUT, exist_ok=True)
  with open(os.path.join(OUT, "padding.csv"), "w", newline="") as fh:
    w = csv.DictWriter(fh, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows(rows)


if __name__ == "__main__":
  main()
