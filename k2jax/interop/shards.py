"""Global arrays built shard by shard from host blocks, and the blocks each host holds.

`build(shape, dtype, sharding, produce)` makes the `jax.Array` a loader returns: for every
distinct block among this process's devices' shards it calls `produce(index)` once (the
host buffer for that block, in the stored dtype), copies it to each local device that holds
that block, and drops it before the next: host memory holds one shard at a time, never the
leaf. (`jax.make_array_from_callback` asks for every device's data before it transfers any,
so a leaf's distinct shards would all sit on the host at once.)

`host_blocks(pspec, shape, mesh_shape, hosts)` says, with no device at hand, which distinct
blocks each host of a slice holds: the index arithmetic of a NamedSharding (a dim split over
mesh axes (a, b) is cut into size(a) x size(b) blocks, a major), for k2jax.plan to size what
every host of a TPU slice reads and holds while loading. tests/test_load.py checks it against
jax's own `devices_indices_map`.
"""

import itertools
import math

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from k2jax.configs.sharding_rules import entry_axes


def normal(index, shape) -> tuple:
  """A device's index (slices, perhaps open) with concrete bounds."""
  return tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape))


def key(index) -> tuple:
  return tuple((s.start, s.stop) for s in index)


def build(shape, dtype, sharding, produce):
  """-> (jax.Array of `shape` / `dtype` in `sharding`, the largest host block it made).

  produce(index) -> np.ndarray: the block `index` (a slice per dim, concrete bounds) of
  the array, in `dtype`."""
  blocks, indices = {}, sharding.addressable_devices_indices_map(tuple(shape))
  for device, index in indices.items():
    index = normal(index, shape)
    blocks.setdefault(key(index), (index, []))[1].append(device)
  arrays, held, pending = {}, 0, []
  for index, devices in blocks.values():
    host = produce(index)
    held = max(held, host.nbytes)
    # the copies of the previous block are done before this one's start: at most two
    # blocks on the host while transfers overlap reading
    jax.block_until_ready(pending)
    pending = [jax.device_put(host, SingleDeviceSharding(d, memory_kind=sharding.memory_kind))
               for d in devices]
    arrays.update(zip(devices, pending))
    del host
  jax.block_until_ready(pending)
  return jax.make_array_from_single_device_arrays(
      tuple(shape), sharding, [arrays[d] for d in indices], dtype=np.dtype(dtype)), held


def block_at(pspec, shape, mesh_shape: dict, coords: dict) -> tuple:
  """The block (a slice per dim) the device at mesh coordinates `coords` holds of an array
  of `shape` split as `pspec` over a mesh of `mesh_shape` (NamedSharding's arithmetic)."""
  out = []
  entries = list(pspec) + [None] * (len(shape) - len(pspec))
  for n, e in zip(shape, entries):
    parts, at = 1, 0
    for a in entry_axes(e):
      parts, at = parts * mesh_shape[a], at * mesh_shape[a] + coords[a]
    size = n // parts
    out.append(slice(at * size, (at + 1) * size))
  return tuple(out)


def host_blocks(pspec, shape, mesh_shape: dict, hosts: np.ndarray) -> dict:
  """{host: [distinct blocks it holds]} for an array split as `pspec` on a mesh of
  `mesh_shape` ({axis: size}, in the mesh's axis order) whose devices, in mesh order,
  belong to `hosts` (an int array of that shape)."""
  axes = list(mesh_shape)
  out = {}
  for pos in itertools.product(*[range(mesh_shape[a]) for a in axes]):
    b = block_at(pspec, shape, mesh_shape, dict(zip(axes, pos)))
    out.setdefault(int(hosts[pos]), {})[key(b)] = b
  return {h: list(v.values()) for h, v in out.items()}


def nbytes(block, itemsize: int) -> int:
  return math.prod(s.stop - s.start for s in block) * itemsize
