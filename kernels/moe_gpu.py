"""MoE grouped matmuls as Triton-lowered Pallas kernels, with the dispatch fused into them.

Rows sorted by expert are cut into tiles of `bm` rows that never straddle two experts: each
expert's rows start a new tile (the static tile count bounds M / bm + E tiles), and the
(cheap, O(M)) tile metadata is built in XLA. Two kernels do all the work:

  gmm    out[dst[p]] = scale[p] * (lhs[src[p]] @ W[g(p)])    grid (tile, n block), K loop
         src / dst are per-row indices (-1 = no row): the gate / up projection reads its rows
         from x through the sort permutation (src = token of the row), the down projection
         writes its rows straight to their token-major slot (dst = assignment id) scaled by
         the combine weight, and the backward passes reuse the same kernel with W^T.
  tgmm   dW[g] = sum over g's rows of lhs[src_l]^T rhs[src_r]           grid (g, k, n block)

so x[order], the un-permute and the per-row scaling are never separate passes over memory.
The custom VJPs of `gather_grouped_matmul` and `grouped_matmul_combine` are built from them:

  h = gather_gmm(x, W):            dx = segment_sum(gmm(dh, W^T)),  dW = tgmm(x[src], dh)
  y = combine_gmm(h, W, s):        dh' = gmm(dy[dst], W^T),  ds = rowsum(dh' * h),
                                   dh = s dh',  dW = tgmm(s h, dy[dst])  (s h in XLA)

On Hopper the backward's products run on jax's own Mosaic GPU kernels instead (`MGPU`
below): the same formulas, with x[src] / dy[dst] gathered once in XLA.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from k2jax.kernels import platform
from k2jax.kernels.pallas_utils import cotangent_for, foreign_kernel, pallas_call
from k2jax.kernels.rows import swiglu, sort_assignments


def _tile_size(n: int, want: int) -> int:
  """The largest power of two <= want dividing n (Triton tiles are powers of two)."""
  t = want
  while t > 16 and n % t:
    t //= 2
  if n % t:
    raise ValueError(f"grouped matmul pallas_gpu: dimension {n} must be a multiple of 16")
  return t


class Tiles:
  """Tile layout of M rows grouped by `group_sizes` into bm-row tiles (see the module doc)."""

  def __init__(self, group_sizes, M: int, bm: int):
    G = group_sizes.shape[0]
    gs = group_sizes.astype(jnp.int32)
    padded = (gs + bm - 1) // bm * bm
    pend = jnp.cumsum(padded)
    pstart = pend - padded
    start = jnp.cumsum(gs) - gs
    self.num_tiles = -(-(M + G * (bm - 1)) // bm)
    rows = self.num_tiles * bm
    marks = jnp.zeros((rows + 1,), jnp.int32).at[jnp.minimum(pend, rows)].add(1)
    p = jnp.arange(rows, dtype=jnp.int32)
    g = jnp.minimum(jnp.cumsum(marks)[:rows], G - 1)          # group of each padded row
    off = p - pstart[g]
    self.row = jnp.where(off < gs[g], start[g] + off, -1)     # sorted row of each padded row
    self.group = g[::bm]                                      # group of each tile
    self.tile_lo, self.tile_hi = pstart // bm, pend // bm     # each group's tiles
    self.bm = bm

  def at(self, index):
    """index[sorted row] per padded row (-1 where there is none)."""
    return jnp.where(self.row >= 0, index[jnp.maximum(self.row, 0)], -1)


def _full(shape):
  return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def _cost(rows: int, K: int, N: int, a, b, out_dtype):
  """What one kernel call does with every padded row real: XLA's scheduler reads it, and so
  does k2jax.parallel.bwsplit when it weighs a backward's two halves."""
  return pl.CostEstimate(flops=2 * rows * K * N, transcendentals=0,
                         bytes_accessed=a.size * a.dtype.itemsize + b.size * b.dtype.itemsize
                         + rows * N * jnp.dtype(out_dtype).itemsize)


def _dot(a, b):
  return plgpu.dot(a, b, allow_tf32=a.dtype != jnp.float32)


def _rows(ref, idx, start, width):
  """ref[idx[i], start + j] as [len(idx), width] with both indices arrays: the row gather
  Triton turns into pointer arithmetic (and interpret mode supports)."""
  return ref.at[jnp.maximum(idx, 0)[:, None], (start + jnp.arange(width))[None, :]]


