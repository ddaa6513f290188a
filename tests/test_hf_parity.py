"""Parity with the PyTorch reference (transformers DeepseekV3ForCausalLM) on random tiny configs,
through checkpoints written in the published layout and read by k2jax.interop.hf."""

import numpy as np
import pytest

from tests import hf_reference as ref

from k2jax import model  # noqa: E402
from k2jax.interop import hf  # noqa: E402

YARN_K2 = {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 64,
           "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
YARN_V3 = {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 32,
           "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


def arch(**kw):
  a = dict(vocab_size=97, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
           num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4,
           q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
           v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
           n_group=1, topk_group=1, routed_scaling_factor=2.827, norm_topk_prob=True,
           rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1)
  a.update(kw)
  return a


CASES = {
    # K2-like: YaRN with beta_fast = beta_slow = 1, one dense layer, no expert groups.
    "k2_yarn": (arch(), YARN_K2, 50000.0, (2, 7)),
    # No YaRN, group-limited routing, two dense layers, 3 heads, top-3, 2 shared experts.
    "groups_no_yarn": (arch(num_attention_heads=3, n_group=2, topk_group=1, num_experts_per_tok=3,
                            first_k_dense_replace=2, num_hidden_layers=4, n_shared_experts=2,
                            routed_scaling_factor=1.0), None, 10000.0, (3, 13)),
    # DeepSeek-V3-like YaRN, 4 groups keep 2, 16 experts top-4, different ranks and head dims.
    "v3_yarn_groups": (arch(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                            q_lora_rank=24, kv_lora_rank=12, qk_nope_head_dim=8,
                            qk_rope_head_dim=4, v_head_dim=12, num_attention_heads=5,
                            routed_scaling_factor=2.5), YARN_V3, 10000.0, (2, 9)),
    # No low-rank q (q_proj), no MoE normalisation, all but one layer MoE.
    "q_proj_unnormalized": (arch(q_lora_rank=None, norm_topk_prob=False, first_k_dense_replace=0,
                                 num_hidden_layers=2), YARN_K2, 50000.0, (2, 11)),
    # Dense only.
    "all_dense": (arch(first_k_dense_replace=2, num_hidden_layers=2), None, 10000.0, (1, 5)),
}


def _tokens(shape, vocab, seed):
  return np.random.default_rng(seed).integers(0, vocab, size=shape)


@pytest.mark.parametrize("name", list(CASES))
def test_logits_and_max_logits_match_reference(name, tmp_path, monkeypatch):
  a, yarn, theta, shape = CASES[name]
  cj = ref.hf_config_dict(a, yarn, theta)
  torch_model = ref.make_model(cj, seed=len(name))
  ref.write_dir(tmp_path, cj, ref.published_tensors(torch_model))
  tokens = _tokens(shape, a["vocab_size"], seed=1)
  want_logits, want_max = ref.reference_forward(torch_model, tokens, monkeypatch)

  cfg, params = hf.load_checkpoint(str(tmp_path))
  logits, aux = model.forward(cfg, params, tokens)
  np.testing.assert_allclose(np.asarray(logits), want_logits, rtol=0, atol=1e-4)
  assert aux.max_logits.shape == (a["num_hidden_layers"], a["num_attention_heads"])
  np.testing.assert_allclose(np.asarray(aux.max_logits), want_max, rtol=1e-5, atol=1e-5)


def test_fp8_checkpoint_matches_dequantized_reference(tmp_path, monkeypatch):
  # Sizes over 128 so weights span several (ragged) 128x128 scale blocks.
  a = arch(hidden_size=160, intermediate_size=320, moe_intermediate_size=136, q_lora_rank=144)
  cj = ref.hf_config_dict(a, YARN_K2, 50000.0)
  torch_model = ref.make_model(cj, seed=3)
  quantized, dequantized = ref.fp8_quantize(ref.published_tensors(torch_model))
  ref.write_dir(tmp_path / "fp8", cj, quantized, fp8=True)
  ref.write_dir(tmp_path / "deq", cj, dequantized)
  deq_model = ref.hf_mod.DeepseekV3ForCausalLM.from_pretrained(
      tmp_path / "deq", attn_implementation="eager", dtype=ref.torch.float32).eval()
  tokens = _tokens((2, 7), a["vocab_size"], seed=2)
  want_logits, _ = ref.reference_forward(deq_model, tokens, monkeypatch)

  cfg, params = hf.load_checkpoint(str(tmp_path / "fp8"))
  logits, _ = model.forward(cfg, params, tokens)
  np.testing.assert_allclose(np.asarray(logits), want_logits, rtol=0, atol=1e-4)


def test_saved_checkpoint_loads_in_transformers(tmp_path, monkeypatch):
  a, yarn, theta, shape = CASES["v3_yarn_groups"]
  cj = ref.hf_config_dict(a, yarn, theta)
  ref.write_dir(tmp_path / "src", cj, ref.published_tensors(ref.make_model(cj, seed=5)))
  cfg, params = hf.load_checkpoint(str(tmp_path / "src"))
  hf.save_checkpoint(cfg, params, str(tmp_path / "out"), max_shard_bytes=200_000)  # 2+ shards
  reloaded, info = ref.hf_mod.DeepseekV3ForCausalLM.from_pretrained(
      tmp_path / "out", attn_implementation="eager", dtype=ref.torch.float32,
      output_loading_info=True)
  assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
  tokens = _tokens(shape, a["vocab_size"], seed=3)
  want_logits, _ = ref.reference_forward(reloaded.eval(), tokens, monkeypatch)
  logits, _ = model.forward(cfg, params, tokens)
  np.testing.assert_allclose(np.asarray(logits), want_logits, rtol=0, atol=1e-4)


def test_int4_experts_match_dequantized_reference(tmp_path, monkeypatch):
  """K2-Thinking-style checkpoint: routed experts INT4 pack-quantized (group 32), the rest
  float; loads to the same logits as the reference model on the dequantized weights."""
  a = arch(hidden_size=64, moe_intermediate_size=32)
  cj = ref.hf_config_dict(a, YARN_K2, 50000.0)
  torch_model = ref.make_model(cj, seed=4)
  quantized, dequantized = ref.int4_quantize(ref.published_tensors(torch_model))
  ref.write_dir(tmp_path / "int4", {**cj, "quantization_config": {
      "quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
          "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
          "group_size": 32}}}}}, quantized)
  ref.write_dir(tmp_path / "deq", cj, dequantized)
  deq_model = ref.hf_mod.DeepseekV3ForCausalLM.from_pretrained(
      tmp_path / "deq", attn_implementation="eager", dtype=ref.torch.float32).eval()
  tokens = _tokens((2, 7), a["vocab_size"], seed=2)
  want_logits, _ = ref.reference_forward(deq_model, tokens, monkeypatch)
  cfg, params = hf.load_checkpoint(str(tmp_path / "int4"))
  logits, _ = model.forward(cfg, params, tokens)
  np.testing.assert_allclose(np.asarray(logits), want_logits, rtol=0, atol=1e-4)
  # a scale that does not fit its weight is a named error
  bad = dict(quantized)
  name = next(k for k in bad if k.endswith("weight_scale"))
  bad[name] = bad[name][:, :1].contiguous()
  ref.write_dir(tmp_path / "bad", {**cj, "quantization_config": {}}, bad)
  with pytest.raises(hf.CheckpointError, match=r"weight_scale of shape \[\d+, 1\] does not match"):
    hf.load_checkpoint(str(tmp_path / "bad"))
