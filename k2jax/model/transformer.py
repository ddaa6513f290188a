"""The K2 / DeepSeek-V3 decoder, top to bottom.

    x = embed[tokens]
    for each layer:  x += mla(norm(x));  x += mlp_or_moe(norm(x))
    logits = norm(x) @ lm_head                      (untied head)

The first `first_k_dense_replace` layers use a dense SwiGLU MLP, the rest MoE. Each kind is
one stack of parameters with a leading `layers` axis run by `jax.lax.scan`, so compile
time does not grow with depth. Public face: pure `init(cfg, rng)` and
`forward(cfg, params, tokens)`, where `cfg` is the `model` group of a k2jax config.
"""

import jax
import jax.numpy as jnp

from k2jax.model import spec
from k2jax.model.attention import attention_specs, mla
from k2jax.model.layers import mlp, mlp_specs, rms_norm
from k2jax.model.moe import moe, moe_specs
from k2jax.model.remat import remat_policy

STACKS = (("dense_layers", "mlp"), ("moe_layers", "moe"))


def num_layers(cfg):
  """(dense, moe) layer counts."""
  return cfg.first_k_dense_replace, cfg.num_hidden_layers - cfg.first_k_dense_replace


def param_specs(cfg):
  d, V = cfg.hidden_size, cfg.vocab_size
  n_dense, n_moe = num_layers(cfg)

  def layer(kind, ffn):
    return {"attn_norm": spec.vector(d, "embed"), "attn": attention_specs(cfg),
            "mlp_norm": spec.vector(d, "embed"), kind: ffn}

  s = {"embed": spec.ParamSpec((V, d), ("vocab", "embed"), "normal", "adamw", 1, True)}
  if n_dense:
    s["dense_layers"] = spec.stack(layer("mlp", mlp_specs(d, cfg.intermediate_size)), n_dense)
  if n_moe:
    s["moe_layers"] = spec.stack(layer("moe", moe_specs(cfg)), n_moe)
  s["final_norm"] = spec.vector(d, "embed")
  s["lm_head"] = spec.ParamSpec((d, V), ("embed", "vocab"), "normal", "adamw", 1, True)
  return s


def init(cfg, rng):
  """Random parameters (normal(0, initializer_range) matrices, unit norms, zero router bias)."""
  return spec.init_params(param_specs(cfg), rng, cfg.initializer_range,
                          jnp.dtype(cfg.param_dtype))


def _block(cfg, kind, x, p, positions, segment_ids):
  eps = cfg.rms_norm_eps
  h, max_logits = mla(cfg, p["attn"], rms_norm(x, p["attn_norm"], eps), positions, segment_ids)
  x = x + h
  h = rms_norm(x, p["mlp_norm"], eps)
  if kind == "mlp":
    return x + mlp(p["mlp"], h), {"max_logits": max_logits}
  y, stats = moe(cfg, p["moe"], h)
  return x + y, {"max_logits": max_logits, **stats}


def _run_stack(cfg, kind, stacked, x, positions, segment_ids):
  def body(x, p):
    return _block(cfg, kind, x, p, positions, segment_ids)
  policy = remat_policy(cfg.remat)
  if policy is not None:
    body = jax.checkpoint(body, policy=policy, prevent_cse=False)
  return jax.lax.scan(body, x, stacked)


def forward(cfg, params, tokens, *, positions=None, segment_ids=None):
  """tokens [B, T] int -> (logits [B, T, vocab] float32, aux).

  positions [B, T] (default 0..T-1) and segment_ids [B, T] (packed documents; None = one
  document per row) are optional. aux holds:
    max_logits   [num_layers, heads] f32: per layer and head, the max scaled pre-softmax
                 logit over batch and valid positions (stop-gradient), for QK-Clip;
    expert_load  [moe_layers, n_routed_experts] f32: tokens routed to each expert;
    aux_loss     scalar: aux_loss_alpha * sequence-wise balance loss, summed over layers.
  """
  dt = jnp.dtype(cfg.dtype)
  B, T = tokens.shape
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  x = jnp.take(params["embed"], tokens, axis=0).astype(dt)
  max_logits, aux = [], {}
  for name, kind in STACKS:
    if name in params:
      x, stats = _run_stack(cfg, kind, params[name], x, positions, segment_ids)
      max_logits.append(stats["max_logits"])
      if kind == "moe":
        aux["expert_load"] = stats["expert_load"]
        aux["aux_loss"] = stats["aux_loss"].sum()
  x = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
  logits = jnp.einsum("btd,dv->btv", x, params["lm_head"].astype(dt),
                      preferred_element_type=jnp.float32)
  aux["max_logits"] = jnp.concatenate(max_logits, axis=0)
  aux.setdefault("expert_load", jnp.zeros((0, cfg.n_routed_experts), jnp.float32))
  aux.setdefault("aux_loss", jnp.zeros((), jnp.float32))
  return logits, aux
