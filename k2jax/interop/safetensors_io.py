"""safetensors files read by the block and written by the tensor (every dtype K2 ships).

The format is an 8-byte header length, a JSON header (dtype, shape and byte offsets of each
tensor) and the tensors' raw little-endian bytes in C order. A reader that loads one device's
slice of a 1T model must touch only that slice's bytes, so `Reader.read` takes a rectangular
block of a tensor and reads exactly its bytes with positioned reads (`os.preadv` into the
result, one call per row run of the block): nothing memory-mapped (touched pages of a map
count toward the process's resident memory until it is unmapped), nothing else copied.
`Reader.bytes_read` counts them. Why not `safetensors.safe_open(...).get_slice`: its numpy
frontend has no float8 dtype, so it cannot return K2's FP8 weights, and it maps the file.

Writing streams too (`Writer`): the header is computed from the tensors' shapes before any
data is written, then each tensor is written as it comes, so host memory holds one tensor,
not the file (`safetensors.numpy.save_file` takes a dict of a whole file's arrays).
"""

import functools
import glob
import json
import math
import os
import struct
from typing import NamedTuple

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_,
}
NAMES = {np.dtype(v): k for k, v in DTYPES.items()}


class FormatError(ValueError):
  """A safetensors file that cannot hold what its header says (one line: tensor and file)."""


class Info(NamedTuple):
  """Where one tensor's bytes are: file, absolute offset of its first byte, dtype, shape."""
  file: str
  offset: int
  dtype: np.dtype
  shape: tuple

  @property
  def nbytes(self) -> int:
    return math.prod(self.shape) * self.dtype.itemsize


def _as_slice(s, size: int) -> slice:
  start, stop, step = s.indices(size) if isinstance(s, slice) else (s, s + 1, 1)
  if step != 1:
    raise ValueError("blocks are contiguous ranges")
  return slice(start, max(start, stop))


def ranges(info: Info, block: tuple) -> tuple[np.ndarray, int]:
  """(file offsets, bytes of each): the contiguous runs of `block` (one slice per leading
  dim, missing trailing dims whole) in a tensor laid out as `info`. A block whose trailing
  dims are whole is one run per index of its leading dims, down to a single run for a
  block of whole rows."""
  shape = info.shape
  block = [_as_slice(s, n) for s, n in zip(tuple(block) + (slice(None),) * len(shape), shape)]
  # the trailing dims the block spans whole fold into one run with the first partial dim
  k = len(shape)
  while k > 0 and block[k - 1].start == 0 and block[k - 1].stop == shape[k - 1]:
    k -= 1
  inner = math.prod(shape[k:]) * info.dtype.itemsize       # bytes of one index of dim k - 1
  if k == 0:
    return np.array([info.offset] if info.nbytes else [], np.int64), info.nbytes
  last = block[k - 1]
  run = (last.stop - last.start) * inner
  flat = np.zeros((), np.int64)        # row-major index over dims < k - 1, then dim k - 1
  for b, n in zip(block[:k - 1], shape[:k - 1]):
    flat = flat[..., None] * n + np.arange(b.start, b.stop)
  offsets = info.offset + (flat.reshape(-1) * shape[k - 1] + last.start) * inner
  return (offsets if run else offsets[:0]), run


def nbytes_of(info: Info, block: tuple) -> int:
  """Bytes `Reader.read` reads for `block` of a tensor laid out as `info`."""
  key = tuple(_as_slice(b, n) for b, n in zip(block, info.shape))
  return _nbytes(info.shape, info.dtype, tuple((b.start, b.stop) for b in key))


@functools.lru_cache(maxsize=1 << 16)
def _nbytes(shape, dtype, block) -> int:   # one count per block of each shape (k2jax.plan)
  offsets, run = ranges(Info("", 0, dtype, shape), tuple(slice(*b) for b in block))
  return len(offsets) * run


