"""Data synthesis of the report (2.2 rephrasing, 3.1.1 agentic tool use) over one model
interface: `python -m k2jax.synth rephrase|math|agentic ...` (see k2jax.synth.cli).

May import: k2jax.configs, k2jax.data, k2jax.kernels, k2jax.model, k2jax.optim,
k2jax.parallel, k2jax.interop, k2jax.training, k2jax.serving, k2jax.sft, k2jax.rl.
"""

from k2jax.synth.client import (Client, LocalClient, ModelError, OpenAIClient, Reply, Request,
                                ScriptedClient, Unreachable)

__all__ = ["Client", "LocalClient", "ModelError", "OpenAIClient", "Reply", "Request",
           "ScriptedClient", "Unreachable"]
