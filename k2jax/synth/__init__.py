"""Data synthesis of the report (2.2 rephrasing, 3.1.1 agentic tool use) over one model
interface: `python -m k2jax.synth rephrase|math|agentic ...` (see k2jax.synth.cli)."""

from k2jax.synth.client import (Client, LocalClient, ModelError, OpenAIClient, Reply, Request,
                                ScriptedClient, Unreachable)

__all__ = ["Client", "LocalClient", "ModelError", "OpenAIClient", "Reply", "Request",
           "ScriptedClient", "Unreachable"]
