"""Causal softmax attention that also returns each head's maximum scaled logit (QK-Clip).

    out, max_logits = attention(q, k, v, scale=s, segment_ids=seg, causal=True, impl="auto")

q, k [B, T, H, Dqk]; v [B, T, H, Dv] (Dqk != Dv: MLA's 192 / 128). A pair (i, j) is valid
when j <= i (causal) and seg[i] == seg[j]; segment id 0 marks padding, which attends among
itself (so its rows stay finite) but is left out of

    max_logits[h] = max over batch and valid pairs with seg[i] > 0 of  s * q[i, h] . k[j, h]

the per-head S_max that QK-Clip (report 2.1) compares with tau: the SCALED logit, in f32,
never a pre-scale or base-2 row max. It carries no gradient. Because every real row's
valid keys are counted ones, S_max is the max over real rows of the online softmax's final
running max: kernels get it for free from state they keep anyway.

Implementations (one signature):
  xla         materializes [B, H, T, T] f32 logits: the reference, O(T^2) memory.
  chunked     the flash algorithm in plain JAX: blockwise online softmax with a custom VJP
              that recomputes blocks from (out, log-sum-exp); O(B H T block) memory, every
              backend. `auto` on CPU.
  pallas_gpu  Triton-lowered Pallas kernels (kernels/flash_gpu.py). `auto` on GPUs not in
              AUTO_GPU, or without tokamax.
  pallas_tpu  Mosaic Pallas kernels (kernels/flash_tpu.py). `auto` on TPU.
  tokamax     tokamax's kernels (optional package; kernels/flash_tokamax.py), S_max from
              their softmax residuals where the residuals' units are checked. `auto` on the
              GPUs AUTO_GPU lists, when tokamax is installed.
Both Pallas versions run on CPU with interpret=True (that is how they are tested).
"""

import functools

import jax
import jax.numpy as jnp

from k2jax.kernels import platform
from k2jax.kernels.flash_common import PAD_SEGMENT, finish  # noqa: F401 (flash.finish: its name first)

IMPLS = ("xla", "chunked", "pallas_gpu", "pallas_tpu", "tokamax")


def attention(q, k, v, *, scale: float, segment_ids=None, causal: bool = True,
              impl: str = "auto", interpret: bool = False, block: int | None = None,
              tuning: dict | None = None):
  """-> (out [B, T, H, Dv] in v's dtype, max_logits [H] f32). See the module docstring.

  Args:
    q: [B, T, H, Dqk].
    k: [B, T, H, Dqk].
    v: [B, T, H, Dv].
    scale: the softmax scale s (1/sqrt(Dqk), times YaRN's mscale^2 in MLA).
    segment_ids: [B, T] int (0 = padding) or None (one document per row).
    causal: mask j > i.
    impl: "auto" | "xla" | "chunked" | "pallas_gpu" | "pallas_tpu" | "tokamax".
    interpret: run a Pallas implementation in interpret mode (CPU tests).
    block: block size along T (chunked / Pallas); None = the implementation's default.
    tuning: pallas_gpu's {"fwd" / "bwd": (block_q, block_k, num_warps, num_stages)}.
  """
  if q.shape[:3] != k.shape[:3] or k.shape[:3] != v.shape[:3] or q.shape[-1] != k.shape[-1]:
    raise ValueError(f"attention: q {q.shape}, k {k.shape}, v {v.shape}: need q, k [B, T, H, "
                     "Dqk] and v [B, T, H, Dv] with equal B, T, H")
  if impl == "auto":
    impl = auto_impl()
  if impl == "xla":
    return attention_xla(q, k, v, scale, segment_ids, causal)
  if impl == "chunked":
    return attention_chunked(q, k, v, scale, segment_ids, causal, block)
  if impl == "pallas_gpu":
    from k2jax.kernels import flash_gpu as attention_gpu
    return attention_gpu.attention(q, k, v, scale=scale, segment_ids=segment_ids,
                                   causal=causal, interpret=interpret, block=block, tuning=tuning)
  if impl == "pallas_tpu":
    from k2jax.kernels import flash_tpu as attention_tpu
    return attention_tpu.attention(q, k, v, scale=scale, segment_ids=segment_ids,
                                   causal=causal, interpret=interpret, block=block)
  if impl == "tokamax":
    from k2jax.kernels import flash_tokamax
    return flash_tokamax.attention(q, k, v, scale=scale, segment_ids=segment_ids, causal=causal)
  raise ValueError(f"attention impl = {impl!r}: must be one of auto, {', '.join(IMPLS)}")


