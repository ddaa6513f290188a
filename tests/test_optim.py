"""MuonClip against optax's own Muon, SVD, and the report's QK-Clip guarantee."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax import contrib

from k2jax import configs, model, optim


def tiny(**kw):
  cfg = configs.get_config("tiny").model
  cfg.update(kw)
  return cfg


def _lm_loss(cfg, params, tokens):
  logits, aux = model.forward(cfg, params, tokens[:, :-1])
  logp = jax.nn.log_softmax(logits)
  return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1)), aux


def test_newton_schulz_shares_singular_vectors_and_flattens_singular_values():
  """NS5 is an odd matrix polynomial, so NS(X) = U f(S) V^T with X = U S V^T: in X's singular
  basis its output is diagonal, with NS5's singular values in about [0.7, 1.2]."""
  x = jax.random.normal(jax.random.key(0), (48, 80))
  tx = contrib.scale_by_muon(nesterov=False,  # the orthogonalization our Muon uses
                             weight_dimension_numbers={"w": contrib.MuonDimensionNumbers()})
  o, _ = tx.update({"w": x}, tx.init({"w": x}))
  o = np.asarray(o["w"], np.float64)
  u, s, vt = np.linalg.svd(np.asarray(x, np.float64), full_matrices=False)
  core = u.T @ o @ vt.T
  off = core - np.diag(np.diag(core))
  assert np.abs(off).max() < 1e-3
  assert 0.65 < np.diag(core).min() and np.diag(core).max() < 1.25


def _steps(tx, params, grads_seq):
  state = tx.init(params)
  update = jax.jit(tx.update)
  for g in grads_seq:
    u, state = update(g, state, params)
    params = optax.apply_updates(params, u)
  return params


def test_muon_equals_optax_contrib_muon_on_each_plain_matrix():
  """Three steps of our Muon on the whole model equal optax.contrib.muon applied to each
  layer's / expert's published 2-D matrix on its own."""
  cfg = tiny()
  params = model.init(cfg, jax.random.key(0))
  keys = iter(jax.random.split(jax.random.key(1), 1000))
  grads_seq = [jax.tree.map(lambda p: jax.random.normal(next(keys), p.shape), params)
               for _ in range(3)]
  lr, wd, mu = 0.02, 0.1, 0.9
  ours = _steps(optim.muon(cfg, lr, weight_decay=wd, momentum=mu), params, grads_seq)
  ref_tx = contrib.muon(lr, beta=mu, weight_decay=wd, nesterov=False, consistent_rms=0.2)

  def check(get, to_matrix):
    w0 = to_matrix(get(params))
    want = _steps(ref_tx, {"w": w0}, [{"w": to_matrix(get(g))} for g in grads_seq])["w"]
    np.testing.assert_allclose(to_matrix(get(ours)), want, rtol=2e-5, atol=2e-6)

  q = cfg.q_lora_rank
  check(lambda t: t["moe_layers"]["attn"]["q_b"][1], lambda w: w.reshape(q, -1))  # [q_lora, H*D]
  check(lambda t: t["dense_layers"]["attn"]["o"][0], lambda w: w.reshape(-1, w.shape[-1]))
  check(lambda t: t["moe_layers"]["moe"]["experts"]["down"][2, 5], lambda w: w)
  check(lambda t: t["moe_layers"]["attn"]["kv_a"][0], lambda w: w)


def _newton_schulz_f64(g, steps=5, coeffs=(3.4445, -4.775, 2.0315)):
  """The quintic iteration (optax's default coefficients) in float64."""
  x = np.asarray(g, np.float64)
  x = x / (np.linalg.norm(x) + 1e-8)
  a, b, c = coeffs
  for _ in range(steps):
    gram = x @ x.T
    x = a * x + (b * gram + c * gram @ gram) @ x
  return x


