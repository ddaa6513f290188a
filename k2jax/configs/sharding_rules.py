"""The one table mapping logical axis names to mesh axes (MaxText-style logical-axis rules).

Every parameter's logical axes come from the parameter table (k2jax.model.spec); activations
name theirs ("batch", "length", ...). Changing the parallel layout means editing RULES (or
the mesh sizes in the config), never the model, the optimizer or the trainer: they all ask
this module which mesh axes a logical axis maps to.

Mesh axes, slowest-varying first over the device list: pipeline, data, context, expert.
Expert parallelism wants the fastest links, so `expert` is innermost; `context` (each
sequence's tokens split over devices: k2jax.model.context) gathers a latent per layer and
sits next to it; each host's devices then hold a contiguous slab of the batch. The table sits with the configs, below the model, because
the model's expert-parallel dispatch reads it (dependencies run one way).
"""

import math

import jax
from flax import linen as nn
from jax.sharding import PartitionSpec as P

MESH_AXES = ("pipeline", "data", "context", "expert")

# logical axis -> mesh axes. A mesh axis is used at most once per array; an earlier rule wins.
# The `vocab`, `embed` and `heads` splits only save memory: a size the axes do not divide
# stays whole (param_spec).
RULES = (
    ("batch", ("data", "expert")),   # sequences are split over the data x expert devices
    ("length", "context"),           # ... and each sequence's tokens over the context devices
                                     # (context parallelism: k2jax.model.context)
    ("experts", "expert"),           # expert parallelism (report 2.4.2)
    ("layers", "pipeline"),          # each pipeline stage holds its layers
    ("head_vocab", ("pipeline", "expert")),  # the head's columns: also over the pipeline,
                                     # whose devices each run one slice of it (vocabulary-
                                     # parallel head and loss, k2jax.parallel.pipeline), so
                                     # it is stored where it runs
    ("vocab", "expert"),             # embedding / head rows split over the expert group: at
                                     # K2's 163,840 x 7168 each would otherwise be 2.3 GB of
                                     # bf16 (+ 4.7 GB of fp32 gradient) on every device
    ("embed", "expert"),             # every other weight (attention, shared MLP, router,
    ("heads", "expert"),             # norms) split over the expert group on its model
                                     # dimension, or its heads where it has none (q_b, kv_b),
                                     # and gathered where it is used (FSDP): the report's
                                     # accounting of 2.4.2, "~6 TB over a model-parallel group
                                     # of 256 GPUs", divides all of them, and at K2's size the
                                     # copies the expert group would otherwise hold are ~7 GB
                                     # per device. Expert weights keep `embed` whole: their
                                     # `experts` rule (earlier) has the axis. Not the dense
                                     # stack under a pipeline (param_spec).
    ("opt_state", ("data", "context")),  # ZeRO-1: optimizer states are also split over the
                                     # devices that hold the same weights for other tokens
)


def logical_spec(axes) -> P:
  """PartitionSpec of an array whose dims carry these logical names (None = unnamed)."""
  return nn.logical_to_mesh_axes(tuple(axes), RULES)


# logical axes whose split only saves memory: kept whole where the mesh does not divide them
# (instead of refusing the mesh)
MEMORY_ONLY = ("vocab", "head_vocab", "embed", "heads")


def param_spec(axes, shape, mesh, whole: bool = False) -> P:
  """logical_spec of a parameter of this shape on `mesh`, with the memory-only splits
  (MEMORY_ONLY) dropped on dimensions the mesh does not divide, or everywhere with `whole`
  (the matrix as computation needs it: Muon's Newton-Schulz). Every place that shards or
  constrains a parameter (its storage, the pipeline's gradient sums, Muon's gather, the MoE
  shard_map) asks this, so they agree."""
  pspec = logical_spec(axes)
  if mesh is None or mesh.empty:
    return pspec
  entries = list(pspec) + [None] * (len(shape) - len(pspec))
  for d, name in enumerate(axes):
    e = entries[d]
    if e is None:
      continue
    n = 1
    for a in ((e,) if isinstance(e, str) else e):
      n *= mesh.shape.get(a, 1)
    # A `layers` stack the pipeline does not divide is the leading dense stack, run by stage
    # 0 only: kept whole on every pipeline device (the pipelined stack is padded to divide).
    if (name in MEMORY_ONLY and (whole or shape[d] % n)) or (name == "layers" and shape[d] % n):
      entries[d] = None
  if axes and axes[0] == "layers" and pspec[0] is not None and entries[0] is None:
    # ... and not split over `expert` either: its update then runs on the device that holds it
    # (split, XLA partitioned its Newton-Schulz across pipeline devices, and a large share of
    # the stack's bytes crossed them every step).
    entries = [None if n in MEMORY_ONLY else e for n, e in zip(axes, entries)]
  return P(*entries[:len(pspec)])


def mesh_axes(logical: str) -> tuple[str, ...]:
  """The mesh axes one logical axis is split over (empty if it is replicated)."""
  for name, axes in RULES:
    if name == logical:
      return (axes,) if isinstance(axes, str) else tuple(axes)
  return ()


