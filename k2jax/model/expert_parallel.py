"""Expert parallelism: dropless token dispatch across the `expert` mesh axis (report 2.4.2).

Runs inside `shard_map`, on one device's tokens. Experts are sharded over the axis, E_loc
per shard, so expert e lives on shard e // E_loc. Every token-expert assignment travels to
its expert's shard, is processed there by a grouped matmul over the shard's local experts,
and travels back:

    sort assignments by expert (hence by destination) -> exchange per-destination counts ->
    send rows -> grouped matmul over local experts -> send results back -> unsort -> combine

Static shapes and droplessness pull against each other: a device may receive anything from
0 to all ep x A assignments of its group (A = N k local assignments per device). The counts
are exchanged first, and the transport buffers take the smallest of a few static sizes
(`capacities`) that fits the largest count anywhere (a pmax), chosen at run time with
`lax.switch`; the largest size is the worst case, so nothing is ever dropped. Transports:

  ragged    `lax.ragged_all_to_all`: only the real rows move (GPU / TPU; XLA:CPU has no
            kernel for it). Moves 2 A d values per device per layer, the ideal.
  bucketed  `lax.all_to_all` of [ep, C, d] slots, C the smallest capacity >= the largest
            (source, destination) count: ~ep C / A x the ideal (1.25x when balanced).
  padded    every slot sized for the worst case (C = A): ep x the ideal; the reference.
"""

import functools

import jax
import jax.numpy as jnp

from k2jax.kernels import platform
from k2jax.kernels.buckets import capacities, choose

TRANSPORTS = ("ragged", "bucketed", "padded")


def auto_transport() -> str:
  return "bucketed" if platform.backend() == "cpu" else "ragged"


def _exclusive_cumsum(x, axis=-1):
  return jnp.cumsum(x, axis=axis) - x


def _run_local(expert_mlp, p_local, rows, local, e_loc):
  """Local experts on received rows; `local` = local expert id, e_loc marks padding."""
  by_expert = jnp.argsort(local, stable=True)            # padding (id e_loc) sorts last
  sizes = jnp.bincount(local, length=e_loc + 1)[:e_loc].astype(jnp.int32)
  out = expert_mlp(p_local, rows[by_expert], sizes)      # rows past sum(sizes) come back 0
  return out[jnp.argsort(by_expert)]


def _slots(ep, cap, d, dest, rank, rows, local, e_loc):
  send_x = jnp.zeros((ep, cap, d), rows.dtype).at[dest, rank].set(rows, mode="drop")
  send_e = jnp.full((ep, cap), e_loc, jnp.int32).at[dest, rank].set(local, mode="drop")
  return send_x, send_e


def _padded_exchange(expert_mlp, p_local, rows, local, dest, rank, e_loc, axis, cap):
  """[ep, cap] slots per device: all_to_all there, local experts, all_to_all back."""
  ep = jax.lax.axis_size(axis)
  d = rows.shape[-1]
  send_x, send_e = _slots(ep, cap, d, dest, rank, rows, local, e_loc)
  recv_x = jax.lax.all_to_all(send_x, axis, 0, 0, tiled=True)   # slot j: rows from shard j
  recv_e = jax.lax.all_to_all(send_e, axis, 0, 0, tiled=True)
  out = _run_local(expert_mlp, p_local, recv_x.reshape(ep * cap, d), recv_e.reshape(-1), e_loc)
  back = jax.lax.all_to_all(out.reshape(ep, cap, d), axis, 0, 0, tiled=True)
  return back[dest, rank]


def _ragged_exchange(expert_mlp, p_local, rows, local, counts, e_loc, axis, cap, a2a):
  """Only the real rows move. counts [ep_src, ep_dst] of this expert group; receive buffers
  hold `cap` rows. `a2a` is lax.ragged_all_to_all (tests pass an emulation on CPU)."""
  me = jax.lax.axis_index(axis)
  d = rows.shape[-1]
  send = counts[me]                                   # rows I send to each shard
  recv = counts[:, me]                                # rows each shard sends me
  send_off = _exclusive_cumsum(send)                  # rows are sorted by destination
  # Where my slice lands on each receiver: after the slices of lower-numbered senders.
  land_off = _exclusive_cumsum(counts, axis=0)[me]
  recv_off = _exclusive_cumsum(recv)
  recv_x = a2a(rows, jnp.zeros((cap, d), rows.dtype), send_off, send, land_off, recv,
               axis_name=axis)
  recv_e = a2a(local, jnp.full((cap,), e_loc, jnp.int32), send_off, send, land_off, recv,
               axis_name=axis)
  out = _run_local(expert_mlp, p_local, recv_x, recv_e, e_loc)
  # Back: my received slices return to where each sender's rows started on its side.
  home_off = _exclusive_cumsum(counts, axis=1)[:, me]
  return a2a(out, jnp.zeros_like(rows), recv_off, recv, home_off, send, axis_name=axis)


