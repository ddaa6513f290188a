"""k2jax.kernels.attention: every implementation against float64 numpy (outputs, S_max and
dq / dk / dv), Pallas kernels in interpret mode with their outputs poisoned (NaN) before the
call (kernels/pallas_utils.py), on odd sizes: T not a multiple of the block, T = 1, several
documents and padding per row, 1 and 5 heads, MLA's 192 / 128 head dims, f32 and bf16."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k2jax.kernels import attention

try:
  import tokamax  # noqa: F401  (optional extra: its tests skip without it)
  HAVE_TOKAMAX = True
except ImportError:
  HAVE_TOKAMAX = False
needs_tokamax = pytest.mark.skipif(not HAVE_TOKAMAX, reason="tokamax is not installed")
IMPLS = ["xla", "chunked", "pallas_gpu", "pallas_tpu",
         pytest.param("tokamax", marks=needs_tokamax)]


def reference(q, k, v, do, scale, seg, causal):
  """float64: out, S_max and the gradients of sum(out * do)."""
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
  s = np.where(valid, s, -np.inf)
  smax = np.where(valid & counted, s, -np.inf).max(axis=(0, 2, 3))
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  out = np.einsum("bhqk,bkhd->bqhd", p, v)
  dp = np.einsum("bqhd,bkhd->bhqk", do, v)
  ds = p * (dp - (dp * p).sum(-1, keepdims=True))
  dq = np.einsum("bhqk,bkhd->bqhd", ds, k) * scale
  dk = np.einsum("bhqk,bqhd->bkhd", ds, q) * scale
  dv = np.einsum("bhqk,bqhd->bkhd", p, do)
  return out, smax, dq, dk, dv


def segments(B, T, rng):
  """Rows of 1-3 documents (ids 1, 2, ...) followed by padding (id 0), like packed rows."""
  seg = np.zeros((B, T), np.int32)
  for b in range(B):
    cuts = np.sort(rng.choice(np.arange(1, T), size=min(3, T - 1), replace=False))
    ids = np.searchsorted(cuts, np.arange(T), side="right") + 1
    seg[b] = np.where(np.arange(T) < cuts[-1] if b % 2 else True, ids, 0)
  return seg


CASES = {
    # name: B, T, H, Dqk, Dv, segments, causal, dtype, block
    "odd": (2, 37, 5, 48, 32, True, True, jnp.float32, 16),
    "mla_dims": (1, 20, 1, 192, 128, False, True, jnp.float32, 16),
    "t1": (2, 1, 1, 32, 16, False, True, jnp.float32, None),
    "bidirectional": (2, 24, 2, 32, 32, True, False, jnp.float32, 16),
    "bf16": (2, 33, 5, 48, 32, True, True, jnp.bfloat16, 16),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_attention_matches_float64(impl, case):
  B, T, H, D, Dv, with_seg, causal, dtype, block = CASES[case]
  rng = np.random.default_rng(abs(hash((impl, case))) % 2**32)   # fresh inputs per test
  q, k = (rng.standard_normal((B, T, H, D)) * 1.5 for _ in range(2))
  v, do = rng.standard_normal((B, T, H, Dv)), rng.standard_normal((B, T, H, Dv))
  seg = segments(B, T, rng) if with_seg else None
  scale = D ** -0.5
  args = [jnp.asarray(a, dtype) for a in (q, k, v)]
  q, k, v = (np.asarray(a.astype(jnp.float32)) for a in args)     # what the kernel sees
  want_out, want_max, *want_grads = reference(q, k, v, do, scale, seg, causal)

  def run(q, k, v):
    return attention(q, k, v, scale=scale, segment_ids=None if seg is None else jnp.asarray(seg),
                     causal=causal, impl=impl, interpret=True, block=block)

  (out, smax), vjp = jax.vjp(run, *args)
  grads = vjp((jnp.asarray(do, dtype), jnp.zeros_like(smax)))
  tol = 1e-5 if dtype == jnp.float32 else 3e-2
  for name, got, want in [("out", out, want_out), *zip(("dq", "dk", "dv"), grads, want_grads)]:
    got = np.asarray(got.astype(jnp.float32), np.float64)
    assert np.isfinite(got).all(), name          # poisoned buffers: unwritten rows are NaN
    err = np.abs(got - want).max() / max(np.abs(want).max(), 1.0)   # dq = 0 when T = 1
    assert err < tol, (name, err)
  assert smax.dtype == jnp.float32 and smax.shape == (H,)
  # A float32 dot product of width D is off by at most D eps sum_d |q_d k_d| <= D eps |q| |k|
  # (Higham 3.5): the bound per head from the largest rows, for the reference (f64) and for
  # two f32 implementations (twice it). A fixed rtol at f32 rounding failed on fresh draws.
  norm = lambda a: np.sqrt((a.astype(np.float64) ** 2).sum(-1)).max(axis=(0, 1))   # [H]
  bound = D * np.finfo(np.float32).eps * scale * norm(q) * norm(k)
  if dtype == jnp.float32:
    np.testing.assert_allclose(np.asarray(smax), want_max, rtol=0, atol=bound.max())
    _, ref_max = attention(*args, scale=scale, segment_ids=None if seg is None else jnp.asarray(seg),
                           causal=causal, impl="xla")
    assert (np.abs(np.asarray(smax) - np.asarray(ref_max)) <= 2 * bound).all()
  else:
    np.testing.assert_allclose(np.asarray(smax), want_max, rtol=1e-2)


def test_max_logits_carry_no_gradient_and_ignore_padding():
  rng = np.random.default_rng(7)
  q, k, v = (jnp.asarray(rng.standard_normal((1, 8, 2, 16)), jnp.float32) for _ in range(3))
  seg = jnp.asarray([[1, 1, 1, 1, 1, 0, 0, 0]])
  for impl in ("chunked", "pallas_gpu") + (("tokamax",) if HAVE_TOKAMAX else ()):
    g = jax.grad(lambda q: attention(q, k, v, scale=1.0, segment_ids=seg, impl=impl,
                                     interpret=True)[1].sum())(q)
    assert float(jnp.abs(g).max()) == 0.0
    # Make a padding row's logits the largest: S_max must not see them.
    loud = q.at[0, 6].multiply(100.0)
    _, a = attention(loud, k, v, scale=1.0, segment_ids=seg, impl=impl, interpret=True)
    _, b = attention(q, k, v, scale=1.0, segment_ids=seg, impl=impl, interpret=True)
    np.testing.assert_array_equal(a, b)


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


@pytest.mark.parametrize("bq,bk,nb", [(128, 128, 5), (64, 128, 4), (128, 64, 3)])
def test_tpu_kernel_fetches_only_the_blocks_of_the_causal_band(bq, bk, nb):
  """The TPU pipeline copies a block HBM -> VMEM when its index changes between grid steps;
  with the index maps clamped into the causal band, every visible (q block, kv block) pair
  still gets its own block, and the copies number at most the visible pairs (consecutive
  steps that share a block copy it once), not every pair."""
  from k2jax.kernels import flash_tpu
  T = nb * max(bq, bk)
  nq, nk = T // bq, T // bk
  visible = sum(kj * bk <= qi * bq + bq - 1 for qi in range(nq) for kj in range(nk))

  def fetches(outer, inner, axis, clamp, q_outer):
    last, n = None, 0
    for x in range(outer):
      for y in range(inner):
        i = int(flash_tpu._visible(x, y, axis, clamp))
        qi, kj = (x, y) if q_outer else (y, x)
        if kj * bk <= qi * bq + bq - 1:       # a pair the kernel computes: its own block
          assert i == y
        n += i != last
        last = i
    return n
  assert visible < nq * nk
  # forward and dq: grid (q block, kv block), k / v indexed by the kv axis
  assert fetches(nq, nk, 3, (bq, bk, "kv"), True) <= visible
  # dk / dv: grid (kv block, q block), q / do / lse / delta indexed by the q axis
  assert fetches(nk, nq, 3, (bq, bk, "q"), False) <= visible
  assert fetches(nq, nk, 3, None, True) == nq * nk     # unclamped: every pair