def active_mesh_axes(logical: str, mesh, manual: bool = False) -> tuple[str, ...]:
  """mesh_axes(logical) restricted to the axes `mesh` has with size > 1 (an empty or
  abstract mesh: those of its axes that exist), without those an enclosing shard_map
  already holds manual (`mesh.manual_axes`: the pipeline holds the batch's axes, so a
  nested shard_map over the batch opens none) unless `manual`."""
  if mesh is None or mesh.empty:
    return ()
  held = () if manual else tuple(getattr(mesh, "manual_axes", ()))
  return tuple(a for a in mesh_axes(logical) if mesh.shape.get(a, 1) > 1 and a not in held)


def without(pspec, axes) -> P:
  """`pspec` with the mesh `axes` left out of every entry."""
  def drop(e):
    kept = tuple(a for a in entry_axes(e) if a not in axes)
    return None if not kept else kept[0] if len(kept) == 1 else kept
  return P(*[drop(e) for e in pspec])


def constrain(x, axes):
  """jax.lax.with_sharding_constraint of `x` to logical_spec(axes) over the axes the current
  mesh leaves automatic: inside a shard_map those it holds manual are already split, and a
  constraint may not name them (none left, as in the pipeline's: `x` unchanged)."""
  mesh = jax.sharding.get_abstract_mesh()
  held = tuple(getattr(mesh, "manual_axes", ()))
  if mesh.empty or set(mesh.axis_names) <= set(held):
    return x      # nothing left to constrain (the pipeline holds every axis manual)
  # ... nor axes the mesh does not have (one built with fewer names than MESH_AXES)
  absent = tuple(a for a in MESH_AXES if a not in mesh.axis_names)
  return jax.lax.with_sharding_constraint(x, without(logical_spec(axes), held + absent))


def entry_axes(entry) -> tuple[str, ...]:
  """The mesh axes of one PartitionSpec entry (None, a name or a tuple of names)."""
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def spread(pspec, shape, axes, mesh_shape) -> P:
  """`pspec` with mesh `axes` added where they divide the array, as many of them as fit.

  Greedy: the largest product of a subset of `axes` (in their order) goes on the largest
  dimension it divides, preferring an unsharded dimension over one already split (the split
  then compounds, e.g. 384 experts over expert = 16 and data = 24); then the rest of the axes
  the same way. Axes already used or of size 1 are skipped; axes nothing divides are left
  out (the array is then whole over them).
  """
  spec = list(pspec) + [None] * (len(shape) - len(pspec))
  used = {a for s in spec for a in entry_axes(s)}
  left = [a for a in axes if mesh_shape.get(a, 1) > 1 and a not in used]
  while left:
    best = None
    for mask in range(1, 2 ** len(left)):
      subset = tuple(a for i, a in enumerate(left) if mask >> i & 1)
      n = math.prod(mesh_shape[a] for a in subset)
      for d, size in enumerate(shape):
        have = math.prod(mesh_shape[a] for a in entry_axes(spec[d]))
        if size % (have * n) == 0:
          key = (n, spec[d] is None, size // have)
          if best is None or key > best[0]:
            best = (key, subset, d)
    if best is None:
      break
    _, subset, d = best
    both = entry_axes(spec[d]) + subset
    spec[d] = both[0] if len(both) == 1 else both
    left = [a for a in left if a not in subset]
  return P(*spec)


def _on_batch_dims(pspec, shape, axes, mesh_shape, batch: int) -> P:
  """`pspec` with mesh `axes` spread over its leading `batch` dimensions only."""
  entries = list(pspec) + [None] * (len(shape) - len(pspec))
  used = {a for e in entries[batch:] for a in entry_axes(e)}
  head = spread(P(*entries[:batch]), shape[:batch], [a for a in axes if a not in used],
                mesh_shape)
  return P(*(list(head) + entries[batch:]))


def opt_state_spec(pspec, shape, mesh_shape, batch: int = 0) -> P:
  """ZeRO-1: the split of an optimizer state that mirrors a parameter split as `pspec`, with
  the `opt_state` mesh axes added (`spread`).

  A Muon matrix's state (`batch` > 0 leading `layers` / `experts` dimensions) takes them on
  those dimensions where they divide them, so each data rank holds whole matrices: the share
  it orthogonalizes (muon_work_spec), with no exchange of momentum before or after. Other
  states, or where nothing there divides, take them where `spread` puts them.
  """
  axes = mesh_axes("opt_state")
  if batch:
    spec = _on_batch_dims(pspec, shape, axes, mesh_shape, batch)
    used = {a for e in spec for a in entry_axes(e)}
    if all(a in used for a in axes if mesh_shape.get(a, 1) > 1):
      return spec
  return spread(pspec, shape, axes, mesh_shape)


def muon_work_spec(axes, shape, mesh, batch: int) -> P:
  """Where Muon orthogonalizes the matrices of a parameter (logical `axes`, `shape`, `batch`
  leading `layers` / `experts` dimensions): matrix dimensions whole, the batch dimensions
  split as the parameter's (each device works on the layers and experts it holds) and, where
  they divide that slice, over the `opt_state` axes too (ZeRO-1: each data rank takes 1 /
  data of them, the share whose momentum it keeps, opt_state_spec)."""
  entries = list(param_spec(axes, shape, mesh, whole=True)) + [None] * len(shape)
  entries = entries[:batch] + [None] * (len(shape) - batch)
  return _on_batch_dims(P(*entries), shape, mesh_axes("opt_state"), mesh.shape, batch)
