"""CPU default: a 4-layer K2-shaped model (1 dense + 3 MoE layers, 16 experts, top-2,
1 shared expert, MLA with small ranks) over a byte-level vocabulary. Trains in minutes
on 2 CPU cores on the embedded corpus."""

from k2jax.configs import base


def get_config():
  c = base.get_config()
  c.model.update(dict(
      vocab_size=264,                 # 256 bytes + specials (k2jax.data.tokenizer.ByteTokenizer)
      hidden_size=128,
      intermediate_size=384,
      moe_intermediate_size=64,
      num_hidden_layers=4,
      num_attention_heads=4,
      q_lora_rank=64,
      kv_lora_rank=32,
      qk_nope_head_dim=32,
      qk_rope_head_dim=16,
      v_head_dim=32,
      n_routed_experts=16,
      num_experts_per_tok=2,
      n_shared_experts=1,
      first_k_dense_replace=1,
      routed_scaling_factor=2.0,
      rope_theta=10000.0,
      max_position_embeddings=1024,
      bos_token_id=257,
      eos_token_id=256,
      # DeepSeek-V3's gamma = 0.001 suits ~1e5-step runs; in 400 steps it leaves the busiest
      # expert well above the mean load. 0.01 balances within this run at equal loss.
      bias_update_speed=0.01,
  ))
  c.optimizer.update(dict(learning_rate=2e-3, end_learning_rate=2e-4, warmup_steps=40,
                          decay_steps=120, weight_decay=0.1, tau=100.0))
  # ~0.8M tokens: sized for a CPU run of a few minutes.
  c.train.update(dict(steps=400, batch_size=16, seq_len=128, log_every=20, eval_every=100,
                      checkpoint_every=100))
  return c
