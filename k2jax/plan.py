"""Per-device memory of a config on a mesh, from abstract shapes and the real sharding rules.

    python -m k2jax.plan --config kimi_k2 --mesh pipeline=16,expert=16,data=1
    python -m k2jax.plan --config kimi_k2 --mesh pipeline=16,expert=16 --devices 2048

Nothing is allocated: every parameter's logical axes go through k2jax.parallel.RULES to a
PartitionSpec, and its shard on the fullest device is its shape divided (rounded up, as an
uneven layer split puts the extra layer on some stage) by the mesh axes it is split over.
States, per device:
  params        --param_bytes per element (bf16 = 2, as K2 stores them)
  grads         --grad_bytes per element (K2's fp32 accumulation buffer = 4)
  optimizer     ZeRO-1 (split over `data` too): fp32 master copy + Muon momentum for Muon
                matrices, fp32 master + Adam m, v for the rest
  activations   an estimate of what the configured implementation keeps (remat policy,
                attention implementation, activation storage), see `activation_bytes`
"""

import argparse
import math
import sys

import jax
from jax.sharding import AbstractMesh, NamedSharding

from k2jax import configs, model
from k2jax.model import remat as remat_lib, spec
from k2jax.parallel import MESH_AXES, logical_spec
from k2jax.parallel.pipeline import bubble
from k2jax.parallel.state import zero1

GB = 1e9


def shard_elements(shape, pspec, mesh_shape) -> int:
  n = 1
  for size, axes in zip(shape, tuple(pspec) + (None,) * (len(shape) - len(pspec))):
    axes = () if axes is None else ((axes,) if isinstance(axes, str) else axes)
    n *= math.ceil(size / math.prod(mesh_shape[a] for a in axes))
  return n


def state_bytes(mcfg, mesh_shape, param_bytes=2, grad_bytes=4):
  """Bytes of params, grads and ZeRO-1 optimizer state on the fullest device, and in total.

  Layer stacks are split over pipeline stages (rounded up); the embedding sits on the first
  stage and the head on the last, so with pipeline > 1 the fullest device holds the larger
  of the two, not both.
  """
  mesh = AbstractMesh(tuple(mesh_shape[a] for a in MESH_AXES), MESH_AXES)
  per_elem = {"params": param_bytes, "grads": grad_bytes}
  layers = dict(params=0, grads=0, optimizer=0)
  ends = {}  # non-layer parameters by pipeline end: first (embed) | last (head, final norm)
  totals = dict(params=0, grads=0)
  for path, s in _leaves_with_path(model.param_specs(mcfg)):
    pspec = logical_spec(s.axes)
    n = shard_elements(s.shape, pspec, mesh_shape)
    n_opt = shard_elements(s.shape, zero1(NamedSharding(mesh, pspec), s.shape).spec, mesh_shape)
    # fp32 master + Muon momentum | fp32 master + Adam m, v | frozen router bias: fp32 only
    b = dict(params=n * param_bytes, grads=n * grad_bytes,
             optimizer=n_opt * 4 * {"muon": 2, "adamw": 3, "frozen": 1}[s.group])
    if "layers" in s.axes or mesh_shape["pipeline"] == 1:
      target = layers
    else:
      target = ends.setdefault("first" if path[0] == "embed" else "last",
                               dict(params=0, grads=0, optimizer=0))
    for k in b:
      target[k] += b[k]
    for k in totals:
      totals[k] += spec.size(s) * per_elem[k]
  end = max(ends.values(), key=lambda e: e["params"], default=dict(params=0, grads=0, optimizer=0))
  out = {k: layers[k] + end[k] for k in layers}
  out.update(total_params=totals["params"], total_grads=totals["grads"])
  return out


