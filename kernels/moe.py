"""Dropless routed experts: the whole dispatch -> SwiGLU experts -> combine of an MoE layer.

    y = routed_experts(x, expert_ids, combine, gate, up, down, impl="auto")
    y[n] = sum_j combine[n, j] * down_e(silu(x[n] @ gate_e) * (x[n] @ up_e)),  e = expert_ids[n, j]

x [N, d]; expert_ids, combine [N, k]; gate, up [E, d, f]; down [E, f, d]. Implementations:

  blocked   the CPU default. Each expert's rows are gathered once into a padded layout of
            whole blocks (`blocked_layout`: about half a block of padding per expert, the
            block chosen per shape), then gate and up, and down, run as one loop over the
            used blocks each (k2jax.kernels.gmm.block_matmul: the block's weight is sliced
            in place, no per-block weight copies); rows come back by one gather. Faster
            than `ragged` on the same loop for a layer's forward + backward (one layout
            instead of three scatter / gather pairs; experiments/bench_moe.py).
  ragged    sort the N k assignments by expert, three grouped matmuls over the sorted rows
            (k2jax.kernels.gmm, its own `auto` per backend), unsort, combine; the default
            where no fused kernel is better (TPU: XLA's ragged_dot, gmm.AUTO; megablox only
            on request, since it cannot run inside the expert-parallel shard_map).
  capacity  each expert's first C rows in an [E, C, d] buffer and three batched matmuls
            with no weight gathers, C = CAPACITY_FACTOR x the balanced load N k / E; rows
            past an expert's capacity go through the blocked path under a lax.cond, so
            nothing is dropped (a cond, not a switch over capacities: XLA:CPU runs a
            conditional's body without intra-op threads, which is slower). Faster than
            blocked for a balanced layer of few experts on CPU, but not the CPU default: a
            fresh router sends several times the mean load to one expert, so the
            overflow runs every step, and with 64+ experts the [E, C] buffers are mostly
            padding (experiments/bench_moe.py has both in the train step).
  tokamax   the ragged path on tokamax's grouped matmul (optional package; Mosaic GPU
            kernels with wgmma + TMA on Hopper, kernels/gmm.py TOKAMAX_TILES).
  pallas_gpu  the ragged path on Triton kernels that read x through the sort permutation and
            write the down projection back in token order scaled by the combine weights
            (kernels/moe_gpu.py), so x[order] and the unsort are never materialized in the
            forward; on Hopper the backward gathers them once and runs jax's Mosaic GPU
            ragged dots (moe_gpu.MGPU).
  gather    each assignment reads its expert's weights ([N k, d, f] gathers): no sorting or
            padding, and only the chosen experts' weights are read, which is what decoding a
            few tokens wants (k2jax.model.decode picks it when N k <= E).
  dense     every expert on every token: the reference.
"""


import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from k2jax.kernels import platform
from k2jax.kernels.fp8 import fp8_saved
# (re-exported: moe.take_rows and moe.sort_assignments were their names first)
from k2jax.kernels.rows import swiglu, sort_assignments, take_rows  # noqa: F401
from k2jax.kernels.gmm import (_count_at_or_below, block_matmul, blocked_block_size,
                              grouped_matmul)

IMPLS = ("blocked", "ragged", "capacity", "pallas_gpu", "tokamax", "gather", "dense")
# Rows per expert kept in the capacity buffer, as a multiple of the balanced load.
CAPACITY_FACTOR = 1.5


def auto_impl(backend: str | None = None) -> str:
  backend = backend or platform.backend()
  return {"gpu": "pallas_gpu", "cpu": "blocked"}.get(backend, "ragged")


def _up_and_swiglu(fp8: bool, mm):
  """(up-projection, swiglu) for rows of tokens; with fp8 their saved inputs are FP8-E4M3
  (report 2.4.3, kernels/fp8.py). mm(a, w) is the implementation's (grouped) matmul."""
  if not fp8:
    return mm, swiglu
  return fp8_saved(mm, 1), fp8_saved(swiglu, 2)


