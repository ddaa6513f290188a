"""k2jax.kernels.attention: every implementation against float64 numpy (outputs, S_max and
dq / dk / dv), Pallas kernels in interpret mode with their outputs poisoned (NaN) before the
call (kernels/pallas_utils.py), on odd sizes: T not a multiple of the block, T = 1, several
documents and padding per row, 1 and 5 heads, MLA's 192 / 128 head dims, f32 and bf16.

Inputs are fresh on every run (tests/numerics.py: K2JAX_TEST_SEED replays one); each element
is held to a rounding bound derived from the inputs' magnitudes (`error_bounds`)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k2jax.kernels import attention
from tests.numerics import U16, U32, assert_within, gamma, replay, seed_and_rng

try:
  import tokamax  # noqa: F401  (optional extra: its tests skip without it)
  HAVE_TOKAMAX = True
except ImportError:
  HAVE_TOKAMAX = False
needs_tokamax = pytest.mark.skipif(not HAVE_TOKAMAX, reason="tokamax is not installed")
IMPLS = ["xla", "chunked", "pallas_gpu", "pallas_tpu",
         pytest.param("tokamax", marks=needs_tokamax)]


def reference(q, k, v, do, scale, seg, causal):
  """float64: out, S_max, the gradients of sum(out * do), and the intermediates the error
  bounds read (logits s, probabilities p, dp = do v^T, delta, ds, masks)."""
  q, k, v, do = (np.asarray(a, np.float64) for a in (q, k, v, do))
  B, T, H, _ = q.shape
  s = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
  valid = np.ones((B, 1, T, T), bool)
  if causal:
    valid &= np.tril(np.ones((T, T), bool))
  counted = np.ones((B, 1, T, 1), bool)
  if seg is not None:
    valid &= seg[:, None, :, None] == seg[:, None, None, :]
    counted = (seg > 0)[:, None, :, None]
  valid = np.broadcast_to(valid, s.shape)
  smax = np.where(valid & counted, s, -np.inf).max(axis=(0, 2, 3))
  ms = np.where(valid, s, -np.inf)
  p = np.exp(ms - ms.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  out = np.einsum("bhqk,bkhd->bqhd", p, v)
  dp = np.einsum("bqhd,bkhd->bhqk", do, v)
  delta = (dp * p).sum(-1, keepdims=True)
  ds = p * (dp - delta)
  dq = np.einsum("bhqk,bkhd->bqhd", ds, k) * scale
  dk = np.einsum("bhqk,bqhd->bkhd", ds, q) * scale
  dv = np.einsum("bhqk,bqhd->bkhd", p, do)
  return dict(out=out, smax=smax, dq=dq, dk=dk, dv=dv, s=s, p=p, dp=dp, delta=delta, ds=ds,
              valid=valid, counted=np.broadcast_to(counted, s.shape))


# The error analysis below is first order: it drops products of two errors, each relative
# error here < 1e-2 (bf16) and < 1e-3 (f32), so they add < 2% to the bound (the exp / log
# roundings are counted in R at 4 ulp each; XLA's f32 approximations are within 2). 1.25
# covers the dropped terms with room to spare.
SLACK = 1.25


def error_bounds(r, q, k, v, do, scale, dtype):
  """Per-element bounds on |kernel - float64| for an implementation that forms logits by
  f32-accumulated dots (all of ours and tokamax's do: S_max is an f32 quantity) and, for
  bf16 inputs, may round each intermediate that feeds a matmul (p, dp, ds, out) to bf16 once
  and writes bf16 outputs. q, k, v, do: the rounded inputs the kernel saw.

    s_ij = scale q_i . k_j       off by E_ij = gamma(D + 6) scale sum_d |q_id k_jd|
                                 (D products summed in any order; the scale rounded and
                                 multiplied; pallas_gpu's round trip through base 2)
    S_max                        off by max E over counted valid pairs (max is exact)
    log p_ij = s_ij - lse_i      off by G_ij + R_i: the logit errors move log p by
                                 d s_ij - sum_l p_il d s_il, so G = (1 - p_ij) E_ij +
                                 sum_{l != j} p_il E_il; R covers the softmax's own roundings
                                 (a T-term denominator, one rescale per key block, at most T
                                 blocks, exp / log within 4 ulp, subtractions of logits and
                                 lse of size <= M_i = max_j |s_ij| + log T)
    out = p @ v                  sum_j p_ij (expm1(G + R) + u_mid + gamma(T + 1)) |v_j|
                                 + the output's rounding
    dp = do @ v^T                gamma(Dv) |do| @ |v|^T + u_mid |dp|
    delta = rowsum(do * out) = rowsum(p * dp): the kernels use the first form, autodiff the
                                 second; p's errors enter both as sum_j d p_ij dp_ij, and
                                 the bound adds both forms' own roundings
    ds = p (dp - delta)          p (rel_p |dp - delta| + err dp + err delta) + u_mid |ds|
    dq = scale ds @ k, dk = scale ds^T @ q, dv = p^T @ do: like out, width T.
  """
  u_mid = 0.0 if dtype == jnp.float32 else U16     # intermediates rounded to bf16
  u_out = U32 if dtype == jnp.float32 else U16     # outputs written in the input dtype
  q, k, v, do = (np.abs(np.asarray(a, np.float64)) for a in (q, k, v, do))
  B, T, H, D = q.shape
  Dv = v.shape[-1]
  valid, p = r["valid"], r["p"]
  A = np.where(valid, scale * np.einsum("bqhd,bkhd->bhqk", q, k), 0.0)
  E = gamma(D + 6) * A
  Ebar = (p * E).sum(-1, keepdims=True)
  G = np.where(valid, E + Ebar - 2 * p * E, 0.0)
  M = np.where(valid, np.abs(r["s"]), 0.0).max(-1, keepdims=True) + np.log(T)
  R = U32 * (T + 8 * (T + 2) + 8 * (M + 1))
  rel_p = np.where(valid, np.expm1(G + R), 0.0)
  b = {"smax": np.where(r["valid"] & r["counted"], E, 0.0).max(axis=(0, 2, 3))}
  b["out"] = (np.einsum("bhqk,bkhd->bqhd", p * (rel_p + u_mid + gamma(T + 1)), v)
              + (u_out + U32) * np.abs(r["out"]))
  dp, delta, ds = r["dp"], r["delta"], r["ds"]
  err_dp = gamma(Dv) * np.einsum("bqhd,bkhd->bhqk", do, v) + u_mid * np.abs(dp)
  # delta's error: the p errors reach it as sum_j d p_ij dp_ij in either form (out's error
  # is sum_j d p_ij v_j plus its roundings); then each form's own roundings.
  out_rounding = (np.einsum("bhqk,bkhd->bqhd", p * (u_mid + gamma(T + 1)), v)
                  + (u_out + U32 + gamma(Dv + 1)) * np.abs(r["out"]))
  err_delta = ((p * (rel_p * np.abs(dp) + err_dp + gamma(T) * np.abs(dp))).sum(-1, keepdims=True)
               + np.swapaxes((do * out_rounding).sum(-1), 1, 2)[..., None])
  err_ds = (p * ((rel_p + 2 * U32) * np.abs(dp - delta) + err_dp + err_delta)
            + u_mid * np.abs(ds))
  ds_w = err_ds + gamma(T + 2) * np.abs(ds)        # what enters dq / dk: errors + its dot
  b["dq"] = scale * np.einsum("bhqk,bkhd->bqhd", ds_w, k) + u_out * np.abs(r["dq"])
  b["dk"] = scale * np.einsum("bhqk,bqhd->bkhd", ds_w, q) + u_out * np.abs(r["dk"])
  b["dv"] = (np.einsum("bhqk,bqhd->bkhd", p * (rel_p + u_mid + gamma(T)), do)
             + u_out * np.abs(r["dv"]))
  return {name: SLACK * x for name, x in b.items()}


def segments(B, T, rng, n_cuts=3):
  """Packed rows: n_cuts random cuts make n_cuts + 1 documents of random lengths (ids 1, 2,
  ...); odd rows turn their last document into padding (id 0)."""
  seg = np.zeros((B, T), np.int32)
  for b in range(B):
    cuts = np.sort(rng.choice(np.arange(1, T), size=min(n_cuts, T - 1), replace=False))
    ids = np.searchsorted(cuts, np.arange(T), side="right") + 1
    seg[b] = np.where(np.arange(T) < cuts[-1] if b % 2 else True, ids, 0)
  return seg


CASES = {
    # name: B, T, H, Dqk, Dv, cuts between documents (None: no segment ids), causal, dtype,
    # block
    "odd": (2, 37, 5, 48, 32, 3, True, jnp.float32, 16),
    "mla_dims": (1, 20, 1, 192, 128, None, True, jnp.float32, 16),
    "t1": (2, 1, 1, 32, 16, None, True, jnp.float32, None),
    "bidirectional": (2, 24, 2, 32, 32, 3, False, jnp.float32, 16),
    "bf16": (2, 33, 5, 48, 32, 3, True, jnp.bfloat16, 16),
    # many documents over many blocks: most block pairs belong to different documents (the
    # Pallas kernels skip them)
    "packed": (2, 75, 2, 32, 16, 8, True, jnp.float32, 8),
    "packed_bidirectional": (2, 75, 2, 32, 16, 8, False, jnp.float32, 8),
}


@functools.lru_cache(maxsize=None)
def _forward_and_gradients(impl, scale, causal, block):
  """jit((q, k, v, do, seg) -> (out, S_max, (dq, dk, dv))), one per configuration, so that
  repeated draws (tests/numerics.py) reuse the compiled kernels."""
  def f(q, k, v, do, seg):
    (out, smax), vjp = jax.vjp(
        lambda q, k, v: attention(q, k, v, scale=scale, segment_ids=seg, causal=causal,
                                  impl=impl, interpret=True, block=block), q, k, v)
    return out, smax, vjp((do, jnp.zeros_like(smax)))
  return jax.jit(f)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_attention_matches_float64(impl, case):
  B, T, H, D, Dv, n_cuts, causal, dtype, block = CASES[case]
  seed, rng = seed_and_rng()
  q, k = (rng.standard_normal((B, T, H, D)) * 1.5 for _ in range(2))
  v, do = rng.standard_normal((B, T, H, Dv)), rng.standard_normal((B, T, H, Dv))
  seg = None if n_cuts is None else segments(B, T, rng, n_cuts)
  scale = D ** -0.5
  args = [jnp.asarray(a, dtype) for a in (q, k, v, do)]
  q, k, v, do = (np.asarray(a.astype(jnp.float32)) for a in args)   # what the kernel sees
  want = reference(q, k, v, do, scale, seg, causal)
  bound = error_bounds(want, q, k, v, do, scale, dtype)
  seg_ = None if seg is None else jnp.asarray(seg)
  out, smax, grads = _forward_and_gradients(impl, scale, causal, block)(*args, seg_)
  for name, got in [("out", out), *zip(("dq", "dk", "dv"), grads)]:
    assert got.dtype == dtype, (name, got.dtype, replay(seed))
    # poisoned buffers: an unwritten element is NaN, outside every bound
    assert_within(f"{impl} {case} {name}", got.astype(jnp.float32), want[name], bound[name],
                  seed)
  assert smax.dtype == jnp.float32 and smax.shape == (H,), (smax.dtype, smax.shape)
  assert_within(f"{impl} {case} S_max", smax, want["smax"], bound["smax"], seed)
  # Against the f32 xla implementation: each within the bound of float64, so within twice it.
  _, ref_max = attention(*args[:3], scale=scale, segment_ids=seg_, causal=causal, impl="xla")
  assert_within(f"{impl} {case} S_max vs xla", smax, ref_max, 2 * bound["smax"], seed)


@functools.lru_cache(maxsize=None)
def _max_logits_and_gradient(impl):
  def smax(q, k, v, seg):
    return attention(q, k, v, scale=1.0, segment_ids=seg, impl=impl, interpret=True)[1]
  return jax.jit(smax), jax.jit(jax.grad(lambda *a: smax(*a).sum()))


def test_max_logits_carry_no_gradient_and_ignore_padding():
  seed, rng = seed_and_rng()
  q, k, v = (jnp.asarray(rng.standard_normal((1, 8, 2, 16)), jnp.float32) for _ in range(3))
  seg = jnp.asarray([[1, 1, 1, 1, 1, 0, 0, 0]])
  loud_row = int(rng.integers(5, 8))
  for impl in ("chunked", "pallas_gpu") + (("tokamax",) if HAVE_TOKAMAX else ()):
    smax, grad = _max_logits_and_gradient(impl)
    assert float(jnp.abs(grad(q, k, v, seg)).max()) == 0.0, (impl, replay(seed))
    # Make a padding row's logits the largest: S_max must not see them.
    loud = q.at[0, loud_row].multiply(100.0)
    np.testing.assert_array_equal(smax(loud, k, v, seg), smax(q, k, v, seg),
                                  err_msg=f"{impl} {replay(seed)}")


def test_auto_picks_the_chunked_flash_path_on_cpu():
  from k2jax.kernels import flash
  assert flash.auto_impl("cpu") == "chunked"
  assert (flash.auto_impl("gpu"), flash.auto_impl("tpu")) == ("pallas_gpu", "pallas_tpu")
  # measured device kinds take their table entry when tokamax is there, ours otherwise
  assert flash.auto_impl("gpu", "NVIDIA H100 80GB HBM3") == (
      "tokamax" if HAVE_TOKAMAX else "pallas_gpu")
  assert flash.auto_impl("gpu", "some unmeasured GPU") == "pallas_gpu"
  with pytest.raises(ValueError, match="attention impl = 'cudnn'"):
    attention(*(jnp.zeros((1, 4, 1, 8)),) * 3, scale=1.0, impl="cudnn")


@needs_tokamax
def test_tokamax_residual_max_is_the_scaled_natural_logit_and_unchecked_kernels_are_refused():
  """S_max from tokamax's softmax residuals: the xla implementation's row max measured
  against float64 (factor 1: scaled, natural units, masked to the row's document), and a
  kernel whose factor nobody measured is refused, naming the fix."""
  from k2jax.kernels import flash_tokamax as ft
  r = ft.residual_check("xla")
  assert r["natural"] and not r["base2"] and r["rel"] < 1e-5, r
  seg = jnp.asarray([[3, 3, 5, 5, 5, 0, 0], [1, 1, 1, 1, 1, 1, 1]])
  start, end = ft._run_bounds(seg)
  assert start.tolist() == [[0, 0, 2, 2, 2, 5, 5], [0] * 7]
  assert end.tolist() == [[2, 2, 5, 5, 5, 7, 7], [7] * 7]
  with pytest.raises(ValueError, match="gpu_check.py --only tokamax"):
    ft.attention(*(jnp.zeros((1, 4, 1, 8)),) * 3, scale=1.0, name="xla_chunked")
  # tokamax's TPU kernel cannot take packed documents at all: that, not its units, is named
  with pytest.raises(ValueError, match=r"NotImplementedError for Mask.k_start.*auto on TPU"):
    ft.attention(*(jnp.zeros((1, 4, 1, 8)),) * 3, scale=1.0, name="mosaic_tpu")


@pytest.mark.parametrize("impl,platform", [("pallas_gpu", "cuda"), ("pallas_tpu", "tpu")])
@pytest.mark.parametrize("x64", [False, True], ids=["x32", "x64"])
def test_pallas_kernels_lower_for_their_accelerator_with_and_without_x64(impl, platform, x64):
  """The Triton / Mosaic lowering (run on CPU) of forward and every gradient, at an odd length
  and MLA's head dims, also under jax_enable_x64 (where the GPU kernel once mixed int32 block
  indices with int64 Python constants)."""
  with jax.enable_x64(x64):
    q = jax.ShapeDtypeStruct((1, 100, 2, 192), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((1, 100, 2, 128), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((1, 100), jnp.int32)

    def loss(q, k, v, seg):
      out, smax = attention(q, k, v, scale=0.07, segment_ids=seg, impl=impl)
      return out.astype(jnp.float32).sum() + smax.sum()
    grads = jax.grad(loss, argnums=(0, 1, 2))
    for f in (loss, grads):
      text = jax.jit(f).trace(q, q, v, seg).lower(lowering_platforms=(platform,)).as_text()
      assert ("triton" if platform == "cuda" else "tpu_custom_call") in text.lower()


@pytest.mark.parametrize("impl,platform", [("pallas_gpu", "cuda"), ("pallas_tpu", "tpu")])
@pytest.mark.parametrize("x64", [False, True], ids=["x32", "x64"])
def test_pallas_kernels_lower_for_a_context_devices_query_blocks(impl, platform, x64):
  """attention_blocks at MLA's head dims as a context device runs it (k2jax.model.context:
  2 of 8 chunks of 128 tokens against the whole 1,024-token sequence, the places traced from
  the device's index) lowers for its accelerator, forward and every gradient."""
  from k2jax.kernels import flash
  with jax.enable_x64(x64):
    q = jax.ShapeDtypeStruct((1, 256, 2, 192), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 1024, 2, 192), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((1, 1024, 2, 128), jnp.bfloat16)
    seg_q, seg_k = (jax.ShapeDtypeStruct((1, n), jnp.int32) for n in (256, 1024))

    def loss(q, k, v, seg_q, seg_k, c):
      ids = jnp.stack([c, 7 - c]).astype(jnp.int32)
      out, smax = flash.attention_blocks(q, k, v, scale=0.07, q_block_ids=ids, block=128,
                                         q_segment_ids=seg_q, k_segment_ids=seg_k, impl=impl)
      return out.astype(jnp.float32).sum() + smax.sum()
    c = jax.ShapeDtypeStruct((), jnp.int32)
    for f in (loss, jax.grad(loss, argnums=(0, 1, 2))):
      text = jax.jit(f).trace(q, k, v, seg_q, seg_k, c).lower(
          lowering_platforms=(platform,)).as_text()
      assert ("triton" if platform == "cuda" else "tpu_custom_call") in text.lower()


@pytest.mark.parametrize("T", [100, 300, 4096])
def test_tpu_kernels_lower_with_segment_ids_and_their_band_at_several_lengths(T):
  """The Mosaic lowering (run on CPU) of forward and every gradient with segment ids, whose
  per-block band reaches each kernel's index maps through scalar prefetch (SMEM): one block
  (T 100), several with a partial last one (300), K2's sequence length (4096)."""
  q = jax.ShapeDtypeStruct((1, T, 2, 192), jnp.bfloat16)
  v = jax.ShapeDtypeStruct((1, T, 2, 128), jnp.bfloat16)
  seg = jax.ShapeDtypeStruct((1, T), jnp.int32)

  def loss(q, k, v, seg):
    out, smax = attention(q, k, v, scale=0.07, segment_ids=seg, impl="pallas_tpu")
    return out.astype(jnp.float32).sum() + smax.sum()
  for f, calls in ((loss, 1), (jax.grad(loss, argnums=(0, 1, 2)), 3)):
    text = jax.jit(f).trace(q, q, v, seg).lower(lowering_platforms=("tpu",)).as_text()
    assert text.count("tpu_custom_call") >= calls


def tpu_block_copies(monkeypatch, seg, bq, bk, causal):
  """The T block each input of the TPU kernels' three pallas_calls reads at every grid step,
  from the calls' own index maps (and scalar-prefetch operands), with a recorder standing in
  for pallas_call: {name: (grid steps [n, 4] in order, [blocks [n] per input])}. The
  pipeline copies a block HBM -> VMEM when its index differs from the previous step's."""
  from k2jax.kernels import flash_tpu
  B, Tp = seg.shape
  calls = {}

  def record(kernel, *, in_specs, out_shape, grid, name, num_scalar_prefetch=0, **_):
    def run(*args):
      scalars, arrays = args[:num_scalar_prefetch], args[num_scalar_prefetch:]
      steps = np.stack(np.meshgrid(*map(np.arange, grid), indexing="ij"), -1).reshape(-1, 4)
      blocks = []
      for spec, a in zip(in_specs, arrays):
        index = jax.vmap(lambda s: spec.index_map(*s, *scalars))(jnp.asarray(steps, jnp.int32))
        blocks.append(np.asarray(index[a.shape.index(Tp)]))       # the block index along T
      calls[name] = (steps, blocks)
      shapes = out_shape if isinstance(out_shape, list) else [out_shape]
      outs = [jnp.zeros(o.shape, o.dtype) for o in shapes]
      return outs if isinstance(out_shape, list) else outs[0]
    return run

  monkeypatch.setattr(flash_tpu, "pallas_call", record)
  x, rows = jnp.zeros((B, 1, Tp, 8)), jnp.zeros((B, 1, 1, Tp))
  q_first = jnp.arange(Tp // bq, dtype=jnp.int32) * bq          # self-attention
  flash_tpu._forward(x, x, x, seg, seg, q_first, 1.0, causal, bq, bk, True)
  flash_tpu._attn_bwd(1.0, causal, bq, bk, True, (x, x, x, seg, seg, q_first, x, rows),
                      (x, None))
  return calls


def check_tpu_copies(monkeypatch, seg, bq, bk, causal):
  """Every block pair holding a valid (q, kv) pair reads its own blocks, and no step copies
  a block that shares no valid pair with the step's outer block: on the inner axis (kv
  blocks of fwd / dq, q blocks of dk / dv) each input is copied at most once per block pair
  that holds a valid pair. -> (copies of one inner input per kernel, pairs holding a valid
  pair, pairs in the causal band)."""
  B, Tp = seg.shape
  nq, nk = Tp // bq, Tp // bk
  pos = np.arange(Tp)
  valid = seg[:, :, None] == seg[:, None, :]
  if causal:
    valid = valid & (pos[:, None] >= pos[None, :])
  share = valid.reshape(B, nq, bq, nk, bk).any(axis=(2, 4))              # [B, nq, nk]
  band = B * sum(not causal or kj * bk <= qi * bq + bq - 1 for qi in range(nq)
                 for kj in range(nk))
  copies = {}
  for name, (steps, blocks) in tpu_block_copies(monkeypatch, seg, bq, bk, causal).items():
    b, x, y = steps[:, 0], steps[:, 2], steps[:, 3]
    inner = [i for i in blocks if (i != x).any()]        # inputs read along the inner axis
    assert len(inner) == (5 if "dkdv" in name else 3), name   # q do lse delta seg / k v seg
    for i in inner:
      # share[b, q block, kv block] of the step's own pair and of the block it reads
      own = share[b, y, x] if "dkdv" in name else share[b, x, y]
      read = share[b, i, x] if "dkdv" in name else share[b, x, i]
      assert (i[own] == y[own]).all(), name          # pairs with valid entries: their block
      assert read.all(), name                        # never a block of other documents
      n = 1 + int((np.diff(i) != 0).sum())
      assert n <= share.sum(), (name, n, share.sum())
    copies[name] = n
  return copies, int(share.sum()), band


@pytest.mark.parametrize("bq,bk,nb", [(128, 128, 5), (64, 128, 4), (128, 64, 3)])
def test_tpu_kernel_fetches_only_the_blocks_of_the_causal_band(monkeypatch, bq, bk, nb):
  """One document per row: the pairs holding a valid pair are the causal band, and the TPU
  kernels copy each inner block at most once per pair of the band, not once per pair."""
  T = nb * max(bq, bk)
  seg = np.ones((2, T), np.int32)
  copies, share, band = check_tpu_copies(monkeypatch, seg, bq, bk, True)
  assert share == band < 2 * (T // bq) * (T // bk)
  assert max(copies.values()) <= band


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_tpu_kernel_fetches_only_the_blocks_of_each_blocks_documents(monkeypatch, causal):
  """Packed rows (documents of odd lengths, then padding, then block padding): a q block's
  kv blocks of other documents are skipped and never copied, nor, in dk / dv, a kv block's
  q blocks of other documents (the index maps clamp into the band `flash_tpu._band` reads
  from the segment ids), so copies fall from the causal band's pairs to the pairs that
  share a document."""
  from k2jax.kernels import flash
  seg = np.zeros((2, 512), np.int32)
  seg[0] = np.repeat(np.arange(1, 8), [37, 101, 63, 51, 97, 13, 150])
  seg[1, :473] = np.repeat(np.arange(1, 5), [150, 7, 99, 217])        # then padding (0)
  seg[:, 500:] = flash.PAD_SEGMENT                   # block padding of a row of T = 500
  for bq, bk in [(64, 64), (32, 64), (64, 32)]:
    copies, share, band = check_tpu_copies(monkeypatch, seg, bq, bk, causal)
    assert max(copies.values()) <= share < band, (bq, bk, copies, share, band)


@needs_tokamax
def test_tokamax_tiles_reach_the_op_only_on_their_device_kind_and_head_dims(monkeypatch):
  """kernels/flash_tokamax.TILES: an entry's forward and backward configs are what the
  Mosaic GPU op and its vjp run with on that device kind and (q, v) head widths; any other
  kind, width or implementation keeps tokamax's own choice (the op unchanged)."""
  from k2jax.kernels import flash_tokamax as ft
  ops, _ = ft._ops()
  if "mosaic_gpu" not in ops:
    pytest.skip("this tokamax has no Mosaic GPU attention")
  fwd = dict(block_q=128, block_kv=64, num_stages=3)
  bwd = dict(block_q_dkv=64, block_kv_dkv=128, block_q_dq=64, block_kv_dq=128, num_stages=3,
             compute_wgs=1)
  monkeypatch.setitem(ft.TILES, ("Some GPU", "mosaic_gpu", 192, 128), (fwd, bwd))
  q, v = jnp.zeros((1, 8, 2, 192)), jnp.zeros((1, 8, 2, 128))
  op = ops["mosaic_gpu"]
  got = ft.configured(op, "mosaic_gpu", q, v, kind="Some GPU")
  assert {k: getattr(got.config, k) for k in fwd} == fwd
  assert {k: getattr(got.vjp.config, k) for k in bwd} == bwd
  assert op.config is None and op.vjp.config is None          # the library's op untouched
  assert ft.configured(op, "mosaic_gpu", q, v, kind="Another GPU") is op
  assert ft.configured(op, "mosaic_gpu", q, q, kind="Some GPU") is op      # v 192 wide
  assert ft.configured(ops["xla"], "xla", q, v, kind="Some GPU") is ops["xla"]
  assert ft.configured(op, "mosaic_gpu", q, v) is op          # no GPU here: no kind


BLOCK_CASES = [("chunked", 2, 12, 4, 1, None), ("chunked", 3, 8, 8, 1, None),
               ("chunked", 4, 6, 3, 1, None), ("chunked", 2, 4, 4, 3, None),
               ("chunked", 4, 2, 1, 2, None), ("xla", 3, 4, 2, 2, None),
               # the kernels' own blocks: several per chunk, straddling chunks (GPU, which
               # reads each row's place), and query rows padded to a block (GPU, 24 of 32)
               ("pallas_gpu", 2, 16, 16, 2, 16), ("pallas_gpu", 4, 8, 8, 1, 16),
               ("pallas_gpu", 3, 4, 4, 1, None),
               ("pallas_tpu", 2, 16, 16, 2, 8), ("pallas_tpu", 4, 8, 8, 1, None),
               pytest.param("tokamax", 2, 8, 8, 2, None, marks=needs_tokamax)]


@pytest.mark.parametrize("impl,C,chunk,block,groups,kernel_block", BLOCK_CASES)
def test_query_blocks_against_the_whole_sequence_match_float64(impl, C, chunk, block, groups,
                                                               kernel_block):
  """kernels.flash.attention_blocks, what each context device runs (k2jax.model.context):
  the device's head and tail chunks of queries against every key, causal by each token's
  place in the sequence, documents and padding respected across chunk borders. For every
  device of C: out and dq of its rows, dk and dv of the whole sequence (its rows' share:
  the cotangent is zero elsewhere) and S_max over its rows, each within the float64 bounds
  of test_attention_matches_float64; the C devices' dk sum to the one-device gradient. With
  several groups of 2C chunks (the striped placement) each device's blocks are spread over
  the whole sequence. Every implementation: the Pallas kernels in interpret mode, tokamax's
  XLA one on CPU."""
  from k2jax.kernels import flash
  from k2jax.model import context
  seed, rng = seed_and_rng()
  B, H, D, Dv = 2, 3, 24, 16
  T = 2 * C * chunk * groups
  q, k = (rng.standard_normal((B, T, H, D)) * 1.5 for _ in range(2))
  v, do = rng.standard_normal((B, T, H, Dv)), rng.standard_normal((B, T, H, Dv))
  seg = segments(B, T, rng, n_cuts=5)
  scale = D ** -0.5
  order = context.placement(T, C, chunk)
  per = chunk // block
  dk_sum = 0
  for c in range(C):
    rows = order[c * T // C:(c + 1) * T // C]                # ascending
    do_c = np.zeros_like(do)
    do_c[:, rows] = do[:, rows]
    want = reference(q, k, v, do_c, scale, seg, True)
    bound = error_bounds(want, q, k, v, do_c, scale, jnp.float32)
    smax = np.where(want["valid"] & want["counted"], want["s"], -np.inf)[:, :, rows].max(
        axis=(0, 2, 3))
    mine = [g * 2 * C + k for g in range(groups) for k in (c, 2 * C - 1 - c)]   # chunks
    ids = np.concatenate([k * per + np.arange(per) for k in mine])
    f = lambda q_, k_, v_: flash.attention_blocks(
        q_, k_, v_, scale=scale, q_block_ids=ids, block=block,
        q_segment_ids=jnp.asarray(seg[:, rows]), k_segment_ids=jnp.asarray(seg), impl=impl,
        interpret=True, kernel_block=kernel_block)
    j = lambda a: jnp.asarray(a, jnp.float32)
    (out, got_max), vjp = jax.vjp(f, j(q[:, rows]), j(k), j(v))
    dq, dk, dv = vjp((j(do[:, rows]), jnp.zeros_like(got_max)))
    what = f"{impl} C={C} device {c}"
    assert_within(f"{what} out", out, want["out"][:, rows], bound["out"][:, rows], seed)
    assert_within(f"{what} dq", dq, want["dq"][:, rows], bound["dq"][:, rows], seed)
    assert_within(f"{what} dk", dk, want["dk"], bound["dk"], seed)
    assert_within(f"{what} dv", dv, want["dv"], bound["dv"], seed)
    assert_within(f"{what} S_max", got_max, smax, bound["smax"], seed)
    dk_sum = dk_sum + np.asarray(dk, np.float64)
  whole = reference(q, k, v, do, scale, seg, True)
  np.testing.assert_allclose(dk_sum, whole["dk"], rtol=1e-4, atol=1e-4 * np.abs(whole["dk"]).max())
