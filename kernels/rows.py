"""Row bookkeeping the MoE kernels share (moe.py's dispatchers, gmm.py's gathered grouped
matmuls, the fused GPU kernels in moe_gpu.py): sorting (token, expert) assignments by
expert, taking rows with a segment-sum transpose, and SwiGLU under the model's checkpoint
names. A module of its own so the backends need not import the dispatcher that imports
them.
"""

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def take_rows(x, idx, n: int):
  """y[p] = x[idx[p]], 0 where idx[p] < 0. Its transpose is a segment sum, which XLA:CPU runs
  much faster than the scatter-add a gather's default transpose lowers to."""
  return jnp.where((idx >= 0)[:, None], x[jnp.maximum(idx, 0)], jnp.zeros((), x.dtype))


def _take_rows_fwd(x, idx, n):
  return take_rows(x, idx, n), idx


def _take_rows_bwd(n, idx, dy):
  dy = jnp.where((idx >= 0)[:, None], dy, jnp.zeros((), dy.dtype))
  return jax.ops.segment_sum(dy, jnp.maximum(idx, 0), n), None


take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)


def swiglu(g, u):
  # The same checkpoint names as k2jax.model.layers.swiglu, so remat / FP8 storage policies
  # see these activations too (kernels sit below the model and cannot import it).
  h = jax.nn.silu(checkpoint_name(g, "swiglu_input")) * checkpoint_name(u, "swiglu_input")
  return checkpoint_name(h, "swiglu")


def sort_assignments(expert_ids, num_experts: int):
  """-> (order [A] assignment ids sorted by expert, group_sizes [E], rank [A] of each
  assignment within its expert), A = N k, assignments in token-major order."""
  flat = expert_ids.reshape(-1)
  A = flat.shape[0]
  order = jnp.argsort(flat, stable=True)
  sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
  start = jnp.cumsum(sizes) - sizes
  rank = jnp.zeros((A,), jnp.int32).at[order].set(
      jnp.arange(A, dtype=jnp.int32) - start[flat[order]])
  return order, sizes, rank
