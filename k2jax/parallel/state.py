"""Shardings of the whole training state: ZeRO-1 (report 2.4.2).

Parameters follow the logical-axis rules (replicated over `data`). Optimizer-state leaves
that mirror a parameter (Muon momentum, Adam moments, fp32 master weights; optax identifies
them for us with `optax.tree_utils.tree_map_params`) take that parameter's sharding and are
additionally split over the mesh axes of the logical `opt_state` axis
(k2jax.configs.sharding_rules: `data`) on a dimension they divide (`mesh.spread`: preferring
an unsharded one, compounding an existing split where needed, e.g. K2's 384 experts over
expert = 16 x data = 24); everything else (counts, flags) is replicated. `k2jax.plan` reports
any state `data` cannot split.

Muon needs whole matrices: under jit the momentum shard of each data rank is gathered where
Newton-Schulz needs it (k2jax.optim.muon.whole_matrix_momentum), the orthogonalized update is
formed on the full matrix, and each rank keeps its shard of the new momentum;
experiments/bench_parallel.py measures what it costs.
"""

import optax
from jax.sharding import NamedSharding

from k2jax.configs.sharding_rules import mesh_axes
from k2jax.parallel.mesh import param_shardings, replicated, spread


def zero1(sharding: NamedSharding, shape) -> NamedSharding:
  """`sharding` with the ZeRO-1 mesh axes added on the largest free divisible dimension."""
  return NamedSharding(sharding.mesh, spread(sharding.spec, shape, mesh_axes("opt_state"),
                                             sharding.mesh.shape))


def state_shardings(specs, mesh, abstract_state, tx, shard_optimizer: bool = True,
                    spread_layers: bool = False, host_state: bool = False):
  """NamedShardings for a TrainState.

  Args:
    specs: the parameter table (`k2jax.model.param_specs(cfg)`).
    mesh: the device mesh.
    abstract_state: a TrainState of ShapeDtypeStructs (`jax.eval_shape` of its init).
    tx: the optax transformation whose `init` made `abstract_state.opt_state`.
    shard_optimizer: False keeps optimizer state sharded like the params (plain data
      parallelism, for comparison).
    spread_layers: param_shardings' (True for a logical view of a pipelined stack).
    host_state: the states that mirror a parameter live in host memory (memory kind
      `pinned_host`); k2jax.step.train_step brings them to the device for the update and
      the step's output shardings put them back (config `optimizer.host_state`).
  Returns:
    A TrainState of NamedShardings.
  """
  params = param_shardings(specs, mesh, spread_layers)
  rep = replicated(mesh)

  def param_leaf(leaf, param_sharding):
    if isinstance(leaf, optax.MaskedNode):  # partition() leaves holes for other groups
      return leaf
    s = zero1(param_sharding, leaf.shape) if shard_optimizer else param_sharding
    return s.with_memory_kind("pinned_host") if host_state else s

  opt = optax.tree_utils.tree_map_params(
      tx, param_leaf, abstract_state.opt_state, params, transform_non_params=lambda _: rep,
      is_leaf=lambda x: isinstance(x, optax.MaskedNode))
  return abstract_state._replace(step=rep, params=params, opt_state=opt, nan_streak=rep,
                                 skipped=rep)
