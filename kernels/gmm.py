"""Grouped matmul for MoE experts: rows of x sorted by group, one weight matrix per group.

    y[r] = x[r] @ w[g(r)]     for rows r of group g; rows past sum(group_sizes) give 0

Fused variants (k2jax.kernels.moe_gpu) read rows through an index, or write them scaled to
token-order slots, inside the kernel:

    gather_grouped_matmul(x, w, group_sizes, row_ids)            y[r] = x[row_ids[r]] @ w[g(r)]
    grouped_matmul_combine(h, w, group_sizes, slot_ids, weights) y[slot_ids[r]] = weights[r] h[r] @ w[g(r)]

Implementations (same signature, same result):
  ragged_dot  `jax.lax.ragged_dot`: XLA's native grouped GEMM on GPU / TPU. XLA:CPU has no
              kernel for it and runs every group over every row (G times the work).
  blocked     pad each group to a multiple of `block` rows and loop over the used blocks,
              one [block, K] @ [K, N] matmul each (`block_matmul`): dropless, about half
              a block of padding per group, the block picked per shape
              (`blocked_block_size`); the CPU choice (routed_experts' `blocked` path, its
              CPU default, uses block_matmul directly).
  pallas_gpu  Triton kernels with the gather / combine fused (kernels/moe_gpu.py).
  megablox    the TPU grouped matmul shipped with jax (pallas.ops.tpu.megablox).
  tokamax     tokamax's ragged_dot, when the optional `tokamax` package is installed.
`auto` picks per backend; experiments/bench_moe.py measures the candidates (its results table
says which won where).
"""

import functools
import importlib

import jax
import jax.numpy as jnp

from k2jax.kernels import platform
from k2jax.kernels.pallas_utils import cotangent_for, varying_like
from k2jax.kernels.rows import take_rows

# TPU: XLA's ragged_dot, not megablox. The expert-parallel path runs the grouped matmul inside
# shard_map, where a pallas_call must declare how its outputs vary over the manual axes;
# jax's megablox does not, so it fails there (found by lowering the K2-shaped step for TPU
# on CPU, tests/test_parallel.py). Neither has been timed on a TPU: none is reachable.
AUTO = {"cpu": "blocked", "gpu": "pallas_gpu", "tpu": "ragged_dot"}


def _count_at_or_below(boundaries, n: int):
  """c[i] = #{b in boundaries : b <= i} for i < n (boundaries sorted, int).

  A scatter-add and a cumsum; jnp.searchsorted would do, but it has failed under
  shard_map's manual axes (and this is O(n + len(boundaries)))."""
  marks = jnp.zeros((n + 1,), jnp.int32).at[jnp.minimum(boundaries, n)].add(1)
  return jnp.cumsum(marks)[:n]


# Relative cost per row of block_matmul at each block size, measured on a 2-core CPU (fwd +
# bwd of one MoE layer; experiments/bench_moe.py "blocked block sweep"): a smaller block pads
# less but spends more per row (more loop steps, each reading its expert's weights).
_ROW_COST = {32: 1.5, 64: 1.25, 128: 1.0}


def blocked_block_size(rows: int, groups: int) -> int:
  """The block minimizing (rows + groups block / 2) x per-row cost: the expected padded rows
  (half a block per group; blocks past the last used one cost nothing) times the measured
  cost of a row at that block. 1024 tokens top-2, d = f = 256: 8 and 16 experts take 128,
  64 and 256 take 32."""
  return min(_ROW_COST, key=lambda b: ((rows + groups * b / 2) * _ROW_COST[b], -b))


