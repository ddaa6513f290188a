"""Published tensors -> one parameter leaf, built on its devices chunk by chunk.

The host only moves bytes as they are stored: for each chunk of a leaf it reads, for the
blocks its devices hold, the published tensors' codes and scales (FP8 e4m3 + float32 block
scales, INT4 words + bf16 group scales, or plain bf16 / float32) into a global "raw" array
sharded like the leaf (`shards.build`: one host block at a time). One compiled SPMD program
per leaf then dequantizes, transposes the published [out, in] into our [*in, *out], casts to
the stored dtype and writes the chunk into the leaf in place (donated): XLA does the
per-element work fused, on every device at once, and an accelerator receives 1 (FP8) or
0.5 (INT4) bytes per weight instead of 2 or 4. Vectors and the embedding, published as we
store them, are read straight into their shards (`direct`).

Chunks: a leaf's leading dims (layers, experts) are split n_d ways by its sharding, each
device holding l_d of them; a chunk takes c_d consecutive ones of every device's l_d (c = 1
layer, and as many experts as keep one device's converted chunk within CHUNK_BYTES), so all
devices read and convert their own layers and experts at once, and the device memory a leaf
needs beyond itself is one chunk's raw bytes and their conversion.

Raw layout of one chunk: [n_0 c_0, n_1 c_1, ..., *tensor], the tensor in its published
orientation ([out, in], a vector, the embedding's [vocab, embed]). Its sharding follows the
leaf's: leading dims as the leaf splits them; a published dim as our first dim of the group
it flattens (out = heads x head_dim splits as heads) when the rest of the group is whole,
else whole; a scale or packing dim only where the split falls on block boundaries (else each
device reads all of that tensor's scales: 1 / 16384 of the codes).
"""

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from k2jax.configs.sharding_rules import entry_axes
from k2jax.interop import quant, safetensors_io

# A chunk's converted values per device (float32 as dequantized) stay within this
CHUNK_BYTES = 16 << 20


class Part(NamedTuple):
  suffix: str      # appended to the published name ("", "_scale_inv", "_packed", "_scale")
  dtype: np.dtype
  shape: tuple     # of one tensor's part
  fill: int = 0    # what a padding row holds: values that dequantize to +0.0


class Plan(NamedTuple):
  """How one leaf is read and converted."""
  kind: str                # plain | fp8 | int4
  parts: tuple             # Part per raw array
  shape: tuple             # one published tensor's (dequantized) shape
  transposed: bool         # a matrix published [out, in]: ours is its transpose, reshaped
  blocks: tuple            # n_d: how many ways the sharding splits each leading dim
  sizes: tuple             # c_d: a chunk's rows of each device's share of each leading dim
  chunks: tuple            # q_d = l_d / c_d: chunks along each leading dim
  raw_specs: tuple         # PartitionSpec per raw array, as converted
  read_specs: tuple        # ... as read: split over replicas on other hosts (_with_replicas)
  group_size: int

  @property
  def lead(self) -> int:
    return len(self.blocks)


def _size(entry, mesh_shape) -> int:
  return math.prod(mesh_shape[a] for a in entry_axes(entry))


