"""Shardings of the whole training state: ZeRO-1 (report 2.4.2).

Parameters follow the logical-axis rules (replicated over `data`). Optimizer-state leaves
that mirror a parameter (Muon momentum, Adam moments, fp32 master weights; optax identifies
them for us with `optax.tree_utils.tree_map_params`) take that parameter's sharding and are
additionally split over the mesh axes of the logical `opt_state` axis
(k2jax.configs.sharding_rules: `data`) on a dimension they divide (`sharding_rules.spread`:
preferring an unsharded one, compounding an existing split where needed, e.g. K2's 384
experts over expert = 16 x data = 24); everything else (counts, flags) is replicated.
`k2jax.plan` reports any state `data` cannot split.

Muon needs whole matrices, so the state of a Muon matrix stack (momentum, master weights)
takes `data` on its `layers` / `experts` dimensions where data divides this device's slice of
them (sharding_rules.opt_state_spec): each data rank then holds whole matrices, orthogonalizes
exactly those (k2jax.optim.muon.on_local_matrices) and keeps their new momentum, with no
momentum exchanged; only the updates are gathered over data. Where data divides no such
dimension, the state is split like any other and the update gathers each matrix first.
"""

import jax
import optax
from jax.sharding import NamedSharding

from k2jax.configs.sharding_rules import opt_state_spec
from k2jax.model import spec
from k2jax.parallel.mesh import param_shardings, replicated


def zero1(sharding: NamedSharding, shape, batch: int = 0) -> NamedSharding:
  """`sharding` with the ZeRO-1 mesh axes added on the largest free divisible dimension, or,
  for the state of a Muon matrix with `batch` leading layers / experts dimensions, on those
  where they divide (sharding_rules.opt_state_spec)."""
  return NamedSharding(sharding.mesh, opt_state_spec(sharding.spec, shape, sharding.mesh.shape,
                                                     batch))


def grad_shardings(specs, mesh, abstract_params, spread_layers: bool = False):
  """Where each parameter's gradient goes for the update: the parameter's sharding split
  over the ZeRO-1 axes like the optimizer states that mirror it (`zero1`). Constrained to
  these, the step's gradient sums are reduce-scattered over `data` rather than all-reduced
  (report 2.4.2: each data rank updates its own slice): half the bytes on the wire, and
  each device holds 1 / data of the reduced gradients, not all of them (at K2 an expert
  stack's whole float32 sums would otherwise sit beside the sums themselves).
  Args as `state_shardings`; abstract_params: the parameters' ShapeDtypeStructs."""
  params = param_shardings(specs, mesh, spread_layers)
  batch = jax.tree.map(spec.muon_batch, specs, is_leaf=spec.is_spec)
  return jax.tree.map(lambda s, a, nb: zero1(s, a.shape, nb), params, abstract_params, batch)


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
      `pinned_host`); k2jax.training.step.train_step brings them to the device for the update and
      the step's output shardings put them back (config `optimizer.host_state`).
  Returns:
    A TrainState of NamedShardings.
  """
  params = param_shardings(specs, mesh, spread_layers)
  batch = jax.tree.map(spec.muon_batch, specs, is_leaf=spec.is_spec)
  rep = replicated(mesh)

  def param_leaf(leaf, param_sharding, nb):
    if isinstance(leaf, optax.MaskedNode):  # partition() leaves holes for other groups
      return leaf
    s = zero1(param_sharding, leaf.shape, nb) if shard_optimizer else param_sharding
    return s.with_memory_kind("pinned_host") if host_state else s

  opt = optax.tree_utils.tree_map_params(
      tx, param_leaf, abstract_state.opt_state, params, batch,
      transform_non_params=lambda _: rep, is_leaf=lambda x: isinstance(x, optax.MaskedNode))
  return abstract_state._replace(step=rep, params=params, opt_state=opt, nan_streak=rep,
                                 skipped=rep)
