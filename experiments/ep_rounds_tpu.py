"""What XLA:TPU reserves for the routed-expert exchange (k2jax.model.expert_parallel): the
ragged exchange with its large capacities in rounds (the default) against the same exchange
in one shot (round_rows = the worst case, ep x A received rows: what it was before rounds).
Compile only, on any machine with libtpu (`pip install -e ".[tpu]"`); forward + backward of
one MoE layer's exchange under shard_map over `expert`, K2's FP8 residual storage.

    python experiments/ep_rounds_tpu.py                   # ep 8, small widths (minutes)
    python experiments/ep_rounds_tpu.py --shape k2 --ep 16   # K2's widths: very long here

Prints a table and writes experiments/results/compile/ep_rounds_tpu.csv: XLA's temporaries
per chip for each mode and their ratio to one shot (the baseline, compiled in the same run).
The worst case is what XLA reserves for: a switch's largest branch is allocated whether or
not it runs.

Measured (libtpu 0.0.42.1, jax 0.10.2, 2-core CPU, loaded): the small shape on ep 8 gives
0.324 GiB one shot and 0.342 GiB in rounds (1.05x; 804 s and 522 s to compile): at these
widths the worst-case branch (two rounds of 4 x the balanced rows) is a small part of the
layer and the rounds' own buffers show. Where it matters is K2's widths on ep 16: in the
flagship's step (python -m k2jax.compile --config kimi_k2 --topology v5p:8x16x16 --dump)
the rounds took XLA's device memory from 80.24 to 56.25 GiB (README). `--shape k2 --ep 16`
compiles that layer alone; it did not finish in 25 min here.
"""

import argparse
import csv
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")       # compile for TPU; run nothing here
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from k2jax.tools import compile as k2compile
from k2jax.kernels import platform as kernels_platform
from k2jax.model import expert_parallel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "experiments", "results", "compile")
TOPOLOGY = {8: "v5p:2x2x2", 16: "v5p:2x2x4"}
# tokens per device, top-k, hidden, expert width, experts
SHAPES = {"small": (512, 8, 1024, 256, 32), "k2": (4096, 8, 7168, 2048, 384)}


def compile_exchange(ep: int, shape: str, round_rows):
  """-> (XLA's memory analysis, seconds) of value_and_grad of the exchange's summed output."""
  n_loc, k, d, f, E = SHAPES[shape]
  mesh = Mesh(np.array(k2compile.topology_devices(TOPOLOGY[ep])).reshape(1, ep),
              ("data", "expert"))
  batch = P(("data", "expert"))
  layer = jax.shard_map(
      lambda p, x, i, w: expert_parallel.sharded_routed_experts(
          p, x, i, w, "expert", sync_axes=("data",), transport="ragged", fp8_storage=True,
          round_rows=round_rows),
      mesh=mesh, in_specs=(P("expert"), batch, batch, batch), out_specs=batch)
  loss = lambda p, x, i, w: jnp.sum(layer(p, x, i, w).astype(jnp.float32))
  arg = lambda s, dt, spec: jax.ShapeDtypeStruct(s, dt, sharding=NamedSharding(mesh, spec))
  bf = jnp.bfloat16
  p = {n: arg(s, bf, P("expert")) for n, s in
       (("gate", (E, d, f)), ("up", (E, d, f)), ("down", (E, f, d)))}
  N = n_loc * ep
  args = (p, arg((N, d), bf, batch), arg((N, k), jnp.int32, batch),
          arg((N, k), jnp.float32, batch))
  t = time.time()
  with kernels_platform.target("tpu"):     # the TPU's kernels (ragged transport, its matmuls)
    lowered = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 3))).lower(*args)
  return lowered.compile().memory_analysis(), time.time() - t


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--ep", type=int, default=8, choices=sorted(TOPOLOGY))
  ap.add_argument("--shape", default="small", choices=sorted(SHAPES))
  args = ap.parse_args()
  n_loc, k = SHAPES[args.shape][:2]
  worst = args.ep * n_loc * k
  rows = []
  for mode, round_rows in (("one_shot", worst), ("rounds", None)):
    mem, s = compile_exchange(args.ep, args.shape, round_rows)
    rows.append(dict(mode=mode, ep=args.ep, shape=args.shape, worst_case_rows=worst,
                     temp_gib=mem.temp_size_in_bytes / 2**30, seconds=round(s)))
  base = rows[0]["temp_gib"]
  for r in rows:
    r["temp_vs_one_shot"] = r["temp_gib"] / base
  print(f"{'mode':10} {'ep':>3} {'shape':6} {'temporaries GiB':>16} {'x one shot':>10} "
        f"{'compile s':>9}")
  for r in rows:
    print(f"{r['mode']:10} {r['ep']:3d} {r['shape']:6} {r['temp_gib']:16.3f} "
          f"{r['temp_vs_one_shot']:10.2f} {r['seconds']:9d}")
  os.makedirs(OUT, exist_ok=True)
  path = os.path.join(OUT, "ep_rounds_tpu.csv")
  with open(path, "w", newline="") as fh:
    w = csv.DictWriter(fh, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows(rows)
  print("wrote", path)


if __name__ == "__main__":
  main()
