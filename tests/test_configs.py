"""Presets load with the published values, and bad values fail with a line naming key, value
and rule."""

import pytest

from k2jax import configs


@pytest.mark.parametrize("name", configs.PRESETS)
def test_presets_validate(name):
  cfg = configs.get_config(name)
  assert set(cfg) >= {"model", "optimizer", "data", "train", "mesh"}


def test_k2_published_values():
  m = configs.get_config("kimi_k2_long_context").model
  assert (m.num_attention_heads, m.n_routed_experts, m.first_k_dense_replace, m.n_group) == (64, 384, 1, 1)
  assert m.routed_scaling_factor == 2.827 and m.rope_theta == 50000.0
  assert (m.rope_scaling.factor, m.rope_scaling.beta_fast, m.rope_scaling.beta_slow) == (32.0, 1.0, 1.0)


def test_k2_pretrains_at_4k_without_yarn_and_keeps_tau_in_report_units():
  """Report 2.5: 4k pre-training with plain RoPE; YaRN arrives with the long-context stage,
  whose tau carries YaRN's mscale^2 so the clip binds at the same q.k."""
  from k2jax.model import rope
  pre, long = configs.get_config("kimi_k2"), configs.get_config("kimi_k2_long_context")
  assert pre.model.rope_scaling.type == "none" and pre.train.seq_len == 4096
  assert long.model.rope_scaling.type == "yarn" and long.train.seq_len == 32768
  base_scale = (pre.model.qk_nope_head_dim + pre.model.qk_rope_head_dim) ** -0.5
  assert rope.softmax_scale(pre.model) == pytest.approx(base_scale)
  ratio = rope.softmax_scale(long.model) / base_scale          # mscale^2 = 1.81
  assert ratio == pytest.approx(1.8133, abs=1e-4)
  assert long.optimizer.tau == pytest.approx(pre.optimizer.tau * ratio)


def test_k2_runs_one_sequence_per_device_per_microbatch_on_any_data_size():
  """The large presets derive train.grad_accum from the mesh (a reference): the batch splits
  over data x expert, one sequence each per microbatch, whatever mesh.data is set to."""
  for name in ("kimi_k2", "kimi_k2_long_context", "deepseek_v3"):
    c = configs.get_config(name)
    for data in (1, 4):
      c.mesh.data = data
      t = c.train
      assert t.grad_accum * data * c.mesh.expert == t.batch_size, (name, data)
      configs.validate(c)
    c.train.grad_accum = 64            # a plain override still wins
    assert c.train.grad_accum == 64


@pytest.mark.parametrize("key,value,fragment", [
    ("num_experts_per_tok", 20, "model.num_experts_per_tok = 20: must be <= n_routed_experts (16)"),
    ("n_group", 3, "model.n_group = 3: must divide n_routed_experts (16)"),
    ("topk_group", 2, "model.topk_group = 2: must be <= n_group (1)"),
    ("first_k_dense_replace", 9, "model.first_k_dense_replace = 9: must be between 0 and num_hidden_layers (4)"),
    ("qk_rope_head_dim", 7, "model.qk_rope_head_dim = 7: must be even"),
    ("num_attention_heads", 0, "model.num_attention_heads = 0: must be a positive number"),
    ("kv_lora_rank", -4, "model.kv_lora_rank = -4: must be a positive number"),
    ("q_lora_rank", -1, "model.q_lora_rank = -1: must be positive"),
    ("dtype", "float16", "model.dtype = 'float16': must be one of float32, bfloat16"),
    ("scoring_func", "softmax", "model.scoring_func = 'softmax'"),
    ("ep_round_load", 1.1, "model.ep_round_load = 1.1: must be >= 1.25 (x the balanced load)"),
])
def test_invalid_model_values_name_key_value_and_rule(key, value, fragment):
  cfg = configs.get_config("tiny")
  cfg.model[key] = value
  with pytest.raises(ValueError) as e:
    configs.validate(cfg)
  assert fragment in str(e.value)
  assert "\n" not in str(e.value)


def test_groups_need_two_experts_each():
  cfg = configs.get_config("tiny")
  cfg.model.update(dict(n_group=16, topk_group=4))
  with pytest.raises(ValueError, match="needs >= 2 experts per group"):
    configs.validate(cfg)


@pytest.mark.parametrize("group,key,value,fragment", [
    ("train", "grad_accum", 3, "train.grad_accum = 3: must divide train.batch_size (16)"),
    ("train", "seq_len", 4096, "must be <= model.max_position_embeddings"),
    ("optimizer", "momentum", 1.0, "optimizer.momentum = 1.0: must be in [0, 1)"),
    ("mesh", "data", 0, "mesh.data = 0: must be a positive number"),
    ("mesh", "context", 0, "mesh.context = 0: must be >= 1"),
    # tiny's seq_len 128 is not a multiple of 2 x 3 chunks
    ("mesh", "context", 3, "train.seq_len = 128: must be a multiple of 2 x mesh.context (6)"),
])
def test_invalid_other_values(group, key, value, fragment):
  cfg = configs.get_config("tiny")
  cfg[group][key] = value
  with pytest.raises(ValueError, match=None) as e:
    configs.validate(cfg)
  assert fragment in str(e.value)


def test_optimizer_name_is_checked_against_the_registry():
  from k2jax import optim
  cfg = configs.get_config("tiny")
  cfg.optimizer.name = "lion"
  for build in (optim.validate, optim.optimizer):
    with pytest.raises(ValueError) as e:
      build(cfg)
    assert "optimizer.name = 'lion': must be one of muonclip, muon, adamw, sgd, adamw_qk_clip" in str(e.value)


def test_unknown_preset():
  with pytest.raises(ValueError, match="unknown config preset 'k3'"):
    configs.get_config("k3")
