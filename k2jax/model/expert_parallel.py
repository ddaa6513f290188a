"""Expert parallelism: dropless token dispatch across the `expert` mesh axis (report 2.4.2).

Runs inside `shard_map`, on one device's tokens. Experts are sharded over the axis, E_loc
per shard, so expert e lives on shard e // E_loc. Every token-expert assignment is sent to
its expert's shard with an all-to-all, processed there by a grouped matmul over the shard's
local experts, and sent back:

    sort assignments by expert -> pack per destination shard -> all_to_all ->
    grouped matmul over local experts -> all_to_all back -> unsort -> weighted sum

Dropless with static shapes: each destination slot holds up to all N*k local assignments
(the worst case of every token choosing the same shard), unused rows are padding. This
padded all_to_all works on every backend (XLA:CPU has no ragged_all_to_all); its cost is
ep x the real traffic and, on CPU's blocked grouped matmul, ep x the expert compute.
"""

import jax
import jax.numpy as jnp


def experts_all_to_all(expert_mlp, p_local, x, idx, w, axis: str):
  """Routed-expert output for local tokens x [N, d] with global expert ids idx [N, k].

  expert_mlp(p_local, rows, group_sizes) runs the shard's experts on rows grouped by local
  expert; p_local holds this shard's E_loc experts. Returns [N, d] (combine weights w applied).
  """
  N, k = idx.shape
  d = x.shape[-1]
  ep = jax.lax.axis_size(axis)
  e_loc = jax.tree.leaves(p_local)[0].shape[0]
  A = N * k
  flat = idx.reshape(-1)
  order = jnp.argsort(flat, stable=True)                 # grouped by expert, hence by shard
  expert = flat[order]
  dest = expert // e_loc
  count = jnp.bincount(dest, length=ep)
  rank = jnp.arange(A) - (jnp.cumsum(count) - count)[dest]   # row within the destination slot

  send_x = jnp.zeros((ep, A, d), x.dtype).at[dest, rank].set(x[order // k])
  send_e = jnp.full((ep, A), e_loc, jnp.int32).at[dest, rank].set(expert % e_loc)  # e_loc = pad
  recv_x = jax.lax.all_to_all(send_x, axis, 0, 0, tiled=True)   # slot j: rows from shard j
  recv_e = jax.lax.all_to_all(send_e, axis, 0, 0, tiled=True)

  rows, local = recv_x.reshape(ep * A, d), recv_e.reshape(ep * A)
  by_expert = jnp.argsort(local, stable=True)            # padding (id e_loc) sorts last
  sizes = jnp.bincount(local, length=e_loc + 1)[:e_loc].astype(jnp.int32)
  out = expert_mlp(p_local, rows[by_expert], sizes)      # rows past sum(sizes) come back 0
  out = out[jnp.argsort(by_expert)].reshape(ep, A, d)

  back = jax.lax.all_to_all(out, axis, 0, 0, tiled=True)     # slot j: my rows, done on shard j
  y_sorted = back[dest, rank]
  y = y_sorted[jnp.argsort(order)].reshape(N, k, d)
  return jnp.einsum("nkd,nk->nd", y, w.astype(y.dtype))
