"""Kernels (imported as k2jax.kernels): each op has XLA reference implementations with one
signature and an `impl="auto"` selector; fused Pallas versions slot in behind the same call.

May import: nothing of k2jax.
"""

from k2jax.kernels import flash, moe, platform
from k2jax.kernels.flash import attention
from k2jax.kernels.gmm import grouped_matmul
from k2jax.kernels.moe import routed_experts

__all__ = ["attention", "grouped_matmul", "prepare", "routed_experts"]


def prepare(attention_impl: str = "auto", moe_impl: str = "auto") -> tuple[str, str]:
  """Import the libraries these kernel choices run on this backend, before anything traces.

  Call it before jitting a step that is called repeatedly (the trainer, the decoder). A
  library imported for the first time inside a trace can register trace-context values
  (tokamax does), so every function traced before it misses jit's cache at its next call
  and compiles again: a second compile of the step, counted as step time. Returns the
  resolved (attention, routed experts) implementations."""
  attn = flash.auto_impl() if attention_impl == "auto" else attention_impl
  experts = moe.auto_impl() if moe_impl == "auto" else moe_impl
  if "tokamax" in (attn, experts):
    platform.tokamax()
  return attn, experts
