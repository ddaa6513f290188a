"""Reinforcement learning for K2 (report 3.2): the K1.5 loss, environments, the code sandbox
and the trainer (`python -m k2jax.rl`, k2jax.rl.train).

May import: k2jax.configs, k2jax.data, k2jax.kernels, k2jax.model, k2jax.optim,
k2jax.parallel, k2jax.interop, k2jax.training, k2jax.serving, k2jax.sft.
"""

from k2jax.rl.loss import budget_rewards, k15_loss, sequence_logprobs, temperature_at, with_ptx

__all__ = ["k15_loss", "sequence_logprobs", "budget_rewards", "with_ptx", "temperature_at"]