def activation_bytes(mcfg, mesh_shape, seq_len, micro_batch=1, *, remat=None,
                     attention_impl=None, storage=None, virtual_stages=1, microbatches=None,
                     schedule="1f1b"):
  """Activation memory of the first pipeline stage, the one holding the most.

  Per layer and token, what the configured implementation keeps for the backward pass
  (k2jax.model.remat.saved_bytes_per_token: the remat policy, the attention implementation
  and the activation storage), for every layer of the stage; plus the working set of the
  layer being differentiated (all its activations, recomputed ones included) and of the
  head (f32 logits and their gradient). Per device, micro_batch sequences of seq_len tokens
  (tokens are split over data x expert). With pipeline > 1, k2jax.parallel.pipeline's
  schedule: 1f1b keeps at most 2 P V stage inputs ([micro_batch, seq_len, hidden]) and one
  stage's saved activations while it is differentiated; gpipe keeps every stage's saved
  activations for all M microbatches. Settings default to the config's. Returns (bytes,
  the settings used).
  """
  m = mcfg
  settings = dict(remat=remat or m.remat,
                  attention_impl=attention_impl or m.attention_impl,
                  storage=storage or m.get("activation_storage", "model"))
  stages = mesh_shape["pipeline"]
  per_stage = math.ceil(m.num_hidden_layers / stages)
  dense = min(m.first_k_dense_replace, per_stage)    # the first stage starts with dense layers
  layer = lambda ffn, **kw: sum(remat_lib.saved_bytes_per_token(m, ffn, seq_len, **{
      **settings, **kw}).values())
  saved = sum(layer(ffn) * n for ffn, n in (("mlp", dense), ("moe", per_stage - dense)))
  working = max(layer(ffn, remat="none") for ffn in ("mlp", "moe")) + 8 * m.vocab_size
  if stages == 1:
    return (saved + working) * seq_len * micro_batch, settings
  M = microbatches or stages
  a = 4 if m.dtype == "float32" else 2
  per_stage = math.ceil(m.num_hidden_layers / (stages * virtual_stages))
  stage = layer("moe") * per_stage
  if schedule == "gpipe":   # every stage's activations of every microbatch
    return (stage * M * virtual_stages + working) * seq_len * micro_batch, settings
  inputs = 2 * stages * virtual_stages * a * m.hidden_size
  return (inputs + stage + working) * seq_len * micro_batch, settings


def _leaves_with_path(tree):
  flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=spec.is_spec)
  return [(tuple(getattr(k, "key", k) for k in path), s) for path, s in flat]


def parse_mesh(text: str, devices: int | None) -> dict:
  mesh = {a: 1 for a in MESH_AXES}
  given = set()
  for part in filter(None, text.split(",")):
    key, _, value = part.partition("=")
    if key not in mesh or not value.isdigit() or int(value) < 1:
      raise ValueError(f"--mesh {text!r}: expected pipeline=P,expert=E,data=D with positive "
                       f"integers, got {part!r}")
    mesh[key] = int(value)
    given.add(key)
  if devices is not None:
    rest = devices // (mesh["pipeline"] * mesh["expert"])
    if "data" not in given and rest * mesh["pipeline"] * mesh["expert"] == devices:
      mesh["data"] = rest
    if math.prod(mesh.values()) != devices:
      raise ValueError(f"--devices {devices} is not pipeline x expert x data = "
                       f"{mesh['pipeline']} x {mesh['expert']} x {mesh['data']}")
  return mesh


