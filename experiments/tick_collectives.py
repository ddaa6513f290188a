"""Collectives inside the pipeline's tick loop, weight-shaped vs activation-shaped.

    python experiments/tick_collectives.py            (8 simulated devices; table + CSV)

Compiles the train step of the tiny model on pipeline 2 x data 2 x expert 2 (9 layers, 2
virtual stages, 8 microbatches, float32 params) with phases skipped per device, as a GPU /
TPU runs it (compiled, not run: XLA:CPU can deadlock on this mesh's branches), and reads
every collective of its optimized HLO inside the schedule's tick loop (the ENTRY while whose
body holds the ring's collective-permute, and everything it calls: the phases' branches, the
layer loops). A collective is weight-shaped when its operand has the shape of a parameter of
one layer (whole or as stored on one device: split over `expert`), or of a stack of them;
every other one moves activations, their cotangents, routing or statistics. Bytes are per
device per tick (each branch counted as if taken, as its worst case), then scaled to K2's
layout (PP16 x EP16 x DP8) by the ratio of one layer's per-device weight bytes, and of one
microbatch's per-device activation bytes, K2 over this model (`k2_scale`: a first-order
estimate; the operations are the same, their sizes scale).

Rows go to experiments/results/pipeline/tick_collectives.csv, keyed by --label (e.g. the
commit), so before / after rows come from the same measurement.
"""

import argparse
import collections
import csv
import os
import re
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# k2jax when not installed; last, so that the root's kernels/ hides no installed package
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

import pipeline_hlo  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "pipeline",
                   "tick_collectives.csv")
# 40 tokens a sequence: no parameter has a dimension of 40 or a multiple of it, so an
# activation (tokens x hidden) is never taken for a weight of the same shape
SEQ = 40
OPS = ("all-reduce", "all-gather", "all-to-all", "collective-permute", "reduce-scatter")


def _shapes(text):
  return [(dt, tuple(int(d) for d in dims.split(",") if d))
          for dt, dims in re.findall(r"([a-z][a-z0-9]*)\[([\d,]*)\]", text)]


