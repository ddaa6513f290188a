"""Kernels (imported as k2jax.kernels): each op has XLA reference implementations with one
signature and an `impl="auto"` selector; fused Pallas versions slot in behind the same call."""

from k2jax.kernels.flash import attention
from k2jax.kernels.grouped_matmul import grouped_matmul

__all__ = ["attention", "grouped_matmul"]
