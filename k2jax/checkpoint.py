"""Orbax checkpoints of a training run: train state, data iterator position and metadata.

DIR/checkpoints/<step>/{state, data, meta} via `orbax.checkpoint.CheckpointManager`
(keep-last-K, async). A step directory is committed atomically by orbax (a killed save
leaves only a `*.orbax-checkpoint-tmp` directory, which orbax ignores).

Restoring tells two failures apart. A checkpoint whose saved tree (read from its metadata)
is not the train state this config builds is a mismatch: nothing is moved and
`CheckpointMismatch` names the first difference. A checkpoint that cannot be read (damaged
or partial files) is reported, moved to DIR/corrupt_checkpoints/ so later saves of that step
are not skipped, and the previous step is tried.
"""

import logging
import os
import shutil

import grain
import jax
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)


class CheckpointMismatch(ValueError):
  """A readable checkpoint that holds a different train state than the one being restored."""


def _path_str(path) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def _leaves(tree) -> dict:
  """{path: (shape, dtype)} with NamedTuple fields, dict keys and indices as plain names (the
  form orbax's tree metadata uses)."""
  return {_path_str(p): (tuple(a.shape), str(a.dtype))
          for p, a in jax.tree_util.tree_flatten_with_path(tree)[0]}


def first_difference(saved: dict, expected: dict) -> str | None:
  """A readable description of the first leaf that differs, or None."""
  for key in sorted(set(saved) | set(expected)):
    a, b = saved.get(key), expected.get(key)
    if a != b:
      show = lambda x: "absent" if x is None else f"{x[1]}{list(x[0])}"
      return f"{key}: saved {show(a)}, expected {show(b)}"
  return None


class Checkpointer:

  def __init__(self, workdir: str, keep: int, use_async: bool):
    self.workdir = os.path.abspath(workdir)  # orbax needs absolute paths
    self.directory = os.path.join(self.workdir, "checkpoints")
    self.manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=use_async,
                                             cleanup_tmp_directories=True),
        # Known handlers let item_metadata read a checkpoint's tree before restoring it.
        item_handlers={"state": ocp.StandardCheckpointHandler(),
                       "data": grain.checkpoint.CheckpointHandler(),
                       "meta": ocp.JsonCheckpointHandler()})

  def save(self, step: int, state, data_iter, meta: dict) -> None:
    if step in self.manager.all_steps():
      return
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=grain.checkpoint.CheckpointSave(data_iter),
        meta=ocp.args.JsonSave(meta)), force=True)

  def restore_latest(self, abstract_state, make_iter):
    """-> (state, data iterator, meta) of the newest restorable step, or None if none.

    Raises CheckpointMismatch (touching nothing) when the newest readable checkpoint holds a
    different tree than `abstract_state`.
    """
    expected = _leaves(abstract_state)
    for step in sorted(self.manager.all_steps(), reverse=True):
      try:
        saved = _leaves(self.manager.item_metadata(step)["state"])
      except Exception as e:  # no or damaged metadata: the checkpoint cannot be read
        self._quarantine(step, e)
        continue
      diff = first_difference(saved, expected)
      if diff:
        raise CheckpointMismatch(
            f"checkpoint step {step} in {self.directory} holds a different train state than "
            f"this config and code build ({diff}); resume with the code and config that wrote "
            "it, or use a new --workdir")
      data_iter = make_iter()  # restore moves the iterator in place: a fresh one per attempt
      try:
        r = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state),
            data=grain.checkpoint.CheckpointRestore(data_iter),
            meta=ocp.args.JsonRestore()))
      except Exception as e:  # orbax / tensorstore / json raise many types for damaged files
        self._quarantine(step, e)
        continue
      log.info("resumed from checkpoint step %d in %s", step, self.directory)
      return r.state, r.data, r.meta
    return None

  def _quarantine(self, step: int, error: Exception) -> None:
    reason = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}" if str(error) else \
        type(error).__name__
    dest = os.path.join(self.workdir, "corrupt_checkpoints", str(step))
    log.warning("checkpoint step %d is corrupt or partial (%s); moved to %s, trying the "
                "previous one", step, reason, dest)
    if jax.process_index() == 0:
      os.makedirs(os.path.dirname(dest), exist_ok=True)
      shutil.rmtree(dest, ignore_errors=True)
      shutil.move(os.path.join(self.directory, str(step)), dest)
    self.manager.reload()

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.close()


def load_run(workdir: str):
  """-> (config, params) of the newest readable checkpoint of a k2jax.train run, on this
  process's first device (for sampling and fine-tuning; the optimizer state is discarded).

  Raises ValueError (one line) when the directory holds no run or no checkpoint.
  """
  import functools
  import json

  from k2jax import configs, optim
  from k2jax.step import init_state

  workdir = os.path.abspath(workdir)
  path = os.path.join(workdir, "config.json")
  if not os.path.isfile(path):
    raise ValueError(f"{workdir} has no config.json: pass the --workdir of a k2jax.train run")
  with open(path) as f:
    config = configs.from_dict(json.load(f))
  configs.validate(config)
  directory = os.path.join(workdir, "checkpoints")
  manager = ocp.CheckpointManager(directory, item_handlers={
      "state": ocp.StandardCheckpointHandler()}) if os.path.isdir(directory) else None
  steps = sorted(manager.all_steps(), reverse=True) if manager else []
  if not steps:
    raise ValueError(f"{workdir} has no checkpoint yet: train longer, or with "
                     "train.checkpoint_every > 0")
  tx = optim.optimizer(config)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  abstract = jax.eval_shape(functools.partial(init_state, config, tx), jax.random.key(0))
  abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device),
                          abstract)
  errors = []
  for step in steps:
    try:
      r = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))
    except Exception as e:  # a damaged checkpoint: try the previous one
      errors.append(f"step {step}: {type(e).__name__}")
      continue
    manager.close()
    state = r.state
    params = state.params if hasattr(state, "params") else state["params"]
    log.info("loaded params of %s at step %d", workdir, step)
    return config, params
  manager.close()
  raise ValueError(f"{workdir}: no checkpoint could be read ({'; '.join(errors)})")
