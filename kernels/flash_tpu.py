"""Flash attention for MLA shapes as Mosaic (TPU) Pallas kernels, with per-head S_max.

TPU Pallas pipelines HBM <-> VMEM over a grid whose last axis may be a reduction: each kernel
keeps its running state in VMEM scratch across that axis and writes its outputs on the last
step. Arrays are head-major [B, H, T, D] so every block's last two dims are (rows, D) (TPU
tiles are (8, 128)). A per-query vector (log-sum-exp, running max, delta) lives in HBM as
a [B, H, 1, T] row: as a [B, H, T, 1] column each value pads to 128 lanes, in HBM and in
every copy (a (128, 1) block is 64 KB, more than a step's q block). Inside a kernel the
online softmax keeps them as [bq, 1] columns (a row reduction of [bq, bk] scores gives
one); `_to_row` / `_to_col` turn one into the other once per q block.

  forward   grid (b, h, q block, kv block): online softmax over the kv axis; writes out,
            log-sum-exp and the final running max (S_max per row, reduced outside).
  dk, dv    grid (b, h, kv block, q block): accumulates dk, dv over the q axis, on the
            transposed scores k q^T so lse and delta broadcast as rows.
  dq        grid (b, h, q block, kv block): accumulates dq over the kv axis; lse and delta
            become columns once per q block.

Fully masked block pairs are skipped with `pl.when`: above the causal diagonal, and pairs
whose segment-id ranges (`_key`) are disjoint (different documents of a packed row). Their
blocks are not copied either: each kernel's inner (reduction) axis is clamped into the band
of blocks that run with the outer block (`_band`), which the index maps read from SMEM.

Query blocks need not be the keys' blocks: each q block's first place in the key sequence
comes from SMEM too (`q_first`, consecutive rows within a block), so one device's blocks of
a context-parallel sequence (k2jax.model.context) run against the whole sequence's keys
(`attention_blocks`); self-attention is q_first = arange(n_q) bq.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from k2jax.kernels import flash_common
from k2jax.kernels.pallas_utils import pallas_call

NEG_INF = float("-inf")


def _qkT(a, b):
  """a @ b^T in f32 (HIGHEST precision for f32 operands, so S_max matches the reference)."""
  prec = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
  return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=prec,
                             preferred_element_type=jnp.float32)


def _mm(a, b, contract_a=1):
  prec = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
  return jax.lax.dot_general(a, b, (((contract_a,), (0,)), ((), ())), precision=prec,
                             preferred_element_type=jnp.float32)


def _eye(n):
  return jax.lax.broadcasted_iota(jnp.int32, (n, n), 0) == jax.lax.broadcasted_iota(
      jnp.int32, (n, n), 1)


def _to_row(col):
  """[n, 1] -> [1, n], exactly (a masked sum: one value and zeros; -inf stays -inf), with
  broadcasts and a sublane reduction, which Mosaic lowers at any n (a transpose of an
  unaligned [n, 1] it may not)."""
  return jnp.sum(jnp.where(_eye(col.shape[0]), col, 0.0), axis=0, keepdims=True)


def _to_col(row):
  """[1, n] -> [n, 1], as `_to_row`."""
  return jnp.sum(jnp.where(_eye(row.shape[1]), row, 0.0), axis=1, keepdims=True)


def _run_pair(q0, kj, bq, bk, ranges, causal):
  """Whether the pair of the q block whose first row sits at place q0 and kv block kj may
  hold a valid pair: the ranges of its q and kv blocks' segment keys (`_key`) overlap (min
  k <= max q and min q <= max k) and, causal, some kv position kj bk + a <= q0 + b (a, b in
  the block) exists, i.e. kj bk <= q0 + bq - 1. On every pair at once (`_band`, arrays) or
  on one inside a kernel."""
  min_q, max_q, min_k, max_k = ranges
  run = (max_k >= min_q) & (min_k <= max_q)
  if causal:
    run = run & (kj * bk <= q0 + bq - 1)
  return run


def _key(seg):
  """Segment ids as the keys whose [min, max] ranges `_run_pair` compares: ids > 0 as they
  are, padding (0) and block padding (flash_common.PAD_SEGMENT) above every document.

  Any key is sound (blocks that share an id share its key, so their ranges overlap); a row
  whose keys never decrease makes the test exact (two blocks' ranges then overlap only at a
  key both hold). A packed row, documents 1, 2, .. then padding then block padding, is one;
  on the raw ids the block that ends the last document and starts the padding spans [0, n]
  and overlaps every block of the row. Ids >= 2^31 - 2 share a key with padding: still
  sound (the masks compare the ids themselves)."""
  # int32 constants: two Python ints would make the inner `where` int64 under x64, inside
  # the kernels too, and Mosaic has no 64-bit vectors (XLA:TPU aborts the compile: "Check
  # failed: ... bitwidth_ <= 32" in its layout pass)
  top = jnp.int32(jnp.iinfo(jnp.int32).max)
  return jnp.where(seg > 0, seg, jnp.where(seg == 0, top - 1, top))


def _ranges(seg_q, seg_k):
  """(min q, max q, min k, max k) of a step's segment-id blocks' keys, for `_run_pair`."""
  kq, kk = _key(seg_q), _key(seg_k)
  return jnp.min(kq), jnp.max(kq), jnp.min(kk), jnp.max(kk)


def _in_band(lo_ref, hi_ref, flat, i):
  """Whether the inner block index i is inside its band, [lo, hi] at `flat` = b n + outer:
  outside it every block was fetched at the clamped index (`_band`), not at i, so the step
  must not run (a pair can only run inside the band, which holds every pair that may)."""
  return (lo_ref[flat] <= i) & (i <= hi_ref[flat])


def _scores(q, k, scale, seg_q, seg_k, q0, kj, bq, bk, causal, kv_rows=False):
  """The block pair's scaled logits, masked: [bq, bk] (seg_q a [bq, 1] column, seg_k a
  [1, bk] row), or transposed, [bk, bq] = k q^T, with kv_rows (seg_k the column, seg_q the
  row): then per-query vectors broadcast as [1, bq] rows, lane-major."""
  s = (_qkT(k, q) if kv_rows else _qkT(q, k)) * scale
  valid = seg_q == seg_k
  if causal:
    shape, (q_axis, k_axis) = ((bk, bq), (1, 0)) if kv_rows else ((bq, bk), (0, 1))
    qpos = q0 + jax.lax.broadcasted_iota(jnp.int32, shape, q_axis)
    kpos = kj * bk + jax.lax.broadcasted_iota(jnp.int32, shape, k_axis)
    valid = valid & (qpos >= kpos)
  return jnp.where(valid, s, NEG_INF)


def _fwd_kernel(lo_ref, hi_ref, qf_ref, q_ref, k_ref, v_ref, sq_ref, sk_ref, o_ref, lse_ref,
                m_ref, m_sc, l_sc, acc_sc, *, scale, causal, bq, bk):
  b, qi, kj = pl.program_id(0), pl.program_id(2), pl.program_id(3)
  q0 = qf_ref[qi]

  @pl.when(kj == 0)
  def _():
    m_sc[...] = jnp.full(m_sc.shape, NEG_INF, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

  seg_q, seg_k = sq_ref[...], sk_ref[...]
  in_band = _in_band(lo_ref, hi_ref, b * pl.num_programs(2) + qi, kj)

  @pl.when(in_band & _run_pair(q0, kj, bq, bk, _ranges(seg_q, seg_k), causal))
  def _():
    s = _scores(q_ref[...], k_ref[...], scale, seg_q, seg_k, q0, kj, bq, bk, causal)
    m = m_sc[...]
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    safe = jnp.where(m_new == NEG_INF, 0.0, m_new)
    p = jnp.exp(s - safe)
    corr = jnp.exp(m - safe)
    v = v_ref[...]
    l_sc[...] = l_sc[...] * corr + jnp.sum(p, axis=1, keepdims=True)
    acc_sc[...] = acc_sc[...] * corr + _mm(p.astype(v.dtype), v)
    m_sc[...] = m_new

  @pl.when(kj == pl.num_programs(3) - 1)
  def _():
    l = l_sc[...]
    l_safe = jnp.where(l == 0, 1.0, l)
    o_ref[...] = (acc_sc[...] / l_safe).astype(o_ref.dtype)
    # a row with no valid key (a padded query row of `attention_blocks`) gets +inf, so the
    # backward's exp(s - lse) is 0, not NaN
    lse_ref[...] = _to_row(jnp.where(l == 0, jnp.inf, m_sc[...] + jnp.log(l_safe)))
    m_ref[...] = _to_row(m_sc[...])


def _dkdv_kernel(lo_ref, hi_ref, qf_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, sq_ref,
                 sk_ref, dk_ref, dv_ref, dk_sc, dv_sc, *, scale, causal, bq, bk):
  b, kj, qi = pl.program_id(0), pl.program_id(2), pl.program_id(3)
  q0 = qf_ref[qi]

  @pl.when(qi == 0)
  def _():
    dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
    dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

  seg_q, seg_k = sq_ref[...], sk_ref[...]                     # [1, bq] row, [bk, 1] column
  in_band = _in_band(lo_ref, hi_ref, b * pl.num_programs(2) + kj, qi)

  @pl.when(in_band & _run_pair(q0, kj, bq, bk, _ranges(seg_q, seg_k), causal))
  def _():
    # Transposed (k q^T): lse and delta, which change every inner step, arrive as [1, bq]
    # rows, and both products are plain matmuls (p^T do, ds^T q without a transpose).
    q, do = q_ref[...], do_ref[...]
    st = _scores(q, k_ref[...], scale, seg_q, seg_k, q0, kj, bq, bk, causal, kv_rows=True)
    pt = jnp.exp(st - lse_ref[...])                                    # [bk, bq]
    dv_sc[...] += _mm(pt.astype(do.dtype), do)                         # p^T do
    dst = pt * (_qkT(v_ref[...], do) - delta_ref[...])                 # (do v^T)^T
    dk_sc[...] += _mm(dst.astype(q.dtype), q)                          # ds^T q

  @pl.when(qi == pl.num_programs(3) - 1)
  def _():
    dk_ref[...] = (dk_sc[...] * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


def _dq_kernel(lo_ref, hi_ref, qf_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, sq_ref,
               sk_ref, dq_ref, dq_sc, lse_sc, delta_sc, *, scale, causal, bq, bk):
  b, qi, kj = pl.program_id(0), pl.program_id(2), pl.program_id(3)
  q0 = qf_ref[qi]

  @pl.when(kj == 0)
  def _():
    dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)
    lse_sc[...] = _to_col(lse_ref[...])        # the q block's rows, as columns, once
    delta_sc[...] = _to_col(delta_ref[...])

  seg_q, seg_k = sq_ref[...], sk_ref[...]
  in_band = _in_band(lo_ref, hi_ref, b * pl.num_programs(2) + qi, kj)

  @pl.when(in_band & _run_pair(q0, kj, bq, bk, _ranges(seg_q, seg_k), causal))
  def _():
    k = k_ref[...]
    s = _scores(q_ref[...], k, scale, seg_q, seg_k, q0, kj, bq, bk, causal)
    p = jnp.exp(s - lse_sc[...])
    ds = p * (_qkT(do_ref[...], v_ref[...]) - delta_sc[...])
    dq_sc[...] += _mm(ds.astype(k.dtype), k)

  @pl.when(kj == pl.num_programs(3) - 1)
  def _():
    dq_ref[...] = (dq_sc[...] * scale).astype(dq_ref.dtype)


def _band(seg_q, seg_k, q_first, bq, bk, causal):
  """The blocks each block runs with: ((kv_lo, kv_hi), (q_lo, q_hi)), int32, flattened.

  A pair the kernel skips still has its blocks copied HBM -> VMEM unless their index repeats
  the previous grid step's: the TPU pipeline copies a block only when its index changes
  (the Pallas TPU guide "Scalar Prefetch and Block-Sparse Computation" skips blocks this way).
  So each kernel's inner axis is clamped into a band. With run(b, i, j) `_run_pair` of q block
  i (first row at place q_first[i]) and kv block j of row b (causal band and overlapping key
  ranges),

    kv_lo[b n_q + i] = min {j : run(b, i, j)},  kv_hi[b n_q + i] = max {j : run(b, i, j)}
    q_lo[b n_k + j]  = min {i : run(b, i, j)},  q_hi[b n_k + j]  = max {i : run(b, i, j)}

  and the index maps read block clamp(y, lo, hi) at step (outer x, inner y): before the band
  they fetch its first block early (used again when y reaches it), after it they keep its
  last. A q block's set is never empty (its first row and the kv block holding that place
  share an id and the causal band). A kv block's may be when the q blocks are some of the
  sequence's (`attention_blocks`: no q row at or after it, or none of its documents): then
  lo = hi = 0, one copy of block 0 and no step runs. In a row whose keys never decrease (a
  packed row: `_key`) each set is an interval and holds exactly the blocks that share a
  document with the block, so only those are copied; ids out of order leave skipped pairs
  inside [lo, hi] that are still copied (never computed: the kernels run a step only when
  `_in_band` and `_run_pair`).

  B n_q n_k booleans in XLA, outside the kernels (1 M at T 128K, 128-row blocks); each
  kernel takes two flat [B n] int32 vectors into SMEM by scalar prefetch (8 KB per row of
  T 128K), indexed b n + x, and q_first [n_q]."""
  B = seg_q.shape[0]
  nq, nk = seg_q.shape[1] // bq, seg_k.shape[1] // bk
  sq, sk = _key(seg_q).reshape(B, nq, bq), _key(seg_k).reshape(B, nk, bk)
  ranges = (sq.min(-1)[:, :, None], sq.max(-1)[:, :, None], sk.min(-1)[:, None, :],
            sk.max(-1)[:, None, :])
  run = _run_pair(q_first[:, None], jnp.arange(nk)[None, :], bq, bk, ranges, causal)
  run = jnp.broadcast_to(run, (B, nq, nk))

  def first_last(r):          # over the last axis; 0, 0 where it holds no True
    n, any_ = r.shape[-1], r.any(-1)
    lo = jnp.where(any_, jnp.argmax(r, axis=-1), 0)
    hi = jnp.where(any_, n - 1 - jnp.argmax(r[..., ::-1], axis=-1), 0)
    return lo.astype(jnp.int32).reshape(-1), hi.astype(jnp.int32).reshape(-1)
  return first_last(run), first_last(jnp.swapaxes(run, 1, 2))


def _zero():
  """Block index 0 of an index map: int32, as Mosaic requires of every index it returns (a
  literal 0 traces as int64 under x64, and Mosaic refuses the map: "failed to legalize
  operation 'func.func' ... -> (i32, i32, i32, i64)")."""
  return jnp.int32(0)


def _index(b, x, y, axis, n, lo_ref, hi_ref):
  """The T block of grid step (b, .., x, y): the outer index x (axis 2), or the inner y
  (axis 3) clamped into x's band [lo, hi] (`_band`; n = the outer axis' size)."""
  if axis == 2:
    return x
  return jnp.minimum(jnp.maximum(y, lo_ref[b * n + x]), hi_ref[b * n + x])


def _spec(n, d, axis, outer):
  """Block (n, d) of a [B, H, T, d] array, indexed along T by grid axis `axis` (2 or 3) of a
  grid whose outer block axis has `outer` blocks."""
  return pl.BlockSpec((None, None, n, d), lambda b, h, x, y, lo, hi, _: (
      b, h, _index(b, x, y, axis, outer, lo, hi), _zero()))


def _row(n, axis, outer):
  """Block [1, n] of a [B, H, 1, T] array of per-query values (lane-major: a [B, H, T, 1]
  column pads every value to 128 lanes in HBM and in each copy)."""
  return pl.BlockSpec((None, None, 1, n), lambda b, h, x, y, lo, hi, _: (
      b, h, _zero(), _index(b, x, y, axis, outer, lo, hi)))


def _seg_specs(bq, bk, q_axis, outer, kv_rows=False):
  """Segment-id blocks: q ids as a [bq, 1] column of seg[:, :, None] and k ids as a [1, bk]
  row of seg[:, None, :]; with kv_rows the other way round (q row, k column)."""
  k_axis = 5 - q_axis
  col = lambda n, axis: pl.BlockSpec((None, n, 1), lambda b, h, x, y, lo, hi, _: (
      b, _index(b, x, y, axis, outer, lo, hi), _zero()))
  row = lambda n, axis: pl.BlockSpec((None, 1, n), lambda b, h, x, y, lo, hi, _: (
      b, _zero(), _index(b, x, y, axis, outer, lo, hi)))
  if kv_rows:
    return row(bq, q_axis), col(bk, k_axis)
  return col(bq, q_axis), row(bk, k_axis)


def _params(interpret, semantics):
  return None if interpret else pltpu.CompilerParams(dimension_semantics=semantics)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10))
