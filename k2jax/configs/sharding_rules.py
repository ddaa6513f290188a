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
RULES = (
    ("batch", ("data", "expert")),   # tokens are split over every non-pipeline device
    ("experts", "expert"),           # expert parallelism (report 2.4.2)
    ("layers", "pipeline"),          # each pipeline stage holds its layers
    ("vocab", "expert"),             # embedding / head rows split over the expert group: at
                                     # K2's 163,840 x 7168 each would otherwise be 2.3 GB of
                                     # bf16 (+ 4.7 GB of fp32 gradient) on every device
    ("opt_state", "data"),           # ZeRO-1: optimizer states are also split over data
)


def logical_spec(axes) -> P:
  """PartitionSpec of an array whose dims carry these logical names (None = unnamed)."""
  return nn.logical_to_mesh_axes(tuple(axes), RULES)


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