@jax.custom_vjp
def block_matmul(xp, ws, block_group, used_blocks):
  """`ys[i][j] = xp[j] @ ws[i][block_group[j]]` for blocks j < used_blocks, 0 after.

  xp [B, b, K]; ws a tuple of [G, K, N_i] sharing the row blocks (an MoE's gate and up
  projections read xp once); block_group [B] int; used_blocks an int scalar. A loop over
  the used blocks that slices each block's weight in place: a batched matmul over weights
  gathered per block ([B, K, N] copies, saved again for the backward pass) ran slower on
  XLA:CPU, more so with more groups, and here padding past used_blocks costs nothing.
  The backward pass loops the same way:

      dxp[j] = sum_i dys_i[j] ws_i[g]^T,    dws_i[g] += xp[j]^T dys_i[j],   g = block_group[j]

  accumulating in float32 whatever the input dtype."""
  return _block_matmul_fwd(xp, ws, block_group, used_blocks)[0]


def _block_matmul_fwd(xp, ws, block_group, used_blocks):
  acc = jnp.promote_types(xp.dtype, jnp.float32)

  def body(j, ys):
    xj, g = xp[j], block_group[j]
    return tuple(y.at[j].set(jnp.dot(xj, w[g], preferred_element_type=acc).astype(y.dtype))
                 for y, w in zip(ys, ws))

  refs = (xp, *ws, block_group, used_blocks)
  ys = tuple(varying_like(jnp.zeros(xp.shape[:2] + w.shape[2:], xp.dtype), *refs) for w in ws)
  return jax.lax.fori_loop(0, used_blocks, body, ys), (xp, ws, block_group, used_blocks)


def _block_matmul_bwd(res, dys):
  xp, ws, block_group, used_blocks = res
  acc = jnp.promote_types(xp.dtype, jnp.float32)

  def body(j, carry):
    dxp, dws = carry
    xj, g = xp[j], block_group[j]
    dx = sum(jnp.dot(dy[j], w[g].T, preferred_element_type=acc) for dy, w in zip(dys, ws))
    dws = tuple(dw.at[g].add(jnp.dot(xj.T, dy[j], preferred_element_type=acc))
                for dw, dy in zip(dws, dys))
    return dxp.at[j].set(dx.astype(dxp.dtype)), dws

  refs = (xp, *ws, *dys, block_group, used_blocks)
  init = jax.tree.map(lambda a: varying_like(a, *refs),
                      (jnp.zeros_like(xp), tuple(jnp.zeros(w.shape, acc) for w in ws)))
  dxp, dws = jax.lax.fori_loop(0, used_blocks, body, init)
  return (cotangent_for(dxp, xp),
          tuple(cotangent_for(dw.astype(w.dtype), w) for dw, w in zip(dws, ws)), None, None)


block_matmul.defvjp(_block_matmul_fwd, _block_matmul_bwd)


