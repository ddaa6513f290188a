"""What may change between a run and its resumption.

A workdir remembers the config it was trained with (DIR/config.json). Before the trainer
touches any file of an existing run it compares that config with the new one, key by key:

  * changes that cannot resume (the model's shape, the optimizer kind, the tokenizer or data
    source, the seed, the batch geometry) stop the run with one line naming every such key
    with its old -> new value, and leave every file as it was;
  * changes that can resume (steps, logging / eval / checkpoint cadence, mesh layout,
    learning-rate and other optimizer values, computation choices such as remat) resume, and
    the trainer logs them.

The table below is the whole policy: a key is resumable iff a rule says so.
"""

import json
import os

from ml_collections import config_dict

from k2jax.training import runlock

# (group.key prefix, reason it can change). Everything not matched cannot change.
RESUMABLE = (
    ("train.steps", "run length"),
    ("train.log_every", "logging cadence"),
    ("train.eval_every", "eval cadence"),
    ("train.eval_batches", "eval size"),
    ("train.checkpoint_every", "checkpoint cadence"),
    ("train.keep_checkpoints", "checkpoint retention"),
    ("train.async_checkpoint", "checkpoint mode"),
    ("train.max_nan_steps", "divergence guard"),
    ("train.profile", "profiling"),
    ("train.grad_accum", "microbatching (same step, split differently)"),
    ("train.cast_once", "where the weights are cast (same gradients)"),
    ("mesh.", "mesh layout (checkpoints reshard on restore)"),
    ("data.worker_count", "data loading workers"),
    ("model.remat", "recomputation policy"),
    ("model.dtype", "compute dtype"),
    ("model.moe_impl", "MoE implementation"),
    ("model.ep_transport", "expert-parallel transport"),
    ("model.ep_round_load", "expert exchange's round size (same values)"),
    ("model.attention_impl", "attention implementation"),
    ("model.activation_storage", "activation storage"),
    ("model.offload", "activation offload"),
    ("model.bias_update_speed", "router-bias speed"),
    ("optimizer.learning_rate", "learning rate"),
    ("optimizer.end_learning_rate", "learning rate"),
    ("optimizer.warmup_steps", "learning-rate schedule"),
    ("optimizer.decay_steps", "learning-rate schedule"),
    ("optimizer.weight_decay", "optimizer value"),
    ("optimizer.tau", "QK-Clip threshold"),
    ("optimizer.momentum", "optimizer value"),
    ("optimizer.nesterov", "optimizer value"),
    ("optimizer.rms_scale", "optimizer value"),
    ("optimizer.ns_steps", "optimizer value"),
    ("optimizer.ns_dtype", "optimizer value"),
    ("optimizer.adam_", "optimizer value"),
    ("optimizer.grad_clip_norm", "gradient clipping value"),
    ("optimizer.host_state", "where optimizer states live (host or device memory)"),
    ("rl.iterations", "run length"),
    ("rl.checkpoint_every", "checkpoint cadence"),
    ("rl.sandbox", "code sandbox isolation"),
    ("rl.eval_every", "evaluation cadence"),
    ("rl.eval_tasks", "evaluation set size"),
    ("rl.samples_every", "sample log cadence"),
    ("rl.kl_to_init", "KL logging"),
    ("rl.inference_mesh.", "sampler layout (weights are resharded to it every iteration)"),
)


def flatten(config) -> dict:
  """{"group.key.sub": value} of a ConfigDict or the dict read from config.json, with values
  normalised through JSON so a saved and a live config compare equal."""
  d = config.to_dict() if isinstance(config, config_dict.ConfigDict) else config
  d = json.loads(json.dumps(d, default=str))
  out = {}

  def walk(prefix, node):
    if isinstance(node, dict):
      for k, v in node.items():
        walk(f"{prefix}.{k}" if prefix else k, v)
    else:
      out[prefix] = node
  walk("", d)
  return out


