"""The embedding lookup and its backward, written out for a table split on its rows.

    x[t] = E[id_t]                                        forward: a gather
    dE[r] = sum over tokens t with id_t = r of dx[t]      backward: a scatter-add

Under a mesh the table [V, d] is split on its rows over the expert group (sharding rule
`vocab`) and the tokens over every non-pipeline device (`batch`: data x expert). Autodiff of
jnp.take leaves both to XLA's partitioner, which gathers: every device then holds the
whole microbatch's cotangents of the expert group ([b, T, d] for all its devices' tokens)
and the rows of their scatter, and the whole table, gathered for each microbatch's forward
and again for the backward's recompute; a sharding rule splitting the table on d instead
gathered as well. Here both are shard_maps over the token
axes. With ep devices in the expert group the table's rows are ep contiguous slices of
Vl = ceil(V / ep) (owner o(r) = r // Vl, the row's place there r - o(r) Vl), and device
(i, j) of (data, expert), holding n tokens and slice j:

    forward   sends each id_t to shard o(id_t), which reads row id_t - o Vl of its slice
              and sends it back                              (two all_to_alls over expert)
    backward  sends each dx[t] to shard o(id_t), which adds it at row id_t - o Vl:
                  dE_j^i = sum over the group's tokens t with o(id_t) = j of dx[t]
              then dE_j = sum_i dE_j^i     (psum over data: replicated there, as E is)

so each device ends with the gradient of the rows it holds and only rows its tokens use
cross the expert group. Shapes are static while ids are not: a device's slots for one shard
are padded to the worst case (all its rows to that shard). The rows go in `chunks` pieces
(a scan), so one chunk's [ep, n / chunks, d] buffer, at chunks = ep the size of the device's
own rows, is all that is live at once; every chunk moves ep x its rows, as padding does (ep
n d per device each way: what an all-gather of the group's cotangents moves, and at K2's
shapes 0.4x the table's all-gather, per microbatch).

The forward equals jnp.take bit for bit. Cotangents travel in the model dtype and are summed
in float32 (or the table's dtype where wider): autodiff widens them to the table's dtype
before its scatter-add, so the sum is at least as precise. Ids outside [0, V) add nothing
(and read zeros where the table is split; jnp.take's NaN elsewhere). A table whose rows the
expert group does not divide is stored whole (sharding_rules.param_spec): its forward is a
local gather, and for the backward its rows are padded to ep Vl and the gradient sliced back. Without an expert axis the tokens already
sit with every row they need: plain jnp.take and its autodiff.
"""

import functools
import math
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from k2jax.configs.sharding_rules import active_mesh_axes
from k2jax.kernels.pallas_utils import varying_like


