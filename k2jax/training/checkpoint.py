"""Orbax checkpoints of a training run: train state, data iterator position and metadata.

DIR/checkpoints/<step>/{state, data, meta} via `orbax.checkpoint.CheckpointManager`
(keep-last-K, async). A step directory is committed atomically by orbax (a killed save
leaves only a `*.orbax-checkpoint-tmp` directory, which orbax ignores). Once a step is
committed, k2jax adds `k2jax_files.json` to it: the size of every file orbax wrote, the
integrity record restore checks against.

Restoring a run has to tell apart what a checkpoint IS from what its reader hit, because
moving a good checkpoint aside silently restarts the run from an older step (or step 0):

  * a readable checkpoint of another train state is a mismatch: nothing is moved,
    `CheckpointMismatch` names the first differing leaf;
  * a checkpoint that fails the integrity record (a file missing, truncated or grown, the
    record itself unreadable) is provably damaged: it is moved to DIR/corrupt_checkpoints/
    (never over an earlier quarantine) and the previous step is tried;
  * any other failure (a transient I/O error, permissions, an orbax error on intact files)
    is retried with backoff; if it persists nothing is moved and `CheckpointUnreadable` says
    what failed and what to do;
  * a run whose every checkpoint was moved aside stops (`CheckpointUnreadable`) instead of
    starting again from step 0 over its own history.

In a multi-host run every process reaches the same verdict on each step (they agree before
acting), so all restore the same step. A failed save (full disk, read-only directory) is
`CheckpointWriteFailed`, one line naming the path, the space it needs and the last good
step; orbax only deletes old steps after a new one commits, so that step is intact.
"""

import errno
import json
import logging
import os
import shutil
import time

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)

MANIFEST = "k2jax_files.json"
# GB a process reads ahead of its devices when restoring weights: a bound on host memory
# (orbax's own default, 96, would let a host of a large slice stage its whole share)
RESTORE_GB = 4


class CheckpointError(Exception):
  """A checkpoint problem the user must act on; the message is one line."""


class CheckpointMismatch(CheckpointError, ValueError):
  """A readable checkpoint that holds a different train state than the one being restored."""


class CheckpointUnreadable(CheckpointError):
  """No checkpoint can be restored, and starting over would discard the run's history."""


class CheckpointWriteFailed(CheckpointError):
  """A save failed (a full disk, a read-only directory); earlier checkpoints are intact."""


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


def _file_sizes(directory: str) -> dict:
  sizes = {}
  for root, _, files in os.walk(directory):
    for f in files:
      path = os.path.join(root, f)
      rel = os.path.relpath(path, directory)
      if not rel.startswith(MANIFEST):
        sizes[rel] = os.path.getsize(path)
  return sizes


def seal(step_dir: str) -> None:
  """Writes the integrity record of a committed step (atomically: a torn record would read
  as damage)."""
  record = {"files": _file_sizes(step_dir)}
  tmp = os.path.join(step_dir, MANIFEST + ".tmp")
  with open(tmp, "w") as f:
    json.dump(record, f)
  os.replace(tmp, os.path.join(step_dir, MANIFEST))


def damage(step_dir: str) -> str | None:
  """What proves a step damaged, or None: its files differ from the integrity record. A
  step without a record (written before k2jax kept one, or killed between orbax's commit and
  the record) cannot be proven damaged."""
  path = os.path.join(step_dir, MANIFEST)
  if not os.path.exists(path):
    return None
  try:
    with open(path) as f:
      want = json.load(f)["files"]
  except (ValueError, KeyError, TypeError) as e:
    return f"its integrity record {MANIFEST} is unreadable ({type(e).__name__})"
  for rel, size in sorted(want.items()):
    full = os.path.join(step_dir, rel)
    if not os.path.exists(full):
      return f"{rel} is missing"
    got = os.path.getsize(full)
    if got != size:
      return f"{rel} has {got} bytes, {size} were written"
  return None


def _reason(error: BaseException) -> str:
  text = str(error).strip()
  return f"{type(error).__name__}: {text.splitlines()[0][:200]}" if text else \
      type(error).__name__


