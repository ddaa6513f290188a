"""Shardings of the whole training state (params, optimizer state, counters).

Optimizer-state leaves that mirror a parameter (Muon momentum, Adam moments) take that
parameter's sharding; everything else (step counts, schedules) is replicated.
"""

import jax

from k2jax.parallel.mesh import param_shardings, replicated


def _key_path(path):
  return tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))


def state_shardings(config, mesh, abstract_state):
  params = param_shardings(config.model, mesh)
  by_path = {_key_path(p): s for p, s in jax.tree_util.tree_flatten_with_path(params)[0]}
  shapes = {_key_path(p): a.shape
            for p, a in jax.tree_util.tree_flatten_with_path(abstract_state.params)[0]}

  def opt_leaf(path, leaf):
    keys = _key_path(path)
    for start in range(len(keys)):  # the longest dict-key suffix naming a parameter
      if keys[start:] in by_path and shapes[keys[start:]] == leaf.shape:
        return by_path[keys[start:]]
    return replicated(mesh)

  opt = jax.tree_util.tree_map_with_path(opt_leaf, abstract_state.opt_state)
  rep = replicated(mesh)
  return abstract_state._replace(step=rep, params=params, opt_state=opt, nan_streak=rep,
                                 skipped=rep)