def test_newton_schulz_in_bfloat16_follows_the_float64_iteration():
  """optimizer.ns_dtype=bfloat16 (Moonlight's Newton-Schulz): one step's update of an expert
  and an attention matrix points where the float64 iteration on the gradient does, to bf16
  rounding (relative Frobenius error ~6%, float32's ~1e-6: so the bf16 path is what ran), and
  the optimizer state is float32's (checkpoints do not depend on the setting)."""
  cfg = tiny()
  params = model.init(cfg, jax.random.key(0))
  keys = iter(jax.random.split(jax.random.key(7), 1000))
  g = jax.tree.map(lambda p: jax.random.normal(next(keys), p.shape), params)
  txs = {d: optim.muon(cfg, 0.02, weight_decay=0.0, ns_dtype=d) for d in ("float32", "bfloat16")}
  assert (jax.tree.structure(txs["float32"].init(params))
          == jax.tree.structure(txs["bfloat16"].init(params)))
  err = {}
  for d, tx in txs.items():
    new = _steps(tx, params, [g])
    for name, get in (("expert", lambda t: t["moe_layers"]["moe"]["experts"]["up"][1, 3]),
                      ("kv_a", lambda t: t["moe_layers"]["attn"]["kv_a"][0])):
      u = np.asarray(get(new), np.float64) - np.asarray(get(params), np.float64)
      want = -_newton_schulz_f64(get(g))
      unit = lambda a: a / np.linalg.norm(a)
      err[d, name] = np.linalg.norm(unit(u) - unit(want))     # relative, Frobenius
  for name in ("expert", "kv_a"):
    assert err["float32", name] < 1e-3, err
    assert 1e-3 < err["bfloat16", name] < 0.1, err      # measured: ~0.06


def test_experts_are_orthogonalized_one_by_one_not_as_a_stack():
  cfg = tiny()
  params = model.init(cfg, jax.random.key(0))
  g = jax.tree.map(lambda p: jax.random.normal(jax.random.key(3), p.shape), params)
  ours = _steps(optim.muon(cfg, 0.02, weight_decay=0.0), params, [g])
  delta = (ours["moe_layers"]["moe"]["experts"]["gate"] - params["moe_layers"]["moe"]["experts"]["gate"])[0]
  E, d, f = delta.shape
  # Per expert: each expert's update is a scaled orthogonal d x f matrix (equal singular values
  # band); as one stacked [E*d, f] matrix its singular values would be ~sqrt(E) larger.
  ref = contrib.muon(0.02, nesterov=False, consistent_rms=0.2)
  g0 = g["moe_layers"]["moe"]["experts"]["gate"][0]
  stacked = _steps(ref, {"w": params["moe_layers"]["moe"]["experts"]["gate"][0].reshape(E * d, f)},
                   [{"w": g0.reshape(E * d, f)}])["w"]
  stacked_delta = stacked - params["moe_layers"]["moe"]["experts"]["gate"][0].reshape(E * d, f)
  assert not np.allclose(delta.reshape(E * d, f), stacked_delta, atol=1e-5)
  per_expert = [_steps(ref, {"w": params["moe_layers"]["moe"]["experts"]["gate"][0, e]},
                       [{"w": g0[e]}])["w"] - params["moe_layers"]["moe"]["experts"]["gate"][0, e]
                for e in range(E)]
  np.testing.assert_allclose(delta, np.stack(per_expert), rtol=2e-5, atol=2e-7)


def test_router_bias_is_not_trained_and_norms_are_not_decayed():
  cfg = tiny()
  params = model.init(cfg, jax.random.key(0))
  zeros = jax.tree.map(jnp.zeros_like, params)
  for tx in (optim.muon(cfg, 0.1, weight_decay=0.5), optim.adamw(cfg, 0.1, weight_decay=0.5)):
    g = jax.tree.map(jnp.ones_like, params)
    u, _ = tx.update(g, tx.init(params), params)
    assert float(jnp.abs(u["moe_layers"]["moe"]["router_bias"]).max()) == 0
    u, _ = tx.update(zeros, tx.init(params), params)   # zero grads: only weight decay acts
    assert float(jnp.abs(u["final_norm"]).max()) == 0
    assert float(jnp.abs(u["dense_layers"]["attn"]["kv_a_norm"]).max()) == 0
    assert float(jnp.abs(u["embed"]).max()) > 0


