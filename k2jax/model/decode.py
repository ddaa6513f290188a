"""Decoding with MLA's latent cache: prefill in the training form, then one token at a time
in the absorbed form (k2jax.model.attention.mla_absorbed).

    cache = init_cache(cfg, batch=B, max_len=S)
    logits, cache = prefill(cfg, params, tokens, lengths, cache)   # logits at each row's last token
    logits, cache = decode_step(cfg, params, cache, next_tokens)   # [B] -> [B, vocab]
    logits, cache = extend(cfg, params, cache, more, counts)        # [B, t]: several at once

The cache holds, per layer and token, only the normalized KV latent and the roped shared key
(kv_lora_rank + qk_rope_head_dim values: 576 for K2), stacked like the parameters so a
decode step is one scan per layer stack and compiles once whatever the depth. Rows have their
own lengths: prompts of different lengths share one batch (right-padded; the padding is
never attended to), and every row appends its next token at its own length.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from k2jax.model import rope
from k2jax.model.attention import Latents, latents, mla_absorbed
from k2jax.model.layers import rms_norm
from k2jax.model.transformer import feed_forward, forward, stacks


class Cache(NamedTuple):
  layers: dict          # {stack name: Latents with [layers, B, S, ...] arrays}
  lengths: jax.Array    # int32 [B]: tokens held per row


def init_cache(cfg, batch: int, max_len: int, dtype=None) -> Cache:
  dt = jnp.dtype(dtype or cfg.dtype)
  layers = {st.name: Latents(jnp.zeros((st.size, batch, max_len, cfg.kv_lora_rank), dt),
                             jnp.zeros((st.size, batch, max_len, cfg.qk_rope_head_dim), dt))
            for st in stacks(cfg)}
  return Cache(layers, jnp.zeros((batch,), jnp.int32))


def cache_bytes_per_token(cfg, dtype=None) -> int:
  """Bytes the latent cache holds per token (all layers)."""
  dt = jnp.dtype(dtype or cfg.dtype)
  return cfg.num_hidden_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * dt.itemsize


def prefill(cfg, params, tokens, lengths, cache: Cache, every: bool = False):
  """Run right-padded prompts tokens [B, T] (row b holds lengths[b] tokens) through the model
  in the training form, fill the cache, -> (logits [B, vocab] at each row's last token, cache);
  with `every`, (that, logits [B, T, vocab] at every position, cache): a prompt's own
  log probabilities (a server's echo)."""
  B, T = tokens.shape
  seg = (jnp.arange(T)[None, :] < lengths[:, None]).astype(jnp.int32)   # padding: segment 0
  # the head at each row's last token only, unless every position's logits are asked for
  logits, _, lat = forward(cfg, params, tokens, segment_ids=seg, return_latents=True,
                           head_at=None if every else lengths - 1)
  layers = {name: Latents(*(jax.lax.dynamic_update_slice_in_dim(c, n.astype(c.dtype), 0, axis=2)
                            for c, n in zip(cache.layers[name], lat[name])))
            for name in cache.layers}
  last = (jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0] if every
          else logits)
  cache = Cache(layers, lengths.astype(jnp.int32))
  return (last, logits, cache) if every else (last, cache)


def decode_step(cfg, params, cache: Cache, tokens):
  """tokens [B] (one new token per row) -> (logits [B, vocab] f32, cache with them added)."""
  return extend(cfg, params, cache, tokens[:, None], jnp.ones_like(cache.lengths))


def extend(cfg, params, cache: Cache, tokens, counts):
  """Append tokens [B, t] to each row's cache (row b: its first counts[b] of them, the rest
  padding) in the absorbed form, each attending to the row's cache and the new tokens before
  it -> (logits [B, vocab] f32 at each row's last new token, cache with lengths + counts).
  t = 1 is a decode step; more continues a prompt whose start a cache already holds (a
  server's reused prefix). Padding tokens write entries past the row's new length, which
  nothing attends to and later tokens overwrite; an entry past the cache's end is dropped."""
  dt = jnp.dtype(cfg.dtype)
  B, t = tokens.shape
  if cfg.moe_impl == "auto" and B * t * cfg.num_experts_per_tok <= cfg.n_routed_experts:
    # A few tokens: read just their experts' weights (no sort, no capacity buffers).
    cfg = cfg.copy_and_resolve_references()
    cfg.moe_impl = "gather"
  S = next(iter(cache.layers.values())).latent.shape[2]
  pos = cache.lengths[:, None] + jnp.arange(t)[None, :]                 # [B, t]
  valid = (jnp.arange(S)[None, None, :] <= pos[..., None])               # [B, t, S]
  rows = jnp.arange(B)[:, None]
  x = jnp.take(params["embed"], tokens, axis=0).astype(dt)
  eps = cfg.rms_norm_eps
  layers = {}
  for st in stacks(cfg):
    def body(x, layer):
      p, c = layer
      h = rms_norm(x, p["attn_norm"], eps)
      cos, sin = rope.cos_sin(cfg, pos)
      new = latents(cfg, p["attn"], h, cos, sin)                        # the new entries
      c = Latents(*(a.at[rows, pos].set(n.astype(a.dtype), mode="drop")
                    for a, n in zip(c, new)))
      x = x + mla_absorbed(cfg, p["attn"], h, pos, c, valid)
      y, _ = feed_forward(cfg, st.ffn, p, rms_norm(x, p["mlp_norm"], eps))
      return x + y, c
    x, layers[st.name] = jax.lax.scan(body, x, (params[st.name], cache.layers[st.name]))
  x = jnp.take_along_axis(x, (counts - 1)[:, None, None], axis=1)       # [B, 1, d]
  x = rms_norm(x, params["final_norm"], eps)
  logits = jnp.einsum("btd,dv->btv", x, params["lm_head"].astype(dt),
                      preferred_element_type=jnp.float32)[:, 0]
  return logits, Cache(layers, cache.lengths + counts)
