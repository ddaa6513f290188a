"""Recomputation policies: which named activations a scanned layer keeps for the backward pass.

The model tags activations with `jax.ad_checkpoint.checkpoint_name`:
  norm          RMSNorm outputs
  mla_up        MLA up-projections (q_b / q_proj, kv_b outputs)
  moe_input     tokens dispatched to experts (input of the MoE up-projections)
  swiglu_input  gate / up projection outputs (input of SwiGLU)
  swiglu        silu(gate) * up
  moe_down      expert down-projection outputs
so recomputation is a policy choice in `model.remat`, not a model change.
"""

import jax

# Report 2.4.3, selective recomputation: cheap but large activations are recomputed.
SELECTIVE_RECOMPUTE = ("norm", "swiglu", "mla_up", "moe_down")


def remat_policy(name: str):
  """None (keep everything, no jax.checkpoint) | a jax.checkpoint policy."""
  if name == "none":
    return None
  if name == "full":
    return jax.checkpoint_policies.nothing_saveable
  if name == "selective":
    return jax.checkpoint_policies.save_anything_except_these_names(*SELECTIVE_RECOMPUTE)
  raise ValueError(f"model.remat = {name!r}: must be one of none, selective, full")
