"""The one table mapping logical axis names to mesh axes (MaxText-style logical-axis rules).

Every parameter's logical axes come from the parameter table (k2jax.model.spec); activations
name theirs ("batch", "length", ...). Changing the parallel layout means editing RULES (or
the mesh sizes in the config), never the model, the optimizer or the trainer: they all ask
this module which mesh axes a logical axis maps to.

Mesh axes, slowest-varying first over the device list: pipeline, data, expert. Expert
parallelism wants the fastest links, so `expert` is innermost; each host's devices then hold
a contiguous slab of the batch. The table sits with the configs, below the model, because
the model's expert-parallel dispatch reads it (dependencies run one way).
"""

from flax import linen as nn
from jax.sharding import PartitionSpec as P

MESH_AXES = ("pipeline", "data", "expert")

# logical axis -> mesh axes. A mesh axis is used at most once per array; an earlier rule wins.
# The `vocab`, `embed` and `heads` splits only save memory: a size the axes do not divide
# stays whole (param_spec).
RULES = (
    ("batch", ("data", "expert")),   # tokens are split over every non-pipeline device
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
    ("opt_state", "data"),           # ZeRO-1: optimizer states are also split over data
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
    # (split, XLA partitioned its Newton-Schulz across pipeline devices: 0.44x the pipelined
    # stack's bytes crossed them per step on pipeline 4 x expert 2); K2: 2.6 GB per device.
    entries = [None if n in MEMORY_ONLY else e for n, e in zip(axes, entries)]
  return P(*entries[:len(pspec)])


def mesh_axes(logical: str) -> tuple[str, ...]:
  """The mesh axes one logical axis is split over (empty if it is replicated)."""
  for name, axes in RULES:
    if name == logical:
      return (axes,) if isinstance(axes, str) else tuple(axes)
  return ()


def active_mesh_axes(logical: str, mesh) -> tuple[str, ...]:
  """mesh_axes(logical) restricted to the axes `mesh` has with size > 1 (an empty or
  abstract mesh: those of its axes that exist)."""
  if mesh is None or mesh.empty:
    return ()
  return tuple(a for a in mesh_axes(logical) if mesh.shape.get(a, 1) > 1)
