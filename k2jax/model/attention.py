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

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jax.sharding import PartitionSpec as P

from k2jax.configs import sharding_rules as rules
from k2jax.kernels import attention, flash
from k2jax.model import context, rope, spec
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


class Latents(NamedTuple):
  """What MLA caches per token: the normalized KV latent and the roped shared key."""
  latent: jax.Array   # [B, T, kv_lora_rank]
  k_rope: jax.Array   # [B, T, qk_rope_head_dim]


def queries(cfg, p, x, cos, sin):
  """q [B, T, H, nope + rope] with the rope part rotated."""
  dt, nope = x.dtype, cfg.qk_nope_head_dim
  if cfg.q_lora_rank:
    cq = rms_norm(x @ p["q_a"].astype(dt), p["q_a_norm"], cfg.rms_norm_eps)
    q = jnp.einsum("btr,rhd->bthd", cq, p["q_b"].astype(dt))
  else:
    q = jnp.einsum("btc,chd->bthd", x, p["q_proj"].astype(dt))
  q = checkpoint_name(q, "mla_up")
  return jnp.concatenate([q[..., :nope], rope.apply_rope(q[..., nope:], cos, sin)], axis=-1)


def latents(cfg, p, x, cos, sin) -> Latents:
  """The per-token KV latent (after kv_a_norm) and the roped k_rope shared by all heads."""
  ckv = x @ p["kv_a"].astype(x.dtype)
  latent = rms_norm(ckv[..., :cfg.kv_lora_rank], p["kv_a_norm"], cfg.rms_norm_eps)
  return Latents(latent, rope.apply_rope(ckv[..., cfg.kv_lora_rank:], cos, sin))


def mla(cfg, p, x, positions, segment_ids=None, *, return_latents=False):
  """x [B, T, d] -> (out [B, T, d], max_logits [H]) (+ the Latents with return_latents)."""
  dt = x.dtype
  nope, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
  cos, sin = rope.cos_sin(cfg, positions)
  q = queries(cfg, p, x, cos, sin)
  lat = latents(cfg, p, x, cos, sin)
  if context.engaged(x.shape[1]):   # tokens split over devices: the latent moves
    out, max_logits = context.attend(cfg, q, lat.latent, lat.k_rope, p["kv_b"], segment_ids)
    out = jnp.einsum("bthv,hvd->btd", out, p["o"].astype(dt))
    return (out, max_logits, lat) if return_latents else (out, max_logits)
  kv = checkpoint_name(jnp.einsum("btr,rhd->bthd", lat.latent, p["kv_b"].astype(dt)), "mla_up")
  k_nope, v = kv[..., :nope], kv[..., nope:]
  k = jnp.concatenate([k_nope, jnp.broadcast_to(lat.k_rope[:, :, None, :],
                                                k_nope.shape[:-1] + (r,))], axis=-1)
  out, max_logits = attend(cfg, q, k, v, segment_ids)
  out = jnp.einsum("bthv,hvd->btd", out, p["o"].astype(dt))
  return (out, max_logits, lat) if return_latents else (out, max_logits)


def attend(cfg, q, k, v, segment_ids):
  """k2jax.kernels.attention with `model.attention_impl`. Under a mesh that splits the batch,
  a Pallas kernel (ours or tokamax's) runs per batch shard in `shard_map` (XLA cannot
  partition a Mosaic kernel, and would gather a Triton one's operands) and the shards' S_max
  are combined by pmax; the XLA implementations are partitioned by XLA as they are."""
  impl = flash.auto_impl() if cfg.attention_impl == "auto" else cfg.attention_impl
  run = lambda q, k, v, seg: attention(q, k, v, scale=rope.softmax_scale(cfg),
                                       segment_ids=seg, impl=impl)
  mesh = jax.sharding.get_abstract_mesh()
  axes = rules.active_mesh_axes("batch", mesh)
  held = set(getattr(mesh, "manual_axes", ()))
  # Manual over every axis not manual yet (size-1 ones too): Mosaic refuses any auto axis,
  # also inside a shard_map that holds the batch's axes already (the pipeline's pipeline x
  # data with expert = 1).
  manual = set(mesh.axis_names) - held
  if not (impl.startswith("pallas") or impl == "tokamax") or not (axes or (held and manual)):
    return run(q, k, v, segment_ids)

  def shard(q, k, v, seg=None):
    out, max_logits = run(q, k, v, seg)
    return out, jax.lax.pmax(max_logits, axes) if axes else max_logits
  args = (q, k, v) if segment_ids is None else (q, k, v, segment_ids)
  # check_vma off: inside the kernels' custom VJPs varying operands meet invariant block
  # indices (dynamic_slice), which the check rejects.
  spec = P(axes or None)
  return jax.shard_map(shard, in_specs=(spec,) * len(args), out_specs=(spec, P()),
                       axis_names=manual, check_vma=False)(*args)


def mla_absorbed(cfg, p, x, positions, cache: Latents, valid):
  """MLA over a latent cache in DeepSeek-V2's absorbed form (decoding).

  For new tokens x [B, t, d] at `positions` and a cache of S entries (this step's latents
  already written into it), with W_uk / W_uv the k_nope / v columns of kv_b:

      q_lat  = q_nope W_uk^T                   [B, t, H, kv_lora]   (k_nope absorbed)
      logits = s (q_lat . latent + q_rope . k_rope)                 over the cache
      out    = (softmax(logits) . latent) W_uv                      (v absorbed)

  so keys and values are never expanded to H heads: the cache holds kv_lora + rope values per
  token (576 for K2, against H (192 + 128) = 20480). valid [B, t, S] masks the cache.
  """
  dt = x.dtype
  nope = cfg.qk_nope_head_dim
  cos, sin = rope.cos_sin(cfg, positions)
  q = queries(cfg, p, x, cos, sin)
  w_uk, w_uv = p["kv_b"][..., :nope].astype(dt), p["kv_b"][..., nope:].astype(dt)
  q_lat = jnp.einsum("bthn,rhn->bthr", q[..., :nope], w_uk)
  logits = (jnp.einsum("bthr,bsr->bhts", q_lat, cache.latent.astype(dt),
                       preferred_element_type=jnp.float32)
            + jnp.einsum("bthe,bse->bhts", q[..., nope:], cache.k_rope.astype(dt),
                         preferred_element_type=jnp.float32)) * rope.softmax_scale(cfg)
  logits = jnp.where(valid[:, None], logits, -jnp.inf)
  probs = jax.nn.softmax(logits, axis=-1)
  out_lat = jnp.einsum("bhts,bsr->bthr", probs.astype(dt), cache.latent.astype(dt))
  out = jnp.einsum("bthr,rhv->bthv", out_lat, w_uv)
  return jnp.einsum("bthv,hvd->btd", out, p["o"].astype(dt))
