"""Grouped matmul for MoE experts: rows of x sorted by group, one weight matrix per group.

    y[r] = x[r] @ w[g(r)]     for rows r of group g; rows past sum(group_sizes) give 0

Implementations (same signature, same result):
  ragged_dot  `jax.lax.ragged_dot`: native grouped GEMM on GPU / TPU. XLA:CPU has no kernel
              for it and runs every group over every row (G times the work).
  blocked     pad each group to a multiple of `block` rows, gather each block's weight
              matrix and run one batched matmul: dropless, at most G * (block - 1) padded
              rows. About 14x faster than ragged_dot on CPU for forward + backward at the
              tiny config's sizes (experiments/bench_grouped_matmul.py).
`auto` picks ragged_dot on accelerators and blocked on CPU.
"""

import jax
import jax.numpy as jnp


def _count_at_or_below(boundaries, n: int):
  """c[i] = #{b in boundaries : b <= i} for i < n (boundaries sorted, int).

  A scatter-add and a cumsum; jnp.searchsorted would do, but it fails under shard_map's
  manual axes in jax 0.10 (and this is O(n + len(boundaries)))."""
  marks = jnp.zeros((n + 1,), jnp.int32).at[jnp.minimum(boundaries, n)].add(1)
  return jnp.cumsum(marks)[:n]


def grouped_matmul_blocked(x, w, group_sizes, block: int = 64):
  M, K = x.shape
  G = w.shape[0]
  group_sizes = group_sizes.astype(jnp.int32)
  padded = (group_sizes + block - 1) // block * block
  padded_end = jnp.cumsum(padded)
  end = jnp.cumsum(group_sizes)
  rows = -(-(M + G * (block - 1)) // block) * block      # static bound on padded rows
  r = jnp.arange(M)
  g = _count_at_or_below(end, M)                         # group of each row (G = past the end)
  valid = g < G
  g = jnp.minimum(g, G - 1)
  dest = jnp.where(valid, padded_end[g] - padded[g] + r - (end[g] - group_sizes[g]), rows)
  xp = jnp.zeros((rows, K), x.dtype).at[dest].set(x, mode="drop")
  n_blocks = rows // block
  block_start = _count_at_or_below(padded_end, rows)[::block]
  block_group = jnp.minimum(block_start, G - 1)
  yp = jnp.einsum("nbk,nkf->nbf", xp.reshape(n_blocks, block, K), w[block_group])
  y = yp.reshape(rows, -1)[jnp.minimum(dest, rows - 1)]
  return jnp.where(valid[:, None], y, jnp.zeros((), y.dtype))


def grouped_matmul_ragged_dot(x, w, group_sizes):
  return jax.lax.ragged_dot(x, w, group_sizes.astype(jnp.int32))


IMPLS = {"ragged_dot": grouped_matmul_ragged_dot, "blocked": grouped_matmul_blocked}


def grouped_matmul(x, w, group_sizes, impl: str = "auto"):
  """x [M, K] (rows sorted by group), w [G, K, N], group_sizes [G] -> [M, N]."""
  if impl == "auto":
    impl = "blocked" if jax.default_backend() == "cpu" else "ragged_dot"
  return IMPLS[impl](x, w, group_sizes)