def _gmm_kernel(group_ref, src_ref, dst_ref, scale_ref, lhs_ref, w_ref, out_ref, *, bm, bn, bk,
                K, transpose_w, out_rows):
  t, j = pl.program_id(0), pl.program_id(1)
  g = group_ref[t]
  rows = pl.ds(t * bm, bm)
  src, dst = src_ref[rows], dst_ref[rows]
  cols = pl.ds(j * bn, bn)

  def body(kk, acc):
    ks = pl.ds(kk * bk, bk)
    a = plgpu.load(_rows(lhs_ref, src, kk * bk, bk), mask=(src >= 0)[:, None], other=0.0)
    if transpose_w:
      b = w_ref[g, cols, ks].T
    else:
      b = w_ref[g, ks, cols]
    return acc + _dot(a.astype(b.dtype), b)

  acc = jax.lax.fori_loop(0, K // bk, body, jnp.zeros((bm, bn), jnp.float32))
  acc = acc * scale_ref[rows][:, None]
  plgpu.store(_rows(out_ref, dst, j * bn, bn), acc.astype(out_ref.dtype),
              mask=(dst < out_rows)[:, None])


def gmm(lhs, w, tiles: Tiles, src, dst, out_rows: int, *, scale=None, transpose_w=False,
        interpret=False, out_dtype=None):
  """out[dst[p]] = scale[p] * (lhs[src[p]] @ w[g(p)]) for every padded row p (see above)."""
  K, N = (w.shape[2], w.shape[1]) if transpose_w else (w.shape[1], w.shape[2])
  _, bn, bk, warps, stages = tiles_for("gmm", K, N)
  bm, bn, bk = tiles.bm, _tile_size(N, bn), _tile_size(K, bk)
  scale = jnp.ones(src.shape, jnp.float32) if scale is None else scale.astype(jnp.float32)
  # Rows with no destination go to one extra row that is dropped: a masked store suffices on
  # a GPU, but interpret mode writes masked lanes back, and duplicates would race.
  dst = jnp.where(dst >= 0, dst, out_rows).astype(jnp.int32)
  meta = (tiles.group, src.astype(jnp.int32), dst, scale)
  kernel = functools.partial(_gmm_kernel, bm=bm, bn=bn, bk=bk, K=K, transpose_w=transpose_w,
                             out_rows=out_rows)
  out = pallas_call(
      kernel, grid=(tiles.num_tiles, N // bn),
      in_specs=[_full(a.shape) for a in (*meta, lhs, w)],
      out_specs=_full((out_rows + 1, N)),
      out_shape=jax.ShapeDtypeStruct((out_rows + 1, N), out_dtype or lhs.dtype),
      compiler_params=None if interpret else plgpu.CompilerParams(num_warps=warps,
                                                                  num_stages=stages),
      cost_estimate=_cost(src.shape[0], K, N, lhs, w, out_dtype or lhs.dtype),
      interpret=interpret, name="moe_gmm")(*meta, lhs, w)
  return out[:out_rows]


def _tgmm_kernel(lo_ref, hi_ref, src_l_ref, src_r_ref, lhs_ref, rhs_ref, out_ref, *, bm, bk,
                 bn):
  g, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)

  # Both tiles go from the loads straight into the dot: an elementwise op in between (the
  # combine weight's scaling once sat here) makes Triton stage the tile through registers
  # instead of its asynchronous copy pipeline. Callers scale lhs beforehand.
  def body(t, acc):
    rows = pl.ds(t * bm, bm)
    sl, sr = src_l_ref[rows], src_r_ref[rows]
    a = plgpu.load(_rows(lhs_ref, sl, i * bk, bk), mask=(sl >= 0)[:, None], other=0.0)
    b = plgpu.load(_rows(rhs_ref, sr, j * bn, bn), mask=(sr >= 0)[:, None], other=0.0)
    return acc + _dot(a.T, b)

  acc = jax.lax.fori_loop(lo_ref[g], hi_ref[g], body, jnp.zeros((bk, bn), jnp.float32))
  out_ref[g, pl.ds(i * bk, bk), pl.ds(j * bn, bn)] = acc.astype(out_ref.dtype)


def tgmm(lhs, rhs, tiles: Tiles, src_l, src_r, num_groups: int, *, interpret=False,
         out_dtype=None):
  """dW[g] = sum over g's padded rows p of lhs[src_l[p]]^T rhs[src_r[p]] (lhs, rhs of one
  dtype). `tiles` is laid out with the tgmm row tile (`Tiles(sizes, M, _bm("tgmm", K, N))`):
  its rows are the reduction, cut independently of gmm's output rows."""
  K, N = lhs.shape[1], rhs.shape[1]
  _, bk, bn, warps, stages = tiles_for("tgmm", K, N)
  bm, bk, bn = tiles.bm, _tile_size(K, bk), _tile_size(N, bn)
  meta = (tiles.tile_lo.astype(jnp.int32), tiles.tile_hi.astype(jnp.int32),
          src_l.astype(jnp.int32), src_r.astype(jnp.int32))
  kernel = functools.partial(_tgmm_kernel, bm=bm, bk=bk, bn=bn)
  return pallas_call(
      kernel, grid=(num_groups, K // bk, N // bn),
      in_specs=[_full(a.shape) for a in (*meta, lhs, rhs)],
      out_specs=_full((num_groups, K, N)),
      out_shape=jax.ShapeDtypeStruct((num_groups, K, N), out_dtype or rhs.dtype),
      compiler_params=None if interpret else plgpu.CompilerParams(num_warps=warps,
                                                                  num_stages=stages),
      cost_estimate=_cost(src_l.shape[0], K, N, lhs, rhs, out_dtype or rhs.dtype),
      interpret=interpret, name="moe_tgmm")(*meta, lhs, rhs)


# (rows per tile bm, then the two other tile dims, num_warps, num_stages) per kernel. gmm's
# row tile lays out its output rows (forward and input gradients); tgmm's, the rows it sums
# over (weight gradients). Measured on one H200 by experiments/gpu_check.py's `tune` sweep at
# the bench model's and K2's expert shapes (experiments/results/moe/gpu_moe_tune.csv); gmm's
# 64-row tile trades a little at K2's shapes for much more at the smaller ones.
TUNING = {"gmm": (64, 256, 64, 8, 4), "tgmm": (64, 128, 128, 4, 3)}

# Entries that replace TUNING's for expert matrices of at least so many elements (K N of one
# expert's weight, the same for every product of a layer: up, down, input and weight
# gradients); the largest that applies wins. Between measured sizes the smaller one's
# entry holds (unmeasured). Measured by the same sweep on one H200 at K2's share of one device
# on its 16-way expert-parallel layout (bench_moe.TUNE_SHAPES "k2_ep16":
# experiments/results/moe/gpu_moe_tune_k2_ep16.csv); for tgmm TUNING's tiles stay fastest.
TUNING_BY_SIZE = {7168 * 2048: {"gmm": (128, 256, 64, 8, 3)}}


def tiles_for(kernel: str, K: int, N: int):
  """The tiles of `kernel` ("gmm" | "tgmm") for expert matrices of K x N elements."""
  pick = TUNING[kernel]
  for size in sorted(TUNING_BY_SIZE):
    if K * N >= size and kernel in TUNING_BY_SIZE[size]:
      pick = TUNING_BY_SIZE[size][kernel]
  return pick


def _bm(kernel: str, K: int, N: int):
  return tiles_for(kernel, K, N)[0]


# ------------------------------------------ the backward on Hopper: jax's Mosaic GPU kernels

# jax ships Mosaic GPU ragged dots for Hopper (jax.experimental.pallas.ops.gpu:
# ragged_dot_mgpu, transposed_ragged_dot_mgpu): wgmma fed by TMA pipelines, one persistent
# block per SM walking the output tiles. TMA cannot gather rows, so the backward makes its
# one permuted operand contiguous with an XLA gather (x[rows] once for the gate and up
# weight gradients, which gather_grouped_matmul takes together; dy[slots] for both products
# of the down projection) and runs the products on jax's kernels. The forward keeps the Triton kernels
# above: there the fused gather / combine saves a pass over the rows.
#
# Per GPU compute capability (major): each kernel's (block_m, block_n, block_k,
# max_concurrent_steps, grid_block_n); a GPU without an entry runs the Triton kernels.
# Measured on an H100 and an H200 at K2's share of one device on its 16-way expert-parallel
# layout: each product alone (gpu_check.py --only wgrad: experiments/results/moe/
# gpu_wgrad_k2_ep16_h200.csv) and the layer's forward + backward (--only moe_bwd:
# gpu_moe_backward_*.csv, every gradient checked against float32 XLA), where jax's kernels
# beat the Triton ones, gather included.
# jax's kernels carry no cost estimate, so k2jax.parallel.bwsplit counts their FLOPs as 0
# when a pipeline's backward is split on a Hopper GPU (plan and CPU traces see the Triton
# kernels' estimates).
MGPU = {9: {"roles": ("backward",),
            "gmm": (128, 128, 64, 6, 4), "tgmm": (128, 128, 64, 4, 4)}}
# "roles": which products run there. "backward": every product of the backward pass.
# "combine": the forward's down projection on sorted rows, then scaled by the combine weights
# and scattered to token order in XLA (the Triton kernel does both in its store); jax's
# kernel alone runs it faster than ours but the pair is unmeasured, so no entry lists it yet
# (gpu_check.py --only moe_bwd times it: FORCE below).
# Measured at 24 and 32 experts per device; jax's forward kernel unrolls a loop over the
# groups in every output tile, so far more (K2's 384 on one device) stay on Triton.
MGPU_MAX_GROUPS = 64
# role -> "triton" | "mgpu", overriding the table (benchmarks, lowering tests).
FORCE: dict = {}


def _mgpu_ops():
  """(ragged_dot, transposed_ragged_dot) from jax's Mosaic GPU ops; None without them."""
  try:
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu
  except ImportError:
    return None
  return ragged_dot_mgpu.ragged_dot, transposed_ragged_dot_mgpu.transposed_ragged_dot


def _mgpu_config(kernel: str):
  cc = platform.gpu_capability()
  return MGPU.get(cc[0] if cc else 9, MGPU[9])[kernel]


def kernels_for(role: str, w, *operands, interpret=False) -> str:
  """Which kernels run `role` ("backward" | "combine", see MGPU) of a grouped matmul with
  weights w [G, K, N]: "mgpu" (jax's) on a GPU whose MGPU entry lists the role, with bf16 /
  f16 operands of one dtype, at most MGPU_MAX_GROUPS groups and K, N that the configs' tiles
  divide; else "triton"."""
  if role in FORCE:
    return FORCE[role]
  if interpret:
    return "triton"
  cc = platform.gpu_capability()
  G, K, N = w.shape
  dtypes = {jnp.dtype(a.dtype) for a in (w, *operands)}
  if (cc is None or role not in MGPU.get(cc[0], {}).get("roles", ()) or G > MGPU_MAX_GROUPS
      or len(dtypes) > 1 or dtypes.pop() not in (jnp.bfloat16, jnp.float16)
      or _mgpu_ops() is None):
    return "triton"
  tm, tn = _mgpu_config("tgmm")[:2]         # dW [G, K, N] in tm x tn tiles
  _, gn, gk, _, _ = _mgpu_config("gmm")     # dx = dy W^T: N contracted, K out (and y = h W)
  return "mgpu" if K % tm == 0 and N % tn == 0 and N % gk == 0 and K % gn == 0 else "triton"


def _mgpu_gmm(a, w, group_sizes, *, transpose_w=False):
  """a[r] @ w[g(r)] (w[g(r)]^T) for rows sorted by group, on jax's Mosaic GPU ragged_dot.
  Rows past the groups are left unwritten: callers mask them."""
  ragged_dot, _ = _mgpu_ops()
  bm, bn, bk, steps, gbn = _mgpu_config("gmm")
  n = w.shape[1] if transpose_w else w.shape[2]
  while (n // bn) % gbn:        # its output-tile walk takes column strips of gbn tiles
    gbn //= 2
  return foreign_kernel(functools.partial(
      ragged_dot, block_m=bm, block_n=bn, block_k=bk, max_concurrent_steps=steps,
      grid_block_n=gbn, transpose_rhs=transpose_w), a, w, group_sizes=group_sizes)


def _mgpu_tgmm(a, b, group_sizes):
  """dW[g] = a_g^T b_g over the (contiguous, sorted) rows of each group g, on jax's Mosaic
  GPU transposed_ragged_dot: [G, a.shape[1], b.shape[1]] in a's dtype."""
  _, transposed = _mgpu_ops()
  bm, bn, bk, steps, gbn = _mgpu_config("tgmm")
  return foreign_kernel(functools.partial(
      transposed, block_m=bm, block_n=bn, block_k=bk, max_concurrent_steps=steps,
      grid_block_n=gbn), a, b, group_sizes=group_sizes)


# ------------------------------------------------------------------ gather_grouped_matmul


def _pad16(a, *axes):
  """`a` zero-padded along `axes` to multiples of 16, Triton's smallest matmul tile. Zero
  columns of x / h meet zero rows of w, so the product is unchanged; pad's VJP drops the
  padding's gradients."""
  widths = [(0, -a.shape[d] % 16 if d in axes else 0) for d in range(a.ndim)]
  return jnp.pad(a, widths) if any(p for _, p in widths) else a


def gather_grouped_matmul(x, w, group_sizes, row_ids, interpret=False):
  """h[r] = x[row_ids[r]] @ w[g(r)] for rows r sorted by group (rows past the groups: 0).
  w: one [G, K, N], or a tuple of them read through the same rows (a layer's gate and up
  projections), giving a tuple of h's: their backward then gathers x's rows and sums the
  input gradients once for all of them. Any K and N: widths that are not multiples of 16
  are zero-padded for the kernel."""
  ws = w if isinstance(w, tuple) else (w,)
  hs = _gather_grouped_matmul(_pad16(x, 1), tuple(_pad16(v, 1, 2) for v in ws), group_sizes,
                              row_ids, interpret)
  hs = tuple(h[:, :v.shape[2]] for h, v in zip(hs, ws))
  return hs if isinstance(w, tuple) else hs[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _gather_grouped_matmul(x, ws, group_sizes, row_ids, interpret=False):
  return _gather_fwd(x, ws, group_sizes, row_ids, interpret)[0]


def _gather_fwd(x, ws, group_sizes, row_ids, interpret):
  M = row_ids.shape[0]
  valid = (jnp.arange(M) < jnp.sum(group_sizes))[:, None]
  hs = []
  for w in ws:
    tiles = Tiles(group_sizes, M, _bm("gmm", *w.shape[1:]))
    h = gmm(x, w, tiles, tiles.at(row_ids), tiles.row, M, interpret=interpret)
    hs.append(jnp.where(valid, h, jnp.zeros((), h.dtype)))
  return tuple(hs), (x, ws, group_sizes, row_ids)


def _gather_bwd(interpret, res, dhs):
  x, ws, group_sizes, row_ids = res
  M = row_ids.shape[0]
  dxs, dws = 0.0, []
  if all(kernels_for("backward", w, x, dh, interpret=interpret) == "mgpu"
         for w, dh in zip(ws, dhs)):
    xs = x[row_ids]                  # x's rows made contiguous, once for every w
    for w, dh in zip(ws, dhs):
      dxs = dxs + _mgpu_gmm(dh, w, group_sizes, transpose_w=True).astype(jnp.float32)
      dws.append(_mgpu_tgmm(xs, dh, group_sizes).astype(w.dtype))
  else:
    for w, dh in zip(ws, dhs):
      tiles = Tiles(group_sizes, M, _bm("gmm", *w.shape[1:]))
      dxs = dxs + gmm(dh, w, tiles, tiles.row, tiles.row, M, transpose_w=True,
                      interpret=interpret, out_dtype=jnp.float32)
      tt = Tiles(group_sizes, M, _bm("tgmm", *w.shape[1:]))
      dws.append(tgmm(x, dh, tt, tt.at(row_ids), tt.row, w.shape[0], interpret=interpret,
                      out_dtype=w.dtype))
  valid = jnp.arange(M) < jnp.sum(group_sizes)
  dx = jax.ops.segment_sum(jnp.where(valid[:, None], dxs, 0.0),   # one pass for every w
                           jnp.where(valid, row_ids, 0), x.shape[0]).astype(x.dtype)
  return (cotangent_for(dx, x), tuple(cotangent_for(dw, w) for dw, w in zip(dws, ws)), None,
          None)


_gather_grouped_matmul.defvjp(_gather_fwd, _gather_bwd)


# ----------------------------------------------------------------- grouped_matmul_combine


def grouped_matmul_combine(h, w, group_sizes, slot_ids, weights, interpret=False):
  """y[slot_ids[r]] = weights[r] * (h[r] @ w[g(r)]): [M, N] with slot_ids a permutation of
  the M rows (the down projection written back in token-major assignment order). Any K and
  N, zero-padded to multiples of 16 for the kernel."""
  y = _grouped_matmul_combine(_pad16(h, 1), _pad16(w, 1, 2), group_sizes, slot_ids, weights,
                              interpret)
  return y[:, :w.shape[2]]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _grouped_matmul_combine(h, w, group_sizes, slot_ids, weights, interpret=False):
  return _combine_fwd(h, w, group_sizes, slot_ids, weights, interpret)[0]


def _combine_fwd(h, w, group_sizes, slot_ids, weights, interpret):
  M = h.shape[0]
  if kernels_for("combine", w, h, interpret=interpret) == "mgpu":
    z = _mgpu_gmm(h, w, group_sizes).astype(jnp.float32)      # sorted rows
    valid = (jnp.arange(M) < jnp.sum(group_sizes))[:, None]
    z = jnp.where(valid, z * weights.astype(jnp.float32)[:, None], 0.0).astype(h.dtype)
    y = jnp.zeros((M, w.shape[2]), h.dtype).at[slot_ids].set(z, unique_indices=True)
  else:
    tiles = Tiles(group_sizes, M, _bm("gmm", *w.shape[1:]))
    y = gmm(h, w, tiles, tiles.row, tiles.at(slot_ids), M, scale=_at_values(tiles, weights),
            interpret=interpret)
  return y, (h, w, group_sizes, slot_ids, weights)


def _at_values(tiles: Tiles, values):
  return jnp.where(tiles.row >= 0, values[jnp.maximum(tiles.row, 0)], 0.0)


def _combine_bwd(interpret, res, dy):
  h, w, group_sizes, slot_ids, weights = res
  M = h.shape[0]
  mgpu = kernels_for("backward", w, h, dy, interpret=interpret) == "mgpu"
  if mgpu:
    dy = dy[slot_ids]     # dy's rows in sorted order, contiguous: read by both products
    dh_unscaled = _mgpu_gmm(dy, w, group_sizes, transpose_w=True).astype(jnp.float32)
  else:
    tiles = Tiles(group_sizes, M, _bm("gmm", *w.shape[1:]))
    dh_unscaled = gmm(dy, w, tiles, tiles.at(slot_ids), tiles.row, M, transpose_w=True,
                      interpret=interpret, out_dtype=jnp.float32)
  valid = (jnp.arange(M) < jnp.sum(group_sizes))[:, None]
  dh_unscaled = jnp.where(valid, dh_unscaled, 0.0)
  dweights = jnp.sum(dh_unscaled * h.astype(jnp.float32), -1).astype(weights.dtype)
  dh = (dh_unscaled * weights.astype(jnp.float32)[:, None]).astype(h.dtype)
  # dW = sum_r (s_r h_r)^T dy[slot_r]: h's rows scaled here, one elementwise pass in XLA,
  # rounded as the product in f32 then dy's dtype (the dot's operand dtype)
  hs = (h.astype(jnp.float32) * weights.astype(jnp.float32)[:, None]).astype(dy.dtype)
  if mgpu:
    dw = _mgpu_tgmm(hs, dy, group_sizes).astype(w.dtype)
  else:
    tt = Tiles(group_sizes, M, _bm("tgmm", *w.shape[1:]))
    dw = tgmm(hs, dy, tt, tt.row, tt.at(slot_ids), w.shape[0],
              interpret=interpret, out_dtype=w.dtype)
  return (cotangent_for(dh, h), cotangent_for(dw, w), None, None,
          cotangent_for(dweights, weights))


_grouped_matmul_combine.defvjp(_combine_fwd, _combine_bwd)


def grouped_matmul(x, w, group_sizes, *, interpret=False):
  """Plain grouped matmul over rows already sorted by group (rows past the groups: 0)."""
  return gather_grouped_matmul(x, w, group_sizes, jnp.arange(x.shape[0], dtype=jnp.int32),
                               interpret)


def routed_experts(x, expert_ids, combine, gate, up, down, *, interpret=False):
  """k2jax.kernels.routed_experts(impl="pallas_gpu"): fused dispatch and combine."""
  N, k = expert_ids.shape
  order, sizes, _ = sort_assignments(expert_ids, gate.shape[0])
  dt = x.dtype
  rows = order // k
  g, u = gather_grouped_matmul(x, (gate.astype(dt), up.astype(dt)), sizes, rows, interpret)
  y = grouped_matmul_combine(swiglu(g, u), down.astype(dt), sizes, order,
                             combine.reshape(-1)[order].astype(jnp.float32), interpret)
  return y.reshape(N, k, -1).sum(1)
