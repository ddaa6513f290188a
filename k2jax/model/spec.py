"""One table describes every parameter: shape, logical axes, init and optimizer role.

Initialisation, sharding (logical axes -> mesh axes), Muon's matrix view and parameter
counts are all derived from it, so they cannot drift apart.

Logical axis names: vocab, head_vocab (the head's output columns), embed, heads, head_dim, q_lora,
kv_lora, mlp, experts, layers.
A matrix parameter is laid out [*batch, *in, *out]: its leading `layers` / `experts` axes
are batch axes (Muon orthogonalizes each layer's and each expert's matrix separately), the
next `n_in` axes are the input (fan-in) and the rest the output. Heads stay explicit
(q_b is [q_lora, heads, head_dim]) so per-head QK-Clip is a broadcast, while Muon still
sees the whole published matrix q_lora x (heads * head_dim).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from optax.contrib import MuonDimensionNumbers

BATCH_AXES = ("layers", "experts")


class ParamSpec(NamedTuple):
  shape: tuple
  axes: tuple            # logical axis name per dim
  init: str = "normal"   # normal (std = initializer_range) | ones | zeros
  group: str = "muon"    # optimizer role: muon | adamw | frozen (not trained by gradients)
  n_in: int = 1          # number of fan-in axes after the batch axes (matrices)
  decay: bool = True     # weight decay applies
  cast: bool = True      # the forward reads it cast whole to model.dtype (see cast_once)


def matrix(shape, axes, n_in=1):
  """A Muon-trained weight matrix (decayed), `n_in` fan-in axes after any batch axes."""
  return ParamSpec(shape=tuple(shape), axes=tuple(axes), init="normal", group="muon", n_in=n_in,
                   decay=True)


def vector(size, axis, init="ones", group="adamw"):
  """A norm weight or similar vector: AdamW, no weight decay."""
  return ParamSpec(shape=(size,), axes=(axis,), init=init, group=group, n_in=0, decay=False)


def stack(tree, n: int):
  """Prepend a `layers` axis of size n to every spec in `tree`."""
  return jax.tree.map(lambda s: s._replace(shape=(n,) + s.shape, axes=("layers",) + s.axes),
                      tree, is_leaf=is_spec)


def is_spec(x):
  return isinstance(x, ParamSpec)


def muon_batch(s: ParamSpec) -> int:
  """How many leading batch axes (`layers` / `experts`) a Muon-trained spec has; 0 outside
  Muon."""
  if s.group != "muon":
    return 0
  nb = 0
  while nb < len(s.axes) and s.axes[nb] in BATCH_AXES:
    nb += 1
  return nb


def muon_dims(s: ParamSpec):
  """MuonDimensionNumbers for a Muon-trained spec, else None (optax uses AdamW / nothing)."""
  if s.group != "muon":
    return None
  nb = muon_batch(s)
  ndim = len(s.shape)
  return MuonDimensionNumbers(reduction_axis=tuple(range(nb, nb + s.n_in)),
                              output_axis=tuple(range(nb + s.n_in, ndim)))


def init_params(specs, rng, std: float, dtype=jnp.float32):
  """Draw every parameter of `specs` from its own key (folded in by leaf index)."""
  leaves, treedef = jax.tree.flatten(specs, is_leaf=is_spec)
  out = []
  for i, s in enumerate(leaves):
    if s.init == "normal":
      out.append((std * jax.random.normal(jax.random.fold_in(rng, i), s.shape, jnp.float32))
                 .astype(dtype))
    elif s.init == "ones":
      out.append(jnp.ones(s.shape, dtype))
    else:
      out.append(jnp.zeros(s.shape, jnp.float32 if s.group == "frozen" else dtype))
  return jax.tree.unflatten(treedef, out)


def cast_once(specs, params, dtype):
  """`params` with every leaf whose spec has `cast` narrowed to `dtype` (a leaf stored
  narrower, bf16 params under float32 compute, stays: widening gains nothing); the rest as
  stored.

  The forward reads such a leaf only as `w.astype(model.dtype)` (whole, or one layer's slice
  under the layers' scan), so differentiating it at a copy cast beforehand gives the same
  values and the same gradient: the cast's transpose only widens the model.dtype
  cotangent that reaches it. Not `cast`: the router (its logits are float32, as in
  DeepSeek-V3's gate), the embedding (read by a gather, whose transpose sums the rows of
  repeated tokens: that sum stays float32), and the experts under the MoE impls that read
  them otherwise (kernels.moe.SUM_BEFORE_CAST).
  """
  dt = jnp.dtype(dtype)
  return jax.tree.map(lambda s, p: p.astype(dt) if s.cast and p.dtype.itemsize > dt.itemsize
                      else p, specs, params, is_leaf=is_spec)


def size(s: ParamSpec) -> int:
  return int(np.prod(s.shape, dtype=np.int64))