def _ragged(x, expert_ids, combine, gate, up, down, gmm_impl="auto", interpret=False,
            fp8=False):
  N, k = expert_ids.shape
  order, sizes, _ = sort_assignments(expert_ids, gate.shape[0])
  dt = x.dtype
  gm = lambda a, w, sizes: grouped_matmul(a, w.astype(dt), sizes, impl=gmm_impl,
                                          interpret=interpret)
  up_mm, sw = _up_and_swiglu(fp8, gm)
  rows = checkpoint_name(take_rows(x, order // k, N), "moe_input")     # grouped by expert
  y = checkpoint_name(gm(sw(up_mm(rows, gate, sizes), up_mm(rows, up, sizes)), down, sizes),
                      "moe_down")
  inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
  y = take_rows(y, inverse, y.shape[0]).reshape(N, k, -1)              # back to token order
  return jnp.einsum("nkd,nk->nd", y, combine.astype(y.dtype))


# The padded-block layout of the `blocked` path: each expert's rows padded to whole blocks.
def blocked_layout(expert_ids, num_experts: int, block: int):
  """-> (src [R] token of each padded row (-1: padding), slot [N k] padded row of each
  assignment (token-major), block_expert [R / block], used_blocks), R the static bound
  N k + E (block - 1) rounded up to whole blocks; blocks past used_blocks hold no rows."""
  N, k = expert_ids.shape
  E, A = num_experts, N * k
  flat = expert_ids.reshape(-1)
  _, sizes, rank = sort_assignments(expert_ids, E)
  padded = (sizes + block - 1) // block * block
  end = jnp.cumsum(padded)
  R = -(-(A + E * (block - 1)) // block) * block
  slot = (end - padded)[flat] + rank
  src = jnp.full((R,), -1, jnp.int32).at[slot].set(jnp.arange(A, dtype=jnp.int32) // k)
  block_expert = jnp.minimum(_count_at_or_below(end, R)[::block], E - 1)
  return src, slot, block_expert, end[-1] // block


def _blocked(x, expert_ids, combine, gate, up, down, block=None, fp8=False):
  N, k = expert_ids.shape
  E, d = gate.shape[0], x.shape[-1]
  dt = x.dtype
  block = block or blocked_block_size(N * k, E)
  src, slot, block_expert, used = blocked_layout(expert_ids, E, block)
  R = src.shape[0]
  xp = checkpoint_name(take_rows(x, src, N), "moe_input").reshape(R // block, block, d)
  # The block layout travels as arguments: fp8_saved's custom VJP must not close over it.
  up_mm, sw = _up_and_swiglu(fp8, block_matmul)
  g, u = up_mm(xp, (gate.astype(dt), up.astype(dt)), block_expert, used)
  (yp,) = block_matmul(sw(g, u), (down.astype(dt),), block_expert, used)
  yp = checkpoint_name(yp.reshape(R, d), "moe_down")
  y = take_rows(yp, slot, R).reshape(N, k, d)
  return jnp.einsum("nkd,nk->nd", y, combine.astype(y.dtype))


def _capacity_rows(C, x, expert_ids, combine, gate, up, down, rank, fp8=False):
  """The routed output of every assignment with rank < C (the rest contribute 0)."""
  N, k = expert_ids.shape
  E, d = gate.shape[0], x.shape[-1]
  dt = x.dtype
  flat = expert_ids.reshape(-1)
  slot = jnp.where(rank < C, flat * C + rank, -1)                       # place in [E * C]
  src = jnp.full((E * C,), -1, jnp.int32).at[jnp.where(slot < 0, E * C, slot)].set(
      jnp.arange(N * k, dtype=jnp.int32) // k, mode="drop")
  xb = checkpoint_name(take_rows(x, src, N).reshape(E, C, d), "moe_input")
  up_mm, sw = _up_and_swiglu(fp8, lambda a, w: jnp.einsum("ecd,edf->ecf", a, w.astype(dt)))
  h = sw(up_mm(xb, gate), up_mm(xb, up))
  yb = checkpoint_name(jnp.einsum("ecf,efd->ecd", h, down.astype(dt)), "moe_down")
  yb = yb.reshape(E * C, d)
  y = take_rows(yb, slot, E * C).reshape(N, k, d)
  return jnp.einsum("nkd,nk->nd", y, combine.astype(y.dtype))


# The impls whose expert weights reach their matmuls other than as one cast of the whole
# stack: gather casts each row's gathered matrix, capacity reads the stack in two places
# (its capacity rows and the overflow's blocked pass). Their weight gradients are summed
# before the cast's transpose, in float32 when the weights are stored so; cast once per step
# (k2jax.model.spec.cast_once) that sum would run in bf16, so the experts' spec keeps them
# as stored for these impls (k2jax.model.moe.moe_specs).
SUM_BEFORE_CAST = ("gather", "capacity")


def _capacity(x, expert_ids, combine, gate, up, down, factor=CAPACITY_FACTOR, fp8=False):
  N, k = expert_ids.shape
  E = gate.shape[0]
  _, sizes, rank = sort_assignments(expert_ids, E)
  C = min(N * k, max(8, -(-int(factor * N * k / E + 0.999) // 8) * 8))
  y = _capacity_rows(C, x, expert_ids, combine, gate, up, down, rank, fp8)
  over = rank.reshape(expert_ids.shape) >= C

  def overflow(x, expert_ids, combine, gate, up, down):
    return _blocked(x, expert_ids, jnp.where(over, combine, 0), gate, up, down, fp8=fp8)

  # Checkpointed so the untaken branch costs no residuals.
  return y + jax.lax.cond(jnp.any(over), jax.checkpoint(overflow),
                          lambda x, *_: jnp.zeros_like(x), x, expert_ids, combine, gate, up,
                          down)


def _gather(x, expert_ids, combine, gate, up, down):
  dt = x.dtype
  ids = expert_ids.reshape(-1)
  xs = jnp.repeat(x, expert_ids.shape[1], axis=0)                      # [N k, d]
  mm = lambda a, w: jnp.einsum("ad,adf->af", a, w[ids].astype(dt))
  y = mm(swiglu(mm(xs, gate), mm(xs, up)), down).reshape(expert_ids.shape + (-1,))
  return jnp.einsum("nkd,nk->nd", y, combine.astype(y.dtype))


def _dense(x, expert_ids, combine, gate, up, down):
  dt = x.dtype
  mm = lambda a, w, eq: jnp.einsum(eq, a, w.astype(dt))
  h = swiglu(mm(x, gate, "nd,edf->nef"), mm(x, up, "nd,edf->nef"))   # [N, E, f]
  y = mm(h, down, "nef,efd->ned")                                      # [N, E, d]
  weights = jnp.zeros(y.shape[:2], jnp.float32).at[
      jnp.arange(x.shape[0])[:, None], expert_ids].add(combine.astype(jnp.float32))
  return jnp.einsum("ne,ned->nd", weights.astype(dt), y)


def routed_experts(x, expert_ids, combine, gate, up, down, *, impl: str = "auto",
                   interpret: bool = False, fp8_storage: bool = False):
  """The routed-expert output [N, d] (see the module docstring for the math and impls).

  fp8_storage: keep the up-projection and SwiGLU inputs saved for the backward pass in
  FP8-E4M3 (blocked, ragged and capacity; the fused Pallas kernels save their own residuals, and
  gather / dense serve decoding and tests).
  """
  impl = auto_impl() if impl == "auto" else impl
  if impl == "blocked":
    return _blocked(x, expert_ids, combine, gate, up, down, fp8=fp8_storage)
  if impl == "ragged":
    return _ragged(x, expert_ids, combine, gate, up, down, fp8=fp8_storage)
  if impl == "tokamax":
    return _ragged(x, expert_ids, combine, gate, up, down, gmm_impl="tokamax", fp8=fp8_storage)
  if impl == "capacity":
    return _capacity(x, expert_ids, combine, gate, up, down, fp8=fp8_storage)
  if impl == "pallas_gpu":
    from k2jax.kernels import moe_gpu
    return moe_gpu.routed_experts(x, expert_ids, combine, gate, up, down, interpret=interpret)
  if impl == "gather":
    return _gather(x, expert_ids, combine, gate, up, down)
  if impl == "dense":
    return _dense(x, expert_ids, combine, gate, up, down)
  raise ValueError(f"routed_experts impl = {impl!r}: must be one of auto, {', '.join(IMPLS)}")
