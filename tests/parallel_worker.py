"""Runs in a subprocess whose XLA_FLAGS fix the simulated device count (tests/test_parallel.py).

    python -m tests.parallel_worker meshes OUT D1xE1 D2xE2 -- CLI_ARGS...   train on each mesh
    python -m tests.parallel_worker zero1                                    shard sizes
"""

import functools
import json
import sys

import jax
import numpy as np


def meshes(out, *rest):
  """Train with the k2jax.train command line CLI_ARGS on each mesh spec: DxE (data x
  expert), optionally /bB (train.batch_size B) and /aA (train.grad_accum A)."""
  from k2jax import metrics, train
  sep = rest.index("--")
  specs, cli = rest[:sep], list(rest[sep + 1:])
  base, _ = train.parse(["k2jax.train", *cli, f"--workdir={out}"])
  result = {}
  for s in specs:
    mesh, *opts = s.split("/")
    d, e = map(int, mesh.split("x"))
    config = base.copy_and_resolve_references()
    config.mesh.update(dict(data=d, expert=e))
    for o in opts:
      config.train[{"b": "batch_size", "a": "grad_accum"}[o[0]]] = int(o[1:])
    workdir = f"{out}/{s.replace('/', '_')}"
    train.train(config, workdir)
    result[s] = {r["step"]: [r["loss"], r["max_logit"]] for r in metrics.read(workdir)}
  print("RESULT " + json.dumps(result))


def zero1():
  from k2jax import configs, model, optim, parallel
  from k2jax.step import init_state
  cfg = configs.get_config("tiny")
  cfg.mesh.data = 8
  mesh = parallel.make_mesh(cfg.mesh)
  tx = optim.optimizer(cfg)
  abstract = jax.eval_shape(functools.partial(init_state, cfg, tx), jax.random.key(0))
  sh = parallel.state_shardings(model.param_specs(cfg.model), mesh, abstract, tx)

  def per_device(tree, shardings):
    return sum(int(np.prod(s.shard_shape(a.shape))) * a.dtype.itemsize
               for a, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)))

  def total(tree):
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree))

  print("RESULT " + json.dumps({
      "params_per_device": per_device(abstract.params, sh.params),
      "params_total": total(abstract.params),
      "opt_per_device": per_device(abstract.opt_state, sh.opt_state),
      "opt_total": total(abstract.opt_state),
      "param_specs_mention_data": any("data" in str(s.spec) for s in jax.tree.leaves(sh.params))}))


if __name__ == "__main__":
  {"meshes": meshes, "zero1": zero1}[sys.argv[1]](*sys.argv[2:])
