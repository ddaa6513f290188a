"""Config presets (ml-collections) and their validation.

`get_config(name)` returns a validated ConfigDict with groups model, optimizer, data,
train, mesh. Each preset file also defines `get_config()` so that
`--config k2jax/configs/tiny.py` works with `ml_collections.config_flags`.

May import: nothing of k2jax.
"""

import importlib

from ml_collections import config_dict

PRESETS = ("tiny", "tiny_sft", "tiny_rl", "kimi_k2", "kimi_k2_long_context", "kimi_k2_rl",
           "deepseek_v3")


def get_config(name: str) -> config_dict.ConfigDict:
  if name not in PRESETS:
    raise ValueError(f"unknown config preset {name!r}: choose one of {', '.join(PRESETS)} "
                     "or pass a path to a config file")
  cfg = importlib.import_module(f"k2jax.configs.{name}").get_config()
  validate(cfg)
  return cfg


def from_dict(d: dict) -> config_dict.ConfigDict:
  """A full config from a saved one (a run's config.json): the base config with every saved
  value that still names a field applied, so runs saved before a field existed still load."""
  from k2jax.configs import base
  cfg = base.get_config()

  def merge(node, values):
    for k, v in values.items():
      if k not in node:
        continue
      if isinstance(node[k], config_dict.ConfigDict) and isinstance(v, dict):
        merge(node[k], v)
      else:
        node[k] = v
  with cfg.ignore_type():
    merge(cfg, d)
  return cfg


def _fail(key, value, rule):
  raise ValueError(f"{key} = {value!r}: {rule}")


def _positive(group, cfg, *keys):
  for k in keys:
    v = cfg[k]
    if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
      _fail(f"{group}.{k}", v, "must be a positive number")


