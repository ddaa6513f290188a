"""Sharded params -> a Hugging Face directory in the published layout, one tensor at a time.

Each published tensor is one position of a leaf's leading `layers` / `experts` dims (or a
whole top-level leaf). A leaf whose sharding also splits inside its tensors (attention
weights split over `expert` on their model dim) is first resharded so that only its leading
dims are split (`whole_tensors`): then every tensor lies whole on some device. Its owner is
the lowest-numbered process holding such a device; every process computes the same owners
from the shardings alone, so no one talks about who writes what. Each process writes the
files of its own tensors (a file never mixes owners: the index maps any name to any file),
fetching one tensor at a time from its device shard and writing it before the next: host
memory holds one tensor (and its float32 view for FP8 quantization), every file is written
once, and no tensor crosses between processes (but for the resharding above).
"""

import functools
import json
import os

import jax
import ml_dtypes  # noqa: F401  (np.dtype("bfloat16") below)
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from k2jax.interop import hf_format as hf, quant, safetensors_io, shards

def whole_tensors(array, lead: int):
  """`array` resharded so that no dim after the first `lead` is split (itself if none is)."""
  s = array.sharding
  if not isinstance(s, NamedSharding):
    return array
  entries = list(s.spec) + [None] * (array.ndim - len(s.spec))
  if all(e is None for e in entries[lead:]):
    return array
  target = NamedSharding(s.mesh, P(*entries[:lead]), memory_kind=s.memory_kind)
  return _resharder(target)(array)


@functools.cache
def _resharder(target):
  """One jitted identity per target sharding (a new lambda each call traced it again)."""
  return jax.jit(lambda x: x, out_shardings=target)


def _owners(array, lead: int) -> dict:
  """{leading position: lowest process index of a device holding that tensor whole}."""
  out = {}
  for device, index in array.sharding.devices_indices_map(array.shape).items():
    ranges = [range(s.start, s.stop) for s in shards.normal(index[:lead], array.shape)]
    for pos in np.ndindex(*[len(r) for r in ranges]):
      at = tuple(r[i] for r, i in zip(ranges, pos))
      out[at] = min(out.get(at, device.process_index), device.process_index)
  return out


def _fetch(array, at: tuple) -> np.ndarray:
  """The tensor at leading position `at`, from a local shard that holds it whole."""
  for shard in array.addressable_shards:
    index = shards.normal(shard.index, array.shape)
    if all(s.start <= p < s.stop for s, p in zip(index, at)):
      local = tuple(p - s.start for s, p in zip(index, at))
      return np.asarray(shard.data[local] if local else shard.data)
  raise AssertionError(f"no local shard holds position {at}")


def _published(hf_name, w: np.ndarray, s, lead: int) -> np.ndarray:
  """Our tensor [*in, *out] -> the published [out, in] (vectors, the embedding as is)."""
  shape = hf.hf_shape(hf_name, s, lead)
  if len(shape) == 1 or hf_name == hf.EMBED:
    return w.reshape(shape)
  return w.reshape(shape[::-1]).T


def save(cfg, params, path: str, *, dtype: str = "float32", fp8: bool = False,
         max_shard_bytes: int = 4 << 30) -> dict:
  """Write `params` to `path` (see the module docstring). -> {"files": this process's
  files, "bytes": the bytes it wrote, "host_peak": its largest tensor buffer}."""
  np_dtype = np.dtype(dtype)
  me = jax.process_index()
  table = hf.leaves(cfg)
  flat, _ = jax.tree_util.tree_flatten_with_path(params)
  arrays = {tuple(k.key for k in p): a for p, a in flat}
  layout_of = {n: (d, s) for n, d, s in hf.published_layout(cfg, np_dtype, fp8=fp8)}
  entries, owner_of = [], {}
  for leaf in table.values():
    owners = _owners(arrays[leaf.path], leaf.lead)
    for at in np.ndindex(*leaf.names.shape):
      name = leaf.names[at]
      owner_of[name] = owners[tuple(int(i) for i in at)]
  for owner in sorted(set(owner_of.values())):
    for leaf in table.values():
      for at in np.ndindex(*leaf.names.shape):
        name = leaf.names[at]
        if owner_of[name] == owner:
          parts = [name] + ([name + "_scale_inv"] if name + "_scale_inv" in layout_of else [])
          entries += [(p, *layout_of[p], owner) for p in parts]
  os.makedirs(path, exist_ok=True)
  writer = safetensors_io.Writer(path, entries, max_shard_bytes)
  if me == 0:
    hf_cfg = hf.config_to_hf(cfg, torch_dtype=dtype)
    if fp8:
      hf_cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                       "activation_scheme": "dynamic",
                                       "weight_block_size": [quant.FP8_BLOCK, quant.FP8_BLOCK]}
    with open(os.path.join(path, "config.json"), "w") as f:
      json.dump(hf_cfg, f, indent=2)
    writer.write_index()
  wrote, peak = 0, 0
  for leaf in table.values():
    mine = [at for at in np.ndindex(*leaf.names.shape) if owner_of[leaf.names[at]] == me]
    array = whole_tensors(arrays[leaf.path], leaf.lead)   # every process: a collective
    for at in mine:
      name = leaf.names[at]
      w = _published(name, _fetch(array, tuple(int(i) for i in at)), leaf.spec, leaf.lead)
      if name + "_scale_inv" in layout_of:
        q, scale_inv = quant.quantize_fp8(w.astype(np.float32))
        out = [(name, q), (name + "_scale_inv", scale_inv)]
      else:
        out = [(name, w.astype(layout_of[name][0]))]
      for n, a in out:
        writer.write(n, a)
        wrote += a.nbytes
        peak = max(peak, a.nbytes + w.nbytes)
    del array
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(f"k2jax export {path}")
  files = sorted({writer.files[writer.file_of[n]] for n, *_, o in entries if o == me})
  return {"files": files, "bytes": wrote, "host_peak": peak}
