"""Flash attention for MLA shapes as Triton-lowered Pallas kernels, with per-head S_max.

Three kernels, each over a grid of (block, batch, head) programs; rows of a head are
contiguous in [B, T, H, D] arrays, read through BlockSpecs:

  forward   program (i, b, h): one q block against kv blocks 0..i (causal), online softmax
            in f32; writes out, the log-sum-exp and the final running max per row. That
            running max is, for a real row, the max of its counted scaled logits, so S_max
            costs one extra [B, H, T] f32 store, reduced outside (k2jax.kernels.flash.finish).
  dk, dv    program (j, b, h): one kv block against q blocks j.. (causal); recomputes
            p = exp(s - lse) and accumulates dv += p^T do, dk += (p (do v^T - delta))^T q.
  dq        program (i, b, h): one q block against its kv blocks; dq += ds k.

MLA's q / k head dim is 192 = 128 + 64: Triton tiles must be powers of two, so q.k is summed
over power-of-two column slices (`_parts`) instead of zero-padding 192 to 256 (which would
waste a quarter of the QK^T FLOPs). Block pairs that are fully masked are skipped: the causal
bound limits each loop, and a per-pair segment test (disjoint segment ranges -> no valid
pair) skips blocks of other documents under `lax.cond`.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from k2jax.kernels import flash
from k2jax.kernels.pallas_utils import pallas_call

NEG_INF = float("-inf")


def _parts(d: int) -> tuple[tuple[int, int], ...]:
  """(offset, width) power-of-two column slices covering d (a multiple of 16), widest first."""
  out, off = [], 0
  for bit in reversed(range(d.bit_length())):
    w = 1 << bit
    if d - off >= w and w >= 16:
      out.append((off, w))
      off += w
  assert off == d, d
  return tuple(out)


def _pow2(n: int) -> int:
  return 1 << (n - 1).bit_length()


def _dot(a, b, trans_a=False, trans_b=False):
  """f32-accumulated tile product; exact f32 (no TF32) for f32 operands, so S_max equals the
  reference's logits. Transposes go to the dot itself (Triton's MMA reads them for free)."""
  return plgpu.dot(a, b, trans_a=trans_a, trans_b=trans_b, allow_tf32=a.dtype != jnp.float32)


def _load_cols(ref, rows, parts):
  return [ref[rows, pl.ds(off, w)] for off, w in parts]


LOG2E = 1.4426950408889634


def _scores(qs, ks, scale2, mask):
  """Logits in base-2 units (scale * log2(e) folded in: exp2 is the cheap exponential), masked
  to -inf where `mask` is False (mask None: every pair of the block is valid)."""
  s = sum(_dot(qp, kp, trans_b=True) for qp, kp in zip(qs, ks)) * scale2
  return s if mask is None else jnp.where(mask, s, NEG_INF)


def _mask(seg_q, seg_k, q_pos, k_pos, causal_block, segmented):
  """The validity mask of a block pair, or None when every pair is valid."""
  mask = (q_pos[:, None] >= k_pos[None, :]) if causal_block else None
  if segmented:
    same = seg_q[:, None] == seg_k[None, :]
    mask = same if mask is None else mask & same
  return mask


def _overlap(seg_q, seg_k):
  """False only if no pair of the two blocks can share a segment (disjoint id ranges)."""
  return (jnp.max(seg_k) >= jnp.min(seg_q)) & (jnp.min(seg_k) <= jnp.max(seg_q))


def _loops(lo, mid, hi, body, carry, seg_a, seg_b_at, segmented):
  """fori_loop over [lo, mid) without the causal mask and [mid, hi) with it; under segment
  ids each block pair whose segment ranges are disjoint is skipped (lax.cond)."""
  def run(causal_block):
    def step(t, c):
      if not segmented:
        return body(t, c, causal_block)
      return jax.lax.cond(_overlap(seg_a, seg_b_at(t)), lambda c: body(t, c, causal_block),
                          lambda c: c, c)
    return step
  carry = jax.lax.fori_loop(lo, mid, run(False), carry)
  return jax.lax.fori_loop(mid, hi, run(True), carry)


def _fwd_kernel(q_ref, k_ref, v_ref, seg_ref, o_ref, lse_ref, *m_ref, scale, causal, bq, bk,
                parts, nk, segmented):
  i = pl.program_id(0)
  rows = pl.ds(i * bq, bq)
  qs = _load_cols(q_ref, slice(None), parts)
  seg_q = seg_ref[rows]
  q_pos = i * bq + jnp.arange(bq)
  dv = o_ref.shape[-1]

  def body(j, carry, causal_block):
    acc, m, l = carry
    cols = pl.ds(j * bk, bk)
    s = _scores(qs, _load_cols(k_ref, cols, parts), scale * LOG2E,
                _mask(seg_q, seg_ref[cols], q_pos, j * bk + jnp.arange(bk), causal_block,
                      segmented))
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    safe = jnp.where(m_new == NEG_INF, 0.0, m_new)
    p = jnp.exp2(s - safe[:, None])
    corr = jnp.exp2(m - safe)
    v = v_ref[cols, :]
    acc = acc * corr[:, None] + _dot(p.astype(v.dtype), v)
    return acc, m_new, l * corr + jnp.sum(p, axis=1)

  hi = ((i + 1) * bq + bk - 1) // bk if causal else nk
  full = (i * bq) // bk if causal else nk      # blocks entirely below the diagonal
  init = (jnp.zeros((bq, dv), jnp.float32), jnp.full((bq,), NEG_INF, jnp.float32),
          jnp.zeros((bq,), jnp.float32))
  acc, m, l = _loops(0, full, hi, body, init, seg_q, lambda j: seg_ref[pl.ds(j * bk, bk)],
                     segmented)
  l_safe = jnp.where(l == 0, 1.0, l)
  o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)
  lse_ref[...] = (m + jnp.log2(l_safe)) / LOG2E          # natural units
  if m_ref:  # S_max: the running max of each row (absent only when benchmarking its cost)
    m_ref[0][...] = m / LOG2E


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, seg_ref, dk_ref, dv_ref, *,
                 scale, causal, bq, bk, parts, nq, segmented):
  j = pl.program_id(0)
  ks = _load_cols(k_ref, slice(None), parts)             # this program's kv block
  v = v_ref[...]
  seg_k = seg_ref[pl.ds(j * bk, bk)]
  k_pos = j * bk + jnp.arange(bk)

  def body(i, carry, causal_block):
    dks, dv = carry
    rows = pl.ds(i * bq, bq)
    qs = _load_cols(q_ref, rows, parts)
    s = _scores(qs, ks, scale * LOG2E, _mask(seg_ref[rows], seg_k, i * bq + jnp.arange(bq),
                                             k_pos, causal_block, segmented))
    p = jnp.exp2(s - (lse_ref[rows] * LOG2E)[:, None])                 # 0 where masked
    do = do_ref[rows, :]
    dv = dv + _dot(p.astype(do.dtype), do, trans_a=True)                # p^T do
    ds = (p * (_dot(do, v, trans_b=True) - delta_ref[rows][:, None])).astype(qs[0].dtype)
    return [a + _dot(ds, qp, trans_a=True) for a, qp in zip(dks, qs)], dv   # ds^T q

  lo = (j * bk) // bq if causal else 0
  full = ((j + 1) * bk - 1 + bq - 1) // bq if causal else 0   # first fully visible
  init = ([jnp.zeros((bk, w), jnp.float32) for _, w in parts],
          jnp.zeros((bk, v.shape[-1]), jnp.float32))
  # masked blocks first ([lo, full)), then the fully visible ones ([full, nq))
  carry = init
  if causal:
    carry = _loops(lo, lo, jnp.minimum(full, nq), body, carry, seg_k,
                   lambda i: seg_ref[pl.ds(i * bq, bq)], segmented)
  dks, dv = _loops(full if causal else 0, nq, nq, body, carry, seg_k,
                   lambda i: seg_ref[pl.ds(i * bq, bq)], segmented)
  for (off, w), a in zip(parts, dks):
    dk_ref[:, pl.ds(off, w)] = (a * scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, seg_ref, dq_ref, *, scale,
               causal, bq, bk, parts, nk, segmented):
  i = pl.program_id(0)
  rows = pl.ds(i * bq, bq)
  qs = _load_cols(q_ref, slice(None), parts)
  seg_q = seg_ref[rows]
  q_pos = i * bq + jnp.arange(bq)
  do = do_ref[...]
  lse2, delta = lse_ref[...] * LOG2E, delta_ref[...]

  def body(j, dqs, causal_block):
    cols = pl.ds(j * bk, bk)
    ks = _load_cols(k_ref, cols, parts)
    s = _scores(qs, ks, scale * LOG2E, _mask(seg_q, seg_ref[cols], q_pos,
                                             j * bk + jnp.arange(bk), causal_block, segmented))
    p = jnp.exp2(s - lse2[:, None])
    ds = (p * (_dot(do, v_ref[cols, :], trans_b=True) - delta[:, None])).astype(ks[0].dtype)
    return [a + _dot(ds, kp) for a, kp in zip(dqs, ks)]

  hi = ((i + 1) * bq + bk - 1) // bk if causal else nk
  full = (i * bq) // bk if causal else nk
  dqs = _loops(0, full, hi, body, [jnp.zeros((bq, w), jnp.float32) for _, w in parts], seg_q,
               lambda j: seg_ref[pl.ds(j * bk, bk)], segmented)
  for (off, w), a in zip(parts, dqs):
    dq_ref[:, pl.ds(off, w)] = (a * scale).astype(dq_ref.dtype)


def _specs(B, H, Tp, bq, dq_pad, dv_pad):
  """BlockSpecs over grid (block, b, h): a q-sized block, the whole sequence, rows of [B,H,T]."""
  block = lambda n, d: pl.BlockSpec((None, n, None, d), lambda i, b, h: (b, i, h, 0))
  whole = lambda d: pl.BlockSpec((None, Tp, None, d), lambda i, b, h: (b, 0, h, 0))
  row_block = lambda n: pl.BlockSpec((None, None, n), lambda i, b, h: (b, h, i))
  row_whole = pl.BlockSpec((None, None, Tp), lambda i, b, h: (b, h, 0))
  seg = pl.BlockSpec((None, Tp), lambda i, b, h: (b, 0))
  return block, whole, row_block, row_whole, seg


# (block_q, block_k, num_warps, num_stages); experiments/bench_attention.py --gpu tunes them.
# Measured on an H100 (experiments/results/attention/gpu_tuning.csv, MLA 192 / 128, bf16).
TUNING = {"fwd": (64, 128, 4, 2), "bwd": (128, 64, 8, 2)}


def _params(interpret, num_warps, num_stages=2):
  return None if interpret else plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _attn(q, k, v, seg, scale, causal, tuning, interpret, segmented):
  out, _, m = _forward(q, k, v, seg, scale, causal, tuning[0], interpret, segmented)
  return out, m


def _forward(q, k, v, seg, scale, causal, fwd_tuning, interpret, segmented=True, write_max=True):
  B, Tp, H, D = q.shape
  Dv = v.shape[-1]
  bq, bk, warps, stages = fwd_tuning
  nq, nk = Tp // bq, Tp // bk
  block, whole, row_block, _, seg_spec = _specs(B, H, Tp, bq, _pow2(D), Dv)
  kernel = functools.partial(_fwd_kernel, scale=scale, causal=causal, bq=bq, bk=bk,
                             parts=_parts(D), nk=nk, segmented=segmented)
  rows = jax.ShapeDtypeStruct((B, H, Tp), jnp.float32)
  return pallas_call(
      kernel, grid=(nq, B, H),
      in_specs=[block(bq, _pow2(D)), whole(_pow2(D)), whole(Dv), seg_spec],
      out_specs=[block(bq, Dv), row_block(bq)] + [row_block(bq)] * write_max,
      out_shape=[jax.ShapeDtypeStruct((B, Tp, H, Dv), v.dtype), rows] + [rows] * write_max,
      compiler_params=_params(interpret, warps, stages), interpret=interpret,
      name="mla_flash_fwd")(q, k, v, seg)


def _attn_fwd(q, k, v, seg, scale, causal, tuning, interpret, segmented):
  out, lse, m = _forward(q, k, v, seg, scale, causal, tuning[0], interpret, segmented)
  return (out, m), (q, k, v, seg, out, lse)


def _attn_bwd(scale, causal, tuning, interpret, segmented, res, cts):
  q, k, v, seg, out, lse = res
  do = cts[0]
  B, Tp, H, D = q.shape
  Dv = v.shape[-1]
  bq, bk, warps, stages = tuning[1]
  nq, nk = Tp // bq, Tp // bk
  delta = jnp.einsum("bthd,bthd->bht", do.astype(jnp.float32), out.astype(jnp.float32))
  block, whole, row_block, row_whole, seg_spec = _specs(B, H, Tp, bq, _pow2(D), Dv)
  parts = _parts(D)
  dk, dv = pallas_call(
      functools.partial(_dkdv_kernel, scale=scale, causal=causal, bq=bq, bk=bk, parts=parts,
                        nq=nq, segmented=segmented),
      grid=(nk, B, H),
      in_specs=[whole(_pow2(D)), block(bk, _pow2(D)), block(bk, Dv), whole(Dv), row_whole,
                row_whole, seg_spec],
      out_specs=[block(bk, _pow2(D)), block(bk, Dv)],
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      compiler_params=_params(interpret, warps, stages), interpret=interpret,
      name="mla_flash_dkdv")(q, k, v, do, lse, delta, seg)
  dq = pallas_call(
      functools.partial(_dq_kernel, scale=scale, causal=causal, bq=bq, bk=bk, parts=parts, nk=nk,
                        segmented=segmented),
      grid=(nq, B, H),
      in_specs=[block(bq, _pow2(D)), whole(_pow2(D)), whole(Dv), block(bq, Dv), row_block(bq),
                row_block(bq), seg_spec],
      out_specs=block(bq, _pow2(D)),
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      compiler_params=_params(interpret, warps, stages), interpret=interpret,
      name="mla_flash_dq")(q, k, v, do, lse, delta, seg)
  return dq, dk, dv, None


_attn.defvjp(_attn_fwd, _attn_bwd)


def attention(q, k, v, *, scale, segment_ids=None, causal=True, interpret=False, block=None,
              tuning=None):
  """k2jax.kernels.attention(impl="pallas_gpu"): see k2jax.kernels.flash for the contract.

  block: one size for every q / kv block (tests); tuning: {"fwd", "bwd"} -> (block_q,
  block_k, num_warps, num_stages), default TUNING. Blocks are clipped to the sequence."""
  B, T, H, D = q.shape
  Dv = v.shape[-1]
  cap = max(16, _pow2(T))
  # f32 tiles take twice the shared memory of bf16 ones: halve the blocks (an H100 has 227 KB).
  base = TUNING if q.dtype != jnp.float32 else {"fwd": (64, 64, 4, 2), "bwd": (64, 64, 8, 2)}
  tuning = dict(base, **(tuning or {}))
  fix = lambda t: (min(block or t[0], cap), min(block or t[1], cap), t[2], t[3])
  tuning = (fix(tuning["fwd"]), fix(tuning["bwd"]))
  step = max(max(t[0], t[1]) for t in tuning)
  Tp = -(-T // step) * step
  Dp = -(-D // 16) * 16                 # Triton tiles need widths of 16+; zeros leave q.k alone
  Dvp = _pow2(max(Dv, 16))
  seg = jnp.ones((B, T), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
  seg = jnp.pad(seg, ((0, 0), (0, Tp - T)), constant_values=flash.PAD_SEGMENT)
  pad = lambda a, d: jnp.pad(a, ((0, 0), (0, Tp - T), (0, 0), (0, d - a.shape[-1])))
  # Without segment ids a causal mask already hides the padded keys (they come after every
  # real query), so the kernels skip segment masks entirely.
  segmented = segment_ids is not None or (not causal and Tp != T)
  out, m = _attn(pad(q, Dp), pad(k, Dp), pad(v, Dvp), seg, float(scale), bool(causal), tuning,
                 bool(interpret), segmented)
  out, max_logits = flash.finish(jnp.swapaxes(out, 1, 2), m, seg, T)
  return out[..., :Dv], max_logits
