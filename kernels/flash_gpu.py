"""Flash attention for MLA shapes as Triton-lowered Pallas kernels, with per-head S_max.

Three kernels, each over a grid of (block, batch, head) programs; rows of a head are
contiguous in [B, T, H, D] arrays, read through BlockSpecs. Each query row carries its place
in the key sequence (`q_pos`): arange(T) for self-attention, the device's rows of the whole
sequence under context parallelism (k2jax.model.context; `attention_blocks`). The causal
bounds of each program's loop are read from small per-block tables computed outside
(`_bands`), so the kernels never assume that q block i sits at rows i bq of the keys:

  forward   program (i, b, h): one q block against the kv blocks up to its last row's place
            (causal), online softmax in f32; writes out, the log-sum-exp and the final
            running max per row. That running max is, for a real row, the max of its counted
            scaled logits, so S_max costs one extra [B, H, T] f32 store, reduced outside
            (k2jax.kernels.flash.finish).
  dk, dv    program (j, b, h): one kv block against the q blocks at or after it; recomputes
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

from k2jax.kernels import flash_common
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


def _fwd_kernel(q_ref, k_ref, v_ref, segq_ref, segk_ref, pos_ref, full_ref, hi_ref, o_ref,
                lse_ref, *m_ref, scale, bq, bk, parts, segmented):
  i = pl.program_id(0)
  rows = pl.ds(i * bq, bq)
  qs = _load_cols(q_ref, slice(None), parts)
  seg_q = segq_ref[rows]
  q_pos = pos_ref[rows]
  dv = o_ref.shape[-1]

  def body(j, carry, causal_block):
    acc, m, l = carry
    cols = pl.ds(j * bk, bk)
    s = _scores(qs, _load_cols(k_ref, cols, parts), scale * LOG2E,
                _mask(seg_q, segk_ref[cols], q_pos, j * bk + jnp.arange(bk), causal_block,
                      segmented))
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    safe = jnp.where(m_new == NEG_INF, 0.0, m_new)
    p = jnp.exp2(s - safe[:, None])
    corr = jnp.exp2(m - safe)
    v = v_ref[cols, :]
    acc = acc * corr[:, None] + _dot(p.astype(v.dtype), v)
    return acc, m_new, l * corr + jnp.sum(p, axis=1)

  init = (jnp.zeros((bq, dv), jnp.float32), jnp.full((bq,), NEG_INF, jnp.float32),
          jnp.zeros((bq,), jnp.float32))
  # kv blocks [0, full) lie before every row's place, [full, hi) need the causal mask
  acc, m, l = _loops(0, full_ref[i], hi_ref[i], body, init, seg_q,
                     lambda j: segk_ref[pl.ds(j * bk, bk)], segmented)
  l_safe = jnp.where(l == 0, 1.0, l)
  o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)
  # natural units; a row with no valid key (a padded query row of `attention_blocks` when
  # the keys need no padding) gets +inf, so the backward's exp(s - lse) is 0, not NaN
  lse_ref[...] = jnp.where(l == 0, jnp.inf, m + jnp.log2(l_safe)) / LOG2E
  if m_ref:  # S_max: the running max of each row (absent only when benchmarking its cost)
    m_ref[0][...] = m / LOG2E


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, segq_ref, segk_ref, pos_ref,
                 lo_ref, full_ref, dk_ref, dv_ref, *, scale, bq, bk, parts, nq, segmented):
  j = pl.program_id(0)
  ks = _load_cols(k_ref, slice(None), parts)             # this program's kv block
  v = v_ref[...]
  seg_k = segk_ref[pl.ds(j * bk, bk)]
  k_pos = j * bk + jnp.arange(bk)

  def body(i, carry, causal_block):
    dks, dv = carry
    rows = pl.ds(i * bq, bq)
    qs = _load_cols(q_ref, rows, parts)
    s = _scores(qs, ks, scale * LOG2E, _mask(segq_ref[rows], seg_k, pos_ref[rows], k_pos,
                                             causal_block, segmented))
    p = jnp.exp2(s - (lse_ref[rows] * LOG2E)[:, None])                 # 0 where masked
    do = do_ref[rows, :]
    dv = dv + _dot(p.astype(do.dtype), do, trans_a=True)                # p^T do
    ds = (p * (_dot(do, v, trans_b=True) - delta_ref[rows][:, None])).astype(qs[0].dtype)
    return [a + _dot(ds, qp, trans_a=True) for a, qp in zip(dks, qs)], dv   # ds^T q

  lo, full = lo_ref[j], full_ref[j]     # q blocks before lo end before this block
  init = ([jnp.zeros((bk, w), jnp.float32) for _, w in parts],
          jnp.zeros((bk, v.shape[-1]), jnp.float32))
  # masked blocks first ([lo, full)), then the fully visible ones ([full, nq))
  seg_at = lambda i: segq_ref[pl.ds(i * bq, bq)]
  carry = _loops(lo, lo, full, body, init, seg_k, seg_at, segmented)
  dks, dv = _loops(full, nq, nq, body, carry, seg_k, seg_at, segmented)
  for (off, w), a in zip(parts, dks):
    dk_ref[:, pl.ds(off, w)] = (a * scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, segq_ref, segk_ref, pos_ref,
               full_ref, hi_ref, dq_ref, *, scale, bq, bk, parts, segmented):
  i = pl.program_id(0)
  rows = pl.ds(i * bq, bq)
  qs = _load_cols(q_ref, slice(None), parts)
  seg_q = segq_ref[rows]
  q_pos = pos_ref[rows]
  do = do_ref[...]
  lse2, delta = lse_ref[...] * LOG2E, delta_ref[...]

  def body(j, dqs, causal_block):
    cols = pl.ds(j * bk, bk)
    ks = _load_cols(k_ref, cols, parts)
    s = _scores(qs, ks, scale * LOG2E, _mask(seg_q, segk_ref[cols], q_pos,
                                             j * bk + jnp.arange(bk), causal_block, segmented))
    p = jnp.exp2(s - lse2[:, None])
    ds = (p * (_dot(do, v_ref[cols, :], trans_b=True) - delta[:, None])).astype(ks[0].dtype)
    return [a + _dot(ds, kp) for a, kp in zip(dqs, ks)]

  dqs = _loops(0, full_ref[i], hi_ref[i], body,
               [jnp.zeros((bq, w), jnp.float32) for _, w in parts], seg_q,
               lambda j: segk_ref[pl.ds(j * bk, bk)], segmented)
  for (off, w), a in zip(parts, dqs):
    dq_ref[:, pl.ds(off, w)] = (a * scale).astype(dq_ref.dtype)


def _specs(Tq, Tk):
  """BlockSpecs over grid (block, b, h): a block of n rows, a whole [B, T, H, d] sequence of
  Tq (q-side) or Tk (k-side) rows, rows of [B, H, Tq], whole [B, T] / [T] id vectors, and one
  band table [n]."""
  block = lambda n, d: pl.BlockSpec((None, n, None, d), lambda i, b, h: (b, i, h, 0))
  whole = lambda T, d: pl.BlockSpec((None, T, None, d), lambda i, b, h: (b, 0, h, 0))
  row_block = lambda n: pl.BlockSpec((None, None, n), lambda i, b, h: (b, h, i))
  row_whole = pl.BlockSpec((None, None, Tq), lambda i, b, h: (b, h, 0))
  seg = lambda T: pl.BlockSpec((None, T), lambda i, b, h: (b, 0))
  vec = lambda n: pl.BlockSpec((n,), lambda i, b, h: (0,))
  return block, whole, row_block, row_whole, seg, vec


def _bands(q_pos, bq, bk, nk, causal):
  """The causal loop bounds of every program, from each query row's place (ascending):
  ((full, hi) [n_q] for the q-block programs, (lo, full) [n_k] for the kv-block ones).

    q block i:   kv blocks [0, full_i) lie before its first row's place (no mask needed),
                 [full_i, hi_i) reach its last row's place (masked); none after
    kv block j:  q blocks [lo_j, full_j) end inside or after it (masked), [full_j, n_q)
                 start after its last key (no mask); q blocks before lo_j end before it

  Self-attention (q_pos = arange) gives full_i = i bq // bk, hi_i = ((i + 1) bq + bk - 1)
  // bk, lo_j = j bk // bq, full_j = ceil(((j + 1) bk - 1) / bq). Without the causal mask
  every program runs every block unmasked."""
  first, last = q_pos.reshape(-1, bq)[:, 0], q_pos.reshape(-1, bq)[:, -1]
  nq = first.shape[0]
  if not causal:
    return ((jnp.full((nq,), nk, jnp.int32),) * 2, (jnp.zeros((nk,), jnp.int32),) * 2)
  starts = jnp.arange(nk, dtype=jnp.int32) * bk
  q_full = jnp.minimum(first // bk, nk)
  q_hi = jnp.minimum(last // bk + 1, nk)
  k_lo = jnp.searchsorted(last, starts, side="left")
  k_full = jnp.searchsorted(first, starts + bk - 1, side="left")
  i32 = lambda a: a.astype(jnp.int32)
  return (i32(q_full), i32(q_hi)), (i32(k_lo), i32(k_full))


# (block_q, block_k, num_warps, num_stages); experiments/bench_attention.py --gpu tunes them.
# Measured on an H100 (experiments/results/attention/gpu_tuning.csv, MLA 192 / 128, bf16).
TUNING = {"fwd": (64, 128, 4, 2), "bwd": (128, 64, 8, 2)}


def _params(interpret, num_warps, num_stages=2):
  return None if interpret else plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10))
def _attn(q, k, v, seg_q, seg_k, q_pos, scale, causal, tuning, interpret, segmented):
  out, _, m = _forward(q, k, v, seg_q, seg_k, q_pos, scale, causal, tuning[0], interpret,
                       segmented)
  return out, m


def _forward(q, k, v, seg_q, seg_k, q_pos, scale, causal, fwd_tuning, interpret, segmented=True,
             write_max=True):
  B, Tq, H, D = q.shape
  Tk, Dv = k.shape[1], v.shape[-1]
  bq, bk, warps, stages = fwd_tuning
  nq, nk = Tq // bq, Tk // bk
  block, whole, row_block, _, seg_spec, vec = _specs(Tq, Tk)
  (full, hi), _ = _bands(q_pos, bq, bk, nk, causal)
  kernel = functools.partial(_fwd_kernel, scale=scale, bq=bq, bk=bk, parts=_parts(D),
                             segmented=segmented)
  rows = jax.ShapeDtypeStruct((B, H, Tq), jnp.float32)
  return pallas_call(
      kernel, grid=(nq, B, H),
      in_specs=[block(bq, _pow2(D)), whole(Tk, _pow2(D)), whole(Tk, Dv), seg_spec(Tq),
                seg_spec(Tk), vec(Tq), vec(nq), vec(nq)],
      out_specs=[block(bq, Dv), row_block(bq)] + [row_block(bq)] * write_max,
      out_shape=[jax.ShapeDtypeStruct((B, Tq, H, Dv), v.dtype), rows] + [rows] * write_max,
      compiler_params=_params(interpret, warps, stages), interpret=interpret,
      name="mla_flash_fwd")(q, k, v, seg_q, seg_k, q_pos, full, hi)


def _attn_fwd(q, k, v, seg_q, seg_k, q_pos, scale, causal, tuning, interpret, segmented):
  out, lse, m = _forward(q, k, v, seg_q, seg_k, q_pos, scale, causal, tuning[0], interpret,
                         segmented)
  return (out, m), (q, k, v, seg_q, seg_k, q_pos, out, lse)


def _attn_bwd(scale, causal, tuning, interpret, segmented, res, cts):
  q, k, v, seg_q, seg_k, q_pos, out, lse = res
  do = cts[0]
  B, Tq, H, D = q.shape
  Tk, Dv = k.shape[1], v.shape[-1]
  bq, bk, warps, stages = tuning[1]
  nq, nk = Tq // bq, Tk // bk
  delta = jnp.einsum("bthd,bthd->bht", do.astype(jnp.float32), out.astype(jnp.float32))
  block, whole, row_block, row_whole, seg_spec, vec = _specs(Tq, Tk)
  (q_full, q_hi), (k_lo, k_full) = _bands(q_pos, bq, bk, nk, causal)
  parts = _parts(D)
  ids = (seg_q, seg_k, q_pos)
  id_specs = [seg_spec(Tq), seg_spec(Tk), vec(Tq)]
  dk, dv = pallas_call(
      functools.partial(_dkdv_kernel, scale=scale, bq=bq, bk=bk, parts=parts, nq=nq,
                        segmented=segmented),
      grid=(nk, B, H),
      in_specs=[whole(Tq, _pow2(D)), block(bk, _pow2(D)), block(bk, Dv), whole(Tq, Dv),
                row_whole, row_whole, *id_specs, vec(nk), vec(nk)],
      out_specs=[block(bk, _pow2(D)), block(bk, Dv)],
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      compiler_params=_params(interpret, warps, stages), interpret=interpret,
      name="mla_flash_dkdv")(q, k, v, do, lse, delta, *ids, k_lo, k_full)
  dq = pallas_call(
      functools.partial(_dq_kernel, scale=scale, bq=bq, bk=bk, parts=parts,
                        segmented=segmented),
      grid=(nq, B, H),
      in_specs=[block(bq, _pow2(D)), whole(Tk, _pow2(D)), whole(Tk, Dv), block(bq, Dv),
                row_block(bq), row_block(bq), *id_specs, vec(nq), vec(nq)],
      out_specs=block(bq, _pow2(D)),
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      compiler_params=_params(interpret, warps, stages), interpret=interpret,
      name="mla_flash_dq")(q, k, v, do, lse, delta, *ids, q_full, q_hi)
  return dq, dk, dv, None, None, None


_attn.defvjp(_attn_fwd, _attn_bwd)


def _run(q, k, v, seg_q, seg_k, q_pos, *, scale, causal, interpret, block, tuning,
         segmented):
  """Pad both sequences to the blocks, run the kernels, and finish: (out, max_logits)."""
  B, Tq, H, D = q.shape
  Tk, Dv = k.shape[1], v.shape[-1]
  cap = max(16, _pow2(max(Tq, Tk)))
  # f32 tiles take twice the shared memory of bf16 ones: halve the blocks (an H100 has 227 KB).
  base = TUNING if q.dtype != jnp.float32 else {"fwd": (64, 64, 4, 2), "bwd": (64, 64, 8, 2)}
  tuning = dict(base, **(tuning or {}))
  fix = lambda t: (min(block or t[0], cap), min(block or t[1], cap), t[2], t[3])
  tuning = (fix(tuning["fwd"]), fix(tuning["bwd"]))
  step = max(max(t[0], t[1]) for t in tuning)
  Tqp, Tkp = -(-Tq // step) * step, -(-Tk // step) * step
  Dp = -(-D // 16) * 16                 # Triton tiles need widths of 16+; zeros leave q.k alone
  Dvp = _pow2(max(Dv, 16))
  pad_ids = lambda s, n: jnp.pad(s, ((0, 0), (0, n - s.shape[1])),
                                 constant_values=flash_common.PAD_SEGMENT)
  seg_q, seg_k = pad_ids(seg_q, Tqp), pad_ids(seg_k, Tkp)
  # padded query rows come after every key, in order (the bands need ascending places)
  q_pos = jnp.concatenate([q_pos.astype(jnp.int32), Tk + jnp.arange(Tqp - Tq, dtype=jnp.int32)])
  pad = lambda a, n, d: jnp.pad(a, ((0, 0), (0, n - a.shape[1]), (0, 0), (0, d - a.shape[-1])))
  out, m = _attn(pad(q, Tqp, Dp), pad(k, Tkp, Dp), pad(v, Tkp, Dvp), seg_q, seg_k, q_pos,
                 float(scale), bool(causal), tuning, bool(interpret),
                 bool(segmented or (not causal and Tkp != Tk)))
  out, max_logits = flash_common.finish(jnp.swapaxes(out, 1, 2), m, seg_q, Tq)
  return out[..., :Dv], max_logits


def attention(q, k, v, *, scale, segment_ids=None, causal=True, interpret=False, block=None,
              tuning=None):
  """k2jax.kernels.attention(impl="pallas_gpu"): see k2jax.kernels.flash for the contract.

  block: one size for every q / kv block (tests); tuning: {"fwd", "bwd"} -> (block_q,
  block_k, num_warps, num_stages), default TUNING. Blocks are clipped to the sequence."""
  B, T = q.shape[:2]
  seg = jnp.ones((B, T), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
  # Without segment ids a causal mask already hides the padded keys (they come after every
  # real query), so the kernels skip segment masks entirely.
  return _run(q, k, v, seg, seg, jnp.arange(T, dtype=jnp.int32), scale=scale, causal=causal,
              interpret=interpret, block=block, tuning=tuning,
              segmented=segment_ids is not None)


def attention_blocks(q, k, v, *, scale, q_positions, q_segment_ids, k_segment_ids, causal=True,
                     interpret=False, block=None, tuning=None):
  """Rows of a sequence against all of its keys (k2jax.kernels.flash.attention_blocks with
  impl="pallas_gpu"): q [B, Tq, H, D] at places q_positions (int [Tq], ascending) of k / v
  [B, Tk, H, D / Dv]; segment ids of both sides [B, Tq] / [B, Tk]."""
  return _run(q, k, v, q_segment_ids.astype(jnp.int32), k_segment_ids.astype(jnp.int32),
              q_positions, scale=scale, causal=causal, interpret=interpret, block=block,
              tuning=tuning, segmented=True)
