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

from k2jax.kernels import flash

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
