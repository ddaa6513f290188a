"""Meshes, logical-axis sharding rules and the shardings of the training state.

May import: k2jax.configs, k2jax.kernels, k2jax.model.
"""

from k2jax.parallel.mesh import (MESH_AXES, RULES, batch_sharding, logical_spec, make_mesh,
                                 param_shardings, process_batch_slice, replicated)
from k2jax.parallel.state import grad_shardings, state_shardings, zero1

__all__ = ["MESH_AXES", "RULES", "make_mesh", "logical_spec", "param_shardings",
           "batch_sharding", "grad_shardings", "process_batch_slice", "replicated",
           "state_shardings", "zero1"]