def plan(leaf, kind: str, dtypes: dict, spec, mesh_shape: dict, group_size: int = 32,
         spanning: tuple = ()) -> Plan:
  """The Plan of `leaf` (hf.Leaf) for a target split as `spec` (a PartitionSpec) over a mesh
  of `mesh_shape` ({axis: size}; {} for one device); `dtypes`: {suffix: dtype} of the
  published parts; `spanning`: the mesh axes whose devices belong to different processes
  (`spanning_axes`)."""
  s, lead = leaf.spec, leaf.lead
  inner = s.shape[lead:]
  e = list(spec) + [None] * (len(s.shape) - len(spec))
  transposed = len(inner) > 1 and not leaf.embedding
  if transposed:
    ein, eout = e[lead:lead + s.n_in], e[lead + s.n_in:]
    # a flattened group splits as its first dim when the rest are whole
    group = lambda g: g[0] if all(x is None for x in g[1:]) else None   # noqa: E731
    shape = (math.prod(inner[s.n_in:]), math.prod(inner[:s.n_in]))
    ents = [group(eout), group(ein)]
  else:
    shape, ents = tuple(inner), e[lead:]

  def aligned(entry, size, block):   # a split that falls on `block` boundaries, or none
    k = _size(entry, mesh_shape)
    return entry if entry is not None and size % k == 0 and (size // k) % block == 0 else None

  if kind == "plain":
    parts = (Part("", dtypes[""], shape),)
    specs = lambda ents: (ents,)   # noqa: E731
  elif kind == "fp8":
    b = quant.FP8_BLOCK
    parts = (Part("", dtypes[""], shape),
             Part("_scale_inv", dtypes["_scale_inv"], quant.fp8_scale_shape(shape)))
    specs = lambda ents: (ents, [aligned(x, m, b) for x, m in zip(ents, shape)])   # noqa: E731
  else:
    packed, scale = quant.int4_shapes(shape, group_size)
    zero = np.uint32(0x88888888).view(np.int32)     # eight codes of 8: q = 0, not -8
    parts = (Part("_packed", dtypes["_packed"], packed, int(zero)),
             Part("_scale", dtypes["_scale"], scale))
    specs = lambda ents: ([ents[0], aligned(ents[1], shape[1], 8)],   # noqa: E731
                          [ents[0], aligned(ents[1], shape[1], group_size)])
  read = [_with_replicas(e, ents[0], shape[0], kind, mesh_shape, spanning)] + ents[1:] if \
      len(shape) == 2 else ents
  blocks = tuple(_size(x, mesh_shape) for x in e[:lead])
  local = [n // b for n, b in zip(s.shape[:lead], blocks)]
  sizes = [1] * lead                 # one layer per chunk; experts while they fit
  per = math.prod(inner) * 4
  for d in range(1, lead):
    sizes[d] = max(c for c in range(1, local[d] + 1) if local[d] % c == 0 and
                   (c == 1 or math.prod(sizes[:d]) * c * per <= CHUNK_BYTES))
  head = e[:lead]
  return Plan(kind, parts, shape, transposed, blocks, tuple(sizes),
              tuple(l // c for l, c in zip(local, sizes)),
              tuple(P(*(head + list(sp))) for sp in specs(ents)),
              tuple(P(*(head + list(sp))) for sp in specs(read)), group_size)


def spanning_axes(mesh_shape: dict, processes: np.ndarray) -> tuple:
  """The mesh axes along which devices belong to different processes (hosts); `processes`:
  the process index of each device, an array of the mesh's shape."""
  return tuple(a for i, a in enumerate(mesh_shape) if mesh_shape[a] > 1 and
               (np.diff(processes, axis=i) != 0).any())


def _with_replicas(entries, rows, size: int, kind: str, mesh_shape: dict, spanning: tuple):
  """The entry of a tensor's published rows with the mesh axes the leaf is replicated over
  across processes (data over hosts, ...) added where they divide the rows (on FP8 scale-
  block boundaries): each host then reads 1 / replicas of the chunk's bytes from the files,
  and the conversion program gathers the rest from the other hosts' devices (over the chip
  interconnect) before it converts. Replicas within a process gain nothing: the process
  reads each distinct block once already. `rows`: the entry so far."""
  used = {a for x in entries for a in entry_axes(x)}
  block = quant.FP8_BLOCK if kind == "fp8" else 1
  axes = entry_axes(rows)
  for a in spanning:        # each that still divides the rows (on whole blocks)
    k = math.prod(mesh_shape[x] for x in axes + (a,))
    if a not in used and size % k == 0 and (size // k) % block == 0:
      axes += (a,)
  return None if not axes else axes[0] if len(axes) == 1 else axes


def raw_shape(shape: tuple, p: Plan, part: Part) -> tuple:
  """The raw array of `part` for one chunk of a leaf of `shape`."""
  return tuple(n * c for n, c in zip(p.blocks, p.sizes)) + part.shape


def raw_sharding(target, spec):
  """A raw array's sharding: `spec` on the target's mesh (a one-device target: itself)."""
  if isinstance(target, NamedSharding):
    return NamedSharding(target.mesh, spec, memory_kind=target.memory_kind)
  return target


def _tensors(leaf, p: Plan, chunk: tuple, index):
  """(published name or None for a padding row, position in the raw block) of raw block
  `index` of `chunk`."""
  if not p.lead:
    yield leaf.names[()], ()
    return
  ranges = [range(b.start, b.stop) for b in index[:p.lead]]
  for pos in np.ndindex(*[len(r) for r in ranges]):
    at = tuple((r[i] // c) * (q * c) + k * c + r[i] % c
               for r, i, c, q, k in zip(ranges, pos, p.sizes, p.chunks, chunk))
    yield leaf.names[at], pos


def read_block(reader, leaf, p: Plan, part: Part, chunk: tuple, index) -> np.ndarray:
  """Host block `index` of the raw array of `part` for `chunk`: the published tensors'
  blocks as stored (rows no tensor fills, the pipeline's padding, dequantize to zeros)."""
  out = np.empty(tuple(b.stop - b.start for b in index), part.dtype)
  for name, pos in _tensors(leaf, p, chunk, index):
    if name is None:
      out[pos] = part.fill
    else:
      reader.read(name + part.suffix, index[p.lead:], out=out[pos])
  return out


def block_bytes(leaf, p: Plan, part: Part, chunk: tuple, index, infos) -> int:
  """Bytes `read_block` reads for block `index` of `part` in `chunk` (counted, not read)."""
  return sum(safetensors_io.nbytes_of(infos[name + part.suffix], index[p.lead:])
             for name, _ in _tensors(leaf, p, chunk, index) if name is not None)


def direct(p: Plan) -> bool:
  """A leaf stored as published (vectors, the embedding: no transpose, no scales) and read
  whole by each of its replicas: straight into its own shards, cast on the host where the
  dtype differs; no program."""
  return p.kind == "plain" and not p.transposed and p.read_specs == p.raw_specs


def leaf_bytes(leaf, index, infos) -> int:
  """Bytes `read_leaf` reads for block `index` (counted, not read)."""
  lead = leaf.lead
  names = leaf.names[tuple(index[:lead])].reshape(-1) if lead else [leaf.names[()]]
  return sum(safetensors_io.nbytes_of(infos[n], index[lead:]) for n in names if n is not None)


def read_leaf(reader, leaf, dtype, index) -> np.ndarray:
  """Host block `index` of a `direct` leaf, in `dtype`."""
  lead = leaf.lead
  out = np.empty(tuple(b.stop - b.start for b in index), dtype)
  for pos in np.ndindex(*out.shape[:lead]):
    name = leaf.names[tuple(b.start + i for b, i in zip(index[:lead], pos))]
    if name is None:
      out[pos] = 0
    elif reader.info(name).dtype == dtype:
      reader.read(name, index[lead:], out=out[pos])
    else:   # through float32, to which every published dtype widens exactly
      out[pos] = reader.read(name, index[lead:]).astype(np.float32).astype(dtype)
  return out


def _expand(s, block: int, axis: int, size: int):
  """Scales per block along `axis` -> per element, cut to `size`."""
  return jax.lax.slice_in_dim(jnp.repeat(s, block, axis=axis), 0, size, axis=axis)


def dequantize(p: Plan, raws):
  """Published tensors [..., out, in] from their raw parts: float32 (FP8, INT4; see
  k2jax.interop.quant), or as stored (plain)."""
  rows, cols = p.shape if len(p.shape) == 2 else (None, None)
  if p.kind == "fp8":
    q, s = raws
    s = _expand(_expand(s, quant.FP8_BLOCK, -2, rows), quant.FP8_BLOCK, -1, cols)
    return q.astype(jnp.float32) * s.astype(jnp.float32)
  if p.kind == "int4":
    words, s = raws
    shifts = 4 * jnp.arange(8, dtype=jnp.uint32)
    codes = (jax.lax.bitcast_convert_type(words, jnp.uint32)[..., None] >> shifts) & 0xF
    codes = codes.reshape(words.shape[:-1] + (-1,))[..., :cols]
    q = (codes.astype(jnp.int32) - 8).astype(jnp.float32)
    return q * _expand(s, p.group_size, -1, cols).astype(jnp.float32)
  return raws[0]


@functools.lru_cache(maxsize=None)
def programs(p: Plan, shape: tuple, dtype, sharding):
  """(zeros, write) for a leaf of `shape` / `dtype` in `sharding`, compiled: programs that
  make it, and that write a chunk (its index along each leading dim, int32 [lead]) of it
  from the chunk's raw parts (the leaf donated: in place). Without leading dims there is one
  chunk: zeros is None and write(*raws) returns the leaf. Compiling releases the GIL: the
  loader compiles these in a thread while it reads."""
  lead, inner = p.lead, shape[p.lead:]
  raws = [jax.ShapeDtypeStruct(raw_shape(shape, p, part), part.dtype,
                               sharding=raw_sharding(sharding, spec))
          for part, spec in zip(p.parts, p.read_specs)]

  def convert(raws):
    raws = [jax.lax.with_sharding_constraint(r, raw_sharding(sharding, spec))
            for r, spec in zip(raws, p.raw_specs)]        # gathered over the replicas
    w = dequantize(p, raws)
    if p.transposed:
      w = jnp.swapaxes(w, -1, -2)       # [..., in, out]
    lead_shape = tuple(n * c for n, c in zip(p.blocks, p.sizes))
    return w.reshape(lead_shape + inner).astype(dtype)

  if not lead:
    return None, jax.jit(lambda *raws: convert(raws), out_shardings=sharding).lower(
        *raws).compile()

  def place(out, update, k):
    """Each device's share of the chunk into its own shard, at rows k_d c_d (in place)."""
    at = tuple(k[d] * c for d, c in enumerate(p.sizes)) + (0,) * len(inner)
    return jax.lax.dynamic_update_slice(out, update, at)

  if isinstance(sharding, NamedSharding):
    # per shard: one window of each device's rows (a global update there would be n_d
    # windows, which XLA writes through a copy of the whole leaf)
    place = jax.shard_map(place, mesh=sharding.mesh, in_specs=(
        sharding.spec, sharding.spec, P()), out_specs=sharding.spec, check_vma=False)

  def write(out, k, *raws):
    return place(out, jax.lax.with_sharding_constraint(convert(raws), sharding), k)
  leaf = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
  k = jax.ShapeDtypeStruct((lead,), jnp.int32)
  return (jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding).lower().compile(),
          jax.jit(write, donate_argnums=0, out_shardings=sharding).lower(leaf, k, *raws).compile())