def validate_model(m: config_dict.ConfigDict, group: str = "model") -> None:
  """Raise ValueError naming the key, its value and the rule it breaks."""
  _positive(group, m, "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
            "rope_theta", "rms_norm_eps", "initializer_range")
  if m.q_lora_rank is not None and m.q_lora_rank <= 0:
    _fail(f"{group}.q_lora_rank", m.q_lora_rank, "must be positive, or None for a full-rank q_proj")
  if m.qk_rope_head_dim % 2:
    _fail(f"{group}.qk_rope_head_dim", m.qk_rope_head_dim, "must be even (RoPE rotates pairs)")
  L, k_dense = m.num_hidden_layers, m.first_k_dense_replace
  if not 0 <= k_dense <= L:
    _fail(f"{group}.first_k_dense_replace", k_dense,
          f"must be between 0 and num_hidden_layers ({L})")
  if k_dense > 0:
    _positive(group, m, "intermediate_size")
  if k_dense < L:  # there are MoE layers
    _positive(group, m, "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
              "n_group", "topk_group", "routed_scaling_factor")
    E, k, G = m.n_routed_experts, m.num_experts_per_tok, m.n_group
    if k > E:
      _fail(f"{group}.num_experts_per_tok", k, f"must be <= n_routed_experts ({E})")
    if E % G:
      _fail(f"{group}.n_group", G, f"must divide n_routed_experts ({E})")
    if m.topk_group > G:
      _fail(f"{group}.topk_group", m.topk_group, f"must be <= n_group ({G})")
    if G > 1 and E // G < 2:
      _fail(f"{group}.n_group", G, "group-limited routing scores a group by its top-2 experts: "
            f"needs >= 2 experts per group (n_routed_experts={E})")
    if G > 1 and m.topk_group * (E // G) < k:
      _fail(f"{group}.topk_group", m.topk_group, f"the kept groups hold {m.topk_group * (E // G)} "
            f"experts, fewer than num_experts_per_tok ({k})")
    if m.n_shared_experts < 0:
      _fail(f"{group}.n_shared_experts", m.n_shared_experts, "must be >= 0")
    if m.aux_loss_alpha < 0:
      _fail(f"{group}.aux_loss_alpha", m.aux_loss_alpha, "must be >= 0")
  if m.scoring_func != "sigmoid":
    _fail(f"{group}.scoring_func", m.scoring_func, "only 'sigmoid' (K2 / DeepSeek-V3) is implemented")
  if m.topk_method != "noaux_tc":
    _fail(f"{group}.topk_method", m.topk_method, "only 'noaux_tc' (K2 / DeepSeek-V3) is implemented")
  rs = m.rope_scaling
  if rs.type not in ("none", "yarn"):
    _fail(f"{group}.rope_scaling.type", rs.type, "must be 'none' or 'yarn'")
  if rs.type == "yarn":
    if rs.factor < 1:
      _fail(f"{group}.rope_scaling.factor", rs.factor, "must be >= 1")
    _positive(f"{group}.rope_scaling", rs, "original_max_position_embeddings", "beta_fast",
              "beta_slow")
  if m.tie_word_embeddings:
    _fail(f"{group}.tie_word_embeddings", True, "K2 / DeepSeek-V3 use an untied lm_head; "
          "tied embeddings are not implemented")
  if m.get("context_chunk", 128) < 1:
    _fail(f"{group}.context_chunk", m.context_chunk, "must be >= 1")
  # A round smaller than the smallest capacity (kernels/buckets.py: 1.25x the balanced load,
  # the one whose residuals are kept) puts every capacity in rounds, which keep nothing: every
  # backward pass would recompute its exchange (k2jax.model.expert_parallel).
  if m.get("ep_round_load", 2.0) < 1.25:
    _fail(f"{group}.ep_round_load", m.ep_round_load,
          "must be >= 1.25 (x the balanced load): smaller rounds keep no residuals, so every "
          "backward pass recomputes the expert exchange")
  for key, allowed in (("dtype", ("float32", "bfloat16")), ("param_dtype", ("float32", "bfloat16")),
                       ("moe_impl", ("auto", "blocked", "ragged", "capacity", "pallas_gpu", "tokamax", "gather", "dense")), ("remat", ("none", "selective", "full")),
                       ("activation_storage", ("model", "fp8")),
                       ("ep_transport", ("auto", "ragged", "bucketed", "padded")),
                       ("attention_impl", ("auto", "xla", "chunked", "pallas_gpu", "pallas_tpu",
                                           "tokamax"))):
    if m[key] not in allowed:
      _fail(f"{group}.{key}", m[key], f"must be one of {', '.join(allowed)}")


def validate(cfg: config_dict.ConfigDict) -> None:
  """Validate a full config (all groups)."""
  for g in ("model", "optimizer", "data", "train", "mesh"):
    if g not in cfg:
      raise ValueError(f"config has no group {g!r}: start from k2jax.configs.base.get_config()")
  validate_model(cfg.model)
  t, o, mesh = cfg.train, cfg.optimizer, cfg.mesh
  _positive("train", t, "batch_size", "seq_len", "grad_accum", "log_every", "eval_every",
            "keep_checkpoints", "max_nan_steps")
  for k in ("steps", "checkpoint_every", "eval_batches"):
    if t[k] < 0:
      _fail(f"train.{k}", t[k], "must be >= 0")
  if t.batch_size % t.grad_accum:
    _fail("train.grad_accum", t.grad_accum, f"must divide train.batch_size ({t.batch_size})")
  _positive("mesh", mesh, "pipeline", "expert", "data")
  context = mesh.get("context", 1)
  if context < 1:
    _fail("mesh.context", context, "must be >= 1")
  if context > 1 and t.seq_len % (2 * context):
    _fail("train.seq_len", t.seq_len,
          f"must be a multiple of 2 x mesh.context ({2 * context}): each context device holds "
          "a chunk from the front half and its mirror from the back half of every group of "
          "2 x mesh.context chunks (k2jax.model.context)")
  if mesh.get("virtual_stages", 1) < 1:
    _fail("mesh.virtual_stages", mesh.virtual_stages, "must be >= 1")
  # mesh.pipeline_schedule (a name in the schedule registry) and the microbatches its order
  # takes: k2jax.parallel.schedules.validate (configs sit below the registry)
  if mesh.get("pipeline_skip", "auto") not in ("auto", "device", "tick"):
    _fail("mesh.pipeline_skip", mesh.pipeline_skip, "must be one of auto, device, tick")
  if mesh.pipeline > 1 and t.grad_accum < mesh.pipeline:
    _fail("train.grad_accum", t.grad_accum,
          f"must be >= mesh.pipeline ({mesh.pipeline}): the pipeline's microbatches are the "
          "gradient-accumulation microbatches, and every stage needs one")
  if t.seq_len > cfg.model.max_position_embeddings:
    _fail("train.seq_len", t.seq_len,
          f"must be <= model.max_position_embeddings ({cfg.model.max_position_embeddings})")
  # optimizer.name is checked against the registry by k2jax.optim.validate (configs sit
  # below optim, so the names are not repeated here).
  _positive("optimizer", o, "learning_rate", "tau", "ns_steps")
  for k in ("end_learning_rate", "weight_decay", "warmup_steps", "decay_steps", "grad_clip_norm"):
    if o[k] < 0:
      _fail(f"optimizer.{k}", o[k], "must be >= 0")
  if not 0 <= o.momentum < 1:
    _fail("optimizer.momentum", o.momentum, "must be in [0, 1)")
  if o.get("ns_dtype", "float32") not in ("float32", "bfloat16"):
    _fail("optimizer.ns_dtype", o.ns_dtype, "must be float32 or bfloat16")
  if not 0 <= cfg.data.eval_fraction < 1:
    _fail("data.eval_fraction", cfg.data.eval_fraction, "must be in [0, 1)")