# GPU device kinds where `auto` takes tokamax over pallas_gpu: on each, tokamax's Mosaic GPU
# kernel was the faster at MLA's 192 / 128 with S_max emitted, forward and backward
# (experiments/results/attention/gpu_attention_h100_64k.csv, tokamax_tune_h200.csv).
# A kind not listed keeps ours, and so does lowering for CUDA on a machine without a GPU (the
# choice needs the device kind).
AUTO_GPU = {"NVIDIA H100 80GB HBM3": "tokamax", "NVIDIA H200": "tokamax"}


def _have_tokamax() -> bool:
  try:
    platform.tokamax()
    return True
  except ImportError:
    return False


def auto_impl(backend: str | None = None, device_kind: str | None = None) -> str:
  """The implementation `auto` picks on a backend (and, on GPUs, device kind: AUTO_GPU)."""
  backend = backend or platform.backend()
  if backend == "gpu":
    pick = AUTO_GPU.get(device_kind or platform.gpu_kind() or "", "pallas_gpu")
    return pick if pick != "tokamax" or _have_tokamax() else "pallas_gpu"
  return {"tpu": "pallas_tpu"}.get(backend, "chunked")


def masks(T: int, segment_ids, causal: bool, q_pos=None, k_pos=None):
  """(valid [B or 1, 1, Tq, Tk], counted rows [B or 1, 1, Tq, 1]) for positions q_pos /
  k_pos (default all T)."""
  q_pos = jnp.arange(T) if q_pos is None else q_pos
  k_pos = jnp.arange(T) if k_pos is None else k_pos
  valid = (q_pos[:, None] >= k_pos[None, :]) if causal else jnp.ones((len(q_pos), len(k_pos)),
                                                                     bool)
  valid = valid[None, None]
  if segment_ids is None:
    return valid, jnp.ones((1, 1, len(q_pos), 1), bool)
  sq, sk = segment_ids[:, q_pos], segment_ids[:, k_pos]
  valid = valid & (sq[:, None, :, None] == sk[:, None, None, :])
  return valid, (sq > 0)[:, None, :, None]


