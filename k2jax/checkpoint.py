"""Orbax checkpoints of a training run: train state, data iterator position and metadata.

DIR/checkpoints/<step>/{state, data, meta} via `orbax.checkpoint.CheckpointManager`
(keep-last-K, async). A step directory is committed atomically by orbax (a killed save
leaves only a `*.orbax-checkpoint-tmp` directory, which orbax ignores). A committed step
that fails to restore (damaged files) is reported, moved to DIR/corrupt_checkpoints/ so
later saves of that step are not skipped, and the previous step is tried.
"""

import logging
import os
import shutil

import grain
import jax
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)


class Checkpointer:

  def __init__(self, workdir: str, keep: int, use_async: bool):
    self.workdir = os.path.abspath(workdir)  # orbax needs absolute paths
    self.directory = os.path.join(self.workdir, "checkpoints")
    self.manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=use_async,
                                             cleanup_tmp_directories=True))

  def save(self, step: int, state, data_iter, meta: dict) -> None:
    if step in self.manager.all_steps():
      return
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=grain.checkpoint.CheckpointSave(data_iter),
        meta=ocp.args.JsonSave(meta)), force=True)

  def restore_latest(self, abstract_state, make_iter):
    """-> (state, data iterator, meta) of the newest restorable step, or None if none."""
    for step in sorted(self.manager.all_steps(), reverse=True):
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