def _size(n: int) -> str:
  return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _errors(error: BaseException):
  """The error and every error it was raised from (orbax wraps the OSError that failed)."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    yield error
    error = error.__cause__ or error.__context__


def _is_disk_full(error: BaseException) -> bool:
  return any(getattr(e, "errno", None) == errno.ENOSPC or "No space left on device" in str(e)
             for e in _errors(error))


def _any_process(flag: bool) -> bool:
  """True on every process if `flag` is true on any (one verdict per step for all hosts)."""
  if jax.process_count() == 1:
    return flag
  from jax.experimental import multihost_utils
  return bool(np.any(multihost_utils.process_allgather(np.asarray(flag))))


class Checkpointer:
  """Saves and restores a run's checkpoints (see the module docstring for the policy).

  Args:
    workdir: the run directory; checkpoints go to workdir/checkpoints.
    keep: how many of the newest steps to keep.
    use_async: save in the background (orbax async checkpointing).
    attempts: how often a failed restore is tried (a transient storage error must not cost
      the checkpoint).
    backoff_s: the wait before the second try, doubled before each later one.
  """

  def __init__(self, workdir: str, keep: int, use_async: bool, attempts: int = 3,
               backoff_s: float = 1.0):
    self.workdir = os.path.abspath(workdir)  # orbax needs absolute paths
    self.directory = os.path.join(self.workdir, "checkpoints")
    self.quarantine_dir = os.path.join(self.workdir, "corrupt_checkpoints")
    self.attempts, self.backoff_s = max(1, attempts), backoff_s
    self.manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=use_async,
                                             cleanup_tmp_directories=True),
        # Known handlers let item_metadata read a checkpoint's tree before restoring it.
        item_handlers={"state": ocp.StandardCheckpointHandler(),
                       "data": grain.checkpoint.CheckpointHandler(),
                       "meta": ocp.JsonCheckpointHandler()})
    self._pending = None  # (step, bytes) of the save in flight

  def save(self, step: int, state, data_iter, meta: dict) -> None:
    """Starts saving `step` (finishing and sealing the previous save first).

    Raises CheckpointWriteFailed (one line) if this or the previous save failed.
    """
    if step in self.manager.all_steps():
      return
    self._finish()
    self._pending = (step, sum(int(a.nbytes) for a in jax.tree.leaves(state)))
    try:
      self.manager.save(step, args=ocp.args.Composite(
          state=ocp.args.StandardSave(state),
          data=grain.checkpoint.CheckpointSave(data_iter),
          meta=ocp.args.JsonSave(meta)), force=True)
    except Exception as e:  # orbax raises its own wrappers around the OSError
      self._failed(e)
    if not self.manager.is_saving_in_progress():
      self._finish()

  def _finish(self) -> None:
    """Waits for the save in flight and writes its integrity record."""
    if self._pending is None:
      return
    try:
      self.manager.wait_until_finished()
      step_dir = os.path.join(self.directory, str(self._pending[0]))
      if jax.process_index() == 0 and os.path.isdir(step_dir):
        seal(step_dir)
    except Exception as e:
      self._failed(e)
    self._pending = None

  def _failed(self, error: Exception):
    """Raises CheckpointWriteFailed for the save in flight."""
    step, nbytes = self._pending
    self._pending = None
    self.manager.reload()
    done = [s for s in self.manager.all_steps() if s != step]
    last = f"step {max(done)} is the last good checkpoint" if done else "no checkpoint was saved"
    if _is_disk_full(error):
      free = shutil.disk_usage(self.directory).free if os.path.isdir(self.directory) else 0
      raise CheckpointWriteFailed(
          f"no space left on the device of {self.directory} while saving step {step}: it needs "
          f"about {_size(nbytes)}, {_size(free)} are free; free space (or lower "
          f"train.keep_checkpoints) and rerun to resume; {last}") from None
    raise CheckpointWriteFailed(
        f"saving checkpoint step {step} to {self.directory} failed ({_reason(error)}); make "
        f"the directory writable and rerun to resume; {last}") from None

  def restore_latest(self, abstract_state, make_iter):
    """-> (state, data iterator, meta) of the newest restorable step, or None if the run has
    no checkpoint.

    Raises CheckpointMismatch (touching nothing) when the newest readable checkpoint holds a
    different tree than `abstract_state`, CheckpointUnreadable when a step fails without
    being provably damaged (nothing moved) or when every step was damaged.
    """
    expected = _leaves(abstract_state)
    moved = []
    for step in sorted(self.manager.all_steps(), reverse=True):
      if self._moved_if_damaged(step, moved):
        continue
      error = None
      for attempt in range(self.attempts):
        if attempt:
          time.sleep(self.backoff_s * 2 ** (attempt - 1))
          self.manager.reload()
        try:
          r = self._read(step, expected, abstract_state, make_iter)
          error = None
          break
        except CheckpointMismatch:
          raise
        except Exception as e:  # orbax / tensorstore / json raise many types
          error = e
          log.warning("reading checkpoint step %d failed (%s), attempt %d of %d", step,
                      _reason(e), attempt + 1, self.attempts)
      if not _any_process(error is not None):
        log.info("resumed from checkpoint step %d in %s", step, self.directory)
        return r.state, r.data, r.meta
      if self._moved_if_damaged(step, moved):   # a file may have gone while we tried
        continue
      why = _reason(error) if error is not None else "it failed on another process"
      raise CheckpointUnreadable(
          f"checkpoint step {step} in {self.directory} could not be read in {self.attempts} "
          f"attempts ({why}), but no file of it is missing or truncated, so nothing was "
          f"moved: fix the cause (permissions, storage) and rerun to resume, or move "
          f"{os.path.join(self.directory, str(step))} aside to resume from the step before it")
    if moved or self._quarantined():
      raise CheckpointUnreadable(
          f"no checkpoint of the run in {self.workdir} is left to resume from: the damaged "
          f"ones are in {self.quarantine_dir}; to train from step 0 use a new --workdir, or "
          f"move that directory and metrics.jsonl away")
    return None

  def _read(self, step, expected, abstract_state, make_iter):
    """Restores `step`; CheckpointMismatch if its saved tree is not `expected`."""
    saved = _leaves(self.manager.item_metadata(step)["state"])
    if saved and all(k.startswith("params/") for k in saved):
      raise CheckpointMismatch(
          f"checkpoint step {step} in {self.directory} holds weights only (k2jax.convert), "
          f"no train state to resume: start from it with --init {self.workdir} and a new "
          "--workdir")
    diff = first_difference(saved, expected)
    if diff:
      raise CheckpointMismatch(
          f"checkpoint step {step} in {self.directory} holds a different train state than "
          f"this config and code build ({diff}); resume with the code and config that wrote "
          "it, or use a new --workdir")
    return self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state),
        # restore moves the iterator in place: a fresh one per attempt
        data=grain.checkpoint.CheckpointRestore(make_iter()),
        meta=ocp.args.JsonRestore()))

  def _moved_if_damaged(self, step: int, moved: list) -> bool:
    """Quarantines `step` (appending where to `moved`) if any process finds it damaged."""
    bad = damage(os.path.join(self.directory, str(step)))
    if not _any_process(bad is not None):
      return False
    moved.append(self._quarantine(step, bad or "damaged as seen by another process"))
    return True

  def _quarantined(self) -> bool:
    return os.path.isdir(self.quarantine_dir) and bool(os.listdir(self.quarantine_dir))

  def _quarantine(self, step: int, reason: str) -> str:
    """Moves a damaged step to corrupt_checkpoints/<step>[.n], keeping earlier quarantines."""
    dest = os.path.join(self.quarantine_dir, str(step))
    n = 0
    while os.path.exists(dest):
      n += 1
      dest = os.path.join(self.quarantine_dir, f"{step}.{n}")
    log.warning("checkpoint step %d is damaged (%s); moved to %s, trying the previous one",
                step, reason, dest)
    if jax.process_index() == 0:
      os.makedirs(self.quarantine_dir, exist_ok=True)
      shutil.move(os.path.join(self.directory, str(step)), dest)
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils
      multihost_utils.sync_global_devices(f"k2jax quarantine {step}")
    self.manager.reload()
    return dest

  def wait(self) -> None:
    """Finishes the save in flight; raises CheckpointWriteFailed if it failed."""
    self._finish()

  def close(self) -> None:
    self.manager.close()


def run_config(workdir: str):
  """The full config of a k2jax.train / sft / rl run directory (its config.json), validated.
  ValueError (one line) when the directory holds no run."""
  from k2jax import configs
  workdir = os.path.abspath(workdir)
  path = os.path.join(workdir, "config.json")
  if not os.path.isfile(path):
    raise ValueError(f"{workdir} has no config.json: pass the --workdir of a k2jax.train run")
  try:
    with open(path) as f:
      config = configs.from_dict(json.load(f))
  except ValueError as e:   # empty or cut short: name the file, not just the parser's words
    raise ValueError(f"{path} is not a readable run config ({type(e).__name__}: "
                     f"{str(e).splitlines()[0] if str(e) else 'empty'}); restore it from "
                     "a copy, or train a new run") from None
  configs.validate(config)
  return config


def _restore(workdir: str, item: dict, shardings: dict):
  """-> (restored {name: tree}, step): the newest checkpoint of the run in `workdir` that
  restores, reading only the subtrees of its train state that `item` names (abstract trees
  of ShapeDtypeStructs: {"params": ...} reads no optimizer state) straight into `shardings`
  (the same keys: trees of Shardings), each process reading its shards' chunks only."""
  workdir = os.path.abspath(workdir)
  directory = os.path.join(workdir, "checkpoints")
  steps = []
  if os.path.isdir(directory):
    with ocp.CheckpointManager(directory) as manager:
      steps = sorted(manager.all_steps(), reverse=True)
  if not steps:
    raise ValueError(f"{workdir} has no checkpoint yet: train longer, or with "
                     "train.checkpoint_every > 0")
  restore_args = {k: jax.tree.map(lambda a, s: ocp.ArrayRestoreArgs(sharding=s, dtype=a.dtype),
                                  item[k], shardings[k]) for k in item}
  errors = []
  handler = ocp.PyTreeCheckpointHandler(restore_concurrent_gb=RESTORE_GB)
  with ocp.Checkpointer(handler) as checkpointer:
    for step in steps:
      try:
        got = checkpointer.restore(os.path.join(directory, str(step), "state"),
                                   args=ocp.args.PyTreeRestore(item=item,
                                                               restore_args=restore_args,
                                                               partial_restore=True))
      except Exception as e:  # a damaged checkpoint: try the previous one
        errors.append(f"step {step}: {_reason(e)}")
        continue
      return got, step
  raise ValueError(f"{workdir}: no checkpoint could be read ({'; '.join(errors)})")


