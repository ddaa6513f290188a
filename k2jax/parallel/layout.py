"""Where the pipelined layer stack lives: the stored layout (report 2.4.2, pipeline stages).

The last layer stack (K2: the 60 MoE layers) is cut into S = P x V stages of L layers, P =
mesh.pipeline devices, V = mesh.virtual_stages, L = ceil(layers / S); stage s = v P + p runs
on device p (round-robin: a microbatch goes round the ring of devices V times). The trainer
stores that stack in the order the schedule runs it, so sharding its leading axis over
`pipeline` in even blocks puts on device p exactly the layers p runs, and a step moves no
weight between pipeline devices:

    stored row  r = (p V + v) L + l      holds      stage v P + p's l-th layer
                                                    (padding where l >= its layer count)

Stage s holds the next n_s layers (n_s <= L) in its first rows. Uneven splits pad storage
(K2: 60 layers in 16 x 2 stages of 2 -> 64 rows, 4 of them padding that is never computed
and keeps zero weights) instead of replicating the stack over the pipeline axis; the padding
goes first to the stage that also runs the embedding (`_balanced_counts`). Everything
per-layer in the trainer follows the stored order: the optimizer (Muon per matrix, QK-Clip
per layer and head, bias balancing per layer: all row-wise, so they are built from
`stored_model`, the model config with the stack padded), the max logits and expert load the
pipeline returns. Checkpoints, metrics and everything outside the
trainer keep the logical [layers, ...] order (`to_logical` / `state_to_logical`), so a
checkpoint restores on any pipeline size.
"""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from k2jax.model import transformer


def stage_of(v, p, P: int):
  """The stage device p runs as its v-th of the pipeline's P devices: s = v P + p (the
  round-robin placement of the module docstring). ints or integer arrays; every placement
  in k2jax.parallel asks this and `placed`."""
  return v * P + p


def placed(s, P: int):
  """(v, p) of stage s: the inverse of `stage_of`."""
  return s // P, s % P


class Split(NamedTuple):
  """How the pipelined stack is cut and stored (module docstring)."""
  stack: transformer.Stack   # the pipelined stack (the model's last), logical
  stages: int                # P: devices on the pipeline axis
  virtual: int               # V: stages per device
  per_stage: int             # L: stored rows per stage
  counts: tuple = ()         # real layers of each stage s = v P + p (default: L each, the
                             # last ones short)

  @property
  def rows(self) -> int:
    """Stored rows of the stack: P V L."""
    return self.stages * self.virtual * self.per_stage

  @property
  def padded(self) -> int:
    return self.rows - self.stack.size

  def layers_per_stage(self) -> np.ndarray:
    """[S] real layers of each stage, in stage order."""
    if self.counts:
      return np.asarray(self.counts)
    S, L = self.stages * self.virtual, self.per_stage
    return np.clip(self.stack.size - np.arange(S) * L, 0, L)

  def logical_rows(self) -> np.ndarray:
    """[P, V, L] int: the logical layer each stored row holds, -1 for padding. Stage s holds
    the next n_s layers in its first n_s rows (layers_per_stage)."""
    P, V, L = self.stages, self.virtual, self.per_stage
    n = self.layers_per_stage()
    start = np.cumsum(n) - n
    s = stage_of(np.arange(V)[None, :, None], np.arange(P)[:, None, None], P)
    l = np.arange(L)[None, None, :]
    return np.where(l < n[s], start[s] + l, -1)

  def real(self) -> np.ndarray:
    """[P, V, L] bool: stored rows that are layers (not padding)."""
    return self.logical_rows() >= 0

  def describe(self, cfg) -> str:
    pre = [s for s in transformer.stacks(cfg) if s != self.stack]
    before = "embedding" + "".join(f" + {s.size} {s.ffn} layer(s)" for s in pre)
    return (f"pipeline: {self.stack.size} {self.stack.name} over {self.stages} devices x "
            f"{self.virtual} virtual = {self.stages * self.virtual} stages of {self.per_stage} "
            f"row(s) (stage s on device s % {self.stages}"
            f"{f', {self.padded} padding row(s) in storage, never computed' if self.padded else ''}"
            f"); {before} on the first stage, norm + head split over the devices by vocabulary")


def _balanced_counts(cfg, stack, P: int, V: int, L: int) -> tuple:
  """Real layers per stage when the split pads (S L > layers): each padding row goes where
  the work is largest. Stage 0 also runs the embedding and the layers before the stack
  (forward, then recomputed and differentiated in its backward: 4 / 3 of a forward + backward
  in layer units), so it takes the padding first (the head is split over every device,
  k2jax.parallel.pipeline); a device never loses its last layer. K2 (60 layers, 16 x 2
  stages of 2): stage 0 holds none, the last two one each."""
  from k2jax.model import counting
  S = P * V
  n = np.full(S, L)
  T = cfg.max_position_embeddings
  unit = counting.layer_flops(cfg, stack.ffn, T)
  extra = np.zeros(S)
  extra[0] += 4 / 3 * sum(counting.layer_flops(cfg, st.ffn, T) * st.size
                          for st in transformer.stacks(cfg) if st != stack) / unit
  device = placed(np.arange(S), P)[1]
  for _ in range(S * L - stack.size):
    per_device = np.bincount(device, weights=n, minlength=P)
    # ties go to the later stage, so an equal-cost split pads its last stages
    ok = (n > 0) & (per_device[device] > 1)
    if not ok.any():        # more padding than devices can spare: validate() names it
      ok = n > 0
    load = np.where(ok, n + extra, -np.inf)
    s = S - 1 - int(np.argmax(load[::-1]))
    n[s] -= 1
  return tuple(int(c) for c in n)


