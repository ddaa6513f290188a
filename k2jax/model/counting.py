"""Parameter counts and model FLOPs, computed from the parameter table (no allocation)."""

import jax

from k2jax.model import spec
from k2jax.model.transformer import param_specs

_CATEGORIES = (  # first path component match wins
    ("embed", "embedding"), ("lm_head", "lm_head"), ("final_norm", "norms"),
    ("attn_norm", "norms"), ("mlp_norm", "norms"), ("attn", "attention"),
    ("experts", "routed_experts"), ("shared", "shared_experts"), ("router", "router"),
    ("router_bias", "router"), ("mlp", "dense_mlp"),
)


def _category(path) -> str:
  keys = [getattr(k, "key", str(k)) for k in path]
  for key in reversed(keys):  # innermost named group decides (q_a_norm counts as attention)
    for name, cat in _CATEGORIES:
      if key == name:
        return cat
  raise KeyError(f"uncategorised parameter {'/'.join(keys)}")


def count_params(cfg) -> dict:
  """{"total", "activated", and a breakdown by component}.

  Activated = every parameter a token passes through: all but the (E - k) unselected routed
  experts of each MoE layer. Embedding and lm_head are both counted (untied).
  """
  counts = {name: 0 for _, name in _CATEGORIES}
  for path, s in jax.tree_util.tree_flatten_with_path(param_specs(cfg), is_leaf=spec.is_spec)[0]:
    counts[_category(path)] += spec.size(s)
  total = sum(counts.values())
  routed_active = 0
  if cfg.n_routed_experts and counts["routed_experts"]:
    routed_active = counts["routed_experts"] * cfg.num_experts_per_tok // cfg.n_routed_experts
  counts["routed_experts_activated"] = routed_active
  return {"total": total, "activated": total - counts["routed_experts"] + routed_active, **counts}


def flops_per_token(cfg, seq_len: int, training: bool = True) -> float:
  """Model FLOPs per token (for MFU): 2 per activated matmul weight, plus causal attention.

  Attention per layer and token: 2 H (qk_dim + v_dim) * ctx with ctx = (T + 1) / 2, the mean
  number of causally visible keys. The embedding lookup and norms do no matmul work.
  Training = 3x forward (backward is twice the forward).
  """
  c = count_params(cfg)
  matmul = c["activated"] - c["embedding"] - c["norms"]
  qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
  attn = (2 * cfg.num_attention_heads * (qk + cfg.v_head_dim) * (seq_len + 1) / 2
          * cfg.num_hidden_layers)
  forward = 2 * matmul + attn
  return 3 * forward if training else forward


def layer_flops(cfg, ffn: str, seq_len: int) -> float:
  """Forward FLOPs per token of one layer ("mlp" dense or "moe"): 2 per activated weight
  (the k routed experts of an MoE layer, its shared experts and router) plus causal
  attention, as in flops_per_token."""
  d = cfg.hidden_size
  s = param_specs(cfg)
  st = {"mlp": "dense_layers", "moe": "moe_layers"}[ffn]
  layer = jax.tree.map(lambda p: spec.size(p) // p.shape[0], s[st], is_leaf=spec.is_spec)
  total = sum(jax.tree.leaves(layer))
  if ffn == "moe":
    routed = sum(jax.tree.leaves(layer["moe"]["experts"]))
    total -= routed - routed * cfg.num_experts_per_tok // cfg.n_routed_experts
  del d
  qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
  attn = 2 * cfg.num_attention_heads * (qk + cfg.v_head_dim) * (seq_len + 1) / 2
  return 2.0 * total + attn


def head_flops(cfg) -> float:
  """Forward FLOPs per token of the output head (hidden x vocabulary)."""
  return 2.0 * cfg.hidden_size * cfg.vocab_size
