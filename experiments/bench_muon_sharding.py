"""Per-device memory of Muon's update at K2's widths: does Newton-Schulz stay on the matrices
each device holds, split over data ranks (ZeRO-1)?

    python experiments/bench_muon_sharding.py [--meshes 1x8,4x2] [--moe-layers 2]
        [--optimizer muon] [--label NAME] [--out experiments/results/muon]

Compiles the optimizer update alone (no forward / backward) for the kimi_k2 preset cut to
1 dense + `--moe-layers` MoE layers on 8 simulated CPU devices, with the trainer's state
shardings (parallel.state_shardings), and reads from XLA's compiled program, per device:
argument / output / temporary bytes (memory_analysis), the Newton-Schulz batch of the
routed experts (the batch size of the [B, m, m] products, m = moe_intermediate_size) against
the matrices the device holds and the share ZeRO-1 gives it, and the largest all-gather.
Nothing is allocated, so K2's widths fit on a laptop; a compile takes 10-20 s.

Meshes are DxE (data x expert) or PxDxE (the stack stored as the pipeline runs it,
k2jax.parallel.layout). `--optimizer muon` is `optim.muon` on K2's bf16 parameters (the
audit of issue 22 measured this); `trainer` is the trainer's whole chain (`optim.optimizer`:
fp32 master weights, QK-Clip, balancing). Gradients are float32, as the trainer's (the
audit fed bf16 ones: 315.7 / 116.9 GB of temporaries before on 1x8 / 4x2). Rows are appended
to muon_sharding.csv, labelled with `--label` (default: the git commit): run it on an older
commit to compare (results/muon/muon_sharding.csv: the "before" rows are this script run on
a `git archive` of 143c227, the commit before issue 22's fix).
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import collections  # noqa: E402
import csv  # noqa: E402
import functools  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

GB = 1e9
FIELDS = ["label", "mesh", "optimizer", "moe_layers", "args_GB", "out_GB", "temp_GB",
          "ns_batch", "held_matrices", "zero1_share", "largest_all_gather", "all_gather_GB",
          "compile_s"]


def _shape_bytes(text):
  dtype, dims = re.match(r"(\w+)\[([\d,]*)\]", text).groups()
  n = math.prod(int(d) for d in dims.split(",") if d)
  return n * {"f32": 4, "bf16": 2, "s32": 4, "f16": 2, "pred": 1, "u32": 4}.get(dtype, 4)


def hlo_figures(text, m):
  """(largest batch B of a [B, m, m] dot, largest all-gather result and its bytes)."""
  batch = 0
  for shape in re.findall(r"= f32\[(\d+),(\d+),(\d+)\]\{[^}]*\} dot\(", text):
    b, r, c = map(int, shape)
    if r == c == m:
      batch = max(batch, b)
  gathers = collections.Counter(re.findall(r"= (\w+\[[\d,]*\])\{[^}]*\} all-gather(?:-start)?\(",
                                           text))
  big = max(gathers, key=_shape_bytes, default="")
  return batch, big, (_shape_bytes(big) if big else 0)


def measure(mesh_spec, moe_layers, which):
  import jax
  import jax.numpy as jnp
  from k2jax import configs, model, optim, parallel
  from k2jax.parallel import layout
  from k2jax.training.step import init_state

  sizes = [1] * (3 - len(mesh_spec.split("x"))) + [int(s) for s in mesh_spec.split("x")]
  c = configs.get_config("kimi_k2")
  c.mesh.update(dict(zip(("pipeline", "data", "expert"), sizes)))
  c.mesh.virtual_stages = 1
  c.optimizer.host_state = False
  c.model.num_hidden_layers = c.model.first_k_dense_replace + moe_layers
  stored = layout.stored_config(c)
  mcfg = stored.model
  mesh = parallel.make_mesh(c.mesh)
  tx = optim.muon(mcfg, 0.01) if which == "muon" else optim.optimizer(stored)
  with jax.set_mesh(mesh):
    ab = jax.eval_shape(functools.partial(init_state, stored, tx), jax.random.key(0))
    sh = parallel.state_shardings(model.param_specs(mcfg), mesh, ab, tx)
    rep = parallel.replicated(mesh)
    n_moe = mcfg.num_hidden_layers - mcfg.first_k_dense_replace
    extra = dict(max_logits=jax.ShapeDtypeStruct((mcfg.num_hidden_layers,
                                                  mcfg.num_attention_heads), jnp.float32),
                 expert_load=jax.ShapeDtypeStruct((n_moe, mcfg.n_routed_experts), jnp.float32))
    grads = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float32), ab.params)
    if which == "muon":
      f = jax.jit(lambda g, o, p: tx.update(g, o, p), in_shardings=(sh.params, sh.opt_state,
                                                                    sh.params),
                  out_shardings=(sh.params, sh.opt_state))
      lowered = f.lower(grads, ab.opt_state, ab.params)
    else:
      f = jax.jit(lambda g, o, p, ml, el: tx.update(g, o, p, max_logits=ml, expert_load=el),
                  in_shardings=(sh.params, sh.opt_state, sh.params, rep, rep),
                  out_shardings=(sh.params, sh.opt_state))
      lowered = f.lower(grads, ab.opt_state, ab.params, extra["max_logits"],
                        extra["expert_load"])
    t = time.perf_counter()
    compiled = lowered.compile()
    compile_s = time.perf_counter() - t
  ma = compiled.memory_analysis()
  batch, big, big_bytes = hlo_figures(compiled.as_text(), mcfg.moe_intermediate_size)
  P, D, E = sizes
  rows_per_device = -(-n_moe // P) if P > 1 else n_moe
  held = rows_per_device * mcfg.n_routed_experts // E
  share = held // D if held % D == 0 else held
  return dict(mesh="x".join(map(str, sizes)), optimizer=which, moe_layers=moe_layers,
              args_GB=round(ma.argument_size_in_bytes / GB, 1),
              out_GB=round(ma.output_size_in_bytes / GB, 1),
              temp_GB=round(ma.temp_size_in_bytes / GB, 1), ns_batch=batch, held_matrices=held,
              zero1_share=share, largest_all_gather=big, all_gather_GB=round(big_bytes / GB, 2),
              compile_s=round(compile_s, 1))


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--meshes", default="1x8,4x2", help="comma list of DxE or PxDxE")
  p.add_argument("--moe-layers", type=int, default=2, help="MoE layers (per pipeline device "
                 "with PxDxE: times P)")
  p.add_argument("--optimizer", default="muon", help="comma list of muon, trainer")
  p.add_argument("--label", default=None, help="the rows' label (default: git commit)")
  p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "muon"))
  args = p.parse_args()
  label = args.label or subprocess.run(["git", "rev-parse", "--short", "HEAD"], text=True,
                                       capture_output=True,
                                       cwd=os.path.dirname(os.path.abspath(__file__))
                                       ).stdout.strip()
  rows = []
  for which in args.optimizer.split(","):
    for spec in args.meshes.split(","):
      pipe = int(spec.split("x")[0]) if spec.count("x") == 2 else 1
      rows.append(dict(label=label, **measure(spec, args.moe_layers * pipe, which)))
  w = max(len("label"), len(label)) + 2
  print(f"{'label':<{w}}{'mesh':<8}{'optimizer':<10}{'args GB':>9}{'out GB':>8}{'temp GB':>9}"
        f"{'NS batch':>10}{'held':>6}{'share':>7}  largest all-gather")
  for r in rows:
    print(f"{r['label']:<{w}}{r['mesh']:<8}{r['optimizer']:<10}{r['args_GB']:>9}{r['out_GB']:>8}"
          f"{r['temp_GB']:>9}{r['ns_batch']:>10}{r['held_matrices']:>6}{r['zero1_share']:>7}  "
          f"{r['largest_all_gather']} ({r['all_gather_GB']} GB)")
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, "muon_sharding.csv")
  new = not os.path.exists(path)
  with open(path, "a", newline="") as f:
    w = csv.DictWriter(f, FIELDS)
    if new:
      w.writeheader()
    w.writerows(rows)
  print(f"appended to {path}")


if __name__ == "__main__":
  main()
