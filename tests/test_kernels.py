"""Grouped matmul implementations against a float64 per-group loop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k2jax.kernels import grouped_matmul
from k2jax.kernels.grouped_matmul import IMPLS


def _loop_reference(x, w, sizes):
  x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
  out = np.zeros((x.shape[0], w.shape[2]))
  start = 0
  for g, n in enumerate(sizes):
    out[start:start + n] = x[start:start + n] @ w[g]
    start += n
  return out


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("sizes", [[3, 0, 5, 2], [0, 0, 7], [1] * 9, [40, 1, 0, 25]])
def test_forward_and_gradients_match_loop(impl, sizes):
  M = sum(sizes) + 3  # trailing rows outside every group must give zeros
  G, K, N = len(sizes), 5, 7
  x = jax.random.normal(jax.random.key(0), (M, K))
  w = jax.random.normal(jax.random.key(1), (G, K, N))
  gs = jnp.asarray(sizes, jnp.int32)
  np.testing.assert_allclose(grouped_matmul(x, w, gs, impl), _loop_reference(x, w, sizes),
                             atol=1e-5)
  cot = jax.random.normal(jax.random.key(2), (M, N))
  gx, gw = jax.grad(lambda x, w: jnp.sum(grouped_matmul(x, w, gs, impl) * cot), (0, 1))(x, w)
  # d/dx = cot @ w_g^T per group, d/dw_g = x_g^T cot_g, independent of the implementation.
  start, cot64 = 0, np.asarray(cot, np.float64)
  want_gx, want_gw = np.zeros((M, K)), np.zeros((G, K, N))
  for g, n in enumerate(sizes):
    want_gx[start:start + n] = cot64[start:start + n] @ np.asarray(w[g], np.float64).T
    want_gw[g] = np.asarray(x[start:start + n], np.float64).T @ cot64[start:start + n]
    start += n
  np.testing.assert_allclose(gx, want_gx, atol=1e-4)
  np.testing.assert_allclose(gw, want_gw, atol=1e-4)
