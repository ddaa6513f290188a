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

import logging

import jax

# Report 2.4.3, selective recomputation: cheap but large activations are recomputed.
SELECTIVE_RECOMPUTE = ("norm", "swiglu", "mla_up", "moe_down")


# Every name the model tags (module docstring); what `offload` moves to host memory is the
# part of these the recomputation policy keeps.
NAMES = ("norm", "mla_up", "moe_input", "swiglu_input", "swiglu", "moe_down")


def host_memory_kind():
  """The backend's host memory space for offloaded activations, or None if it has none."""
  kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
  return "pinned_host" if "pinned_host" in kinds else None


def remat_policy(name: str, offload: bool = False):
  """None (keep everything, no jax.checkpoint) | a jax.checkpoint policy.

  offload=True (report 2.4.3, CPU offload): the named activations the policy would keep are
  copied to host memory after the forward pass and back for the backward pass; untagged
  intermediates are recomputed. On a backend without a host memory space it is the policy
  without offload (and a warning).
  """
  if name not in ("none", "selective", "full"):
    raise ValueError(f"model.remat = {name!r}: must be one of none, selective, full")
  if offload and name != "full":
    if host_memory_kind() is None:
      logging.getLogger("k2jax.model").warning(
          "model.offload: %s has no host memory space; activations stay on the device",
          jax.default_backend())
    else:
      recompute = SELECTIVE_RECOMPUTE if name == "selective" else ()
      return jax.checkpoint_policies.save_and_offload_only_these_names(
          names_which_can_be_saved=[], names_which_can_be_offloaded=[
              n for n in NAMES if n not in recompute],
          offload_src="device", offload_dst="pinned_host")
  if name == "none":
    return None
  if name == "full":
    return jax.checkpoint_policies.nothing_saveable
  # A whitelist: the named activations outside the recompute list, nothing else. The
  # complement (save_anything_except_these_names) saved as much as no policy at all: the
  # linearization keeps unnamed residuals of the same size (silu's and rms_norm's
  # intermediates, the rotary-embedded q / k) in place of the excluded names.
  return jax.checkpoint_policies.save_only_these_names(
      *[n for n in NAMES if n not in SELECTIVE_RECOMPUTE])
