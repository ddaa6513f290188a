"""Context parallelism: each sequence's tokens split over the `context` mesh axis.

K2 trains its last stages at 32k and 128k tokens (report 2.4.2 / 2.5: YaRN), and SFT and RL
trajectories run as long. The `context` axis (sharding_rules: logical `length`) splits every
sequence over C devices; everything but attention works token by token, so only MLA needs
the other devices' tokens.

Placement (striped head-tail): the sequence is cut into chunks of `model.context_chunk`
tokens in groups of 2C, and context device c holds chunks c and 2C - 1 - c of every group.
A chunk's causal work grows with its place, so each device gets one cheap and one dear chunk
of a group and all run the same number of (query block, key block) pairs (contiguous chunks
would leave the last device (2C - 1) / C of the mean); small chunks also spread each packed
document over all devices, which one head and one tail chunk of the whole row would not.
The model permutes its tokens into this order as they enter (`to_placement`) and back
before the head (`from_placement`); positions and segment ids travel with the tokens, so
the split is invisible outside the model.

Attention all-gathers MLA's per-token latent (kv_lora_rank + qk_rope_head_dim values, 576
at K2) over `context`, and each device up-projects the whole sequence's keys and values
itself and runs its own query blocks against them (k2jax.kernels.flash.attention_blocks).
The per-head keys and values are H (nope + rope + v) values per token (20,480 at K2), so
this moves far fewer bytes than gathering those. The price: the up-projection of the whole
sequence on every context device, 2 kv_lora H (nope + v) FLOPs per token, and the whole
sequence's keys and values held during one layer's attention. A ring over key blocks would
hold two blocks instead, but receives the same latent bytes and must merge partial
softmaxes across C steps; it pays only where the held keys and values grow too large (128k).
Balance, bytes and FLOPs: experiments/bench_context.py, docs/results/parallelism.md.

QK-Clip: each device's per-head max over its own query rows, then a max over the context
devices (and the batch's): the max over the whole sequence.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from k2jax.configs import sharding_rules as rules
from k2jax.kernels import flash
from k2jax.model import rope


def axes(mesh=None, manual: bool = False) -> tuple[str, ...]:
  """The mesh axes the tokens of a sequence are split over (empty: no context parallelism),
  without those an enclosing shard_map holds manual unless `manual`."""
  mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
  return rules.active_mesh_axes("length", mesh, manual=manual)


def size(mesh=None, manual: bool = False) -> int:
  mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
  return math.prod(mesh.shape[a] for a in axes(mesh, manual))


def engaged(T: int, mesh=None) -> bool:
  """Whether a layer whose arrays show T tokens per sequence runs split over the context
  axes: always inside a shard_map that holds them manual (the pipeline's: T is this device's
  share), else where 2C chunks divide T. A decode step's one new token (or a prompt no
  multiple of 2C) then runs whole on every context device."""
  mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
  ctx = axes(mesh, manual=True)
  if not ctx:
    return False
  return set(ctx) <= set(getattr(mesh, "manual_axes", ())) or T % (2 * size(mesh, True)) == 0


def chunk_size(cfg, T: int, C: int) -> int:
  """The placement's chunk: the largest divisor of T / 2C up to `model.context_chunk`, a
  multiple of 8 where one is (the TPU kernel's blocks are whole multiples of 8 rows)."""
  if T % (2 * C):
    raise ValueError(f"sequence length {T} is not a multiple of 2 x context ({2 * C}): "
                     "set train.seq_len to a multiple of it")
  n, most = T // (2 * C), cfg.get("context_chunk", 128)
  fits = [b for b in range(1, min(n, most) + 1) if n % b == 0]
  return max([b for b in fits if b % 8 == 0] or fits)


def placement(T: int, C: int, chunk: int) -> np.ndarray:
  """The token order whose C equal slices are the context devices' tokens: the sequence in
  chunks of `chunk` tokens, in groups of 2C; device c holds chunks c and 2C - 1 - c of every
  group, in sequence order. int [T]: placement(...)[i] is the place in the sequence of the
  i-th token in that order."""
  if T % (2 * C * chunk):
    raise ValueError(f"sequence length {T} is not a multiple of 2 x context x chunk "
                     f"({2 * C * chunk}): set train.seq_len to a multiple of it")
  groups = np.arange(T).reshape(-1, 2 * C, chunk)              # [group, 2C, chunk]
  return np.concatenate([groups[:, [c, 2 * C - 1 - c]].reshape(-1) for c in range(C)])


def to_placement(x, C: int, chunk: int, axis: int = 1):
  """x with its token axis in placement order."""
  return x if C == 1 else jnp.take(x, placement(x.shape[axis], C, chunk), axis=axis)


def from_placement(x, C: int, chunk: int, axis: int = 1):
  """The inverse of `to_placement`."""
  return x if C == 1 else jnp.take(x, np.argsort(placement(x.shape[axis], C, chunk)),
                                   axis=axis)


def block_size(chunk: int, most: int = 512) -> int:
  """The flash block: the largest divisor of a chunk's length up to `most` (a block never
  straddles two chunks, so each device's query blocks are whole blocks of the sequence)."""
  return max(b for b in range(1, min(chunk, most) + 1) if chunk % b == 0)


def attend(cfg, q, latent, k_rope, kv_b, segment_ids):
  """MLA's attention with this device's tokens in placement order.

  q [B, T, H, nope + rope] (roped), latent [B, T, kv_lora], k_rope [B, T, rope] (roped),
  kv_b [kv_lora, H, nope + v], segment_ids [B, T] or None, all global arrays whose token
  axis is split over the context axes -> (out [B, T, H, v], max_logits [H]) as
  kernels.attention returns them. Inside a shard_map that holds the context axes manual
  already (the pipeline's) the arrays are this device's and max_logits stays this
  device's over context, for that shard_map to reduce with its other statistics.
  """
  mesh = jax.sharding.get_abstract_mesh()
  ctx = axes(mesh, manual=True)
  C = size(mesh, manual=True)
  held = set(getattr(mesh, "manual_axes", ()))
  inside = set(ctx) <= held
  batch = rules.active_mesh_axes("batch", mesh)        # the batch's axes not manual yet
  # every axis not manual yet: the body is per device (its query blocks depend on its
  # place), and Mosaic kernels refuse any automatic axis (inside the pipeline's shard_map
  # too, where expert may still be one)
  manual = set(mesh.axis_names) - held
  T = q.shape[1] * (C if inside else 1)
  chunk = chunk_size(cfg, T, C)
  block = block_size(chunk)
  per_chunk = chunk // block
  groups = T // (2 * C * chunk)
  # the gathered tokens come in placement order; this puts them in sequence order
  natural = np.argsort(placement(T, C, chunk))
  nope = cfg.qk_nope_head_dim
  # the model's kernel (model.attention_impl), run per device: every mesh axis is manual
  # in `local`, as Mosaic needs
  impl = flash.auto_impl() if cfg.attention_impl == "auto" else cfg.attention_impl
  if impl == "pallas_tpu" and block % 8:
    impl = "chunked"      # a prompt of a few tokens per device: blocks below the kernel's 8
  seg = (jnp.ones(q.shape[:2], jnp.int32) if segment_ids is None
         else segment_ids.astype(jnp.int32))

  def local(q, latent, k_rope, kv_b, seg):
    c = jax.lax.axis_index(ctx)
    gather = lambda a: jnp.take(jax.lax.all_gather(a, ctx, axis=1, tiled=True), natural,
                                axis=1)
    latent_all, rope_all, seg_all = gather(latent), gather(k_rope), gather(seg)
    kv = jnp.einsum("btr,rhd->bthd", latent_all, kv_b.astype(latent_all.dtype))
    # not "mla_up": the whole sequence's keys and values are C times a device's share;
    # the backward recomputes them from the gathered latent instead of saving them
    kv = checkpoint_name(kv, "context_kv")
    k_nope, v = kv[..., :nope], kv[..., nope:]
    k = jnp.concatenate([k_nope, jnp.broadcast_to(rope_all[:, :, None, :],
                                                  k_nope.shape[:-1] + rope_all.shape[-1:])],
                        axis=-1)
    # this device's chunks, ascending: c and 2C - 1 - c of each group of 2C
    mine = (jnp.arange(groups)[:, None] * 2 * C + jnp.stack([c, 2 * C - 1 - c])).reshape(-1)
    ids = (mine[:, None] * per_chunk + jnp.arange(per_chunk)).reshape(-1)
    out, max_logits = flash.attention_blocks(
        q, k, v, scale=rope.softmax_scale(cfg), q_block_ids=ids, block=block,
        q_segment_ids=seg, k_segment_ids=seg_all, impl=impl)
    over = tuple(batch) + (() if inside else tuple(ctx))
    return out, jax.lax.pmax(max_logits, over) if over else max_logits

  if inside and not manual:
    return local(q, latent, k_rope, kv_b, seg)
  act = P(batch or None, None if inside else ctx)
  # check_vma off: the flash loops' carries start invariant and become varying
  return jax.shard_map(local, in_specs=(act, act, act, P(), act), out_specs=(act, P()),
                       axis_names=manual, check_vma=False)(q, latent, k_rope, kv_b, seg)
