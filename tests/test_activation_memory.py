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


def _round_e4m3(x64, tile=128):
  """float64 reference of the tile quantization: scale max|tile| / 448, round to E4M3."""
  n = x64.shape[-1]
  pad = -n % tile
  t = np.pad(x64, [(0, 0)] * (x64.ndim - 1) + [(0, pad)]).reshape(x64.shape[:-1] + (-1, tile))
  s = np.abs(t).max(-1, keepdims=True) / 448.0
  s = np.where(s > 0, s, 1.0)
  q = (t / s).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * s
  return q.reshape(x64.shape[:-1] + (-1,))[..., :n]


@pytest.mark.parametrize("shape", [(5, 128), (3, 7, 200), (1, 1)])
def test_quantize_round_trips_within_e4m3_precision(shape):
  x = np.asarray(jax.random.normal(jax.random.key(1), shape) * 3.0, np.float32)
  q, s = fp8.quantize(jnp.asarray(x))
  assert q.dtype == jnp.float8_e4m3fn and s.dtype == jnp.float32
  assert s.shape == shape[:-1] + (-(-shape[-1] // 128),)
  back = np.asarray(fp8.dequantize(q, s, jnp.float32), np.float64)
  np.testing.assert_allclose(back, _round_e4m3(x.astype(np.float64)), rtol=1e-6, atol=1e-30)
  assert np.all(np.abs(back - x) <= 2.0 ** -4 * np.abs(x) + 1e-6 * np.abs(x).max())


def test_fp8_saved_matmul_keeps_the_forward_and_rounds_only_what_dw_reads():
  kx, kw, kg = jax.random.split(jax.random.key(2), 3)
  x = jax.random.normal(kx, (37, 130))
  w = jax.random.normal(kw, (130, 9))
  g = jax.random.normal(kg, (37, 9))
  mm = lambda a, b: a @ b
  y, vjp = jax.vjp(fp8.fp8_saved(mm, 1), x, w)
  np.testing.assert_array_equal(y, mm(x, w))
  dx, dw = vjp(g)
  x64, w64, g64 = (np.asarray(a, np.float64) for a in (x, w, g))
  np.testing.assert_allclose(dx, g64 @ w64.T, rtol=1e-5, atol=1e-5)          # exact: no x
  np.testing.assert_allclose(dw, _round_e4m3(x64).T @ g64, rtol=1e-5, atol=1e-4)
  assert np.max(np.abs(np.asarray(dw) - x64.T @ g64)) > 1e-3                  # it did round


def test_fp8_saved_swiglu_gradients_are_those_at_the_rounded_inputs():
  ka, kb, kg = jax.random.split(jax.random.key(3), 3)
  a, b, g = (jax.random.normal(k, (11, 64)) for k in (ka, kb, kg))
  sw = lambda a, b: jax.nn.silu(a) * b
  y, vjp = jax.vjp(fp8.fp8_saved(sw, 2), a, b)
  np.testing.assert_array_equal(y, sw(a, b))
  da, db = vjp(g)
  a64, b64, g64 = _round_e4m3(np.asarray(a, np.float64)), _round_e4m3(np.asarray(b, np.float64)), \
      np.asarray(g, np.float64)
  sig = 1 / (1 + np.exp(-a64))
  np.testing.assert_allclose(db, g64 * a64 * sig, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(da, g64 * b64 * sig * (1 + a64 * (1 - sig)), rtol=1e-5, atol=1e-5)


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
