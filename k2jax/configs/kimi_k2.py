"""Kimi K2 pre-training: the published architecture and the report's recipe (section 2.5).

1.04T total / 32.6B activated parameters (report Table 2); `python -m k2jax.params
--config kimi_k2` shows our count and its breakdown. Pre-training runs at 4k context with
plain RoPE: YaRN only extends the context afterwards (report 2.5), and with YaRN on the
softmax scale carries mscale^2 = 1.81, which would make tau = 100 clip at a logit of 55 in
the report's units. The published config.json (YaRN factor 32 to 128k) is the
`kimi_k2_long_context` preset, and a loaded checkpoint keeps its own rope_scaling.
"""

from k2jax.configs import base


def get_config():
  c = base.get_config()
  c.model.update(dict(
      vocab_size=163840,
      hidden_size=7168,
      intermediate_size=18432,
      moe_intermediate_size=2048,
      num_hidden_layers=61,
      num_attention_heads=64,
      q_lora_rank=1536,
      kv_lora_rank=512,
      qk_nope_head_dim=128,
      qk_rope_head_dim=64,
      v_head_dim=128,
      n_routed_experts=384,
      num_experts_per_tok=8,
      n_shared_experts=1,
      first_k_dense_replace=1,
      n_group=1,
      topk_group=1,
      routed_scaling_factor=2.827,
      rope_theta=50000.0,
      rope_scaling=base.no_rope_scaling(),
      max_position_embeddings=4096,
      bos_token_id=163584,
      eos_token_id=163585,
      # The published config.json lists 0.001; the report does not discuss a balance loss.
      aux_loss_alpha=0.001,
      dtype="bfloat16",
      # Report 2.4.2: bf16 parameters; the optimizer keeps float32 master weights in its
      # ZeRO-1 state (k2jax.optim.master_weights), the gradient buffer is float32.
      param_dtype="bfloat16",
      # Report 2.4.3: selective recomputation, FP8 (E4M3, 1 x 128 tiles) storage of the MoE
      # up-projection and SwiGLU inputs, and the saved activations offloaded to host memory:
      # on this pipeline the schedule's residual slots are host memory (the bytes per
      # device: `python -m k2jax.plan --config kimi_k2 --devices 2048`).
      remat="selective",
      activation_storage="fp8",
      offload=True,
  ))
  # Report 2.5: WSD, 500-step warmup, 2e-4 for 10T tokens, cosine to 2e-5 over 5.5T tokens,
  # 67M-token global batch (16384 x 4096) -> ~149k constant + ~82k decay steps. tau = 100.
  # Report 2.4.2: the optimizer states (Muon momentum, fp32 master weights; ZeRO-1 over
  # data) live in host memory and come to the device for the update only, so a device
  # holds bf16 params + fp32 gradient buffer between updates (`python -m k2jax.plan
  # --config kimi_k2 --devices 2048` counts both placements).
  c.optimizer.update(dict(learning_rate=2e-4, end_learning_rate=2e-5, warmup_steps=500,
                          decay_steps=82_000, weight_decay=0.1, tau=100.0, host_state=True))
  # Logging reads metrics back from the device (device_get); every 10 steps keeps the
  # device busy in between.
  c.train.update(dict(steps=231_000, batch_size=16384, seq_len=4096, log_every=10,
                      eval_every=1000, checkpoint_every=500))
  # Report 2.4.2: 16-way PP (virtual stages), 16-way EP, ZeRO-1 DP over the rest (data=1
  # here is the smallest layout, 256 devices; set mesh.data to the devices / 256 you have).
  # 60 MoE layers over 16 x 2 stages of 2 (64 stored rows, 4 of them padding, placed where
  # the work is largest: the stage with the embedding + dense layer first,
  # layout._balanced_counts); the head is split over the 16 pipeline devices by vocabulary.
  # With model.offload the stage residuals of the microbatches in flight wait in host memory,
  # which is what fits the device (`python -m k2jax.plan --config kimi_k2 --mesh
  # pipeline=16,expert=16,data=8` reads the bytes from the code that runs it;
  # docs/results/compile.md has XLA:TPU's check of them).
  c.mesh.update(dict(pipeline=16, expert=16, data=1, virtual_stages=2))
  # One sequence per device per microbatch (base.one_sequence_per_device): the global batch
  # of 16384 is 1024 microbatches on 256 devices, 128 on the report's PP16 x EP16 x DP8,
  # and follows an override of mesh.data. The bubble shrinks with the microbatch count while
  # the activations in flight do not grow. 16 x 4 stages of 1 idle more: stage 0 holds
  # padding only and its backward recomputes the embedding and dense layer, so its ticks are
  # the longest. zbh1 idles less at 16 x 2 but keeps much more in host memory (what B hands
  # W, the routed experts' row cotangents most of it), so the preset stays 1f1b (the figures:
  # docs/results/parallelism.md, "Idle time and memory of 1f1b against zbh1").
  base.one_sequence_per_device(c)
  return c