def _attn(q, k, v, seg_q, seg_k, q_first, scale, causal, bq, bk, interpret):
  out, _, m = _forward(q, k, v, seg_q, seg_k, q_first, scale, causal, bq, bk, interpret)
  return out, m


def _forward(q, k, v, seg_q, seg_k, q_first, scale, causal, bq, bk, interpret):
  B, H, Tq, D = q.shape
  Tk, Dv = k.shape[2], v.shape[-1]
  nq = Tq // bq
  (kv_lo, kv_hi), _ = _band(seg_q, seg_k, q_first, bq, bk, causal)
  sq, sk = _seg_specs(bq, bk, 2, nq)                 # grid (b, h, q block, kv block)
  rows = jax.ShapeDtypeStruct((B, H, 1, Tq), jnp.float32)
  return pallas_call(
      functools.partial(_fwd_kernel, scale=scale, causal=causal, bq=bq, bk=bk),
      grid=(B, H, nq, Tk // bk), num_scalar_prefetch=3,
      in_specs=[_spec(bq, D, 2, nq), _spec(bk, D, 3, nq), _spec(bk, Dv, 3, nq), sq, sk],
      out_specs=[_spec(bq, Dv, 2, nq), _row(bq, 2, nq), _row(bq, 2, nq)],
      out_shape=[jax.ShapeDtypeStruct((B, H, Tq, Dv), v.dtype), rows, rows],
      scratch_shapes=[pltpu.VMEM((bq, 1), jnp.float32), pltpu.VMEM((bq, 1), jnp.float32),
                      pltpu.VMEM((bq, Dv), jnp.float32)],
      compiler_params=_params(interpret, ("parallel", "parallel", "parallel", "arbitrary")),
      interpret=interpret, name="mla_flash_fwd_tpu")(kv_lo, kv_hi, q_first, q, k, v,
                                                    seg_q[:, :, None], seg_k[:, None, :])


def _attn_fwd(q, k, v, seg_q, seg_k, q_first, scale, causal, bq, bk, interpret):
  out, lse, m = _forward(q, k, v, seg_q, seg_k, q_first, scale, causal, bq, bk, interpret)
  return (out, m), (q, k, v, seg_q, seg_k, q_first, out, lse)


def _attn_bwd(scale, causal, bq, bk, interpret, res, cts):
  q, k, v, seg_q, seg_k, q_first, out, lse = res
  do = cts[0]
  B, H, Tq, D = q.shape
  Tk, Dv = k.shape[2], v.shape[-1]
  nq, nk = Tq // bq, Tk // bk
  delta = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), -1)      # [B, H, Tq]
  sem = ("parallel", "parallel", "parallel", "arbitrary")
  (kv_lo, kv_hi), (q_lo, q_hi) = _band(seg_q, seg_k, q_first, bq, bk, causal)
  # grid (b, h, kv block, q block): lse and delta change every inner step and are read as
  # [1, bq] rows, as splash attention's dkv kernel reads its logsumexp.
  sq, sk = _seg_specs(bq, bk, 3, nk, kv_rows=True)
  dk, dv = pallas_call(
      functools.partial(_dkdv_kernel, scale=scale, causal=causal, bq=bq, bk=bk),
      grid=(B, H, nk, nq), num_scalar_prefetch=3,
      in_specs=[_spec(bq, D, 3, nk), _spec(bk, D, 2, nk), _spec(bk, Dv, 2, nk),
                _spec(bq, Dv, 3, nk), _row(bq, 3, nk), _row(bq, 3, nk), sq, sk],
      out_specs=[_spec(bk, D, 2, nk), _spec(bk, Dv, 2, nk)],
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      scratch_shapes=[pltpu.VMEM((bk, D), jnp.float32), pltpu.VMEM((bk, Dv), jnp.float32)],
      compiler_params=_params(interpret, sem), interpret=interpret,
      name="mla_flash_dkdv_tpu")(q_lo, q_hi, q_first, q, k, v, do, lse, delta[:, :, None, :],
                                 seg_q[:, None, :], seg_k[:, :, None])
  sq, sk = _seg_specs(bq, bk, 2, nq)              # grid (b, h, q block, kv block)
  dq = pallas_call(
      functools.partial(_dq_kernel, scale=scale, causal=causal, bq=bq, bk=bk),
      grid=(B, H, nq, nk), num_scalar_prefetch=3,
      in_specs=[_spec(bq, D, 2, nq), _spec(bk, D, 3, nq), _spec(bk, Dv, 3, nq),
                _spec(bq, Dv, 2, nq), _row(bq, 2, nq), _row(bq, 2, nq), sq, sk],
      out_specs=_spec(bq, D, 2, nq),
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      scratch_shapes=[pltpu.VMEM((bq, D), jnp.float32), pltpu.VMEM((bq, 1), jnp.float32),
                      pltpu.VMEM((bq, 1), jnp.float32)],
      compiler_params=_params(interpret, sem), interpret=interpret,
      name="mla_flash_dq_tpu")(kv_lo, kv_hi, q_first, q, k, v, do, lse, delta[:, :, None, :],
                               seg_q[:, :, None], seg_k[:, None, :])
  return dq, dk, dv, None, None, None


