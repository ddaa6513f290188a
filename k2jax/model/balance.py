"""Aux-loss-free load balancing (DeepSeek-V3 noaux_tc routing, used by K2).

After each optimizer step the trainer nudges every MoE layer's router correction bias
towards balance, instead of back-propagating a balance loss:

    b_i <- b_i + gamma * sign(mean_j load_j - load_i)

so overloaded experts become less likely to be selected. The bias only affects selection;
combine weights use the unbiased scores (k2jax.model.moe.route). The optional sequence-wise
balance loss (`model.aux_loss_alpha`) is computed in the forward pass.
"""

import jax.numpy as jnp


def update_router_bias(params, expert_load, gamma):
  """Return params with moe_layers.moe.router_bias moved by the rule above.

  expert_load: [moe_layers, n_routed_experts] tokens routed per expert in this step
  (aux.expert_load, summed over microbatches). A no-op for models without MoE layers.
  """
  if "moe_layers" not in params:
    return params
  moe = params["moe_layers"]["moe"]
  load = expert_load.astype(jnp.float32)
  step = gamma * jnp.sign(load.mean(-1, keepdims=True) - load)
  new_moe = {**moe, "router_bias": moe["router_bias"] + step.astype(moe["router_bias"].dtype)}
  return {**params, "moe_layers": {**params["moe_layers"], "moe": new_moe}}


def load_imbalance(expert_load):
  """max_i load_i / mean_j load_j per MoE layer (1 = perfectly balanced)."""
  load = expert_load.astype(jnp.float32)
  return load.max(-1) / jnp.maximum(load.mean(-1), 1e-9)
