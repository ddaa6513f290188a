"""The full config every preset starts from: groups model, optimizer, data, train, mesh.

Presets (tiny.py, kimi_k2.py, ...) only override fields. Model keys use the published
config.json names so a Hugging Face checkpoint maps one to one; fields that are ours
(dtype, moe_impl, remat, ...) are listed last in the model group.
"""

from ml_collections import config_dict


def yarn(factor, original_max_position_embeddings, beta_fast=32.0, beta_slow=1.0,
         mscale=1.0, mscale_all_dim=1.0):
  """A `rope_scaling` group in the published layout (DeepSeek-V3 / K2 config.json)."""
  return config_dict.ConfigDict(dict(
      type="yarn", factor=float(factor),
      original_max_position_embeddings=int(original_max_position_embeddings),
      beta_fast=float(beta_fast), beta_slow=float(beta_slow),
      mscale=float(mscale), mscale_all_dim=float(mscale_all_dim)))


def no_rope_scaling():
  """Plain RoPE. Same fields as `yarn` so a CLI override can switch it on."""
  s = yarn(1.0, 4096)
  s.type = "none"
  return s


def one_sequence_per_device(c) -> None:
  """Set train.grad_accum so each device runs one sequence per microbatch: train.batch_size
  over the devices the logical `batch` axis splits over (sharding_rules: data x expert), as
  Megatron-style pipelines run. A reference to the mesh, so an override of mesh.data keeps
  the geometry; an override of train.grad_accum still wins."""
  from k2jax.configs.sharding_rules import mesh_axes
  devices = None
  for a in mesh_axes("batch"):
    ref = c.mesh.get_ref(a)
    devices = ref if devices is None else devices * ref
  c.train.grad_accum = c.train.get_ref("batch_size") // devices


def model_config():
  return config_dict.ConfigDict(dict(
      # --- published config.json keys -------------------------------------------
      vocab_size=264,                 # byte tokenizer (256 bytes + specials)
      hidden_size=64,
      intermediate_size=192,          # dense-layer MLP width
      moe_intermediate_size=32,       # one routed / shared expert's width
      num_hidden_layers=2,
      num_attention_heads=4,
      q_lora_rank=config_dict.placeholder(int),   # None: q = x @ q_proj (no low-rank q)
      kv_lora_rank=32,
      qk_nope_head_dim=16,
      qk_rope_head_dim=8,
      v_head_dim=16,
      n_routed_experts=8,
      num_experts_per_tok=2,
      n_shared_experts=1,
      first_k_dense_replace=1,        # the leading layers use a dense MLP
      n_group=1,
      topk_group=1,
      routed_scaling_factor=1.0,
      norm_topk_prob=True,
      scoring_func="sigmoid",
      topk_method="noaux_tc",
      rope_theta=10000.0,
      rope_scaling=no_rope_scaling(),
      max_position_embeddings=4096,
      rms_norm_eps=1e-6,
      tie_word_embeddings=False,
      initializer_range=0.02,
      bos_token_id=config_dict.placeholder(int),
      eos_token_id=config_dict.placeholder(int),
      aux_loss_alpha=0.0,             # sequence-wise balance loss coefficient (0 = off)
      # --- ours -------------------------------------------------------------------
      dtype="float32",                # compute dtype: float32 | bfloat16 (softmax, norms, router stay f32)
      param_dtype="float32",
      moe_impl="auto",                # k2jax.kernels.routed_experts: auto | blocked | ragged | capacity | pallas_gpu | tokamax | dense
      ep_transport="auto",            # expert-parallel all-to-all: auto | ragged | bucketed | padded
      ep_round_load=2.0,              # ragged: a device receives at most this x its balanced rows at once; more runs in rounds
      remat="none",                   # none | selective (report 2.4.3) | full
      activation_storage="model",     # model | fp8: MoE up-projection / SwiGLU inputs kept in E4M3 (2.4.3)
      offload=False,                  # saved activations the remat policy keeps go to host memory (2.4.3)
      attention_impl="auto",          # k2jax.kernels.attention: auto | xla | chunked | pallas_gpu | pallas_tpu | tokamax
      context_chunk=128,              # tokens per chunk of the context-parallel placement
                                      # (k2jax.model.context; mesh.context > 1)
      bias_update_speed=0.001,        # gamma of the aux-loss-free balancing rule
  ))


def optimizer_config():
  return config_dict.ConfigDict(dict(
      name="muonclip",                # muonclip | muon | adamw | adamw_qk_clip
      learning_rate=2e-4,             # peak
      end_learning_rate=2e-5,         # floor of the cosine decay
      warmup_steps=500,
      decay_steps=0,                  # cosine decay length; 0 = no decay
      weight_decay=0.1,
      tau=100.0,                      # QK-Clip threshold
      momentum=0.95,                  # Muon mu
      nesterov=False,                 # Algorithm 1 uses plain momentum
      rms_scale=0.2,                  # match AdamW update RMS (Moonlight)
      ns_steps=5,
      ns_dtype="float32",             # Newton-Schulz's dtype: float32 (optax's) | bfloat16
                                      # (Moonlight's: the bf16 matmul rate on GPU / TPU)
      adam_b1=0.9,
      adam_b2=0.95,
      adam_eps=1e-8,
      grad_clip_norm=0.0,             # 0 = off
      host_state=False,               # ZeRO-1 states (momentum, Adam moments, fp32 master
                                      # weights) kept in host memory and brought to the device
                                      # for the update only (report 2.4.2: optimizer states
                                      # offloaded to CPU)
  ))


def data_config():
  return config_dict.ConfigDict(dict(
      files="",                       # glob of .txt/.jsonl/.parquet; empty = embedded corpus
      text_field="text",              # JSONL / Parquet column
      tokenizer="byte",               # byte | path to a tiktoken BPE file
      eval_fraction=0.02,             # held-out documents for eval loss
      max_corpus_bytes=0,             # 0 = no cap
      worker_count=0,
  ))


def train_config():
  return config_dict.ConfigDict(dict(
      steps=1000,
      batch_size=8,                   # global, in sequences
      seq_len=128,
      grad_accum=1,                   # microbatches per step
      # with grad_accum > 1 and param_dtype wider than dtype: cast the weights to dtype once
      # per step, not in every microbatch (k2jax.training.step.differentiated; one dtype copy held)
      cast_once=True,
      log_every=10,
      eval_every=100,
      eval_batches=4,
      checkpoint_every=100,           # 0 = no checkpoints (benchmarks)
      keep_checkpoints=3,
      async_checkpoint=True,
      seed=0,
      max_nan_steps=10,               # consecutive non-finite steps before giving up
      profile=False,
  ))


def mesh_config():
  # virtual_stages: pipeline stages per pipeline device (interleaved schedule, report 2.4.2);
  # pipeline_schedule: 1f1b (activations independent of the microbatch count) | gpipe |
  # zbh1 (1f1b with weight gradients split off to fill its bubbles: k2jax.parallel.bwsplit);
  # pipeline_skip: how idle schedule slots are skipped (k2jax.parallel.pipeline): auto (per
  # device on GPU / TPU, per tick on CPU) | device | tick; context: devices each sequence's
  # tokens are split over (context parallelism, k2jax.model.context)
  return config_dict.ConfigDict(dict(pipeline=1, expert=1, data=1, context=1, virtual_stages=1,
                                     pipeline_schedule="1f1b", pipeline_skip="auto"))


def get_config():
  return config_dict.ConfigDict(dict(
      model=model_config(),
      optimizer=optimizer_config(),
      data=data_config(),
      train=train_config(),
      mesh=mesh_config(),
  ))