def load_run(workdir: str, shardings=None, param_dtype=None):
  """-> (config, params) of the newest readable checkpoint of a k2jax.train / sft / rl run,
  restored straight into `shardings` (a params tree of Shardings; default: this process's
  first device, for models that fit one) in the logical layout checkpoints keep. Only the
  params are read: not the optimizer state, whatever its size. param_dtype: the dtype to
  restore them in (default: the run's model.param_dtype); config.model says the one used.

  Raises ValueError (one line) when the directory holds no run or no checkpoint.
  """
  import functools

  from k2jax import model
  config = run_config(workdir)
  if param_dtype is not None:
    config.model.param_dtype = np.dtype(param_dtype).name
  abstract = jax.eval_shape(functools.partial(model.init, config.model), jax.random.key(0))
  if shardings is None:
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = jax.tree.map(lambda _: one, abstract)
  got, step = _restore(workdir, {"params": abstract}, {"params": shardings})
  log.info("loaded params of %s at step %d", os.path.abspath(workdir), step)
  return config, got["params"]


def load_state(workdir: str, shardings=None):
  """-> (config, whole train state, step) of the newest readable checkpoint of a k2jax.train
  run, in the logical layout, on this process's first device unless `shardings` (a
  TrainState of Shardings) says where. For comparing runs at small size (tests): a large
  run's state is many times its params. ValueError as `load_run`."""
  import functools

  from k2jax import optim
  from k2jax.training.step import TrainState, init_state

  config = run_config(workdir)
  abstract = jax.eval_shape(functools.partial(init_state, config, optim.optimizer(config)),
                            jax.random.key(0))
  if shardings is None:
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = jax.tree.map(lambda _: one, abstract)
  item = dict(abstract._asdict())
  got, step = _restore(workdir, item, dict(shardings._asdict()))
  return config, TrainState(**got), step