def test_sgd_steps_along_the_gradient_scaled_by_lr_and_keeps_the_router_bias():
  """u = -lr g on every trained leaf (random gradients, so a wrong sign or a normalization
  shows), zero on the router bias (it follows the balancing rule)."""
  cfg = tiny()
  params = model.init(cfg, jax.random.key(0))
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(1), len(leaves))
  g = treedef.unflatten([jax.random.normal(k, x.shape, x.dtype) * (i + 1)
                         for i, (k, x) in enumerate(zip(keys, leaves))])
  tx = optim.sgd(cfg, 0.03)
  u, _ = tx.update(g, tx.init(params), params)
  flat_u = jax.tree_util.tree_flatten_with_path(u)[0]
  for (path, ui), gi in zip(flat_u, jax.tree.leaves(g)):
    expected = 0 * gi if "router_bias" in jax.tree_util.keystr(path) else -0.03 * gi
    np.testing.assert_allclose(np.asarray(ui), np.asarray(expected), rtol=1e-6, atol=0)
  assert "sgd" in optim.OPTIMIZERS


@pytest.mark.parametrize("base", ["muonclip", "adamw_qk_clip"])
def test_qk_clip_brings_recomputed_max_logits_to_tau(base):
  """lr = 0: the first layer's max logits on the same batch become exactly min(S, tau) per head,
  and every weight outside clipped heads' q / k_nope columns stays bit-identical."""
  cfg = tiny()
  params = model.init(cfg, jax.random.key(0))
  params = jax.tree.map(lambda x: x * 6 if x.ndim == 4 and x.shape[-2] == cfg.num_attention_heads
                        else x, params)  # q_b / kv_b x6: logits x36
  tokens = jax.random.randint(jax.random.key(1), (2, 33), 0, cfg.vocab_size)
  (_, aux), grads = jax.jit(jax.value_and_grad(lambda p: _lm_loss(cfg, p, tokens),
                                               has_aux=True))(params)
  S = np.asarray(aux.max_logits)
  tau = float(np.median(S[0]))  # some heads of layer 0 above tau, some below
  if base == "muonclip":
    tx = optim.muonclip(cfg, 0.0, tau=tau)
  else:
    tx = optax.chain(optim.adamw(cfg, 0.0), optim.qk_clip(cfg, tau))
  u, state = jax.jit(lambda g, s, p, m: tx.update(g, s, p, max_logits=m))(
      grads, tx.init(params), params, aux.max_logits)
  new = optax.apply_updates(params, u)
  _, aux2 = jax.jit(lambda p: model.forward(cfg, p, tokens[:, :-1]))(new)
  np.testing.assert_allclose(aux2.max_logits[0], np.minimum(S[0], tau), rtol=1e-5)
  assert (S > tau).any() and (S <= tau).any()

  clipped = S > tau
  flat_old = jax.tree_util.tree_flatten_with_path(params)[0]
  flat_new = jax.tree.leaves(new)
  for (path, old), nw in zip(flat_old, flat_new):
    name = "/".join(str(getattr(k, "key", k)) for k in path)
    if name.endswith(("attn/q_b", "attn/kv_b")):
      stack = name.split("/")[0]
      rows = clipped[:1] if stack == "dense_layers" else clipped[1:]
      keep = ~rows[:, None, :, None]  # unclipped heads of every layer: untouched
      nope = cfg.qk_nope_head_dim
      cols = slice(None) if name.endswith("q_b") else slice(0, nope)
      np.testing.assert_array_equal(np.where(keep, old, 0)[..., cols],
                                    np.where(keep, nw, 0)[..., cols])
      if name.endswith("kv_b"):  # v columns never change
        np.testing.assert_array_equal(np.asarray(old)[..., nope:], np.asarray(nw)[..., nope:])
    else:
      np.testing.assert_array_equal(old, nw)
  ever = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, optim.QKClipState))
  assert any(isinstance(s, optim.QKClipState) and np.array_equal(s.ever_clipped, clipped)
             for s in ever)