_attn.defvjp(_attn_fwd, _attn_bwd)


def _block(T: int, block: int | None) -> int:
  # 128-row blocks fill the MXU; short sequences use one block of T rounded to 8 sublanes.
  return block or (128 if T >= 128 else -(-T // 8) * 8)


def attention(q, k, v, *, scale, segment_ids=None, causal=True, interpret=False, block=None):
  """k2jax.kernels.attention(impl="pallas_tpu"): see k2jax.kernels.flash for the contract."""
  B, T, H, D = q.shape
  bq = bk = _block(T, block)
  Tp = -(-T // bq) * bq
  seg = jnp.ones((B, T), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
  seg = jnp.pad(seg, ((0, 0), (0, Tp - T)), constant_values=flash_common.PAD_SEGMENT)
  hm = lambda a: jnp.swapaxes(jnp.pad(a, ((0, 0), (0, Tp - T), (0, 0), (0, 0))), 1, 2)
  out, m = _attn(hm(q), hm(k), hm(v), seg, seg, jnp.arange(Tp // bq, dtype=jnp.int32) * bq,
                 float(scale), bool(causal), bq, bk, bool(interpret))
  return flash_common.finish(out, m[:, :, 0, :], seg, T)


def attention_blocks(q, k, v, *, scale, q_block_ids, block, q_segment_ids, k_segment_ids,
                     causal=True, interpret=False, kernel_block=None):
  """Some blocks of a sequence's queries against all of its keys
  (k2jax.kernels.flash.attention_blocks with impl="pallas_tpu"): q [B, nq block, H, D] holds
  the sequence's blocks q_block_ids (ascending), k / v [B, nk block, H, D / Dv] the whole
  sequence, segment ids of both sides. The kernels' own blocks (kernel_block, default 128 or
  the largest divisor of `block` below it that is a multiple of 8) split `block` evenly,
  so each holds consecutive places."""
  B, Tq = q.shape[:2]
  bq = kernel_block or max((b for b in range(8, min(block, 128) + 1, 8) if block % b == 0),
                           default=None)
  if bq is None or block % bq or bq % 8:
    raise ValueError(f"attention impl = 'pallas_tpu' under context parallelism: query blocks "
                     f"of {block} tokens have no divisor that is a multiple of 8; make "
                     "model.context_chunk a multiple of 8 (train.seq_len a multiple of "
                     "16 x mesh.context)")
  per = block // bq
  q_first = (jnp.asarray(q_block_ids, jnp.int32)[:, None] * block
             + jnp.arange(per, dtype=jnp.int32) * bq).reshape(-1)
  hm = lambda a: jnp.swapaxes(a, 1, 2)
  seg_q = q_segment_ids.astype(jnp.int32)
  out, m = _attn(hm(q), hm(k), hm(v), seg_q, k_segment_ids.astype(jnp.int32), q_first,
                 float(scale), bool(causal), bq, bq, bool(interpret))
  return flash_common.finish(out, m[:, :, 0, :], seg_q, Tq)
