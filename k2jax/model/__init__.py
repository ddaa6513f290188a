"""The K2 model as pure functions of (model config, params).

May import: k2jax.configs, k2jax.kernels.
"""

from k2jax.model.counting import count_params, flops_per_token
from k2jax.model.moe import MoEStats
from k2jax.model.transformer import (ForwardStats, Stack, forward, init, num_layers, param_specs,
                                     stacks)

__all__ = ["init", "forward", "param_specs", "num_layers", "stacks", "Stack", "ForwardStats",
           "MoEStats", "count_params", "flops_per_token"]