class _LookupPlan(NamedTuple):
  """What is static about one lookup (hashable: a custom_vjp nondiff argument)."""
  vocab: int             # V, the table's rows
  table_dtype: object    # the gradient's dtype (the table's)
  owners: tuple          # mesh axes the rows are split over (the expert group)
  ep: int                # devices in the expert group
  tokens: tuple          # mesh axes the tokens (leading dim of ids) are split over
  chunks: int            # chunks the rows go in (0: as many as the expert group's devices)
  manual: bool = False   # an enclosing shard_map holds the token axes: no shard_map here,
                         # and each device's gradient stays its tokens' share (that
                         # shard_map sums it over the token axes, once)

  @property
  def rows(self) -> int:
    """Vl = ceil(V / ep): the rows of each expert shard's slice."""
    return -(-self.vocab // self.ep)


def _axis(names):
  return names[0] if len(names) == 1 else names


def _plan(table, ids, chunks: int, vocab: int | None = None):
  """The plan of a lookup under the current mesh, or None where jnp.take and its autodiff
  need no exchange or cannot have this one (no mesh, no expert group, ids not split over
  the owners' axes, or a shard_map that already holds those axes)."""
  mesh = jax.sharding.get_abstract_mesh()
  everywhere = active_mesh_axes("batch", mesh, manual=True)
  if everywhere and set(everywhere) <= set(mesh.manual_axes):
    # the pipeline's shard_map: ids are this device's tokens, the table its slice of rows
    owners = active_mesh_axes("vocab", mesh, manual=True)
    if not owners or vocab is None or table.shape[0] == vocab or ids.ndim == 0:
      return None             # whole here: a local gather, the gradient this device's share
    ep = math.prod(mesh.shape[a] for a in owners)
    return _LookupPlan(vocab, table.dtype, owners, ep, everywhere, chunks, True)
  owners = active_mesh_axes("vocab", mesh)
  tokens = active_mesh_axes("batch", mesh)
  if not owners or ids.ndim == 0 or not set(owners) <= set(tokens):
    return None
  if set(tokens) & set(mesh.manual_axes):
    return None
  if ids.shape[0] % math.prod(mesh.shape[a] for a in tokens):
    return None     # (decode's single sequences): the tokens are not split
  ep = math.prod(mesh.shape[a] for a in owners)
  return _LookupPlan(table.shape[0], table.dtype, owners, ep, tokens, chunks)


def _routes(plan, ids):
  """Inside shard_map over plan.tokens: where this device's ids [n] go, in R chunks of c ->
  (dest [R, c]: the expert shard holding each one's row, ep where none does; at [R, ep, c]:
  the rows of this shard's slice that chunk k's s-th id of each sender asks for, Vl where
  it asks none of this shard)."""
  owners, ep, vl = _axis(plan.owners), plan.ep, plan.rows
  n = ids.shape[0]
  R = min(plan.chunks or ep, n)
  c = -(-n // R)
  ids = jnp.pad(ids, (0, R * c - n), constant_values=-1)
  real = (ids >= 0) & (ids < plan.vocab)
  dest = jnp.where(real, ids // vl, ep).reshape(R, c)     # ep: nowhere (dropped)
  local = (ids - (ids // vl) * vl).astype(jnp.int32).reshape(R, c)
  slot = jnp.broadcast_to(jnp.arange(c), (R, c))
  rnd = jnp.broadcast_to(jnp.arange(R)[:, None], (R, c))
  # every chunk's requests in one exchange (ep R c integers)
  where = jnp.full((ep, R, c), vl, jnp.int32).at[dest, rnd, slot].set(local, mode="drop")
  return dest, jax.lax.all_to_all(where, owners, 0, 0, tiled=True).transpose(1, 0, 2)


def _as_bits(a):
  """Rows cross the group as their bits: XLA (seen on CPU) otherwise moves a widening that
  follows an exchange ahead of it, which then carries twice the bytes of bf16 rows."""
  return jax.lax.bitcast_convert_type(a, jnp.dtype(f"uint{8 * a.dtype.itemsize}"))


def _gather(plan, dtype, table, ids):
  """Inside shard_map over plan.tokens: this expert shard's slice [Vl, d] of the table and
  this device's ids [b, ...] -> its rows [b, ..., d] in `dtype`, each read on the shard that
  holds it and sent back (the backward's exchange in reverse)."""
  owners, ep = _axis(plan.owners), plan.ep
  d = table.shape[-1]
  dest, at = _routes(plan, ids.reshape(-1))
  R, c = dest.shape

  def chunk(_, xs):
    to, at = xs                                      # [c], [sender, c]
    rows = jnp.take(table, at.reshape(-1), axis=0, mode="fill", fill_value=0).astype(dtype)
    back = jax.lax.all_to_all(_as_bits(rows.reshape(ep, c, d)), owners, 0, 0, tiled=True)
    back = jax.lax.bitcast_convert_type(back, dtype)          # [owner, c, d]
    return None, back.at[to, jnp.arange(c)].get(mode="fill", fill_value=0)

  _, x = jax.lax.scan(chunk, None, (dest, at))
  n = math.prod(ids.shape)
  return x.reshape(R * c, d)[:n].reshape(ids.shape + (d,))


def _scatter(plan, d: int, ct, ids):
  """Inside shard_map over plan.tokens: this device's cotangents ct [b, ..., d] of its ids
  [b, ...] -> the gradient of the expert shard's Vl rows, summed over the group and over
  the other token axes (module docstring)."""
  owners, ep, vl = _axis(plan.owners), plan.ep, plan.rows
  acc = jnp.promote_types(plan.table_dtype, jnp.float32)
  dest, at = _routes(plan, ids.reshape(-1))
  R, c = dest.shape
  rows = ct.reshape(-1, d)
  rows = jnp.pad(rows, ((0, R * c - rows.shape[0]), (0, 0))).reshape(R, c, d)
  g = varying_like(jnp.zeros((vl, d), acc), rows)

  def chunk(g, xs):
    r, to, at = xs                                   # [c, d], [c], [sender, c]
    send = jnp.zeros((ep, c, d), _as_bits(r).dtype).at[to, jnp.arange(c)].set(
        _as_bits(r), mode="drop")
    got = jax.lax.all_to_all(send, owners, 0, 0, tiled=True).reshape(ep * c, d)
    got = jax.lax.bitcast_convert_type(got, r.dtype).astype(acc)
    return g.at[at.reshape(-1)].add(got, mode="drop"), None

  # the chunks read `at`: the requests' exchange precedes theirs on every device (XLA:CPU may
  # order independent collectives differently per device and deadlock)
  g, _ = jax.lax.scan(chunk, g, (rows, dest, at))
  rest = () if plan.manual else tuple(a for a in plan.tokens if a not in plan.owners)
  return jax.lax.psum(g, rest) if rest else g


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3))
def _lookup(plan, table, ids, dtype):
  if plan.vocab % plan.ep:      # stored whole: every device holds the rows its ids need
    return jnp.take(table, ids, axis=0).astype(dtype)
  if plan.manual:
    return _gather(plan, dtype, table, ids)
  owners, tokens = _axis(plan.owners), _axis(plan.tokens)
  return jax.shard_map(functools.partial(_gather, plan, dtype),
                       in_specs=(P(owners), P(tokens)), out_specs=P(tokens),
                       axis_names=set(plan.tokens))(table, ids)


def _lookup_fwd(plan, table, ids, dtype):
  return _lookup(plan, table, ids, dtype), ids


def _lookup_bwd(plan, dtype, ids, dx):
  del dtype
  d = dx.shape[-1]
  if plan.manual:
    return _scatter(plan, d, dx, ids).astype(plan.table_dtype), None
  owners, tokens = _axis(plan.owners), _axis(plan.tokens)
  g = jax.shard_map(functools.partial(_scatter, plan, d), in_specs=(P(tokens), P(tokens)),
                    out_specs=P(owners), axis_names=set(plan.tokens))(dx, ids)
  # a table the group does not divide is stored whole: its padded rows sliced off
  g = g[:plan.vocab] if plan.rows * plan.ep != plan.vocab else g
  return g.astype(plan.table_dtype), None


_lookup.defvjp(_lookup_fwd, _lookup_bwd)


def embed(table, ids, dtype=None, *, chunks: int = 0, vocab: int | None = None,
          rounds: int | None = None):
  """table[ids] in `dtype` (default the table's), each row read on, and its gradient sent
  to, the expert shard that holds it where a mesh splits the table's rows and the tokens
  (module docstring).

  Args:
    table: [V, d], under a mesh split on its rows as sharding rule `vocab` says (or whole).
    ids: int [b, ...], under a mesh split on its leading dimension as `batch` says.
    dtype: the output's dtype (the cotangents travel in it).
    chunks: the pieces this device's rows go in, one exchange each (0: ep, module
      docstring).
    vocab: V, inside a shard_map that holds the token axes manual and passes this device's
      slice of the rows (the pipeline's): then the exchange runs without a shard_map of its
      own and the gradient is this device's tokens' share, summed by that shard_map.
    rounds: the old name of `chunks` (deprecated: "rounds" are the expert exchange's
      windows of received rows, k2jax.model.expert_parallel).
  Returns:
    [b, ..., d]: jnp.take(table, ids, axis=0).astype(dtype).
  """
  if rounds is not None:
    warnings.warn("embed(rounds=...) is now embed(chunks=...)", DeprecationWarning,
                  stacklevel=2)
    chunks = rounds
  dtype = jnp.dtype(table.dtype if dtype is None else dtype)
  plan = _plan(table, ids, chunks, vocab)
  if plan is None:
    return jnp.take(table, ids, axis=0).astype(dtype)
  return _lookup(plan, table, ids, dtype)