def report(name, mesh, seq_len=None, micro_batch=1, param_bytes=2, grad_bytes=4, *,
           virtual_stages=None, microbatches=None, remat=None, storage=None) -> str:
  cfg = configs.get_config(name)
  virtual_stages = virtual_stages or cfg.mesh.get("virtual_stages", 1)
  seq_len = seq_len or cfg.train.seq_len
  st = state_bytes(cfg.model, mesh, param_bytes, grad_bytes)
  M = microbatches or max(mesh["pipeline"], cfg.train.grad_accum)
  schedule = cfg.mesh.get("pipeline_schedule", "1f1b")
  act, used = activation_bytes(cfg.model, mesh, seq_len, micro_batch, remat=remat,
                               storage=storage, virtual_stages=virtual_stages, microbatches=M,
                               schedule=schedule)
  n = math.prod(mesh.values())
  lines = [f"{name} on mesh {', '.join(f'{a}={mesh[a]}' for a in MESH_AXES)} ({n} devices), "
           f"params {param_bytes} B, grads {grad_bytes} B, seq_len {seq_len}, "
           f"micro_batch {micro_batch}",
           f"{'per device':<26}{'GB':>10}"]
  for key, label in (("params", "params"), ("grads", "grads / accumulation"),
                     ("optimizer", "optimizer (ZeRO-1)")):
    lines.append(f"  {label:<24}{st[key] / GB:>10.2f}")
  states = st["params"] + st["grads"] + st["optimizer"]
  lines.append(f"  {'all states':<24}{states / GB:>10.2f}")
  lines.append(f"  {'activations (estimate)':<24}{act / GB:>10.2f}   remat={used['remat']}, "
               f"attention={used['attention_impl']}, storage={used['storage']}")
  lines.append(f"  {'total':<24}{(states + act) / GB:>10.2f}")
  if mesh["pipeline"] > 1:
    P = mesh["pipeline"]
    lines.append(f"pipeline ({schedule}): {P} devices x {virtual_stages} virtual stages, "
                 f"{M} microbatches: idle stage slots "
                 f"{bubble(P, virtual_stages, M, schedule):.1%}")
  group = mesh["pipeline"] * mesh["expert"]
  tb = (st["total_params"] + st["total_grads"]) / 1e12
  lines.append(f"params + grads of the whole model: {tb:.2f} TB over a {group}-device "
               f"model-parallel group: {tb * 1e12 / group / GB:.1f} GB per device on average, "
               f"{(st['params'] + st['grads']) / GB:.1f} GB on the fullest")
  lines.append("for scale, report 2.4.2 (K2 on 256 GPUs): ~6 TB of bf16 params + fp32 grad "
               "buffer, ~30 GB per GPU for all states")
  return "\n".join(lines)


def main(argv=None):
  p = argparse.ArgumentParser(prog="python -m k2jax.plan", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", required=True, help=f"preset: {', '.join(configs.PRESETS)}")
  p.add_argument("--mesh", default="", help="pipeline=P,expert=E,data=D (missing axes = 1)")
  p.add_argument("--devices", type=int, default=None, help="total devices; fills in data")
  p.add_argument("--seq_len", type=int, default=None)
  p.add_argument("--micro_batch", type=int, default=1, help="sequences per device per microbatch")
  p.add_argument("--param_bytes", type=int, default=2)
  p.add_argument("--grad_bytes", type=int, default=4)
  p.add_argument("--virtual_stages", type=int, default=None,
                 help="pipeline stages per device (default: the config's)")
  p.add_argument("--microbatches", type=int, default=None,
                 help="pipeline microbatches (train.grad_accum; default max(pipeline, config's))")
  p.add_argument("--remat", choices=("none", "selective", "full"), default=None)
  p.add_argument("--storage", choices=("model", "fp8"), default=None,
                 help="activation storage of MoE / SwiGLU inputs (report 2.4.3)")
  args = p.parse_args(argv)
  try:
    mesh = parse_mesh(args.mesh, args.devices)
    if (args.virtual_stages or 1) < 1 or (args.microbatches or mesh["pipeline"]) < mesh["pipeline"]:
      raise ValueError("--virtual_stages must be >= 1 and --microbatches >= pipeline")
    print(report(args.config, mesh, args.seq_len, args.micro_batch, args.param_bytes,
                 args.grad_bytes, virtual_stages=args.virtual_stages,
                 microbatches=args.microbatches, remat=args.remat, storage=args.storage))
  except ValueError as e:
    print(f"k2jax.plan: error: {e}", file=sys.stderr)
    raise SystemExit(2)


if __name__ == "__main__":
  main()
