"""DeepSeek-V3 (671B total / 37B activated) pre-training: the published architecture.

Differs from K2 in heads (128), experts (256), dense layers (3) and group-limited routing
(8 groups, top-4 groups). Its multi-token-prediction layer is not modelled (the 671B count
excludes it too). Like K2 it pre-trains at 4k with plain RoPE; the published config.json's
YaRN (factor 40) comes with its context extension, and a loaded checkpoint keeps it.
"""

from k2jax.configs import base


def get_config():
  c = base.get_config()
  c.model.update(dict(
      vocab_size=129280,
      hidden_size=7168,
      intermediate_size=18432,
      moe_intermediate_size=2048,
      num_hidden_layers=61,
      num_attention_heads=128,
      q_lora_rank=1536,
      kv_lora_rank=512,
      qk_nope_head_dim=128,
      qk_rope_head_dim=64,
      v_head_dim=128,
      n_routed_experts=256,
      num_experts_per_tok=8,
      n_shared_experts=1,
      first_k_dense_replace=3,
      n_group=8,
      topk_group=4,
      routed_scaling_factor=2.5,
      rope_theta=10000.0,
      rope_scaling=base.no_rope_scaling(),
      max_position_embeddings=4096,
      bos_token_id=0,
      eos_token_id=1,
      aux_loss_alpha=0.0001,          # DeepSeek-V3 report, complementary sequence-wise loss
      dtype="bfloat16",
      remat="selective",
  ))
  c.train.update(dict(seq_len=4096, batch_size=15360))
  c.mesh.update(dict(pipeline=16, expert=16, data=1))
  # One sequence per device per microbatch, as in kimi_k2: 960 microbatches here (16 put 60
  # sequences on every device: 4 TB of activations by `python -m k2jax.plan`).
  base.one_sequence_per_device(c)
  return c
