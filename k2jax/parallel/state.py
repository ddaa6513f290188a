"""Shardings of the whole training state: ZeRO-1 (report 2.4.2).

Parameters follow the logical-axis rules (replicated over `data`). Optimizer-state leaves
that mirror a parameter (Muon momentum, Adam moments) take that parameter's sharding and
are additionally split over `data` along their largest dimension that is still unsharded
and divisible by the data-axis size; everything else (counts, flags) is replicated.

Muon needs whole matrices: under jit the momentum shard of each data rank is gathered where
Newton-Schulz needs it, the orthogonalized update is formed on the full matrix, and each
rank keeps its shard of the new momentum (GSPMD inserts the all-gather from these
shardings; experiments/bench_parallel.py measures what it costs).
"""

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from k2jax.parallel.mesh import param_shardings, replicated


def _key_path(path):
  return tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))


def zero1(sharding: NamedSharding, shape) -> NamedSharding:
  """`sharding` with the `data` mesh axis added on the largest free divisible dimension."""
  mesh = sharding.mesh
  n = mesh.shape.get("data", 1)
  spec = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
  used = {a for s in spec if s is not None for a in ((s,) if isinstance(s, str) else s)}
  if n == 1 or "data" in used:
    return sharding
  free = [d for d in range(len(shape)) if spec[d] is None and shape[d] % n == 0]
  if not free:
    return sharding
  dim = max(free, key=lambda d: shape[d])
  spec[dim] = "data"
  return NamedSharding(mesh, P(*spec))


def state_shardings(specs, mesh, abstract_state, shard_optimizer: bool = True):
  """specs: the parameter table (`k2jax.model.param_specs(cfg)`); abstract_state: a TrainState
  of ShapeDtypeStructs. Returns a TrainState of NamedShardings. shard_optimizer=False keeps
  optimizer state sharded like the params (plain data parallelism, for comparison)."""
  params = param_shardings(specs, mesh)
  by_path = {_key_path(p): s for p, s in jax.tree_util.tree_flatten_with_path(params)[0]}
  shapes = {_key_path(p): a.shape
            for p, a in jax.tree_util.tree_flatten_with_path(abstract_state.params)[0]}

  def opt_leaf(path, leaf):
    keys = _key_path(path)
    for start in range(len(keys)):  # the longest dict-key suffix naming a parameter
      if keys[start:] in by_path and shapes[keys[start:]] == leaf.shape:
        param = by_path[keys[start:]]
        return zero1(param, leaf.shape) if shard_optimizer else param
    return replicated(mesh)

  opt = jax.tree_util.tree_map_with_path(opt_leaf, abstract_state.opt_state)
  rep = replicated(mesh)
  return abstract_state._replace(step=rep, params=params, opt_state=opt, nan_streak=rep,
                                 skipped=rep)