class Reader:
  """All tensors of a directory's *.safetensors files (or of one file), by name.

  Opening reads the headers only, and checks that every file is as long as its header says:
  a truncated file ends in FormatError naming the first tensor it cuts and the file."""

  def __init__(self, path: str):
    files = (sorted(glob.glob(os.path.join(path, "*.safetensors"))) if os.path.isdir(path)
             else [path])
    if not files:
      raise FileNotFoundError(f"{path}: no .safetensors files")
    self._where: dict[str, Info] = {}
    self._fds: dict[str, int] = {}
    self.bytes_read = 0
    for f in files:
      size = os.path.getsize(f)
      with open(f, "rb") as fh:
        head = fh.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else size
        if 8 + n > size:
          raise FormatError(f"{f}: the file is shorter than its header ({size} bytes): it is "
                            "truncated or not a safetensors file; download it again")
        header = json.loads(fh.read(n))
      header.pop("__metadata__", None)
      for name, info in header.items():
        if info["dtype"] not in DTYPES:
          raise FormatError(f"tensor {name} in {f} has dtype {info['dtype']}, which k2jax "
                            "does not read")
        start, end = info["data_offsets"]
        if 8 + n + end > size:
          raise FormatError(f"tensor {name} in {f} ends at byte {8 + n + end}, past the end "
                            f"of the file ({size} bytes): the file is truncated; download "
                            "it again")
        self._where[name] = Info(f, 8 + n + start, np.dtype(DTYPES[info["dtype"]]),
                                 tuple(info["shape"]))

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def close(self):
    for fd in self._fds.values():
      os.close(fd)
    self._fds.clear()

  def __contains__(self, name):
    return name in self._where

  def names(self):
    return list(self._where)

  def info(self, name: str) -> Info:
    return self._where[name]

  def read(self, name: str, block: tuple = (), out: np.ndarray | None = None) -> np.ndarray:
    """The block (a slice per leading dim, the rest whole) of tensor `name`, reading only its
    bytes (into `out`, a C-contiguous array of the block's shape and dtype, if given)."""
    info = self._where[name]
    shape = tuple(_as_slice(s, n).stop - _as_slice(s, n).start for s, n in
                  zip(tuple(block) + (slice(None),) * len(info.shape), info.shape))
    if out is None:
      out = np.empty(shape, info.dtype)
    elif out.shape != shape or out.dtype != info.dtype or not out.flags.c_contiguous:
      raise ValueError(f"tensor {name}: block {shape} {info.dtype} read into "
                       f"{out.shape} {out.dtype}")
    if info.file not in self._fds:
      self._fds[info.file] = os.open(info.file, os.O_RDONLY)
    fd = self._fds[info.file]
    view = memoryview(out.reshape(-1).view(np.uint8))
    offsets, n = ranges(info, block)
    for i, offset in enumerate(offsets.tolist()):
      got = os.preadv(fd, [view[i * n:(i + 1) * n]], offset)
      if got != n:   # the file shrank after its header was checked
        raise FormatError(f"tensor {name} in {info.file}: read {got} of {n} bytes at offset "
                          f"{offset}: the file is truncated; download it again")
    self.bytes_read += len(offsets) * n
    return out

  def get(self, name: str) -> np.ndarray:
    """The whole tensor."""
    return self.read(name)


class Writer:
  """Writes tensors into files of at most `max_shard_bytes` (+ an index when there are
  several), in the order `layout` gives them, one tensor in memory at a time.

  layout: [(name, dtype, shape[, owner])] of every tensor, in writing order. The files are
  planned from it (`files`, `file_of`), a new one whenever the owner changes; `write(name,
  array)` then comes in that order from whichever process writes a file's tensors, once."""

  def __init__(self, path: str, layout: list, max_shard_bytes: int):
    self.path = path
    groups, size, owner = [[]], 0, None
    for name, dtype, shape, *rest in layout:
      nbytes = math.prod(shape) * np.dtype(dtype).itemsize
      if groups[-1] and (size + nbytes > max_shard_bytes or (rest and rest[0] != owner)):
        groups.append([])
        size = 0
      owner = rest[0] if rest else None
      groups[-1].append((name, np.dtype(dtype), tuple(shape)))
      size += nbytes
    n = len(groups)
    self.files = ["model.safetensors"] if n == 1 else [
        f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    self.file_of = {name: i for i, g in enumerate(groups) for name, _, _ in g}
    self._groups = groups
    self._open = None     # (file index, file object, names still to come)

  def write_index(self) -> None:
    """model.safetensors.index.json (only with several files)."""
    if len(self.files) == 1:
      return
    total = sum(math.prod(s) * d.itemsize for g in self._groups for _, d, s in g)
    with open(os.path.join(self.path, "model.safetensors.index.json"), "w") as f:
      json.dump({"metadata": {"total_size": total},
                 "weight_map": {n: self.files[i] for n, i in self.file_of.items()}}, f, indent=1)

  def write(self, name: str, array: np.ndarray) -> None:
    i = self.file_of[name]
    if self._open is None or self._open[0] != i:
      self._start(i)
    _, f, pending = self._open
    want_name, dtype, shape = pending.pop(0)
    if want_name != name or np.dtype(array.dtype) != dtype or tuple(array.shape) != shape:
      raise ValueError(f"{name} {array.dtype}{list(array.shape)} written where the layout "
                       f"has {want_name} {dtype}{list(shape)}")
    f.write(memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8)))
    if not pending:
      f.close()
      self._open = None

  def _start(self, i: int) -> None:
    if self._open is not None:
      raise ValueError(f"{self.files[self._open[0]]} was left unfinished")
    header, at = {}, 0
    for name, dtype, shape in self._groups[i]:
      n = math.prod(shape) * dtype.itemsize
      header[name] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [at, at + n]}
      at += n
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)     # data 8-byte aligned, as safetensors writes it
    f = open(os.path.join(self.path, self.files[i]), "wb")
    f.write(struct.pack("<Q", len(raw)) + raw)
    self._open = (i, f, list(self._groups[i]))
