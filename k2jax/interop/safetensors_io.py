"""Lazy, memory-mapped safetensors reading (every dtype the K2 release uses) and sharded writing.

Why not `safetensors.safe_open(framework="numpy")` for reading: numpy has no float8 dtype,
so it cannot return the FP8 e4m3 weights of the K2 / DeepSeek-V3 releases. The format is
an 8-byte header length, a JSON header (dtype, shape, byte offsets per tensor) and raw
little-endian buffers, so we memory-map the file and view each tensor's bytes through
ml_dtypes: one tensor at a time, nothing else loaded. Writing uses safetensors itself.
"""

import glob
import json
import os
import struct

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_,
}


class Reader:
  """All tensors of a directory's *.safetensors files (or of one file), by name."""

  def __init__(self, path: str):
    files = sorted(glob.glob(os.path.join(path, "*.safetensors"))) if os.path.isdir(path) else [path]
    if not files:
      raise FileNotFoundError(f"{path}: no .safetensors files")
    self._where = {}
    self._maps = {}
    for f in files:
      with open(f, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(n))
      header.pop("__metadata__", None)
      self._maps[f] = None
      for name, info in header.items():
        self._where[name] = (f, 8 + n, info)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self._maps.clear()

  def __contains__(self, name):
    return name in self._where

  def names(self):
    return list(self._where)

  def get(self, name: str) -> np.ndarray:
    f, base, info = self._where[name]
    if self._maps.get(f) is None:
      self._maps[f] = np.memmap(f, np.uint8, "r")
    if info["dtype"] not in _DTYPES:
      raise ValueError(f"tensor {name} in {f} has unsupported dtype {info['dtype']}")
    start, end = info["data_offsets"]
    buf = self._maps[f][base + start: base + end]
    return buf.view(_DTYPES[info["dtype"]]).reshape(info["shape"])


def write_sharded(tensors, path: str, max_shard_bytes: int) -> None:
  """Write (name, array) pairs into model-0000i-of-0000n.safetensors (+ index when n > 1)."""
  shards, current, size = [], {}, 0
  for name, arr in tensors:
    arr = np.ascontiguousarray(arr)
    if current and size + arr.nbytes > max_shard_bytes:
      shards.append(current)
      current, size = {}, 0
    current[name] = arr
    size += arr.nbytes
  shards.append(current)
  if len(shards) == 1:
    save_file(shards[0], os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return
  weight_map, total = {}, 0
  for i, shard in enumerate(shards):
    fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    save_file(shard, os.path.join(path, fname), metadata={"format": "pt"})
    for name, arr in shard.items():
      weight_map[name] = fname
      total += arr.nbytes
  with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
