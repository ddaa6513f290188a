"""Multi-head Latent Attention (DeepSeek-V2/V3 MLA, used by K2: report 2.3), training form.

    q      = q_b(norm(q_a(x)))            [B, T, H, nope + rope]   (or q_proj(x) if no q_lora)
    latent | k_rope = kv_a(x)              latent [B, T, kv_lora], ONE rope key shared by all heads
    k_nope | v      = kv_b(norm(latent))   [B, T, H, nope + v]
    logit_h(i, j)   = scale * (q_nope_i . k_nope_j + rope(q_rope_i) . rope(k_rope_j))
    out    = o(concat_h softmax_j(logit_h) v)

The per-head maximum of the scaled logit over the batch and all valid (causal, same
document, non-padding) pairs is returned for QK-Clip (report 2.1, S_max^h). The attention
itself is `k2jax.kernels.attention` (`model.attention_impl`: a flash kernel on GPU / TPU,
the chunked flash algorithm on CPU, or the materialized reference).
"""

import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from k2jax.kernels import attention
from k2jax.model import rope, spec
from k2jax.model.layers import rms_norm


def attention_specs(cfg):
  d, H, r = cfg.hidden_size, cfg.num_attention_heads, cfg.qk_rope_head_dim
  dq = cfg.qk_nope_head_dim + r
  s = {}
  if cfg.q_lora_rank:
    s["q_a"] = spec.matrix((d, cfg.q_lora_rank), ("embed", "q_lora"))
    s["q_a_norm"] = spec.vector(cfg.q_lora_rank, "q_lora")
    s["q_b"] = spec.matrix((cfg.q_lora_rank, H, dq), ("q_lora", "heads", "head_dim"))
  else:
    s["q_proj"] = spec.matrix((d, H, dq), ("embed", "heads", "head_dim"))
  s["kv_a"] = spec.matrix((d, cfg.kv_lora_rank + r), ("embed", "kv_lora"))
  s["kv_a_norm"] = spec.vector(cfg.kv_lora_rank, "kv_lora")
  s["kv_b"] = spec.matrix((cfg.kv_lora_rank, H, cfg.qk_nope_head_dim + cfg.v_head_dim),
                          ("kv_lora", "heads", "head_dim"))
  s["o"] = spec.matrix((H, cfg.v_head_dim, d), ("heads", "head_dim", "embed"), n_in=2)
  return s


def q_proj_name(cfg) -> str:
  """The parameter holding per-head queries ([..., H, nope + rope])."""
  return "q_b" if cfg.q_lora_rank else "q_proj"


def qk_clip_scales(cfg, gamma):
  """Per-head multipliers that scale head h's logits by exactly gamma[..., h] (report 2.1).

  q_nope and k_nope columns of head h get sqrt(gamma), q_rope columns get gamma; the shared
  k_rope (in kv_a) and v are untouched. Returns {param name: multiplier} shaped to broadcast
  against the parameter ([..., 1, H, head_dim], the `1` standing for the fan-in axis).
  """
  nope, r, v = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
  g = gamma[..., None, :, None]
  rep = lambda a, n: jnp.broadcast_to(a, g.shape[:-1] + (n,))
  q = jnp.concatenate([rep(jnp.sqrt(g), nope), rep(g, r)], axis=-1)
  kv = jnp.concatenate([rep(jnp.sqrt(g), nope), rep(jnp.ones_like(g), v)], axis=-1)
  return {q_proj_name(cfg): q, "kv_b": kv}


def mla(cfg, p, x, positions, segment_ids=None):
  """x [B, T, d] -> (out [B, T, d], max_logits [H])."""
  dt = x.dtype
  nope, r, eps = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.rms_norm_eps
  if cfg.q_lora_rank:
    cq = rms_norm(x @ p["q_a"].astype(dt), p["q_a_norm"], eps)
    q = jnp.einsum("btr,rhd->bthd", cq, p["q_b"].astype(dt))
  else:
    q = jnp.einsum("btc,chd->bthd", x, p["q_proj"].astype(dt))
  q = checkpoint_name(q, "mla_up")
  ckv = x @ p["kv_a"].astype(dt)
  latent, k_rope = ckv[..., :cfg.kv_lora_rank], ckv[..., cfg.kv_lora_rank:]
  kv = jnp.einsum("btr,rhd->bthd", rms_norm(latent, p["kv_a_norm"], eps), p["kv_b"].astype(dt))
  kv = checkpoint_name(kv, "mla_up")
  k_nope, v = kv[..., :nope], kv[..., nope:]

  cos, sin = rope.cos_sin(cfg, positions)
  q = jnp.concatenate([q[..., :nope], rope.apply_rope(q[..., nope:], cos, sin)], axis=-1)
  k_rope = rope.apply_rope(k_rope, cos, sin)                        # [B, T, r], shared
  k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope[:, :, None, :], k_nope.shape[:-1] + (r,))],
                      axis=-1)
  out, max_logits = attention(q, k, v, scale=rope.softmax_scale(cfg), segment_ids=segment_ids,
                              impl=cfg.attention_impl)
  return jnp.einsum("bthv,hvd->btd", out, p["o"].astype(dt)), max_logits
