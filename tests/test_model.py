"""Model pieces against independent results: float64 brute force, the report's numbers,
the dense MoE reference and YaRN values from the facts sheet."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k2jax import configs, kernels, model
from k2jax.model import moe, rope
from tests.numerics import assert_within, gamma, seed_and_rng


def tiny(**overrides):
  cfg = configs.get_config("tiny").model
  cfg.update(overrides)
  configs.validate_model(cfg)
  return cfg


# ----------------------------------------------------------------------------- RoPE / YaRN


def test_yarn_k2_values_from_the_facts_sheet():
  m = configs.get_config("kimi_k2_long_context").model
  assert rope.softmax_scale(m) == pytest.approx(0.13086080, abs=1e-8)
  assert rope.cos_sin_multiplier(m) == 1.0
  inv = rope.inv_frequencies(m)
  pos = 50000.0 ** (np.arange(0, 64, 2) / 64)
  # K2: low = 19, high = 20: dims < 19 keep their frequency, dims >= 20 are divided by 32.
  np.testing.assert_allclose(inv[:19], 1 / pos[:19], rtol=1e-12)
  np.testing.assert_allclose(inv[20:], 1 / (32 * pos[20:]), rtol=1e-12)


def test_rope_rotation_preserves_norm_and_is_relative():
  cfg = tiny()
  x = jax.random.normal(jax.random.key(0), (1, 1, 2, cfg.qk_rope_head_dim))
  y = jax.random.normal(jax.random.key(1), (1, 1, 2, cfg.qk_rope_head_dim))
  def rot(v, p):
    c, s = rope.cos_sin(cfg, jnp.full((1, 1), p))
    return rope.apply_rope(v, c, s)
  np.testing.assert_allclose(jnp.linalg.norm(rot(x, 7)), jnp.linalg.norm(x), rtol=1e-5)
  # <R(a) x, R(b) y> depends only on a - b.
  d1 = jnp.sum(rot(x, 10) * rot(y, 3))
  d2 = jnp.sum(rot(x, 107) * rot(y, 100))
  np.testing.assert_allclose(d1, d2, rtol=1e-4)


# ----------------------------------------------------------------------------- attention


def _brute_force_max_logits(q, k, scale, segment_ids):
  """float64 loops over every (batch, head, query, key) pair that may attend: the per-head
  max logit and, for an f32 kernel, its rounding bound (the max over those pairs of
  gamma(D + 6) scale sum_d |q_d k_d|: tests/test_attention.py's error_bounds)."""
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  B, T, H, D = q.shape
  best, bound = np.full(H, -np.inf), np.zeros(H)
  for b in range(B):
    for h in range(H):
      for i in range(T):
        for j in range(i + 1):
          if segment_ids is None or segment_ids[b, i] == segment_ids[b, j]:
            best[h] = max(best[h], scale * q[b, i, h] @ k[b, j, h])
            bound[h] = max(bound[h], gamma(D + 6) * scale * abs(q[b, i, h]) @ abs(k[b, j, h]))
  return best, bound


@pytest.mark.parametrize("with_segments", [False, True])
def test_max_logits_equal_brute_force(with_segments):
  seed, rng = seed_and_rng()
  B, T, H, D = 2, 9, 3, 8
  q, k = (jnp.asarray(3 * rng.standard_normal((B, T, H, D)), jnp.float32) for _ in range(2))
  v = jnp.asarray(rng.standard_normal((B, T, H, 5)), jnp.float32)
  seg = np.array([[1] * 4 + [2] * 5, [1] * 9]) if with_segments else None
  _, got = kernels.attention(q, k, v, scale=0.3,
                             segment_ids=None if seg is None else jnp.asarray(seg))
  want, bound = _brute_force_max_logits(q, k, 0.3, seg)
  assert_within("S_max", got, want, bound, seed)


def test_model_max_logits_per_layer_equal_brute_force_on_materialized_logits():
  """Recompute each layer's q, k by hand from its input (captured by running the layers one at
  a time) and take the float64 max; compare with aux.max_logits [layers, heads]."""
  cfg = tiny(num_hidden_layers=3, first_k_dense_replace=1)
  params = model.init(cfg, jax.random.key(0))
  params = jax.tree.map(lambda x: x * 4 if x.ndim == 4 else x, params)  # bigger logits
  tokens = jax.random.randint(jax.random.key(1), (2, 11), 0, cfg.vocab_size)
  _, aux = model.forward(cfg, params, tokens)

  from k2jax.model import layers, transformer
  x = params["embed"][tokens]
  pos = jnp.broadcast_to(jnp.arange(11), (2, 11))
  want = []
  for stack, kind in ((st.name, st.ffn) for st in transformer.stacks(cfg)):
    for j in range(params[stack]["attn_norm"].shape[0]):
      p = jax.tree.map(lambda a: a[j], params[stack])
      h = layers.rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)
      a = p["attn"]
      q = jnp.einsum("btr,rhd->bthd", layers.rms_norm(h @ a["q_a"], a["q_a_norm"], 1e-6), a["q_b"])
      ckv = h @ a["kv_a"]
      kv = jnp.einsum("btr,rhd->bthd", layers.rms_norm(ckv[..., :cfg.kv_lora_rank],
                                                      a["kv_a_norm"], 1e-6), a["kv_b"])
      c, s = rope.cos_sin(cfg, pos)
      n = cfg.qk_nope_head_dim
      qf = jnp.concatenate([q[..., :n], rope.apply_rope(q[..., n:], c, s)], -1)
      kr = rope.apply_rope(ckv[..., cfg.kv_lora_rank:], c, s)
      kf = jnp.concatenate([kv[..., :n], jnp.broadcast_to(kr[:, :, None], kv.shape[:3] + kr.shape[-1:])], -1)
      want.append(_brute_force_max_logits(qf, kf, rope.softmax_scale(cfg), None)[0])
      x, _ = transformer._block(cfg, kind, x, p, pos, None)
  np.testing.assert_allclose(aux.max_logits, np.stack(want), rtol=1e-5)


