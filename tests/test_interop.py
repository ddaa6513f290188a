"""Checkpoint errors name the tensor and the shapes; FP8 block math; config.json mapping."""

import json

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from k2jax import configs, model
from k2jax.interop import hf, quant


@pytest.fixture
def saved(tmp_path):
  cfg = configs.get_config("tiny").model
  cfg.update(dict(num_hidden_layers=2, n_routed_experts=4))
  params = model.init(cfg, jax.random.key(0))
  hf.save_checkpoint(cfg, params, str(tmp_path))
  return cfg, params, tmp_path


def test_round_trip_is_exact(saved):
  cfg, params, path = saved
  cfg2, params2 = hf.load_checkpoint(str(path))
  for k in ("hidden_size", "n_routed_experts", "q_lora_rank", "rope_theta"):
    assert cfg2[k] == cfg[k]
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
    np.testing.assert_array_equal(a, b)


def _rewrite(path, fn):
  from k2jax.interop.safetensors_io import Reader
  with Reader(str(path)) as r:
    tensors = {n: np.array(r.get(n)) for n in r.names()}
  fn(tensors)
  save_file(tensors, str(path / "model.safetensors"))


def test_wrong_shape_names_tensor_and_shapes(saved):
  _, _, path = saved
  name = "model.layers.1.self_attn.kv_b_proj.weight"
  _rewrite(path, lambda t: t.__setitem__(name, np.zeros((7, 3), np.float32)))
  with pytest.raises(hf.CheckpointError, match=rf"tensor {name} in model.safetensors: expected \[256, 32\] .* found \[7, 3\]"):
    hf.load_checkpoint(str(path))


def test_missing_and_unexpected_tensors(saved):
  _, _, path = saved
  _rewrite(path, lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"))
  with pytest.raises(hf.CheckpointError, match=r"experts.3.up_proj.weight is missing .*\[64, 128\]"):
    hf.load_checkpoint(str(path))


def test_extra_tensors_and_ignored_ones(saved):
  _, _, path = saved
  _rewrite(path, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(4, np.float32),
                                     "model.layers.2.eh_proj.weight": np.ones((2, 2), np.float32)}))
  hf.load_checkpoint(str(path))  # inv_freq and the MTP layer (index 2 of 2) are skipped
  _rewrite(path, lambda t: t.update({"model.layers.0.mlp.bogus.weight": np.ones(2, np.float32)}))
  with pytest.raises(hf.CheckpointError, match="bogus.weight .* has no place in this config"):
    hf.load_checkpoint(str(path))


def test_fp8_block_dequantization_against_elementwise_formula():
  rng = np.random.default_rng(0)
  w = rng.normal(size=(200, 300)).astype(np.float32)
  q, s = hf.quantize_fp8(w)
  assert q.dtype == ml_dtypes.float8_e4m3fn and s.shape == (2, 3)
  deq = hf.dequantize_fp8(q, s)
  for i, j in [(0, 0), (127, 128), (128, 255), (199, 299), (150, 10)]:
    assert deq[i, j] == np.float32(q[i, j]) * s[i // 128, j // 128]
  assert np.abs(deq - w).max() <= np.abs(w).max() / 8  # e4m3 has 3 mantissa bits
  with pytest.raises(quant.QuantizationError, match=r"weight_scale_inv of shape \[1, 3\]"):
    hf.dequantize_fp8(q, s[:1])


def test_published_k2_config_json_maps_to_the_preset():
  published = {  # the fields of Kimi-K2-Instruct's config.json that we read
      "model_type": "kimi_k2", "vocab_size": 163840, "hidden_size": 7168,
      "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
      "num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 1536,
      "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
      "n_routed_experts": 384, "num_experts_per_tok": 8, "n_shared_experts": 1,
      "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.827,
      "norm_topk_prob": True, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
      "rope_theta": 50000.0, "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
      "rope_scaling": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                       "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
      "bos_token_id": 163584, "eos_token_id": 163585, "aux_loss_alpha": 0.001}
  got = hf.config_from_hf(json.loads(json.dumps(published)))
  want = configs.get_config("kimi_k2_long_context").model
  for k in published:
    if k in want and k != "rope_scaling":
      assert got[k] == want[k], k
  assert got.rope_scaling.to_dict() == want.rope_scaling.to_dict()


def test_missing_directory_is_a_clear_error(tmp_path):
  with pytest.raises(hf.CheckpointError, match="no config.json"):
    hf.load_checkpoint(str(tmp_path))