def attention_xla(q, k, v, scale, segment_ids=None, causal=True):
  """The reference: materialized f32 logits and softmax."""
  T = q.shape[1]
  # Head-major layout: XLA:CPU runs the batched matmuls faster than with heads inside.
  q, k, v = (jnp.swapaxes(a, 1, 2) for a in (q, k, v))              # [B, H, T, D]
  logits = jnp.einsum("bhqd,bhkd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
  valid, counted = masks(T, segment_ids, causal)
  logits = jnp.where(valid, logits, -jnp.inf)
  max_logits = jnp.max(jnp.where(valid & counted, logits, -jnp.inf), axis=(0, 2, 3))
  probs = jax.nn.softmax(logits, axis=-1)
  out = jnp.einsum("bhqk,bhkd->bhqd", probs.astype(v.dtype), v)
  return jnp.swapaxes(out, 1, 2), jax.lax.stop_gradient(max_logits)


# --------------------------------------------------------------------------- chunked (flash)

def _default_block(T: int) -> int:
  # Large enough that each block pair is an efficient matmul on CPU, small enough that the
  # [B, H, block, block] temporaries stay cache-sized; never more than T needs.
  return min(512, -(-T // 8) * 8)


def _blocked(x, nb, block):
  """[B, H, nb * block, ...] -> [nb, B, H, block, ...]."""
  B, H = x.shape[:2]
  return jnp.moveaxis(x.reshape((B, H, nb, block) + x.shape[3:]), 2, 0)


def _unblocked(x):
  """[nb, B, H, block, ...] -> [B, H, nb * block, ...]."""
  nb, B, H, bl = x.shape[:4]
  return jnp.moveaxis(x, 0, 2).reshape((B, H, nb * bl) + x.shape[4:])


def _prepare(q, k, v, segment_ids, block):
  """Pad T to a block multiple (padding gets PAD_SEGMENT) and go head-major."""
  B, T = q.shape[:2]
  block = block or _default_block(T)
  nb = -(-T // block)
  pad = nb * block - T
  seg = jnp.ones((B, T), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
  seg = jnp.pad(seg, ((0, 0), (0, pad)), constant_values=PAD_SEGMENT)
  hm = lambda a: jnp.swapaxes(jnp.pad(a, ((0, 0), (0, pad), (0, 0), (0, 0))), 1, 2)
  return hm(q), hm(k), hm(v), seg, nb, block


def _block_logits(qi, kj, segi, segj, i, j, block, scale, causal):
  """Scaled f32 logits of q block i against k block j, invalid pairs at -inf."""
  s = jnp.einsum("bhqd,bhkd->bhqk", qi, kj, preferred_element_type=jnp.float32) * scale
  valid = segi[:, None, :, None] == segj[:, None, None, :]
  if causal:
    rows = i * block + jnp.arange(block)
    cols = j * block + jnp.arange(block)
    valid = valid & (rows[:, None] >= cols[None, :])
  return jnp.where(valid, s, -jnp.inf)


def _kv_range(i, nb, causal):
  return 0, (i + 1 if causal else nb)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _flash(q, k, v, qseg, kseg, qids, scale, causal, block):
  out, _, mx = _flash_fwd_impl(q, k, v, qseg, kseg, qids, scale, causal, block)
  return out, mx


# q may hold a subset of the sequence's blocks (context parallelism: k2jax.model.context),
# in ascending order: qids[i] is the position of q's block i among k's blocks, which is what
# the causal mask compares. Self-attention is qids = arange(nb).

def _segments(seg, nb, block):
  return jnp.moveaxis(seg.reshape(seg.shape[0], nb, block), 1, 0)      # [nb, B, block]


def _flash_fwd_impl(q, k, v, qseg, kseg, qids, scale, causal, block):
  """Head-major padded inputs -> (out [B, H, Tq, Dv], lse [B, H, Tq], row max [B, H, Tq])."""
  B, H, Tq, _ = q.shape
  nq, nk = Tq // block, k.shape[2] // block
  Dv = v.shape[-1]
  qb, kb, vb = _blocked(q, nq, block), _blocked(k, nk, block), _blocked(v, nk, block)
  qsb, ksb = _segments(qseg, nq, block), _segments(kseg, nk, block)

  def q_block(args):
    i, qi, segi = args

    def kv_step(j, carry):
      m, l, acc = carry
      s = _block_logits(qi, kb[j], segi, ksb[j], i, j, block, scale, causal)
      m_new = jnp.maximum(m, s.max(-1))
      safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)                  # rows with no key yet
      p = jnp.exp(s - safe[..., None])
      corr = jnp.exp(m - safe)
      l = l * corr + p.sum(-1)
      acc = acc * corr[..., None] + jnp.einsum("bhqk,bhkd->bhqd", p.astype(vb.dtype), vb[j],
                                               preferred_element_type=jnp.float32)
      return m_new, l, acc

    init = (jnp.full((B, H, block), -jnp.inf, jnp.float32), jnp.zeros((B, H, block), jnp.float32),
            jnp.zeros((B, H, block, Dv), jnp.float32))
    m, l, acc = jax.lax.fori_loop(*_kv_range(i, nk, causal), kv_step, init)
    l_safe = jnp.where(l == 0, 1.0, l)
    return (acc / l_safe[..., None]).astype(v.dtype), m + jnp.log(l_safe), m

  out, lse, m = jax.lax.map(q_block, (qids, qb, qsb))
  return _unblocked(out), _unblocked(lse), _unblocked(m)


def _flash_fwd(q, k, v, qseg, kseg, qids, scale, causal, block):
  out, lse, m = _flash_fwd_impl(q, k, v, qseg, kseg, qids, scale, causal, block)
  return (out, m), (q, k, v, qseg, kseg, qids, out, lse)


def _flash_bwd(scale, causal, block, res, cts):
  q, k, v, qseg, kseg, qids, out, lse = res
  do = cts[0]
  B, H, Tq, _ = q.shape
  nq, nk = Tq // block, k.shape[2] // block
  delta = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), -1)   # [B, H, Tq]
  qb, dob, lb, db = (_blocked(a, nq, block) for a in (q, do, lse, delta))
  kb, vb = _blocked(k, nk, block), _blocked(v, nk, block)
  qsb, ksb = _segments(qseg, nq, block), _segments(kseg, nk, block)

  def probs(i, j):     # q's block i (position qids[i]) against k's block j
    s = _block_logits(qb[i], kb[j], qsb[i], ksb[j], qids[i], j, block, scale, causal)
    return jnp.exp(s - lb[i][..., None])                                # 0 where invalid

  def dscores(i, j, p):
    dp = jnp.einsum("bhqd,bhkd->bhqk", dob[i], vb[j], preferred_element_type=jnp.float32)
    return p * (dp - db[i][..., None])

  def dq_block(i):
    def step(j, acc):
      ds = dscores(i, j, probs(i, j))
      return acc + jnp.einsum("bhqk,bhkd->bhqd", ds.astype(k.dtype), kb[j],
                              preferred_element_type=jnp.float32)
    acc = jax.lax.fori_loop(*_kv_range(qids[i], nk, causal), step,
                            jnp.zeros(qb.shape[1:], jnp.float32))
    return (acc * scale).astype(q.dtype)

  def dkv_block(j):
    def step(i, carry):
      dk, dv = carry
      p = probs(i, j)
      dv = dv + jnp.einsum("bhqk,bhqd->bhkd", p.astype(do.dtype), dob[i],
                           preferred_element_type=jnp.float32)
      ds = dscores(i, j, p)
      dk = dk + jnp.einsum("bhqk,bhqd->bhkd", ds.astype(q.dtype), qb[i],
                           preferred_element_type=jnp.float32)
      return dk, dv
    init = (jnp.zeros(kb.shape[1:], jnp.float32), jnp.zeros(vb.shape[1:], jnp.float32))
    # the q blocks at or after k's block j (qids ascend): all of them without the mask
    first = jnp.searchsorted(qids, j).astype(jnp.int32) if causal else 0
    dk, dv = jax.lax.fori_loop(first, nq, step, init)
    return (dk * scale).astype(k.dtype), dv.astype(v.dtype)

  dq = _unblocked(jax.lax.map(dq_block, jnp.arange(nq)))
  dk, dv = jax.lax.map(dkv_block, jnp.arange(nk))
  return dq, _unblocked(dk), _unblocked(dv), None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def attention_chunked(q, k, v, scale, segment_ids=None, causal=True, block=None):
  """The flash algorithm in plain JAX (see the module docstring)."""
  T = q.shape[1]
  qh, kh, vh, seg, nb, block = _prepare(q, k, v, segment_ids, block)
  out, row_max = _flash(qh, kh, vh, seg, seg, jnp.arange(nb), float(scale), bool(causal),
                        int(block))
  return finish(out, row_max, seg, T)


def attention_blocks(q, k, v, *, scale: float, q_block_ids, block: int, q_segment_ids=None,
                     k_segment_ids=None, causal: bool = True, impl: str = "chunked",
                     interpret: bool = False, kernel_block: int | None = None):
  """Some query blocks of a sequence against all of its keys: what one device of a
  context-parallel attention computes (k2jax.model.context).

  q [B, nq * block, H, Dqk] holds the sequence's blocks q_block_ids (int [nq], ascending;
  block b is tokens b * block .. (b + 1) * block - 1); k [B, nk * block, H, Dqk] and
  v [B, nk * block, H, Dv] the whole sequence. Pairs are valid as in `attention` with each
  token's place in the whole sequence: causal by place, same segment (q_segment_ids
  [B, nq * block] / k_segment_ids [B, nk * block], 0 = padding, None = one document).
  -> (out [B, nq * block, H, Dv], max_logits [H] over these rows).

  impl: as `attention`'s. chunked is the flash loop above (the dkv loop starts at the first
  q block at or after each key block); the Pallas kernels and tokamax take each row's place
  (pallas_tpu: each of its blocks' first place, so its blocks split `block`); xla
  materializes the [B, H, Tq, Tk] logits. interpret: the Pallas kernels' interpret mode
  (CPU tests); kernel_block: their block size (tests; default their own choice).
  """
  B, Tq = q.shape[:2]
  Tk = k.shape[1]
  if Tq % block or Tk % block:
    raise ValueError(f"attention_blocks: {Tq} query and {Tk} key tokens must be "
                     f"whole blocks of {block}")
  ones = lambda n: jnp.ones((B, n), jnp.int32)
  qseg = ones(Tq) if q_segment_ids is None else q_segment_ids.astype(jnp.int32)
  kseg = ones(Tk) if k_segment_ids is None else k_segment_ids.astype(jnp.int32)
  ids = jnp.asarray(q_block_ids, jnp.int32)
  places = (ids[:, None] * block + jnp.arange(block, dtype=jnp.int32)).reshape(-1)
  if impl == "auto":
    impl = auto_impl()
  if impl == "chunked":
    hm = lambda a: jnp.swapaxes(a, 1, 2)
    out, row_max = _flash(hm(q), hm(k), hm(v), qseg, kseg, ids, float(scale), bool(causal),
                          int(block))
    return finish(out, row_max, qseg, Tq)
  if impl == "xla":
    return _blocks_xla(q, k, v, scale, places, qseg, kseg, causal)
  if impl == "pallas_gpu":
    from k2jax.kernels import flash_gpu
    return flash_gpu.attention_blocks(q, k, v, scale=scale, q_positions=places,
                                      q_segment_ids=qseg, k_segment_ids=kseg, causal=causal,
                                      interpret=interpret, block=kernel_block)
  if impl == "pallas_tpu":
    from k2jax.kernels import flash_tpu
    return flash_tpu.attention_blocks(q, k, v, scale=scale, q_block_ids=ids, block=block,
                                      q_segment_ids=qseg, k_segment_ids=kseg, causal=causal,
                                      interpret=interpret, kernel_block=kernel_block)
  if impl == "tokamax":
    from k2jax.kernels import flash_tokamax
    return flash_tokamax.attention_blocks(q, k, v, scale=scale, q_positions=places,
                                          q_segment_ids=qseg, k_segment_ids=kseg,
                                          causal=causal)
  raise ValueError(f"attention impl = {impl!r}: must be one of auto, {', '.join(IMPLS)}")


def _blocks_xla(q, k, v, scale, places, qseg, kseg, causal):
  """`attention_xla` for rows at `places` of the keys' sequence."""
  q, k, v = (jnp.swapaxes(a, 1, 2) for a in (q, k, v))              # [B, H, T, D]
  logits = jnp.einsum("bhqd,bhkd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
  valid = (qseg[:, :, None] == kseg[:, None, :])[:, None]
  if causal:
    valid = valid & (places[:, None] >= jnp.arange(k.shape[2]))[None, None]
  logits = jnp.where(valid, logits, -jnp.inf)
  counted = (qseg > 0)[:, None, :, None]
  max_logits = jnp.max(jnp.where(valid & counted, logits, -jnp.inf), axis=(0, 2, 3))
  out = jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(logits, axis=-1).astype(v.dtype), v)
  return jnp.swapaxes(out, 1, 2), jax.lax.stop_gradient(max_logits)


def flops(B: int, T: int, H: int, dqk: int, dv: int, causal: bool = True) -> float:
  """Matmul FLOPs of the forward pass (QK^T and PV), halved for causal masking."""
  return 2.0 * B * H * T * T * (dqk + dv) * (0.5 if causal else 1.0)
