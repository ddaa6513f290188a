"""Device meshes and the shardings the logical-axis rules give parameters and batches.

The rules themselves (logical axis -> mesh axes) are the one table in
k2jax.configs.sharding_rules; every parameter's logical axes come from the parameter table
(k2jax.model.spec) and every batch is ("batch", "length").
"""

import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from k2jax.configs.sharding_rules import (MESH_AXES, RULES, entry_axes, logical_spec,  # noqa: F401
                                          param_spec, spread)
from k2jax.model import spec


def make_mesh(mesh_cfg, devices=None) -> Mesh:
  """A Mesh of shape (pipeline, data, context, expert) over all devices (of every process).
  A config written before the `context` axis existed has none: 1."""
  devices = jax.devices() if devices is None else devices
  shape = tuple(int(mesh_cfg.get(a, 1)) for a in MESH_AXES)
  if math.prod(shape) != len(devices):
    raise ValueError(
        f"mesh {' x '.join(MESH_AXES)} = {' x '.join(map(str, shape))} = {math.prod(shape)} "
        f"devices, but {len(devices)} are available: set --config.mesh.* so the product is "
        f"{len(devices)}")
  return Mesh(np.asarray(devices).reshape(shape), MESH_AXES)


def parse_mesh(text: str, devices: int | None = None, flag: str = "--mesh") -> dict:
  """"pipeline=P,data=D,context=C,expert=E" (any subset; the rest 1) -> {axis: size}. With
  `devices`, data defaults to what the others leave of them and the product must be them.
  ValueError naming the flag and the fix otherwise."""
  mesh = {a: 1 for a in MESH_AXES}
  given = set()
  for part in filter(None, text.split(",")):
    key, _, value = part.partition("=")
    if key not in mesh or not value.isdigit() or int(value) < 1:
      raise ValueError(f"{flag} {text!r}: expected pipeline=P,expert=E,data=D,context=C with "
                       f"positive integers, got {part!r}")
    mesh[key] = int(value)
    given.add(key)
  if devices is not None:
    others = mesh["pipeline"] * mesh["expert"] * mesh["context"]
    if "data" not in given and devices // others * others == devices:
      mesh["data"] = devices // others
    if math.prod(mesh.values()) != devices:
      raise ValueError(f"--devices {devices} is not {' x '.join(MESH_AXES)} = "
                       f"{' x '.join(str(mesh[a]) for a in MESH_AXES)}")
  return mesh


def _check_divisible(name, shape, pspec, mesh, fix="change the mesh or the model size"):
  for dim, (size, axes) in enumerate(zip(shape, pspec)):
    if axes is None:
      continue
    axes = entry_axes(axes)
    n = math.prod(mesh.shape[a] for a in axes)
    if size % n:
      raise ValueError(f"{name}: dim {dim} of size {size} is sharded over mesh axes "
                       f"{' x '.join(axes)} = {n}, which does not divide it: {fix}")


def param_shardings(specs, mesh: Mesh, spread_layers: bool = False):
  """NamedSharding per parameter of a parameter table (`k2jax.model.param_specs(cfg)`).

  The trainer stores the pipelined stack padded to a multiple of the pipeline size
  (k2jax.parallel.layout), so its `layers` axis always divides. A stack the pipeline axis
  does not divide is the leading dense stack (run by stage 0 only: kept whole on every
  pipeline device, which costs what padding it to one copy per device would) or a logical
  view of the pipelined one (a checkpoint's: with `spread_layers` the pipeline axis moves to
  its largest other dimension it divides, so saving never gathers a stack on one device).
  """
  def one(path, s):
    pspec = param_spec(s.axes, s.shape, mesh)
    if (spread_layers and s.axes and s.axes[0] == "layers" and pspec[0] is None
        and mesh.shape["pipeline"] > 1):
      pspec = spread(pspec, s.shape, ("pipeline",), mesh.shape)
    _check_divisible("/".join(str(getattr(k, "key", k)) for k in path), s.shape, pspec, mesh)
    return NamedSharding(mesh, pspec)
  return jax.tree_util.tree_map_with_path(one, specs, is_leaf=spec.is_spec)


def batch_sharding(mesh: Mesh, global_batch: int, grad_accum: int = 1) -> NamedSharding:
  """Rows split over the mesh axes of the logical `batch` axis. With grad_accum microbatches
  (k2jax.training.step.microbatches takes every grad_accum-th row) each microbatch must split evenly
  too, so every device works on every microbatch."""
  pspec = logical_spec(("batch", None))
  fix = "make train.batch_size a multiple of it"
  if grad_accum > 1:
    axes = [a for a in pspec[0]] if isinstance(pspec[0], tuple) else [pspec[0]]
    n = math.prod(mesh.shape[a] for a in axes if a)
    fix = (f"each of the train.grad_accum = {grad_accum} microbatches must split evenly too: "
           f"make train.batch_size a multiple of {grad_accum * n}")
  name = "train.batch_size" if grad_accum == 1 else "train.batch_size / train.grad_accum"
  _check_divisible(name, (global_batch // grad_accum, 1), pspec, mesh, fix=fix)
  return NamedSharding(mesh, pspec)


def process_batch_slice(sharding: NamedSharding, global_batch: int,
                        devices=None) -> tuple[int, int]:
  """(index, count): this process feeds rows [index, index + 1) x global_batch / count of
  the batch. The rows a process feeds are those its devices hold; a mesh axis that spans
  processes without splitting the batch (the pipeline axis across hosts) means several
  processes feed the same rows, so count is not always the process count.

  devices: the process's devices (default: this process's addressable devices).
  """
  index_map = sharding.devices_indices_map((global_batch, 1))
  devices = sharding.addressable_devices if devices is None else devices
  rows = [index_map[d][0] for d in devices]
  lo = min(r.start or 0 for r in rows)
  hi = max(global_batch if r.stop is None else r.stop for r in rows)
  return lo // (hi - lo), global_batch // (hi - lo)


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())
