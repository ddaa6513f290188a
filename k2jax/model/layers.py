"""Small building blocks shared by attention, MoE and the transformer: RMSNorm and SwiGLU."""

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from k2jax.kernels.fp8 import fp8_saved
from k2jax.model import spec


def rms_norm(x, weight, eps):
  """RMSNorm computed in float32, returned in x's dtype (as the reference does)."""
  x32 = x.astype(jnp.float32)
  normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return checkpoint_name(weight.astype(x.dtype) * normed.astype(x.dtype), "norm")


def mlp_specs(hidden: int, ff: int):
  """A SwiGLU MLP: down(silu(x @ gate) * (x @ up))."""
  return {"gate": spec.matrix((hidden, ff), ("embed", "mlp")),
          "up": spec.matrix((hidden, ff), ("embed", "mlp")),
          "down": spec.matrix((ff, hidden), ("mlp", "embed"))}


def swiglu(gate, up):
  h = jax.nn.silu(checkpoint_name(gate, "swiglu_input")) * checkpoint_name(up, "swiglu_input")
  return checkpoint_name(h, "swiglu")


def mlp(p, x, fp8_storage: bool = False):
  """fp8_storage: the up-projection and SwiGLU inputs are saved for backward in FP8-E4M3
  (report 2.4.3, kernels/fp8.py); the forward pass is unchanged."""
  dt = x.dtype
  mm, sw = lambda a, w: a @ w.astype(dt), swiglu
  if fp8_storage:
    mm, sw = fp8_saved(mm, 1), fp8_saved(swiglu, 2)
  h = sw(mm(x, p["gate"]), mm(x, p["up"]))
  return h @ p["down"].astype(dt)