def split(cfg, stages: int, virtual: int = 1) -> Split:
  """The Split of model config `cfg` over `stages` pipeline devices x `virtual` stages each."""
  stack = transformer.stacks(cfg)[-1]
  L = math.ceil(stack.size / (stages * virtual))
  counts = ()
  if stages * virtual * L > stack.size:
    counts = _balanced_counts(cfg, stack, stages, virtual, L)
  return Split(stack, stages, virtual, L, counts)


def validate(config) -> None:
  """ValueError (one line) when a pipeline device would hold padding rows only (the split
  pads the stack to P x V stages; `logical_rows` says which rows are real)."""
  if config.mesh.pipeline <= 1:
    return
  sp = of(config)
  empty = int(np.sum((sp.logical_rows() < 0).all(axis=(1, 2))))
  if empty:
    raise ValueError(
        f"mesh.pipeline = {sp.stages} x mesh.virtual_stages = {sp.virtual}: the "
        f"{sp.stack.size} layers of the pipelined stack leave {empty} pipeline device(s) "
        f"without a layer; use a smaller mesh.pipeline")


def of(config) -> Split | None:
  """The Split a full config trains with, or None without a pipeline."""
  if config.mesh.pipeline <= 1:
    return None
  return split(config.model, config.mesh.pipeline, config.mesh.get("virtual_stages", 1))


def stored_model(cfg, sp: Split | None):
  """The model config as stored: the pipelined stack has `sp.rows` layers. Row-wise consumers
  (the parameter table, the optimizer, QK-Clip, balancing) built from it see stored arrays."""
  if sp is None or not sp.padded:
    return cfg
  cfg = cfg.copy_and_resolve_references()
  cfg.num_hidden_layers += sp.padded
  if sp.stack.ffn == "mlp":            # an all-dense model pipelines its dense stack
    cfg.first_k_dense_replace += sp.padded
  return cfg


def stored_config(config):
  """A full config whose model group is `stored_model` (the trainer's view)."""
  sp = of(config)
  if sp is None or not sp.padded:
    return config
  config = config.copy_and_resolve_references()
  config.model = stored_model(config.model, sp)
  return config


def to_stored(sp: Split, x):
  """Logical [layers, ...] -> stored [P V L, ...] (zero padding rows): row r takes the
  layer logical_rows() names (a static gather)."""
  idx = sp.logical_rows().reshape(-1)
  y = jnp.take(x, np.maximum(idx, 0), axis=0)
  real = (idx >= 0).reshape((-1,) + (1,) * (x.ndim - 1))
  return jnp.where(real, y, jnp.zeros((), x.dtype))


def to_logical(sp: Split, x):
  """Stored [P V L, ...] -> logical [layers, ...] (padding dropped)."""
  idx = sp.logical_rows().reshape(-1)
  rows = np.empty(sp.stack.size, np.int64)
  rows[idx[idx >= 0]] = np.nonzero(idx >= 0)[0]
  return jnp.take(x, rows, axis=0)


def layer_rows(sp: Split, x, fn):
  """Apply fn to the pipelined stack's rows of a per-layer array [all layers, ...]."""
  r = sp.stack.first
  return jnp.concatenate([x[:r], fn(sp, x[r:])], axis=0)


def stats_to_logical(sp: Split | None, max_logits, expert_load):
  """Per-layer statistics in stored order -> logical order (metrics, logs)."""
  if sp is None:
    return max_logits, expert_load
  load = to_logical(sp, expert_load) if sp.stack.ffn == "moe" else expert_load
  return layer_rows(sp, max_logits, to_logical), load


def convert_params(sp: Split | None, params, fn):
  """fn (to_stored / to_logical) on every leaf of the pipelined stack of a params tree."""
  if sp is None:
    return params
  return {**params, sp.stack.name: jax.tree.map(lambda a: fn(sp, a), params[sp.stack.name])}


def convert_state(sp: Split | None, tx, state, fn):
  """fn on the pipelined stack's rows of a whole TrainState: its params, every optimizer-state
  leaf that mirrors them (momentum, moments, master weights: found by optax's
  tree_map_params from `tx`, the transformation whose init made `state.opt_state`) and
  QK-Clip's per-layer record of clipped heads."""
  if sp is None:
    return state
  marks = {k: jax.tree.map(lambda _: k == sp.stack.name, v) for k, v in state.params.items()}
  masked = lambda x: isinstance(x, optax.MaskedNode)
  opt = optax.tree_utils.tree_map_params(
      tx, lambda leaf, stacked: leaf if masked(leaf) or not stacked else fn(sp, leaf),
      state.opt_state, marks, transform_non_params=lambda x: x, is_leaf=masked)
  ever = optax.tree_utils.tree_get(opt, "ever_clipped")
  if ever is not None:
    opt = optax.tree_utils.tree_set(opt, ever_clipped=layer_rows(sp, ever, fn))
  return state._replace(params=convert_params(sp, state.params, fn), opt_state=opt)
