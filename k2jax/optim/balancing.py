"""Aux-loss-free load balancing (DeepSeek-V3 noaux_tc routing, used by K2) as an optax transform.

The router's correction bias b (one per expert and MoE layer) decides which experts a token
is sent to but not how their outputs are mixed (k2jax.model.moe.route). It is not trained by
gradients; after each step it moves towards balance by a fixed amount:

    b_i <- b_i + gamma * sign(mean_j load_j - load_i)

so overloaded experts become less likely to be selected. `load` is the number of (non-padding)
tokens routed to each expert in this step, measured by the forward pass
(`ForwardStats.expert_load`), the way QK-Clip takes this step's max logits.
"""

import jax
import jax.numpy as jnp
import optax

from k2jax.model import stacks


def router_bias_balancing(cfg, gamma: float | None = None
                          ) -> optax.GradientTransformationExtraArgs:
  """Adds the balancing step to the router-bias updates of every MoE layer.

  Use it as a link of a chain whose other links leave the bias alone (k2jax's `muon`,
  `adamw` and `muonclip` give it a zero update), and pass this step's load:

      tx = optax.chain(optim.muonclip(cfg, lr), optim.router_bias_balancing(cfg))
      updates, state = tx.update(grads, state, params, max_logits=aux.max_logits,
                                 expert_load=aux.expert_load)

  Args:
    cfg: the model config (its MoE stack and `bias_update_speed`).
    gamma: the bias speed; defaults to `cfg.bias_update_speed` (DeepSeek-V3: 0.001).
  Returns:
    A GradientTransformationExtraArgs whose update takes `expert_load=` f32
    [moe_layers, n_routed_experts]. Updates of every other parameter pass through. A no-op
    for a model without MoE layers.
  """
  gamma = cfg.bias_update_speed if gamma is None else gamma
  moe_stacks = [s for s in stacks(cfg) if s.ffn == "moe"]

  def update_fn(updates, state, params=None, *, expert_load=None, **extra):
    del params, extra
    if not moe_stacks:
      return updates, state
    if expert_load is None:
      raise ValueError("router_bias_balancing needs this step's expert load: call "
                       "tx.update(grads, state, params, expert_load=aux.expert_load, ...)")
    (st,) = moe_stacks
    moe_u = updates[st.name]["moe"]
    load = expert_load.astype(jnp.float32)
    step = gamma * jnp.sign(load.mean(-1, keepdims=True) - load)
    bias_u = moe_u["router_bias"] + step.astype(moe_u["router_bias"].dtype)
    updates = {**updates, st.name: {**updates[st.name], "moe": {**moe_u, "router_bias": bias_u}}}
    return updates, state

  return optax.GradientTransformationExtraArgs(optax.init_empty_state, update_fn)


def load_imbalance(expert_load: jax.Array) -> jax.Array:
  """max_i load_i / mean_j load_j per MoE layer (1 = perfectly balanced)."""
  load = expert_load.astype(jnp.float32)
  return load.max(-1) / jnp.maximum(load.mean(-1), 1e-9)
