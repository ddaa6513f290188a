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

from k2jax.kernels import flash

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
  return jax.checkpoint_policies.save_anything_except_these_names(*SELECTIVE_RECOMPUTE)


def saved_bytes_per_token(cfg, ffn: str, seq_len: int, *, remat: str, attention_impl: str,
                          storage: str = "model") -> dict:
  """Bytes one layer keeps for its backward pass, per token, by activation name.

  An estimate that follows the code: every tensor the layer's backward needs, under the name
  the model tags it with, kept or dropped by the `remat` policy above. Untagged tensors
  (MLA's low-rank projections, roped q / k, the attention output, router scores) are kept
  by `none` and `selective`. `attention_impl` "xla" materializes the f32 logits, the f32
  probabilities and their cast per query and key (O(T) per token); the flash kernels
  ("auto", "chunked", Pallas) keep the output and a log-sum-exp per head (O(1)). `storage` "fp8" keeps the MoE
  inputs and SwiGLU inputs in E4M3 with one f32 scale per 128 values (report 2.4.3);
  "model" keeps everything in the compute dtype.

  Args:
    cfg: the model config.
    ffn: "mlp" (dense layer) or "moe".
    seq_len: tokens per sequence (the materialized attention's key count).
    remat: "none" | "selective" | "full".
    attention_impl: the configured attention implementation ("xla" materializes T x T).
    storage: "model" | "fp8".
  Returns:
    {name: bytes per token} for the names the policy keeps.
  """
  a = 4 if cfg.dtype == "float32" else 2
  low = 1 + 4 / 128 if storage == "fp8" else a
  d, H = cfg.hidden_size, cfg.num_attention_heads
  dq, dv, r = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.qk_rope_head_dim
  ql, kvl = cfg.q_lora_rank or 0, cfg.kv_lora_rank
  kept = {
      "layer_input": a * d,
      "norm": a * (2 * d + ql + kvl),
      "mla_up": a * H * (dq + cfg.qk_nope_head_dim + dv),
      "mla_other": a * (ql + kvl + r + 2 * H * dq + H * dv),   # q_a, kv_a, roped q / k, out
      "attention": flash.activation_bytes_per_token(attention_impl, H, seq_len, dq, dv, a),
  }
  if ffn == "mlp":
    f = cfg.intermediate_size
    kept.update(swiglu_input=2 * f * low, swiglu=a * f)
  else:
    k, E, f = cfg.num_experts_per_tok, cfg.n_routed_experts, cfg.moe_intermediate_size
    fs = f * cfg.n_shared_experts
    kept.update(router=8 * E, moe_input=k * d * low, swiglu_input=2 * (k * f + fs) * low,
                swiglu=a * (k * f + fs), moe_down=a * k * d)
  if remat == "full":
    return {"layer_input": kept["layer_input"]}
  if remat == "selective":
    return {n: b for n, b in kept.items() if n not in SELECTIVE_RECOMPUTE}
  return kept