def test_max_logits_carry_no_gradient():
  cfg = tiny(num_hidden_layers=2)
  params = model.init(cfg, jax.random.key(0))
  tokens = jnp.zeros((1, 5), jnp.int32)
  g = jax.grad(lambda p: model.forward(cfg, p, tokens)[1].max_logits.sum())(params)
  assert all(float(jnp.abs(x).max()) == 0 for x in jax.tree.leaves(g))


# ----------------------------------------------------------------------------- MoE


@pytest.mark.parametrize("groups", [(1, 1), (4, 2)])
@pytest.mark.parametrize("impl", ["blocked", "ragged"])
def test_sorted_dispatch_equals_dense_reference(groups, impl):
  cfg = tiny(n_routed_experts=16, num_experts_per_tok=3, n_group=groups[0], topk_group=groups[1])
  params = model.init(cfg, jax.random.key(1))
  p = jax.tree.map(lambda a: a[0], params["moe_layers"]["moe"])
  p["router_bias"] = 0.1 * jax.random.normal(jax.random.key(2), p["router_bias"].shape)
  x = jax.random.normal(jax.random.key(3), (3, 13, cfg.hidden_size))

  def run(impl, p, x):
    c = cfg.copy_and_resolve_references()
    c.moe_impl = impl
    y, stats = moe.moe(c, p, x)
    return jnp.sum(jnp.sin(y)), (y, stats)

  (_, (y_r, s_r)), g_r = jax.value_and_grad(run, argnums=(1, 2), has_aux=True)(impl, p, x)
  (_, (y_d, s_d)), g_d = jax.value_and_grad(run, argnums=(1, 2), has_aux=True)("dense", p, x)
  np.testing.assert_allclose(y_r, y_d, atol=1e-5)
  np.testing.assert_array_equal(s_r.expert_load, s_d.expert_load)
  for a, b in zip(jax.tree.leaves(g_r), jax.tree.leaves(g_d)):
    np.testing.assert_allclose(a, b, atol=1e-5)


def test_router_selects_with_bias_but_combines_without():
  cfg = tiny(n_routed_experts=8, num_experts_per_tok=2, routed_scaling_factor=2.5)
  d, E = cfg.hidden_size, 8
  x = jax.random.normal(jax.random.key(0), (64, d))
  wg = jax.random.normal(jax.random.key(1), (d, E)) * 0.1
  bias = jnp.zeros(E).at[5].set(10.0)  # expert 5 always selected
  w, idx, scores = moe.route(cfg, {"router": wg, "router_bias": bias}, x)
  assert bool(jnp.all(jnp.any(idx == 5, axis=-1)))
  s = np.asarray(jax.nn.sigmoid(x @ wg), np.float64)
  for n in range(64):
    chosen = s[n, np.asarray(idx[n])]
    np.testing.assert_allclose(w[n], 2.5 * chosen / chosen.sum(), rtol=1e-5)


