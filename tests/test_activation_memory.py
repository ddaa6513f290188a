"""Activation reduction (report 2.4.3): FP8-E4M3 storage of saved MoE / SwiGLU inputs and host
offload of saved activations. Forward values never change; gradients equal those of the
function at the E4M3-rounded inputs (checked against float64 numpy); offload changes where
residuals live, not what is computed."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from k2jax import configs, model
from k2jax.kernels import fp8, routed_experts
from k2jax.model import remat
from tests.numerics import U32, assert_within, gamma, replay, seed_and_rng


def _e4m3_candidates(x64, tile=128):
  """The E4M3 tile quantization of float64 values, dequantized: scale s = max|tile| / 448,
  value x -> round_e4m3(x / s) s. An f32 kernel computes s and x / s with a relative error
  < 4 u32, which can move x / s across a rounding midpoint: -> (lo, hi), the roundings of
  x / s moved down and up by 4 u32 |x / s|, times s (equal unless x / s is that close to a
  midpoint), and s per value."""
  n = x64.shape[-1]
  pad = -n % tile
  t = np.pad(x64, [(0, 0)] * (x64.ndim - 1) + [(0, pad)]).reshape(x64.shape[:-1] + (-1, tile))
  s = np.abs(t).max(-1, keepdims=True) / 448.0
  s = np.where(s > 0, s, 1.0)
  r = t / s
  e4m3 = lambda v: v.astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
  untile = lambda v: np.broadcast_to(v, t.shape).reshape(x64.shape[:-1] + (-1,))[..., :n]
  return (untile(e4m3(r - 4 * U32 * abs(r)) * s), untile(e4m3(r + 4 * U32 * abs(r)) * s),
          untile(s))


def _rounded_input(x64):
  """(mid, half): the value an f32 kernel's E4M3 round trip gives for x is within
  half + 4 u32 |mid| of mid (the two candidates' midpoint, their half distance, and the
  round trip's f32 scale and product)."""
  lo, hi, _ = _e4m3_candidates(x64)
  return (lo + hi) / 2, abs(hi - lo) / 2 + 4 * U32 * abs(lo + hi) / 2


@pytest.mark.parametrize("shape", [(5, 128), (3, 7, 200), (1, 1)])
def test_quantize_round_trips_within_e4m3_precision(shape):
  seed, rng = seed_and_rng()
  x = np.asarray(rng.standard_normal(shape) * 3.0, np.float32)
  q, s = fp8.quantize(jnp.asarray(x))
  assert q.dtype == jnp.float8_e4m3fn and s.dtype == jnp.float32
  assert s.shape == shape[:-1] + (-(-shape[-1] // 128),)
  back = np.asarray(fp8.dequantize(q, s, jnp.float32), np.float64)
  x64 = x.astype(np.float64)
  lo, hi, scale = _e4m3_candidates(x64)
  # one of the two candidates, up to the f32 scale (< 2 u32 off) and product (u32)
  want = np.where(abs(back - lo) <= abs(back - hi), lo, hi)
  assert_within("round trip", back, want, 4 * U32 * abs(want), seed)
  # E4M3's precision: half a unit in the last place, 2^-4 relative for normal values and
  # 2^-10 s for subnormal ones (spacing 2^-9 below 2^-6), plus the rounding above
  assert_within("round trip vs x", back, x64,
                2.0 ** -4 * abs(x64) + 2.0 ** -10 * scale + 8 * U32 * abs(x64), seed)


def test_fp8_saved_matmul_keeps_the_forward_and_rounds_only_what_dw_reads():
  seed, rng = seed_and_rng()
  M, K, N = 37, 130, 9
  x, w, g = (jnp.asarray(rng.standard_normal(sh), jnp.float32) for sh in ((M, K), (K, N), (M, N)))
  mm = lambda a, b: a @ b
  y, vjp = jax.vjp(fp8.fp8_saved(mm, 1), x, w)
  np.testing.assert_array_equal(y, mm(x, w), err_msg=replay(seed))
  dx, dw = vjp(g)
  x64, w64, g64 = (np.asarray(a, np.float64) for a in (x, w, g))
  # dx = g w^T reads no x: exact inputs, an N-wide f32 dot
  assert_within("dx", dx, g64 @ w64.T, gamma(N) * abs(g64) @ abs(w64).T, seed)
  # dw = x_e4m3^T g: the rounded x's uncertainty, then an M-wide f32 dot
  xm, xh = _rounded_input(x64)
  assert_within("dw", dw, xm.T @ g64, xh.T @ abs(g64) + gamma(M) * abs(xm).T @ abs(g64), seed)
  # and it did round: dw is off the unrounded x's gradient by more than f32 could explain
  assert (abs(np.asarray(dw) - x64.T @ g64) > gamma(M) * abs(x64).T @ abs(g64)).any(), \
      replay(seed)


def test_fp8_saved_swiglu_gradients_are_those_at_the_rounded_inputs():
  seed, rng = seed_and_rng()
  a, b, g = (jnp.asarray(rng.standard_normal((11, 64)), jnp.float32) for _ in range(3))
  sw = lambda a, b: jax.nn.silu(a) * b
  y, vjp = jax.vjp(fp8.fp8_saved(sw, 2), a, b)
  np.testing.assert_array_equal(y, sw(a, b), err_msg=replay(seed))
  da, db = vjp(g)
  (a64, ah), (b64, bh) = _rounded_input(np.asarray(a, np.float64)), \
      _rounded_input(np.asarray(b, np.float64))
  g64 = np.asarray(g, np.float64)
  sig = 1 / (1 + np.exp(-a64))
  # |silu'| <= 1.1, |silu''| <= 0.5 carry the rounded inputs' uncertainty; f32's own:
  # sigmoid's three roundings (+ 4 ulp absolute, a tanh expansion), then <= 6 products / sums
  sig_err = 3 * U32 * sig + 4 * U32
  assert_within("db", db, g64 * a64 * sig,
                abs(g64) * (1.1 * ah + abs(a64) * sig_err + 6 * U32 * abs(a64) * sig), seed)
  silu_d = sig * (1 + a64 * (1 - sig))
  assert_within("da", da, g64 * b64 * silu_d,
                abs(g64) * (1.1 * bh + abs(b64) * (0.5 * ah + (1 + abs(a64)) * sig_err
                                                    + 6 * U32 * sig * (1 + abs(a64) * (1 - sig)))),
                seed)


@pytest.mark.parametrize("impl", ["blocked", "ragged", "capacity"])
def test_routed_experts_fp8_storage_same_forward_close_gradients(impl):
  E, d, f, N, k = 8, 128, 64, 40, 2
  ks = jax.random.split(jax.random.key(4), 6)
  x = jax.random.normal(ks[0], (N, d))
  ids = jax.random.randint(ks[1], (N, k), 0, E)
  comb = jax.random.uniform(ks[2], (N, k))
  gate, up = (0.1 * jax.random.normal(kk, (E, d, f)) for kk in ks[3:5])
  down = 0.1 * jax.random.normal(ks[5], (E, f, d))

  def loss(fp8_storage, x, gate, up, down):
    y = routed_experts(x, ids, comb, gate, up, down, impl=impl, fp8_storage=fp8_storage)
    return jnp.sum(y * jnp.cos(y)), y

  (l0, y0), g0 = jax.value_and_grad(lambda *a: loss(False, *a), (0, 1, 2, 3), has_aux=True)(
      x, gate, up, down)
  (l1, y1), g1 = jax.value_and_grad(lambda *a: loss(True, *a), (0, 1, 2, 3), has_aux=True)(
      x, gate, up, down)
  np.testing.assert_array_equal(y0, y1)
  rels = []
  for a, b in zip(g0, g1):
    rel = float(jnp.linalg.norm(a - b) / jnp.linalg.norm(a))
    rels.append(rel)
  # dx, d gate, d up read the rounded inputs (rounded, not identical, E4M3-close); d down
  # reads the SwiGLU output, which stays in the working dtype.
  assert all(1e-6 < r < 0.06 for r in rels[:3]) and rels[3] == 0.0, rels


def _step_grads(cfg):
  params = model.init(cfg, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 64), 0, cfg.vocab_size)

  def loss(p):
    logits, _ = model.forward(cfg, p, tokens)
    return jnp.mean(jax.nn.log_softmax(logits)[..., 0])
  return jax.jit(jax.value_and_grad(loss))(params)


def test_offload_computes_the_same_gradients():
  cfg = configs.get_config("tiny").model
  cfg.remat = "selective"
  l0, g0 = _step_grads(cfg)
  cfg.offload = True
  l1, g1 = _step_grads(cfg)
  assert float(l0) == float(l1)
  for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9)
  if remat.host_memory_kind() is not None:
    policy = remat.remat_policy("selective", offload=True)
    assert policy is not remat.remat_policy("selective")