def test_qk_clip_scales_each_head_component_as_the_report_says():
  cfg = tiny(num_hidden_layers=1, first_k_dense_replace=1)
  params = model.init(cfg, jax.random.key(0))
  S = jnp.asarray([[400.0, 50.0, -3.0, 0.0]])  # tau 100: only head 0 clips, gamma 1/4
  tx = optim.qk_clip(cfg, 100.0)
  zeros = jax.tree.map(jnp.zeros_like, params)
  u, _ = tx.update(zeros, tx.init(params), params, max_logits=S)
  new = optax.apply_updates(params, u)
  a0, a1 = params["dense_layers"]["attn"], new["dense_layers"]["attn"]
  n = cfg.qk_nope_head_dim
  np.testing.assert_allclose(a1["q_b"][..., 0, :n], a0["q_b"][..., 0, :n] * 0.5, rtol=1e-6)
  np.testing.assert_allclose(a1["q_b"][..., 0, n:], a0["q_b"][..., 0, n:] * 0.25, rtol=1e-6)
  np.testing.assert_allclose(a1["kv_b"][..., 0, :n], a0["kv_b"][..., 0, :n] * 0.5, rtol=1e-6)
  np.testing.assert_array_equal(a1["kv_b"][..., 0, n:], a0["kv_b"][..., 0, n:])   # v
  np.testing.assert_array_equal(a1["kv_a"], a0["kv_a"])                            # shared k_rope
  for h in (1, 2, 3):  # S <= tau, including negative and zero: unchanged, no NaN
    np.testing.assert_array_equal(a1["q_b"][..., h, :], a0["q_b"][..., h, :])
  assert np.isfinite(np.asarray(optim.clip_factors(S, 100.0))).all()


def test_router_bias_balancing_rule():
  """b_i += gamma sign(mean load - load_i) per MoE layer, on top of the optimizer's (zero)
  bias update; every other update passes through."""
  cfg = tiny()
  params = model.init(cfg, jax.random.key(0))
  load = jnp.asarray([[0.0] * 15 + [32.0]] * 3)  # expert 15 overloaded in every layer
  tx = optax.chain(optim.adamw(cfg, 0.0), optim.router_bias_balancing(cfg, 0.001))
  grads = jax.tree.map(jnp.ones_like, params)
  u, _ = tx.update(grads, tx.init(params), params, expert_load=load)
  new = optax.apply_updates(params, u)
  b = new["moe_layers"]["moe"]["router_bias"]
  np.testing.assert_allclose(b[:, 15], -0.001)
  np.testing.assert_allclose(b[:, :15], 0.001)
  for (path, a), c in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(new)):
    if "router_bias" not in jax.tree_util.keystr(path):
      np.testing.assert_array_equal(a, c)  # lr 0: nothing else moves
  with pytest.raises(ValueError, match="expert_load=aux.expert_load"):
    tx.update(grads, tx.init(params), params)


def test_qk_clip_demands_max_logits():
  cfg = tiny()
  params = model.init(cfg, jax.random.key(0))
  tx = optim.qk_clip(cfg, 100.0)
  with pytest.raises(ValueError, match="max_logits=aux"):
    tx.update(params, tx.init(params), params)


def test_wsd_schedule_shape():
  s = optim.wsd(2e-4, total_steps=1000, warmup_steps=100, decay_steps=400, end_value=2e-5)
  np.testing.assert_allclose([s(0), s(50), s(100), s(599), s(600), s(800), s(1000), s(5000)],
                             [0, 1e-4, 2e-4, 2e-4, 2e-4, 1.1e-4, 2e-5, 2e-5], rtol=1e-5, atol=1e-12)