def experts_all_to_all(expert_mlp, p_local, x, idx, w, axis: str, *, sync_axes=(),
                       transport: str = "auto", ragged_all_to_all=None):
  """Routed-expert output for local tokens x [N, d] with global expert ids idx [N, k].

  Args:
    expert_mlp: expert_mlp(p_local, rows, group_sizes) runs the shard's experts on rows
      grouped by local expert.
    p_local: this shard's E_loc experts.
    x, idx, w: local tokens [N, d], their expert ids [N, k] and combine weights [N, k].
    axis: the mesh axis experts are split over.
    sync_axes: every other manual mesh axis of the enclosing shard_map: all devices agree on
      the buffer size, so they all take the same compiled branch.
    transport: "ragged" | "bucketed" | "padded" | "auto" (ragged off CPU).
    ragged_all_to_all: override for lax.ragged_all_to_all (a CPU emulation in tests).
  Returns:
    [N, d]: sum_k w[n, k] * expert_{idx[n, k]}(x[n]).
  """
  transport = auto_transport() if transport == "auto" else transport
  if transport not in TRANSPORTS:
    raise ValueError(f"transport = {transport!r}: must be one of {', '.join(TRANSPORTS)}, auto")
  N, k = idx.shape
  ep = jax.lax.axis_size(axis)
  e_loc = jax.tree.leaves(p_local)[0].shape[0]
  A = N * k
  flat = idx.reshape(-1)
  order = jnp.argsort(flat, stable=True)                 # grouped by expert, hence by shard
  expert = flat[order]
  dest = expert // e_loc
  count = jnp.bincount(dest, length=ep).astype(jnp.int32)
  rank = jnp.arange(A) - _exclusive_cumsum(count)[dest]  # row within the destination slot
  rows, local = x[order // k], (expert % e_loc).astype(jnp.int32)
  counts = jax.lax.all_gather(count, axis)               # [ep_src, ep_dst], ep^2 integers
  agree = lambda v: jax.lax.pmax(v, (axis, *sync_axes))

  if transport == "padded":
    y_sorted = _padded_exchange(expert_mlp, p_local, rows, local, dest, rank, e_loc, axis, A)
    return _combine(y_sorted, order, w)
  if transport == "bucketed":
    caps = capacities(A, ep)
    need = jnp.max(counts)                               # largest (source, destination) slice
    exchange = lambda c, p, r: _padded_exchange(expert_mlp, p, r, local, dest, rank, e_loc,
                                                axis, c)
  else:
    a2a = ragged_all_to_all or jax.lax.ragged_all_to_all
    caps = capacities(ep * A, ep)                        # receive buffer: up to ep x A rows
    need = jnp.max(jnp.sum(counts, 0))                   # most rows any shard receives
    exchange = lambda c, p, r: _ragged_exchange(expert_mlp, p, r, local, counts, e_loc, axis,
                                                c, a2a)
  # Differentiating a switch materializes every branch's residuals (zeros where not taken);
  # checkpointed branches keep only their inputs and recompute the taken one backwards
  # (experiments/bench_ep.py, 8 simulated CPU devices: 0.51x the padded time, 1.43x without).
  branches = [jax.checkpoint(functools.partial(exchange, c)) for c in caps]
  y_sorted = jax.lax.switch(choose(agree(need), caps), branches, p_local, rows)
  return _combine(y_sorted, order, w)


def _combine(y_sorted, order, w):
  """Back to token order and the weighted sum over each token's k experts."""
  y = y_sorted[jnp.argsort(order)].reshape(w.shape + (-1,))
  return jnp.einsum("nkd,nk->nd", y, w.astype(y.dtype))


def bytes_moved(counts, d: int, itemsize: int, transport: str) -> int:
  """Bytes one device sends per layer (there and back) given the group's counts matrix
  [ep_src, ep_dst] (numpy), for the benchmark's bytes-vs-ideal table."""
  import numpy as np
  counts = np.asarray(counts)
  ep = counts.shape[0]
  A = int(counts.sum(1).max())
  if transport == "padded":
    rows = ep * A
  elif transport == "bucketed":
    caps = capacities(A, ep)
    rows = ep * next(c for c in caps if c >= counts.max())
  else:
    rows = A
  return 2 * rows * d * itemsize
