"""Float32 master weights for low-precision parameters (report 2.4.2: bf16 parameters).

K2 keeps its parameters in bf16 in the model-parallel group and everything the optimizer
needs in ZeRO-1 state over data parallelism. `master_weights` wraps any optax chain so that
the chain sees, updates and clips a float32 copy w of the parameters p, kept in the
optimizer state (so `k2jax.parallel.state_shardings` splits it over `data` like the
momentum), while the parameters the model runs on are its rounding:

    u, s  = inner.update(g, s, w, **extra)      # Muon, QK-Clip, balancing: on the master
    w'    = w + u
    return  w' - p   (float32)                  # optax.apply_updates: p' = round(p + (w' - p))
                                                #  = round_to_param_dtype(w')

p + (w' - p) is exact in float32 whenever w' and p are within a factor of two (Sterbenz),
so p' is w' rounded to the parameter dtype. Small updates accumulate in w instead of
vanishing in bf16's 8-bit mantissa. Parameters already in float32 need no master: wrap only
chains over lower-precision parameters (`optimizer` does so when model.param_dtype is not
float32).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax


class MasterWeightsState(NamedTuple):
  master: optax.Params     # float32 copy of the parameters
  inner: optax.OptState


def master_weights(inner: optax.GradientTransformation, dtype=jnp.float32
                   ) -> optax.GradientTransformationExtraArgs:
  """`inner` applied to a `dtype` master copy of the parameters (module docstring).

  Args:
    inner: the optimizer chain; its `update` is called with `params=` the master copy and
      any extra keyword arguments (max_logits=, expert_load=).
    dtype: the master weights' dtype.
  Returns:
    A GradientTransformationExtraArgs whose updates, applied with optax.apply_updates, give
    parameters equal to the new master weights rounded to the parameters' dtype.
  """
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    master = jax.tree.map(lambda p: jnp.asarray(p, dtype), params)
    return MasterWeightsState(master, inner.init(master))

  def update_fn(updates, state, params=None, **extra):
    if params is None:
      raise ValueError("master_weights needs params: tx.update(grads, state, params)")
    updates = jax.tree.map(lambda g: jnp.asarray(g, dtype), updates)
    u, inner_state = inner.update(updates, state.inner, state.master, **extra)
    master = jax.tree.map(lambda w, d: w + d.astype(dtype), state.master, u)
    out = jax.tree.map(lambda w, p: w - jnp.asarray(p, dtype), master, params)
    return out, MasterWeightsState(master, inner_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