def grouped_matmul_blocked(x, w, group_sizes, block: int | None = None,
                           interpret: bool = False):
  del interpret
  M, K = x.shape
  G = w.shape[0]
  block = block or blocked_block_size(M, G)
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
  block_group = jnp.minimum(_count_at_or_below(padded_end, rows)[::block], G - 1)
  (yp,) = block_matmul(xp.reshape(rows // block, block, K), (w,), block_group,
                       padded_end[-1] // block)
  y = yp.reshape(rows, -1)[jnp.minimum(dest, rows - 1)]
  return jnp.where(valid[:, None], y, jnp.zeros((), y.dtype))


def grouped_matmul_ragged_dot(x, w, group_sizes, interpret: bool = False):
  del interpret
  return jax.lax.ragged_dot(x, w, group_sizes.astype(jnp.int32))


def grouped_matmul_pallas_gpu(x, w, group_sizes, interpret: bool = False):
  from k2jax.kernels import moe_gpu
  return moe_gpu.grouped_matmul(x, w, group_sizes, interpret=interpret)


def _megablox():
  # The package re-exports a function named like its `gmm` module; ask for the module.
  return importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")


def _megablox_call(name: str, *args, **kwargs):
  """megablox.`name`(*args, **kwargs) traced with jax_enable_x64 off.

  Under x64 jax's megablox (make_group_metadata) counts its active row tiles with
  `group_tiles.sum()`, which promotes the int32 tile counts to int64, and that count is the
  pallas_call's dynamic grid size: XLA:TPU then refuses the kernel ("UNIMPLEMENTED: While
  rewriting computation to not contain X64 element types ... tpu_custom_call", forward and
  backward), and interpret mode's int64 grid indices meet tgmm's int32 metadata ("lax.sub
  requires arguments to have the same dtypes, got int64, int32"). Casting our group sizes
  cannot help (they are int32 already); every operand here is 32-bit, so tracing the call
  with x64 off changes nothing but that count's type."""
  with jax.enable_x64(False):
    return getattr(_megablox(), name)(*args, **kwargs)


def _megablox_tiling(M, K, N):
  tm = 128 if M >= 128 else 8
  return tm, (tm, min(K, 128), min(N, 128))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def grouped_matmul_megablox(x, w, group_sizes, interpret: bool = False):
  M, K = x.shape
  tm, tiling = _megablox_tiling(M, K, w.shape[2])
  Mp = -(-M // tm) * tm                      # megablox wants whole row tiles
  y = _megablox_call("gmm", jnp.pad(x, ((0, Mp - M), (0, 0))), w,
                     group_sizes.astype(jnp.int32), preferred_element_type=x.dtype,
                     tiling=tiling, interpret=interpret)[:M]
  valid = jnp.arange(M) < jnp.sum(group_sizes)
  return jnp.where(valid[:, None], y, jnp.zeros((), y.dtype))


def _megablox_fwd(x, w, group_sizes, interpret):
  return grouped_matmul_megablox(x, w, group_sizes, interpret), (x, w, group_sizes)


def _megablox_bwd(interpret, res, dy):
  """dx by gmm against w^T, dw by megablox's tgmm; empty groups' dw set to 0 explicitly."""
  x, w, gs = res
  M, K = x.shape
  tm, tiling = _megablox_tiling(M, K, w.shape[2])
  Mp = -(-M // tm) * tm
  valid = (jnp.arange(M) < jnp.sum(gs))[:, None]
  dyp = jnp.pad(jnp.where(valid, dy, 0).astype(x.dtype), ((0, Mp - M), (0, 0)))
  xp = jnp.pad(x, ((0, Mp - M), (0, 0)))
  gs = gs.astype(jnp.int32)
  dx = _megablox_call("gmm", dyp, w, gs, preferred_element_type=x.dtype, transpose_rhs=True,
                      tiling=_megablox_tiling(M, w.shape[2], K)[1], interpret=interpret)[:M]
  dw = _megablox_call("tgmm", xp.T, dyp, gs, preferred_element_type=w.dtype, tiling=tiling,
                      num_actual_groups=w.shape[0], interpret=interpret)
  return (jnp.where(valid, dx, 0), jnp.where((gs > 0)[:, None, None], dw, 0), None)


grouped_matmul_megablox.defvjp(_megablox_fwd, _megablox_bwd)


# tokamax's Mosaic GPU ragged dot takes its tiles from an autotuning cache keyed by exact
# shapes (group count and total rows included) and otherwise from heuristics (64 x 64 x 128,
# 2 stages on Hopper). TOKAMAX_TILES holds the tiles that won per device kind for the forward
# y = x w_g and the input gradient dx = dy w_g^T (measured at K2's expert shapes by
# experiments/bench_moe.py gpu_roles: experiments/results/moe/gpu_gmm_roles.csv). The weight
# gradient dw_g = x_g^T dy_g is ours on GPUs (moe_gpu.tgmm): tokamax's ragged-contracting
# Mosaic kernel returned wrong values there, for its own tiles and every tile set tried.
_H100_TILES = dict(block_m=128, block_n=64, block_k=128, num_stages=4, split_k=1,
                   persistent=True, grid_minor_dim="N", grid_tile_width=8)
TOKAMAX_TILES: dict = {"NVIDIA H100 80GB HBM3": {"fwd": _H100_TILES, "dlhs": _H100_TILES}}

_DIMS = {  # ragged_dot_general dimension numbers: (contracting, batch), lhs ragged, rhs group
    "fwd": ((([1], [1]), ([], [])), [0], [0]),
    "dlhs": ((([1], [2]), ([], [])), [0], [0]),
}


def _tokamax_role(a, b, group_sizes, role: str):
  """tokamax's ragged dot in `role`'s dimension numbers, with this device kind's tiles."""
  tk = platform.tokamax()
  dims, lhs_ragged, rhs_group = _DIMS[role]
  impl = None
  tiles = TOKAMAX_TILES.get(platform.gpu_kind() or "", {}).get(role)
  if tiles is not None:
    from tokamax._src.ops.ragged_dot import pallas_mosaic_gpu as mgpu  # pinned (pyproject)
    from tokamax._src.ops.ragged_dot.pallas_mosaic_gpu_common import Config, MatmulDimension
    kw = dict(tiles, grid_minor_dim=MatmulDimension[tiles["grid_minor_dim"]])
    impl = [mgpu.PallasMosaicGpuRaggedDot(config=Config(**kw))]
  return tk.ragged_dot_general(a, b, group_sizes, jax.lax.RaggedDotDimensionNumbers(
      dot_dimension_numbers=dims, lhs_ragged_dimensions=lhs_ragged,
      rhs_group_dimensions=rhs_group), implementation=impl)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def tokamax_ours_dw(x, w, group_sizes, interpret: bool = False):
  """tokamax for y and dx, ours for dw (moe_gpu's weight gradient: jax's Mosaic GPU kernel
  on Hopper, our Triton tgmm elsewhere; the GPU path of impl="tokamax")."""
  return _tokamax_role(x, w, group_sizes, "fwd")


def _tokamax_ours_dw_fwd(x, w, group_sizes, interpret):
  return _tokamax_role(x, w, group_sizes, "fwd"), (x, w, group_sizes)


def _tokamax_ours_dw_bwd(interpret, res, dy):
  from k2jax.kernels import moe_gpu
  x, w, group_sizes = res
  M, (G, K, N) = x.shape[0], w.shape
  dx = _tokamax_role(dy.astype(x.dtype), w, group_sizes, "dlhs")
  dx = jnp.where((jnp.arange(M) < jnp.sum(group_sizes))[:, None], dx, jnp.zeros((), dx.dtype))
  if moe_gpu.kernels_for("backward", w, x, dy.astype(x.dtype), interpret=interpret) == "mgpu":
    dw = moe_gpu._mgpu_tgmm(x, dy.astype(x.dtype), group_sizes).astype(w.dtype)  # Hopper
  else:
    tiles = moe_gpu.Tiles(group_sizes, M, moe_gpu._bm("tgmm", K, N))
    dw = moe_gpu.tgmm(moe_gpu._pad16(x, 1), moe_gpu._pad16(dy.astype(x.dtype), 1), tiles,
                      tiles.row, tiles.row, G, interpret=interpret, out_dtype=w.dtype)
  return (cotangent_for(dx.astype(x.dtype), x), cotangent_for(dw[:, :K, :N], w), None)


tokamax_ours_dw.defvjp(_tokamax_ours_dw_fwd, _tokamax_ours_dw_bwd)


@jax.custom_vjp
def tokamax_tpu(x, w, group_sizes):
  """tokamax's ragged dot on TPU (its Mosaic TPU kernels, forward and VJP), traced with
  jax_enable_x64 off. Under x64 its kernels mix int64 and int32 index arithmetic, which
  Pallas' Mosaic verifier refuses ("'arith.divsi' op requires the same type for all operands
  and results"). Its VJP is traced where jax.grad transposes, outside any
  context set around the forward call, so the backward is re-entered here under the same
  switch (its forward there is unused and dropped). Operands are bf16 / f32 / int32: x64
  off changes only the kernels' own index types."""
  with jax.enable_x64(False):
    return platform.tokamax().ragged_dot(x, w, group_sizes)


def _tokamax_tpu_fwd(x, w, group_sizes):
  return tokamax_tpu(x, w, group_sizes), (x, w, group_sizes)


def _tokamax_tpu_bwd(res, dy):
  x, w, group_sizes = res
  with jax.enable_x64(False):
    _, vjp = jax.vjp(lambda x, w: platform.tokamax().ragged_dot(x, w, group_sizes), x, w)
    dx, dw = vjp(dy)
  return dx, dw, None


tokamax_tpu.defvjp(_tokamax_tpu_fwd, _tokamax_tpu_bwd)


def grouped_matmul_tokamax(x, w, group_sizes, interpret: bool = False):
  """tokamax's ragged dot (its own VJP): on GPUs with our weight gradient, on TPU traced
  with x64 off (both above)."""
  gs = group_sizes.astype(jnp.int32)
  if platform.backend() == "gpu":
    return tokamax_ours_dw(x, w, gs, interpret)
  if platform.backend() == "tpu":
    return tokamax_tpu(x, w, gs)
  return platform.tokamax().ragged_dot(x, w, gs)


IMPLS = {"ragged_dot": grouped_matmul_ragged_dot, "blocked": grouped_matmul_blocked,
         "pallas_gpu": grouped_matmul_pallas_gpu, "megablox": grouped_matmul_megablox,
         "tokamax": grouped_matmul_tokamax}


def grouped_matmul(x, w, group_sizes, *, impl: str = "auto", interpret: bool = False):
  """x [M, K] (rows sorted by group), w [G, K, N], group_sizes [G] -> [M, N].

  Args:
    impl: "auto" | one of IMPLS.
    interpret: run a Pallas implementation in interpret mode (CPU tests).
  """
  if impl == "auto":
    impl = AUTO.get(platform.backend(), "ragged_dot")
  if impl not in IMPLS:
    raise ValueError(f"grouped_matmul impl = {impl!r}: must be one of auto, {', '.join(IMPLS)}")
  return IMPLS[impl](x, w, group_sizes, interpret=interpret)


def gather_grouped_matmul(x, w, group_sizes, row_ids, *, impl: str = "auto",
                          interpret: bool = False):
  """y[r] = x[row_ids[r]] @ w[g(r)]: the gate / up projection reading rows through the sort
  permutation. pallas_gpu fuses the gather into its loads; other impls gather first."""
  if impl == "auto":
    impl = AUTO.get(platform.backend(), "ragged_dot")
  if impl == "pallas_gpu":
    from k2jax.kernels import moe_gpu
    return moe_gpu.gather_grouped_matmul(x, w, group_sizes, row_ids, interpret)
  return grouped_matmul(take_rows(x, row_ids, x.shape[0]), w, group_sizes, impl=impl,
                        interpret=interpret)


def grouped_matmul_combine(h, w, group_sizes, slot_ids, weights, *, impl: str = "auto",
                           interpret: bool = False):
  """y[slot_ids[r]] = weights[r] * (h[r] @ w[g(r)]): the down projection written back in
  token order scaled by the combine weights (slot_ids a permutation of the rows).
  pallas_gpu fuses the scatter and the scaling into its stores; other impls compose."""
  if impl == "auto":
    impl = AUTO.get(platform.backend(), "ragged_dot")
  if impl == "pallas_gpu":
    from k2jax.kernels import moe_gpu
    return moe_gpu.grouped_matmul_combine(h, w, group_sizes, slot_ids, weights, interpret)
  y = grouped_matmul(h, w, group_sizes, impl=impl, interpret=interpret)
  y = y * weights.astype(y.dtype)[:, None]
  inverse = jnp.zeros_like(slot_ids).at[slot_ids].set(jnp.arange(slot_ids.shape[0],
                                                                 dtype=slot_ids.dtype))
  return take_rows(y, inverse, y.shape[0])