def weight_shapes(layer_params):
  """{shape (leading 1s dropped): index of the parameter} for one layer's parameters, whole
  and as split over any factor of their dimensions the mesh could give (2, 4, 8): a
  weight-shaped operand."""
  out = {}
  for i, shape in enumerate(layer_params):
    shape = tuple(shape)
    forms = {shape}
    for d in range(len(shape)):
      for k in (2, 4, 8):
        if shape[d] % k == 0:
          forms.add(shape[:d] + (shape[d] // k,) + shape[d + 1:])
    for f in forms:
      out.setdefault(tuple(x for x in f if x != 1), i)
  return out


def spanned(groups, mesh):
  """The mesh axes (pipeline, data, expert) some device group varies over (devices in
  the mesh's order: pipeline slowest)."""
  names = ("pipeline", "data", "expert")
  coords = lambda d: np.unravel_index(d, mesh)
  return tuple(a for i, a in enumerate(names)
               if any(len({coords(d)[i] for d in g}) > 1 for g in groups))


def loop_collectives(hlo, weights, scale=None, mesh=(2, 2, 2)):
  """Rows (op, bytes, weight-shaped, shapes, bytes scaled, mesh axes spanned) of every
  collective inside the tick loop; `scale`: a factor per parameter index for weight-shaped
  operands, and at key None for the others."""
  comps, inside = pipeline_hlo.tick_loop(hlo)
  scale = scale or {}
  rows = []
  for c in inside:
    for line in comps[c]:
      line = re.sub(r"/\*.*?\*/", "", line)   # tuple shapes' /*index=N*/ comments
      m = re.search(r"= (\(?[a-z0-9]+\[[^=]*?) (" + "|".join(OPS) + r")(-start)?\(", line)
      if not m:
        continue
      shapes = [s for s in _shapes(m.group(1)) if s[1]]
      # an async start that returns a tuple holds operand and result (all-gather-start,
      # collective-permute-start); all-reduce-start returns its result only
      half = 2 if m.group(3) and m.group(1).startswith("(") and m.group(2) != "all-reduce" else 1
      b, scaled, shaped = 0, 0.0, False
      for dt, s in shapes:
        nb = pipeline_hlo.DTYPE_BYTES.get(dt, 4) * int(np.prod(s)) // half
        leaf = weights.get(tuple(x for x in s if x != 1))
        shaped |= leaf is not None
        b += nb
        scaled += nb * scale.get(leaf, 1.0)
      axes = spanned(pipeline_hlo._groups(line, int(np.prod(mesh))), mesh)
      rows.append((m.group(2), b, shaped, " ".join(f"{dt}{list(s)}" for dt, s in shapes),
                   scaled, axes))
  return rows


def k2_scale(c, mesh):
  """{parameter index: factor, None: factor} from this model on `mesh` to kimi_k2 on PP16 x
  EP16 x DP8: for each parameter of a layer, K2's over this model's bytes as a device holds
  it (the experts split over `expert`, the rest whole as the phases use them; K2's in bf16,
  its parameters' and model dtype, against this model's float32), and for everything else
  one microbatch's activation bytes on a device (its tokens x hidden, bf16 against float32).
  A first-order estimate: the operations are the same, their sizes scale."""
  import jax
  from k2jax import configs, model
  from k2jax.model import spec
  k2 = configs.get_config("kimi_k2")

  def per_device(cfg, expert):
    specs = jax.tree.leaves(model.param_specs(cfg.model)["moe_layers"], is_leaf=spec.is_spec)
    size = np.dtype(cfg.model.param_dtype).itemsize
    return [int(np.prod(sp.shape[1:])) * size / (expert if "experts" in sp.axes else 1)
            for sp in specs]
  ours, theirs = per_device(c, mesh[2]), per_device(k2, 16)
  scale = {i: t / o for i, (o, t) in enumerate(zip(ours, theirs))}
  tokens = lambda cfg, m: cfg.train.batch_size // cfg.train.grad_accum * cfg.train.seq_len / (
      m[1] * m[2])
  scale[None] = (tokens(k2, (16, 8, 16)) * k2.model.hidden_size * 2) / (
      tokens(c, mesh) * c.model.hidden_size * 4)
  return scale


def measure(label, mesh=(2, 2, 2)):
  import jax
  from k2jax import model
  compiled, _, _, _, ticks, _ = pipeline_hlo.build(mesh, seq=SEQ, skip="device")
  c = pipeline_hlo.tiny_config(mesh, seq=SEQ)
  params = model.init(c.model, jax.random.key(0))
  layer = [a.shape[1:] for a in jax.tree.leaves(params["moe_layers"])]
  rows = loop_collectives(compiled.as_text(), weight_shapes(layer), k2_scale(c, mesh), mesh)
  count = collections.Counter((op, w) for op, _, w, _, _, _ in rows)
  nbytes, k2 = collections.Counter(), collections.Counter()
  for op, b, w, _, scaled, _ in rows:
    nbytes[w] += b
    k2[w] += scaled
  per_layer = sum(int(np.prod(s)) * 4 for s in layer)
  return dict(label=label, mesh="x".join(map(str, mesh)), ticks=ticks,
              weight_ops=sum(n for (_, w), n in count.items() if w),
              activation_ops=sum(n for (_, w), n in count.items() if not w),
              weight_bytes_per_tick=nbytes[True], activation_bytes_per_tick=nbytes[False],
              layer_weight_bytes=per_layer,
              k2_weight_gb_per_tick=k2[True] / 1e9, k2_activation_gb_per_tick=k2[False] / 1e9,
              ops=" ".join(f"{op}{'(w)' if w else ''}:{n}" for (op, w), n in sorted(count.items()))
              ), rows


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--label", default="current")
  p.add_argument("--rows", action="store_true", help="print every collective")
  args = p.parse_args()
  rec, rows = measure(args.label)
  if args.rows:
    for r in sorted(rows, key=lambda r: -r[1]):
      print(f"  {r[0]:<20}{r[1]:>12,d}  {'weight' if r[2] else 'act':<7}"
            f"{'+'.join(r[5]) or '-':<22}{r[3][:80]}")
  for k, v in rec.items():
    print(f"{k:<28}{v}")
  os.makedirs(os.path.dirname(OUT), exist_ok=True)
  old = list(csv.DictReader(open(OUT))) if os.path.exists(OUT) else []
  old = [r for r in old if r["label"] != args.label] + [rec]
  with open(OUT, "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=list(rec))
    w.writeheader()
    w.writerows(old)


if __name__ == "__main__":
  main()
