"""QK-Clip (report 2.1, Algorithm 1 lines 8-17) as the last link of an optax chain.

After the optimizer's update, for every layer l and head h whose max scaled attention logit
S[l, h] (measured in this step's forward pass) exceeds tau, with gamma = tau / S[l, h]:

    q_nope columns of head h  *= sqrt(gamma)      (in q_b, or q_proj without q_lora)
    k_nope columns of head h  *= sqrt(gamma)      (in kv_b)
    q_rope columns of head h  *= gamma
    shared k_rope (kv_a) and v: untouched

so every logit of head h is scaled by exactly gamma. Written as an update on the weights
the optimizer holds, u' = s * (p + u) - p, so `optax.apply_updates` applies it and
p + u' = s * (p + u). Heads with S <= tau (including S <= 0) are left exactly as they are.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from k2jax.model import stacks
from k2jax.model.attention import qk_clip_scales


class QKClipState(NamedTuple):
  ever_clipped: jax.Array  # bool [layers, heads]: heads clipped at least once so far


def clip_factors(max_logits, tau):
  """gamma = min(1, tau / S), computed so S <= tau (or S <= 0) gives exactly 1, never NaN.

  Args:
    max_logits: S, any shape (usually [layers, heads]).
    tau: the threshold (> 0).
  Returns:
    f32 gamma with the shape of `max_logits`.
  """
  s = max_logits.astype(jnp.float32)
  return tau / jnp.maximum(s, tau)


def qk_clip(cfg, tau: float = 100.0) -> optax.GradientTransformationExtraArgs:
  """Per-head QK-Clip as the last link of a chain (the math is in the module docstring).

      tx = optax.chain(any_optimizer, qk_clip(cfg, tau))
      updates, state = tx.update(grads, state, params, max_logits=aux.max_logits)

  Args:
    cfg: the model config (heads, head dims, layer stacks).
    tau: the threshold on the max scaled logit (K2: 100).
  Returns:
    An optax.GradientTransformationExtraArgs; `update` needs `params` and `max_logits=` f32
    [num_hidden_layers, num_attention_heads]. Its state (QKClipState) records which heads
    were ever clipped.
  """
  if not tau > 0:
    raise ValueError(f"optimizer.tau = {tau!r}: must be positive")
  heads = cfg.num_attention_heads

  def init_fn(params):
    del params
    return QKClipState(jnp.zeros((cfg.num_hidden_layers, heads), bool))

  def update_fn(updates, state, params=None, *, max_logits=None, **extra):
    del extra
    if params is None or max_logits is None:
      raise ValueError("qk_clip needs the params and this step's max logits: call "
                       "tx.update(grads, state, params, max_logits=aux.max_logits)")
    if max_logits.shape != (cfg.num_hidden_layers, heads):
      raise ValueError(f"max_logits has shape {max_logits.shape}, expected "
                       f"[num_hidden_layers, num_attention_heads] = "
                       f"{(cfg.num_hidden_layers, heads)}")
    gamma = clip_factors(max_logits, tau)
    updates = dict(updates)
    for st in stacks(cfg):
      attn_u = dict(updates[st.name]["attn"])
      for name, s in qk_clip_scales(cfg, gamma[st.rows]).items():
        p, u = params[st.name]["attn"][name], attn_u[name]
        clipped = s * (p + u) - p
        attn_u[name] = jnp.where(s == 1, u, clipped.astype(u.dtype))  # unclipped: bit-exact
      updates[st.name] = {**updates[st.name], "attn": attn_u}
    return updates, QKClipState(state.ever_clipped | (max_logits > tau))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
