"""Kernels (imported as k2jax.kernels): each op has XLA reference implementations with one
signature and an `impl="auto"` selector; fused Pallas versions slot in behind the same call."""

from k2jax.kernels.flash import attention
from k2jax.kernels.gmm import grouped_matmul
from k2jax.kernels.moe import routed_experts

__all__ = ["attention", "grouped_matmul", "routed_experts"]
