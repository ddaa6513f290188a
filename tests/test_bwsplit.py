"""k2jax.parallel.bwsplit: a backward cut into input-gradient (B) and weight-gradient (W)
halves gives exactly jax.vjp's gradients (float64), and the weight matmuls land in W."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k2jax.parallel import bwsplit


def _layer(w, x):
  """A pre-norm residual block: RMSNorm with a weight, a SwiGLU MLP, a down projection."""
  h = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * w["norm"]
  g = jax.nn.silu(h @ w["gate"]) * (h @ w["up"])
  return x + g @ w["down"]


def _split_of(fn, w, x):
  y, vjp = jax.vjp(fn, w, x)
  leaves, tree = jax.tree.flatten(vjp)
  wl = jax.tree.leaves(w)
  ids = {id(a): i for i, a in enumerate(wl)}
  res = [a for a in leaves if id(a) not in ids]
  src = [ids.get(id(a)) for a in leaves]

  def bwd(*ins):
    ws, r, ct = ins[:len(wl)], iter(ins[len(wl):-1]), ins[-1]
    f = jax.tree.unflatten(tree, [next(r) if s is None else ws[s] for s in src])
    g_w, g_x = f(ct)
    return jax.tree.leaves(g_w) + [g_x]
  return y, vjp, wl, res, bwsplit.split(bwd, len(wl), len(wl) + len(res), *wl, *res, y)


@pytest.mark.parametrize("remat", [None, "full"])
def test_b_then_w_equal_the_backward_in_float64(remat):
  with jax.enable_x64(True):
    k = jax.random.split(jax.random.key(3), 6)
    d, f, n = 7, 11, 5                                   # odd sizes
    w = {"norm": 1 + 0.1 * jax.random.normal(k[0], (d,), jnp.float64),
         "gate": jax.random.normal(k[1], (d, f), jnp.float64),
         "up": jax.random.normal(k[2], (d, f), jnp.float64),
         "down": jax.random.normal(k[3], (f, d), jnp.float64)}
    x = jax.random.normal(k[4], (n, d), jnp.float64)
    fn = _layer if remat is None else jax.checkpoint(
        _layer, policy=jax.checkpoint_policies.nothing_saveable)
    y, vjp, wl, res, sp = _split_of(fn, w, x)
    dy = jax.random.normal(k[5], y.shape, jnp.float64)
    dx, early, cut = sp.b(*wl, *res, dy)
    late = sp.w(list(wl) + res, cut)
    g_w, g_x = vjp(dy)
    np.testing.assert_allclose(dx[0], g_x, rtol=1e-12, atol=1e-12)
    for e, l, want in zip(early, late, jax.tree.leaves(g_w)):
      assert (e is None) != (l is None)
      np.testing.assert_allclose(e if l is None else l, want, rtol=1e-12, atol=1e-12)
    # Every weight gradient is W's (none is made inside an op dx needs), and W does the
    # three weight matmuls: 2 n d f each, a third of the backward's six when nothing is
    # recomputed (B also recomputes the forward's three under full remat).
    assert sp.late == (0, 1, 2, 3)
    assert sp.flops["W"] == 3 * 2 * n * d * f
    # (B's dx chain is three matmuls; under full remat it also recomputes gate and up)
    assert sp.flops["B"] == (3 if remat is None else 5) * 2 * n * d * f
    # The normalised input is recomputed in W from the stored residuals, not handed over:
    # what B hands W depends on the cotangent (or comes from a matmul).
    h = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)
    for c in cut:
      assert not any(c.shape == a.shape and np.allclose(c, a) for a in (h, h * w["norm"]))


def test_weight_gradients_made_inside_an_atom_stay_in_b():
  """A weight used inside a lax.cond that dx needs: its gradient is B's ("early")."""
  def fn(w, x):
    h = jax.lax.cond(True, lambda a: a @ w["inner"], lambda a: a @ w["inner"] * 2, x)
    return h @ w["outer"]
  w = {"inner": jnp.ones((3, 4)), "outer": jnp.ones((4, 2))}
  y, vjp, wl, res, sp = _split_of(fn, w, jnp.ones((5, 3)))
  assert sp.late == (1,)                  # "outer" in W, "inner" in B
  dx, early, cut = sp.b(*wl, *res, jnp.ones(y.shape))
  late = sp.w(list(wl) + res, cut)
  g_w, g_x = vjp(jnp.ones(y.shape))
  np.testing.assert_allclose(early[0], g_w["inner"])
  np.testing.assert_allclose(late[1], g_w["outer"])
  np.testing.assert_allclose(dx[0], g_x)


def test_a_shard_map_is_cut_so_its_weight_gradients_are_w():
  """The MoE's pattern: a shard_map over the batch computing per-device rows with a
  replicated weight. B needs its input gradient, W its weight gradient (a matmul and a
  psum over the batch), so bwsplit cuts its body into two shard_maps: the weight gradient
  is late, W does its matmul, and B and W equal jax.vjp (float64, odd sizes)."""
  from jax.sharding import PartitionSpec as P
  mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))

  def fn(w, x):
    def rows(wi, xb):
      return jnp.tanh(xb @ wi)
    h = jax.shard_map(rows, mesh=mesh, in_specs=(P(), P("data")), out_specs=P("data"))(
        w["inner"], x)
    return h @ w["outer"]

  with jax.enable_x64(True):
    k = jax.random.split(jax.random.key(5), 4)
    n, d, f, o = 5, 7, 11, 3
    w = {"inner": jax.random.normal(k[0], (d, f), jnp.float64),
         "outer": jax.random.normal(k[1], (f, o), jnp.float64)}
    x = jax.random.normal(k[2], (n, d), jnp.float64)
    y, vjp, wl, res, sp = _split_of(fn, w, x)
    assert sp.late == (0, 1)                 # both weight gradients are W's
    # W: the two weight matmuls; B: the two input-gradient ones
    assert sp.flops["W"] == 2 * n * d * f + 2 * n * f * o
    assert sp.flops["B"] == 2 * n * d * f + 2 * n * f * o
    dy = jax.random.normal(k[3], y.shape, jnp.float64)
    dx, early, cut = sp.b(*wl, *res, dy)
    late = sp.w(list(wl) + res, cut)
    g_w, g_x = vjp(dy)
    assert early == [None, None]
    np.testing.assert_allclose(dx[0], g_x, rtol=1e-12, atol=1e-12)
    for got, want in zip(late, jax.tree.leaves(g_w)):
      np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