def test_group_limited_routing_stays_in_top_groups():
  cfg = tiny(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2)
  x = jax.random.normal(jax.random.key(0), (50, cfg.hidden_size))
  p = {"router": jax.random.normal(jax.random.key(1), (cfg.hidden_size, 16)),
       "router_bias": jnp.zeros(16)}
  _, idx, scores = moe.route(cfg, p, x)
  s = np.asarray(scores).reshape(50, 4, 4)
  group_score = np.sort(s, -1)[..., -2:].sum(-1)
  for n in range(50):
    top_groups = set(np.argsort(-group_score[n])[:2])
    assert {int(e) // 4 for e in idx[n]} <= top_groups


def test_balance_loss_is_one_when_balanced():
  # Every token scores all experts equally and the k picks are spread evenly.
  E, T = 4, 8   # top-2
  idx = jnp.asarray([[t % E, (t + 1) % E] for t in range(T)])
  loss = moe.balance_loss(jnp.ones((T, E)), idx, E, batch=1)
  assert float(loss) == pytest.approx(1.0)


# ----------------------------------------------------------------------------- whole model


def test_padding_counts_for_nothing_in_the_statistics():
  """Rows padded at the end (segment id 0) give the max logits, expert load and balance loss
  of the same rows without the padding: padding is invisible to QK-Clip and balancing."""
  cfg = tiny(num_hidden_layers=3, aux_loss_alpha=0.01)
  params = model.init(cfg, jax.random.key(0))
  params = jax.tree.map(lambda x: x * 3 if x.ndim == 4 else x, params)   # larger logits
  T, real = 16, 11
  tokens = jax.random.randint(jax.random.key(1), (1, T), 0, cfg.vocab_size)
  # Padding tokens chosen to be loud: if they counted, they would set the max logits.
  tokens = tokens.at[0, real:].set(tokens[0, 0])
  seg = jnp.where(jnp.arange(T) < real, 1, 0)[None].astype(jnp.int32)
  _, padded = model.forward(cfg, params, tokens, segment_ids=seg)
  _, trimmed = model.forward(cfg, params, tokens[:, :real], segment_ids=seg[:, :real])
  np.testing.assert_allclose(padded.max_logits, trimmed.max_logits, rtol=1e-6)
  np.testing.assert_array_equal(padded.expert_load, trimmed.expert_load)
  assert float(padded.expert_load.sum()) == real * cfg.num_experts_per_tok * 2  # 2 MoE layers
  np.testing.assert_allclose(padded.aux_loss, trimmed.aux_loss, rtol=1e-6)


@pytest.mark.parametrize("moe_layers", [False, True])
def test_bfloat16_compute_stays_close_to_float32(moe_layers):
  cfg = tiny() if moe_layers else tiny(first_k_dense_replace=4)
  params = model.init(cfg, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, cfg.vocab_size)
  l32, _ = model.forward(cfg, params, tokens)
  cfg.dtype = "bfloat16"
  l16, a16 = model.forward(cfg, params, tokens)
  assert l16.dtype == jnp.float32 and a16.max_logits.dtype == jnp.float32
  err, scale = jnp.abs(l16 - l32), float(jnp.abs(l32).mean())
  if moe_layers:  # at init router scores are near-ties, so a few tokens switch experts
    assert float(err.mean()) < 0.05 * scale
  else:
    assert float(err.max()) < 0.05 * scale


def test_remat_policies_give_identical_gradients():
  cfg = tiny()
  params = model.init(cfg, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, cfg.vocab_size)
  grads = {}
  for policy in ("none", "selective", "full"):
    cfg.remat = policy
    c = cfg.copy_and_resolve_references()
    grads[policy] = jax.jit(jax.grad(lambda p: model.forward(c, p, tokens)[0].sum()))(params)
  for policy in ("selective", "full"):
    for a, b in zip(jax.tree.leaves(grads["none"]), jax.tree.leaves(grads[policy])):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_segment_ids_isolate_documents():
  cfg = tiny()
  params = model.init(cfg, jax.random.key(0))
  a = jax.random.randint(jax.random.key(1), (1, 6), 0, cfg.vocab_size)
  b = jax.random.randint(jax.random.key(2), (1, 5), 0, cfg.vocab_size)
  packed = jnp.concatenate([a, b], 1)
  seg = jnp.asarray([[1] * 6 + [2] * 5])
  pos = jnp.asarray([list(range(6)) + list(range(5))])
  logits, _ = model.forward(cfg, params, packed, positions=pos, segment_ids=seg)
  alone, _ = model.forward(cfg, params, b)
  np.testing.assert_allclose(logits[:, 6:], alone, atol=1e-4)


@pytest.mark.parametrize("name,total,active,tol_total,tol_active", [
    ("kimi_k2", 1.04e12, 32.6e9, 0.02, 0.02),        # report Table 2
    ("deepseek_v3", 671e9, 37e9, 0.01, 0.03),
])
def test_param_counts_match_the_report(name, total, active, tol_total, tol_active):
  c = model.count_params(configs.get_config(name).model)
  assert abs(c["total"] / total - 1) < tol_total
  assert abs(c["activated"] / active - 1) < tol_active
  breakdown = sum(v for k, v in c.items() if k not in ("total", "activated",
                                                       "routed_experts_activated"))
  assert breakdown == c["total"]


def test_param_count_equals_initialised_leaves():
  cfg = tiny()
  params = model.init(cfg, jax.random.key(0))
  assert model.count_params(cfg)["total"] == sum(x.size for x in jax.tree.leaves(params))


def test_flops_per_token_is_six_n_plus_attention():
  cfg = configs.get_config("kimi_k2").model
  c = model.count_params(cfg)
  f = model.flops_per_token(cfg, 4096)
  n = c["activated"] - c["embedding"] - c["norms"]
  attn = 6 * 61 * 64 * (192 + 128) * 4097 / 2
  assert f == pytest.approx(6 * n + attn)
  assert 1.9e11 < f < 2.2e11  # ~6 x 32.6B + attention at 4k context