def can_resume(key: str, old, new) -> bool:
  if key == "optimizer.grad_clip_norm" and ((old or 0) > 0) != ((new or 0) > 0):
    return False  # switching clipping on or off changes the optimizer state's structure
  return any(key == p or (p.endswith((".", "_")) and key.startswith(p)) for p, _ in RESUMABLE)


def saved_config(workdir: str) -> dict | None:
  """The flattened config of the run in `workdir`, or None if there is none (a new run)."""
  path = os.path.join(workdir, "config.json")
  if not os.path.isfile(path):
    return None
  try:
    with open(path) as f:
      return flatten(json.load(f))
  except (OSError, ValueError) as e:
    raise ValueError(f"{path} cannot be read ({e}); it records the run's config: restore it, "
                     "or use a new --workdir") from None


# What our runs write before config.json (train, sft and rl take the lock and open the log
# first), and train._writable_workdir's probe if a kill left it: a workdir holding only
# these is a run that stopped before it began, and starts afresh.
_OWN_BEFORE_CONFIG = (runlock.NAME, "train.log")
_PROBE = ".k2jax-write-test-"


def foreign_entries(workdir: str) -> list[str]:
  """The names in `workdir` that no run of ours writes before its config.json (sorted);
  empty for a missing or empty workdir."""
  try:
    names = os.listdir(workdir)
  except FileNotFoundError:
    return []
  return sorted(n for n in names if n not in _OWN_BEFORE_CONFIG and not n.startswith(_PROBE))


def compare(saved: dict | None, config) -> tuple[list[str], list[str]]:
  """-> (resumable changes, blocking changes), each as "key: old -> new" strings."""
  if saved is None:
    return [], []
  new = flatten(config)
  resumable, blocking = [], []
  for key in sorted(set(saved) | set(new)):
    old_v, new_v = saved.get(key, "<absent>"), new.get(key, "<absent>")
    if old_v == new_v:
      continue
    change = f"{key}: {old_v!r} -> {new_v!r}"
    (resumable if can_resume(key, old_v, new_v) else blocking).append(change)
  return resumable, blocking


def kind(flat: dict) -> str:
  """What trained a flattened config: RL runs have an `rl` group, the trainer's runs
  (pre-training and SFT) do not."""
  return "rl" if any(k.startswith("rl.") for k in flat) else "train"


_KINDS = {"rl": "an RL run (k2jax.rl)", "train": "a training run (k2jax.train / k2jax.sft)"}


def check(workdir: str, config) -> list[str]:
  """The resumable changes of `config` against the run in `workdir` (empty for a new run:
  a missing or empty workdir, or one holding only what a run writes before config.json).

  Raises ValueError (one line) naming every change that cannot resume, saying the workdir
  holds files but no config.json (not a run of ours), or saying it holds another kind of
  run (an RL run's checkpoints hold trajectories a trainer cannot read, and the other way
  round): a run is never written into by another kind.
  """
  saved = saved_config(workdir)
  if saved is None:
    # Files but no config.json: not ours (or its config.json was lost). Treated as a new run
    # it got our config.json, log and lock, then failed reading its checkpoints/ as ours.
    others = foreign_entries(workdir)
    if others:
      shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
      raise ValueError(f"{workdir} is not a k2jax run: it holds {shown} but no config.json; "
                       "nothing was written to it: choose an empty directory, or the run's "
                       "own --workdir")
  if saved is not None and kind(saved) != kind(flatten(config)):
    raise ValueError(f"{workdir} holds {_KINDS[kind(saved)]}, not {_KINDS[kind(flatten(config))]}"
                     "; nothing was written to it: choose a new --workdir (its checkpoints can "
                     "start the new run through --init)")
  resumable, blocking = compare(saved, config)
  if blocking:
    raise ValueError(f"{workdir} holds a run whose config differs in what a resumed run cannot "
                     f"change: {'; '.join(blocking)}. Rerun with the original values, or use a "
                     "new --workdir")
  return resumable
