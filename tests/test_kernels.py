"""MoE kernels against float64 loops: grouped matmuls (every impl; Pallas in interpret mode
with NaN-poisoned outputs), the fused gather / combine variants and whole routed-expert
layers, forward and every gradient, with empty experts, one expert taking every row, row
counts not divisible by the block size, f32 and bf16."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k2jax.kernels import gmm as gm
from k2jax.kernels import moe

SIZES = [[3, 0, 5, 2], [0, 0, 7], [1] * 9, [40, 1, 0, 25], [0, 70, 0]]
PALLAS = ("pallas_gpu", "megablox")


def _impls():
  out = []
  for impl in gm.IMPLS:
    if impl == "tokamax":
      try:
        import tokamax  # noqa: F401
      except ImportError:
        continue
    out.append(impl)
  # blocked at each size blocked_block_size can pick (auto picks 32 at these small shapes)
  return out + [f"blocked/{b}" for b in gm._ROW_COST]


def _loop(x, w, sizes, rows=None):
  """float64 y[r] = x[rows[r]] @ w[g(r)] for rows r sorted by group; trailing rows 0."""
  x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
  rows = np.arange(sum(sizes)) if rows is None else np.asarray(rows)
  out, start = np.zeros((len(rows) if rows is not None else x.shape[0], w.shape[2])), 0
  for g, n in enumerate(sizes):
    out[start:start + n] = x[rows[start:start + n]] @ w[g]
    start += n
  return out


@pytest.mark.parametrize("impl", _impls())
@pytest.mark.parametrize("sizes", SIZES)
def test_grouped_matmul_forward_and_gradients_match_loop(impl, sizes):
  # Mosaic (megablox) tiles need feature dims in multiples of 16; pallas_gpu pads odd ones
  # itself, so it is tested at odd widths like the XLA paths. Row counts are odd everywhere.
  K, N = (32, 48) if impl == "megablox" else (5, 7)
  M = sum(sizes) + 3                          # trailing rows outside every group must give 0
  G = len(sizes)
  rng = np.random.default_rng(sum(sizes) * 7 + len(impl))
  x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((G, K, N)), jnp.float32)
  gs = jnp.asarray(sizes, jnp.int32)
  if impl.startswith("blocked/"):
    run = lambda x, w: gm.grouped_matmul_blocked(x, w, gs, block=int(impl.split("/")[1]))
  else:
    run = lambda x, w: gm.grouped_matmul(x, w, gs, impl=impl, interpret=True)
  want = np.zeros((M, N))
  want[:sum(sizes)] = _loop(x, w, sizes)
  y, vjp = jax.vjp(run, x, w)
  np.testing.assert_allclose(y, want, atol=1e-4)
  _check_gradients(vjp, x, w, sizes, rng)


def _check_gradients(vjp, x, w, sizes, rng):
  """d/dx = cot @ w_g^T per group, d/dw_g = x_g^T cot_g (float64), whatever the impl."""
  (M, K), (G, _, N) = x.shape, w.shape
  cot = rng.standard_normal((M, N))
  gx, gw = vjp(jnp.asarray(cot, jnp.float32))
  start, want_gx, want_gw = 0, np.zeros((M, K)), np.zeros((G, K, N))
  for g, n in enumerate(sizes):
    want_gx[start:start + n] = cot[start:start + n] @ np.asarray(w[g], np.float64).T
    want_gw[g] = np.asarray(x[start:start + n], np.float64).T @ cot[start:start + n]
    start += n
  np.testing.assert_allclose(gx, want_gx, atol=1e-3)
  np.testing.assert_allclose(gw, want_gw, atol=1e-3)


@pytest.mark.parametrize("sizes", SIZES[:4])
def test_tokamax_gpu_path_forward_and_gradients_match_loop(sizes):
  """impl="tokamax" on a GPU: tokamax's ragged dot for y and dx, our tgmm for dw (tokamax's
  Mosaic dw was wrong on the H100). Run here with tokamax's XLA kernel and our tgmm in
  interpret mode, at odd widths (padded to 16 for the Triton tiles) and trailing rows."""
  pytest.importorskip("tokamax")
  K, N, G = 5, 7, len(sizes)
  M = sum(sizes) + 3
  rng = np.random.default_rng(len(sizes) * 11 + sum(sizes))
  x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((G, K, N)), jnp.float32)
  gs = jnp.asarray(sizes, jnp.int32)
  y, vjp = jax.vjp(lambda x, w: gm.tokamax_ours_dw(x, w, gs, True), x, w)
  want = np.zeros((M, N))
  want[:sum(sizes)] = _loop(x, w, sizes)
  np.testing.assert_allclose(y, want, atol=1e-4)
  _check_gradients(vjp, x, w, sizes, rng)


@pytest.mark.parametrize("impl", ["blocked", "pallas_gpu"])
def test_fused_gather_and_combine_variants(impl):
  """gather_grouped_matmul reads x through row ids; grouped_matmul_combine writes rows to
  their slots scaled by weights; both against float64, with their three gradients."""
  rng = np.random.default_rng(3)
  sizes = [11, 0, 37, 1, 0]
  M, Nt, K, F = sum(sizes), 29, 21, 40      # neither width a multiple of 16
  x = jnp.asarray(rng.standard_normal((Nt, K)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((len(sizes), K, F)), jnp.float32)
  row_ids = jnp.asarray(rng.integers(0, Nt, M), jnp.int32)     # tokens repeat (top-k)
  gs = jnp.asarray(sizes, jnp.int32)
  h, vjp = jax.vjp(lambda x, w: gm.gather_grouped_matmul(x, w, gs, row_ids, impl=impl,
                                                         interpret=True), x, w)
  np.testing.assert_allclose(h, _loop(x, w, sizes, row_ids), atol=1e-4)
  cot = rng.standard_normal((M, F))
  gx, gw = vjp(jnp.asarray(cot, jnp.float32))
  x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
  want_gx, want_gw, start = np.zeros((Nt, K)), np.zeros(w.shape), 0
  for g, n in enumerate(sizes):
    r = np.asarray(row_ids[start:start + n])
    np.add.at(want_gx, r, cot[start:start + n] @ w64[g].T)
    want_gw[g] = x64[r].T @ cot[start:start + n]
    start += n
  np.testing.assert_allclose(gx, want_gx, atol=1e-3)
  np.testing.assert_allclose(gw, want_gw, atol=1e-3)

  w2 = jnp.asarray(rng.standard_normal((len(sizes), F, K)), jnp.float32)
  hh = jnp.asarray(rng.standard_normal((M, F)), jnp.float32)
  slots = jnp.asarray(rng.permutation(M), jnp.int32)
  scale = jnp.asarray(rng.uniform(0.1, 2.0, M), jnp.float32)
  y, vjp = jax.vjp(lambda h, w, s: gm.grouped_matmul_combine(h, w, gs, slots, s, impl=impl,
                                                             interpret=True), hh, w2, scale)
  z = _loop(hh, w2, sizes)
  want = np.zeros((M, K))
  want[np.asarray(slots)] = z * np.asarray(scale)[:, None]
  np.testing.assert_allclose(y, want, atol=1e-3)
  cot = rng.standard_normal((M, K))
  gh, gw2, gs_ = vjp(jnp.asarray(cot, jnp.float32))
  c = cot[np.asarray(slots)]                                    # cotangent per sorted row
  np.testing.assert_allclose(gs_, np.sum(c * z, 1), rtol=1e-4, atol=1e-3)
  sc = np.asarray(scale, np.float64)[:, None]
  want_gh, want_gw2, start = np.zeros((M, F)), np.zeros(w2.shape), 0
  for g, n in enumerate(sizes):
    sl = slice(start, start + n)
    want_gh[sl] = sc[sl] * (c[sl] @ np.asarray(w2[g], np.float64).T)
    want_gw2[g] = (sc[sl] * np.asarray(hh[sl], np.float64)).T @ c[sl]
    start += n
  np.testing.assert_allclose(gh, want_gh, atol=1e-3)
  np.testing.assert_allclose(gw2, want_gw2, atol=1e-3)


def _dense64(x, ids, comb, gate, up, down):
  x, comb = np.asarray(x, np.float64), np.asarray(comb, np.float64)
  gate, up, down = (np.asarray(a, np.float64) for a in (gate, up, down))
  silu = lambda a: a / (1 + np.exp(-a))
  y = np.zeros_like(x)
  for n in range(x.shape[0]):
    for j, e in enumerate(np.asarray(ids)[n]):
      y[n] += comb[n, j] * ((silu(x[n] @ gate[e]) * (x[n] @ up[e])) @ down[e])
  return y


@pytest.mark.parametrize("impl", ["blocked", "blocked/32", "blocked/128", "ragged", "capacity",
                                  "pallas_gpu", "dense"])
@pytest.mark.parametrize("routing", ["spread", "one_expert_takes_all"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_routed_experts_match_float64(impl, routing, dtype):
  rng = np.random.default_rng(11)
  N, d, f, E, k = 37, 24, 40, 6, 2          # widths not multiples of 16 (pallas_gpu pads)
  x = rng.standard_normal((N, d))
  gate, up = (rng.standard_normal((E, d, f)) * d ** -0.5 for _ in range(2))
  down = rng.standard_normal((E, f, d)) * f ** -0.5
  comb = rng.uniform(0.2, 1.0, (N, k))
  if routing == "spread":   # expert 5 never chosen: an empty group
    ids = np.stack([rng.permutation(N) % 5, (rng.permutation(N) + 1) % 5], 1)
  else:                     # every token's first choice is expert 2: capacity overflows
    ids = np.stack([np.full(N, 2), rng.integers(0, E, N)], 1)
  ids = np.where(ids[:, :1] == ids[:, 1:], np.stack([ids[:, 0], (ids[:, 1] + 1) % E], 1), ids)
  args = [jnp.asarray(a, dtype) for a in (x,)] + [jnp.asarray(ids, jnp.int32)] + [
      jnp.asarray(a, dtype) for a in (comb, gate, up, down)]
  f32 = [np.asarray(a) if a.dtype == jnp.int32 else np.asarray(a.astype(jnp.float32))
         for a in args]
  want = _dense64(*f32)
  if impl.startswith("blocked/"):   # the blocked path at a block other than its own pick
    run = lambda x, c, g, u, dn: moe._blocked(x, args[1], c, g, u, dn,
                                              block=int(impl.split("/")[1]))
  else:
    run = lambda x, c, g, u, dn: moe.routed_experts(x, args[1], c, g, u, dn, impl=impl,
                                                    interpret=True)
  y, vjp = jax.vjp(run, args[0], *args[2:])
  tol = 1e-4 if dtype == jnp.float32 else 5e-2
  scale = np.abs(want).max()
  assert np.isfinite(np.asarray(y.astype(jnp.float32))).all()
  np.testing.assert_allclose(np.asarray(y.astype(jnp.float32)) / scale, want / scale, atol=tol)
  cot = rng.standard_normal((N, d))
  grads = vjp(jnp.asarray(cot, dtype))
  # The float64 gradient by central differences would be slow; the dense implementation in
  # float64 (x64 off: f32) is the reference for gradients, itself checked against the loop.
  ref = jax.vjp(lambda x, c, g, u, dn: moe.routed_experts(x, args[1], c, g, u, dn, impl="dense"),
                *(jnp.asarray(a, jnp.float32) for a in (f32[0], *f32[2:])))[1](
                    jnp.asarray(cot, jnp.float32))
  for name, a, b in zip(("x", "combine", "gate", "up", "down"), grads, ref):
    a, b = np.asarray(a.astype(jnp.float32)), np.asarray(b)
    assert np.isfinite(a).all(), name
    np.testing.assert_allclose(a / np.abs(b).max(), b / np.abs(b).max(), atol=tol * 2, err_msg=name)


def test_dense_reference_gradient_matches_finite_differences():
  """The dense implementation the gradients above are compared with, against float64
  central differences of the loop in a few random directions."""
  rng = np.random.default_rng(5)
  N, d, f, E, k = 5, 4, 6, 3, 2
  x, comb = rng.standard_normal((N, d)), rng.uniform(0.2, 1, (N, k))
  gate, up, down = rng.standard_normal((E, d, f)), rng.standard_normal((E, d, f)), rng.standard_normal((E, f, d))
  ids = np.stack([np.arange(N) % E, (np.arange(N) + 1) % E], 1)
  cot = rng.standard_normal((N, d))
  grads = jax.grad(lambda *a: jnp.sum(moe.routed_experts(a[0], jnp.asarray(ids), *a[1:],
                                                        impl="dense") * cot), argnums=range(5))(
      *(jnp.asarray(a, jnp.float32) for a in (x, comb, gate, up, down)))
  base = [x, comb, gate, up, down]
  for i, g in enumerate(grads):
    v = rng.standard_normal(base[i].shape)
    eps = 1e-5
    plus = [b + eps * v if j == i else b for j, b in enumerate(base)]
    minus = [b - eps * v if j == i else b for j, b in enumerate(base)]
    fd = (np.sum(_dense64(plus[0], ids, *plus[1:]) * cot)
          - np.sum(_dense64(minus[0], ids, *minus[1:]) * cot)) / (2 * eps)
    assert abs(float(np.sum(np.asarray(g, np.float64) * v)) - fd) < 1e-3 * max(1, abs(fd))
