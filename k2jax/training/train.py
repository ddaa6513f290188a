"""Pre-training with MuonClip: `python -m k2jax.train --config CONFIG --workdir DIR`.

    python -m k2jax.train --config k2jax/configs/tiny.py --workdir runs/tiny \
        --config.train.steps=300 --config.optimizer.tau=30

CONFIG is a config file or a preset name (k2jax.configs.PRESETS). Writes
DIR/metrics.jsonl, TensorBoard events under DIR/tensorboard, orbax checkpoints under
DIR/checkpoints and DIR/train.log. Running the same command again resumes from the newest
good checkpoint (data position included) and reproduces the uninterrupted run exactly on
CPU. SIGTERM / SIGINT save a checkpoint and exit. Mistakes in the command line or config
end in one line naming the problem and exit code 2.
"""

import contextlib
import errno
import functools
import itertools
import logging
import os
import shutil
import signal
import sys
import time
from collections.abc import Sequence

import jax
import numpy as np
from absl import flags
from jax.experimental import multihost_utils
from ml_collections import config_flags
from tqdm import tqdm

from k2jax import configs, data as data_lib, kernels, model, optim
from k2jax.training import metrics as metrics_lib
from k2jax import parallel
from k2jax.training import resume, runlock
from k2jax.training.console import quiet_libraries
from k2jax.training.checkpoint import CheckpointError, Checkpointer
from k2jax.training.metrics import MetricsWriter
from k2jax.parallel import layout, pipeline, schedules
from k2jax.training import step as step_lib
from k2jax.training.step import TrainState, eval_step, fresh_state, init_state

log = logging.getLogger("k2jax.train")

_CONFIG = config_flags.DEFINE_config_file("config", None, "config file or preset name")
_WORKDIR = flags.DEFINE_string("workdir", None, "directory for checkpoints and metrics")
_DISTRIBUTED = flags.DEFINE_bool(
    "distributed", False, "call jax.distributed.initialize() with cluster auto-detection "
    "(TPU VM slices, SLURM, Open MPI); implied by --coordinator_address")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None,
                                   "host:port of process 0, for multi-process runs")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "processes in the run")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "this process's index")
_CACHE = flags.DEFINE_string(
    "compilation_cache", os.path.join(os.path.expanduser("~"), ".cache", "k2jax", "xla"),
    "directory of JAX's persistent compilation cache (resumed and repeated runs skip "
    "recompiling); empty to disable. JAX_COMPILATION_CACHE_DIR takes precedence")
_HEARTBEAT = flags.DEFINE_integer(
    "heartbeat_timeout", 60, "seconds without a heartbeat after which the other processes "
    "of a multi-process run give up (a dead peer then ends the run instead of hanging it)")


class UserError(ValueError):
  """A mistake in the command line, config or input files: one line, exit code 2."""


class TrainingDiverged(RuntimeError):
  pass


class _StopFlag:
  """Set by SIGTERM / SIGINT; the loop saves a checkpoint after the current step and exits.

  With several processes the checkpoint is written collectively, so they must stop at the
  same step: they compare flags at log steps (a tiny all-gather), and stop when any was set.
  """

  def __init__(self):
    self.signum = None

  def __call__(self, signum, frame):
    self.signum = signum

  def agreed(self, log_step: bool):
    if jax.process_count() == 1:
      return self.signum
    if not log_step:
      return None
    flags_seen = multihost_utils.process_allgather(np.int32(self.signum or 0))
    return int(np.max(flags_seen)) or None


def _writable_workdir(workdir: str) -> str:
  """The absolute workdir, created if needed; UserError if it cannot hold a run."""
  workdir = os.path.abspath(workdir)
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise UserError(f"--workdir {workdir} is a file, not a directory: choose a directory")
  try:
    os.makedirs(workdir, exist_ok=True)
    probe = os.path.join(workdir, f".k2jax-write-test-{os.getpid()}")
    with open(probe, "w"):
      pass
    os.remove(probe)
  except OSError as e:
    raise UserError(f"--workdir {workdir} is not a writable directory ({e.strerror or e}): "
                    "choose a directory you can write to") from None
  return workdir


def _setup_logging(workdir):
  root = logging.getLogger()
  root.setLevel(logging.INFO)
  for h in list(root.handlers):  # an imported library may have called basicConfig
    root.removeHandler(h)
  fmt = "%(asctime)s %(levelname)s %(name)s: %(message)s"
  console = logging.StreamHandler(sys.stderr)
  console.setFormatter(_ConsoleFormatter(fmt, "%H:%M:%S"))
  console.addFilter(_OncePerLibraryLine())
  log_file = _LogFile(os.path.join(workdir, "train.log"))
  log_file.setFormatter(logging.Formatter(fmt, "%H:%M:%S"))
  for h in (console, log_file):
    root.addHandler(h)
  quiet_libraries()
  _quiet_closed_event_loops()


class _LogFile(logging.FileHandler):
  """train.log, which gives up quietly when its disk is full: logging's default prints a
  "--- Logging error ---" traceback to the console for every record it cannot write, burying
  the one line that says the disk is full (the console still has every record)."""

  def handleError(self, record):
    e = sys.exc_info()[1]
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
      return
    super().handleError(record)


class _ConsoleFormatter(logging.Formatter):
  """On the console, a library's error is its first line; train.log keeps the traceback.

  A failed orbax save (a full disk) logs the same error from four threads with ~100-line
  tracebacks each; the user needs the one line k2jax prints after them, which says what to
  do. Our own records are formatted in full."""

  def format(self, record):
    message = record.getMessage()
    if record.name.startswith("k2jax") or not (record.exc_info or "\n" in message):
      return super().format(record)
    return (f"{self.formatTime(record, self.datefmt)} {record.levelname} {record.name}: "
            f"{message.splitlines()[0][:300]} (traceback in train.log)")


class _OncePerLibraryLine(logging.Filter):
  """On the console, a library's warning or error whose first line was already shown is not
  shown again; train.log keeps every record. After a failed orbax save (a full disk) asyncio
  logs "_GatheringFuture exception was never retrieved" once per pending write: 35 identical
  lines under the one k2jax prints, in one run on a 24 MB tmpfs."""

  def __init__(self):
    super().__init__()
    self.shown = set()

  def filter(self, record):
    if record.name.startswith("k2jax") or record.levelno < logging.WARNING:
      return True
    key = (record.name, (record.getMessage().splitlines() or [""])[0])
    if key in self.shown:
      return False
    self.shown.add(key)
    return True


def _quiet_closed_event_loops():
  """Drops the 'Event loop is closed' tracebacks tensorstore's write callbacks print after
  orbax has closed the event loop of a save that failed (dozens, one per pending write);
  the save's own error is reported. Anything else goes to the previous hook."""
  if getattr(sys.unraisablehook, "k2jax", False):
    return
  previous = sys.unraisablehook, sys.excepthook

  def closed_loop(exc) -> bool:
    return isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"

  def unraisable(u):
    if not closed_loop(u.exc_value):
      previous[0](u)

  def hook(kind, value, tb):
    if not closed_loop(value):
      previous[1](kind, value, tb)
  unraisable.k2jax = True
  sys.unraisablehook, sys.excepthook = unraisable, hook


def _compiled_on_every_process(fn, name: str, *args):
  """`fn` compiled for `args`, returned once every process of the run has compiled it.

  Without the wait a process whose compile ends first starts the program's collectives
  alone. XLA:CPU's gloo collectives set up each communicator at its first collective
  with a fixed 30 s deadline: a peer that compiled 30 s longer (a loaded machine, one
  process finding the program in the compilation cache) failed the run with
  "Gloo context initialization failed: DEADLINE_EXCEEDED". The coordination service's
  barrier (orbax's, not a device collective) waits as long as the slowest compile; a dead
  peer still ends the run through jax.distributed's heartbeat."""
  from orbax.checkpoint import multihost
  compiled = fn.lower(*args).compile()   # fn: a jax.jit
  multihost.get_barrier_sync_fn()(key=f"k2jax_{name}_compiled", timeout_ms=3 * 3600 * 1000)
  return compiled


def _device_batch(batch, sharding):
  return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v))
          for k, v in batch.items()}


def train(config, workdir: str, *, build_data=None, init_params=None) -> dict:
  """Train (or resume) the run in `workdir`; returns the summary dict it logs at the end.

  Raises UserError (one line) for mistakes in the config, the workdir or the data, before
  any file of an existing run is touched.

  Args:
    config: a full config.
    workdir: the run's directory.
    build_data: fn(config, process_index, process_count) -> k2jax.data.Data; default: the
      pre-training corpus of config.data (k2jax.sft passes its chat data).
    init_params: fn(model config, shardings, layout) -> params: the weights to start from
      instead of a random init (fine-tuning), built into `shardings` (a params tree of
      Shardings) in model.param_dtype, the pipelined stack as stored (`layout`, a
      k2jax.parallel.layout.Split, or None without a pipeline); unused when a checkpoint is
      resumed.
  """
  _check(config)
  workdir = _writable_workdir(workdir)
  try:  # before anything is written: a changed config must not disturb the saved run
    changes = resume.check(workdir, config)
  except ValueError as e:
    raise UserError(str(e)) from None
  with hold(workdir):   # before the first write: a second run must not touch this workdir
    return _locked(config, workdir, changes, build_data, init_params)


@contextlib.contextmanager
def hold(workdir: str):
  """Holds the workdir's run lock (k2jax.training.runlock) for the block; UserError if another run
  holds it (train, sft, rl)."""
  try:
    lock = runlock.RunLock(workdir).acquire()
  except runlock.RunBusy as e:
    raise UserError(str(e)) from None
  try:
    yield
  finally:
    lock.release()


def _locked(config, workdir, changes, build_data, init_params):
  main_process = jax.process_index() == 0
  _setup_logging(workdir)
  if changes:
    log.info("resuming with changed settings: %s", "; ".join(changes))
  t, m = config.train, config.model
  if config.mesh.pipeline > 1:
    tab = pipeline.table(config)
    log.info("%s; schedule %s: %d ticks, idle %.1f%% of device time by stage FLOPs, %d "
             "stage activations kept per device", layout.of(config).describe(m), tab.name,
             tab.ticks, 100 * tab.idle_fraction(pipeline.costs(config)), tab.in_flight)
    if jax.process_count() > 1 and jax.default_backend() == "cpu":
      # Seen hanging under load (CI, 2 cores): XLA:CPU's gloo collectives tag every
      # collective-permute alike, so two in flight between the same pair of devices can
      # take each other's messages. GPU / TPU collectives do not share this.
      log.warning("pipeline across processes on XLA:CPU (gloo) can hang when the machine "
                  "is loaded; use one process with several CPU devices, or GPU / TPU")
  try:  # mistakes in the mesh or the data files are the user's: one line, exit 2
    mesh = parallel.make_mesh(config.mesh)
    index, count = parallel.process_batch_slice(
        parallel.batch_sharding(mesh, t.batch_size, t.grad_accum), t.batch_size)
    if build_data is None:
      data = data_lib.build(config.data, t, m.vocab_size, process_index=index,
                            process_count=count)
    else:
      data = build_data(config, index, count)
  except (ValueError, OSError) as e:
    raise UserError(str(e).splitlines()[0]) from None
  if main_process:
    with open(os.path.join(workdir, "config.json"), "w") as f:
      f.write(config.to_json_best_effort(indent=2))
  try:
    with jax.set_mesh(mesh):  # the model's MoE reads the mesh for its shard_map dispatch
      return _run(config, workdir, mesh, data, init_params)
  except CheckpointError as e:  # a save that failed: the last good checkpoint is intact
    raise UserError(str(e)) from None
  except OSError as e:
    if e.errno != errno.ENOSPC:
      raise
    raise UserError(f"no space left on the device of {e.filename or workdir} "
                    f"({shutil.disk_usage(workdir).free / 1e6:.0f} MB free): free space and "
                    f"rerun to resume from the last checkpoint") from None


def _run(config, workdir, mesh, data, init_params=None):
  """Train `config` in `workdir` on `mesh` from its newest checkpoint, `init_params` or a
  fresh initialization, to train.steps; -> the summary (`_summary`)."""
  t, m = config.train, config.model
  main_process = jax.process_index() == 0
  # before any trace: a kernel library imported inside the step's first trace would make
  # its second call compile again (kernels.prepare)
  kernels.prepare(m.attention_impl, m.moe_impl)
  prog = step_lib.program(config, mesh)
  ckpt = Checkpointer(workdir, t.keep_checkpoints, t.async_checkpoint)
  try:
    state, train_iter, meta, to_logical = _initial_state(config, mesh, prog, ckpt, data,
                                                         init_params)
  except BaseException:
    ckpt.close()
    raise
  start = int(state.step)
  counts = model.count_params(m)
  log.info("model: %.3fM params (%.3fM activated); optimizer %s; mesh %s; %d devices; "
           "starting at step %d of %d", counts["total"] / 1e6, counts["activated"] / 1e6,
           config.optimizer.name, dict(mesh.shape), jax.device_count(), start, t.steps)
  if main_process:
    log.info("%s", files_line(workdir))
  step_fn, evaluate, batches = _programs(config, prog, state, data, train_iter, start)
  step, eval_loss, stop_signal = _loop(
      config, workdir, state, step_fn, evaluate, batches,
      save=lambda step, state, eval_loss: ckpt.save(
          step, to_logical(state), train_iter,
          {"step": step, "eval_loss": eval_loss, "seed": int(t.seed)}),
      eval_loss=meta.get("eval_loss", float("nan")), ckpt=ckpt)
  stopped = stop_signal if step < t.steps else None
  summary = _summary(workdir, step, t.steps, eval_loss, data.unigram_baseline, stopped)
  log.info("%s", summary["line"])
  if main_process:
    log.info("%s", files_line(workdir))
  if stopped is not None:
    raise SystemExit(128 + stopped)
  return summary


def _initial_state(config, mesh, prog, ckpt, data, init_params):
  """(state in the trainer's layout, the data iterator, the checkpoint's metadata, a
  function giving a state's checkpoint layout): restored from the newest checkpoint, else
  `init_params` with a fresh optimizer state, else a fresh initialization.

  Two views of the state (k2jax.parallel.layout): the trainer's, with the pipelined stack
  stored in the order the schedule runs it (padded, sharded over `pipeline`), and the logical
  one checkpoints hold, so they restore on any pipeline size. Without a pipeline they are the
  same."""
  t, m = config.train, config.model
  sp = layout.of(config)
  tx, abstract, shardings = prog.tx, prog.abstract, prog.shardings
  rng = jax.random.key(t.seed)
  if sp is None:
    tx_logical, abstract_logical, ckpt_shardings = tx, abstract, shardings
  else:
    tx_logical = optim.optimizer(config)
    abstract_logical = jax.eval_shape(functools.partial(init_state, config, tx_logical), rng)
    ckpt_shardings = parallel.state_shardings(model.param_specs(m), mesh, abstract_logical,
                                              tx_logical, spread_layers=True,
                                              host_state=config.optimizer.host_state)
  to_stored = jax.jit(lambda s: layout.convert_state(sp, tx_logical, s, layout.to_stored),
                      out_shardings=shardings, donate_argnums=0)
  to_logical = jax.jit(lambda s: layout.convert_state(sp, tx, s, layout.to_logical),
                       out_shardings=ckpt_shardings)
  try:
    restored = ckpt.restore_latest(
        jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                     abstract_logical, ckpt_shardings), data.train_iter)
  except CheckpointError as e:
    raise UserError(str(e)) from None
  logical = (lambda s: s) if sp is None else to_logical
  if restored:
    state, train_iter, meta = restored
    state = TrainState(*state) if not isinstance(state, TrainState) else state
    return (to_stored(state) if sp is not None else state), train_iter, meta, logical
  if init_params is not None:
    # fine-tuning: the given weights, loaded shard by shard into the stored layout's
    # shardings, and a fresh optimizer state; no random state is built
    state = jax.jit(functools.partial(fresh_state, tx), out_shardings=shardings,
                    donate_argnums=0)(init_params(m, shardings.params, sp))
    return state, data.train_iter(), {}, logical
  # Initialized in the logical layout and then laid out: the same weights on every mesh.
  state = jax.jit(lambda r: layout.convert_state(
      sp, tx_logical, init_state(config, tx_logical, r), layout.to_stored),
      out_shardings=shardings)(rng)
  return state, data.train_iter(), {}, logical


def _programs(config, prog, state, data, train_iter, start):
  """(step, evaluate(params) -> eval loss, the device batches): the compiled step, the eval
  loss over train.eval_batches held-out batches, and the training batches read lazily (the
  iterator's saved position stays the steps taken)."""
  t = config.train
  batch_sharding = prog.batch_sharding
  step_fn = prog.step
  eval_fn = jax.jit(functools.partial(eval_step, config),
                    in_shardings=(prog.shardings.params, batch_sharding))
  eval_batches = [_device_batch(b, batch_sharding) for b in data.eval_batches(t.eval_batches)]
  batches = (_device_batch(b, batch_sharding) for b in train_iter)
  if jax.process_count() > 1 and start < t.steps:
    first = next(batches)
    batches = itertools.chain([first], batches)
    step_fn = _compiled_on_every_process(step_fn, "train_step", state, first)
    if eval_batches:
      eval_fn = _compiled_on_every_process(eval_fn, "eval_step", state.params, eval_batches[0])

  def evaluate(params):
    if not eval_batches:
      return float("nan")
    sums = [eval_fn(params, b) for b in eval_batches]
    ce, n = (float(sum(x)) for x in zip(*jax.device_get(sums)))
    return ce / max(n, 1.0)
  return step_fn, evaluate, batches


def _loop(config, workdir, state, step_fn, evaluate, batches, *, save, eval_loss, ckpt):
  """Steps to train.steps, logging, evaluating and checkpointing on the config's cadence;
  SIGTERM / SIGINT save a checkpoint at the step all processes agree on and stop there.
  -> (last step, last eval loss, the signal that stopped it or None). The checkpointer
  `ckpt` (what `save` writes with) is waited for and closed on the way out, whatever
  happens."""
  t = config.train
  main_process = jax.process_index() == 0
  start = step = int(state.step)
  writer = MetricsWriter(workdir, start, enabled=main_process)
  stop = _StopFlag()
  old_handlers = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
  tokens_per_step = t.batch_size * t.seq_len
  flops_per_token = model.flops_per_token(config.model, t.seq_len)
  last = {"time": time.perf_counter(), "step": start}
  bar = tqdm(total=t.steps, initial=start, disable=not main_process, dynamic_ncols=True,
             desc="train")
  row, stop_signal, shown = {}, None, {}
  try:
    previous = None  # the last step's (number, nan streak), read once the next step is queued
    while step < t.steps:
      state, metrics = step_fn(state, next(batches))
      step += 1
      if previous is not None:  # waits for the previous step only: the device stays busy
        _check_divergence(*previous, t.max_nan_steps)
      previous = (step, metrics["nan_streak"])
      bar.update(1)
      log_step = step % t.log_every == 0 or step == t.steps
      stop_signal = stop.agreed(log_step)
      if log_step:
        row = {k: v.item() if np.ndim(v) == 0 else v for k, v in jax.device_get(metrics).items()}
        _check_divergence(step, row.pop("nan_streak"), t.max_nan_steps)
        now = time.perf_counter()
        tps = tokens_per_step * (step - last["step"]) / (now - last["time"])
        last.update(time=now, step=step)
        row.update(skipped_steps=int(jax.device_get(state.skipped)), tokens_per_s=tps,
                   model_tflops_per_s=tps * flops_per_token / 1e12)
        row.pop("finite")
      if step % t.eval_every == 0 or step == t.steps:
        eval_loss = row["eval_loss"] = evaluate(state.params)
      if row:
        writer.write(step, row)
        bar.set_postfix(postfix(shown, row))
        row = {}
      if t.checkpoint_every and (step % t.checkpoint_every == 0 or step == t.steps
                                 or stop_signal is not None):
        save(step, state, eval_loss)
      if stop_signal is not None:
        log.warning("received signal %d: saved checkpoint at step %d; exiting", stop_signal, step)
        break
    if previous is not None:
      _check_divergence(*previous, t.max_nan_steps)
  finally:
    bar.close()
    ckpt.wait()
    ckpt.close()
    writer.close()
    for s, h in old_handlers.items():
      signal.signal(s, h)
  return step, eval_loss, stop_signal


_POSTFIX = {"loss": ".3f", "eval_loss": ".3f", "max_logit": ".1f"}


def postfix(shown: dict, row: dict) -> dict:
  """The progress bar's figures: `shown` updated with those `row` has. A row of eval loss
  alone (an eval step that is no log step) keeps the last loss on show, not nan."""
  shown.update({k: format(row[k], f) for k, f in _POSTFIX.items() if k in row})
  return shown


def _check_divergence(step: int, nan_streak, max_nan_steps: int) -> None:
  streak = int(nan_streak)
  if streak >= max_nan_steps:
    raise TrainingDiverged(
        f"loss or gradients were NaN/Inf for {streak} consecutive steps (step {step}); the "
        f"updates were skipped and the run stopped. Resume from the last checkpoint with "
        f"a lower --config.optimizer.learning_rate or a lower --config.optimizer.tau")


def _summary(workdir, step, steps, eval_loss, baseline, signum):
  rows = metrics_lib.read(workdir) if os.path.exists(os.path.join(workdir, "metrics.jsonl")) else []
  last = next((r for r in reversed(rows) if "loss" in r), {})
  max_logit = max((r["max_logit"] for r in rows if "max_logit" in r), default=float("nan"))
  s = {"step": step, "steps": steps, "loss": last.get("loss"), "eval_loss": eval_loss,
       "unigram_baseline": baseline, "max_logit_seen": max_logit,
       "clipped_heads_ever_frac": last.get("clipped_heads_ever_frac"),
       "skipped_steps": last.get("skipped_steps"), "tokens_per_s": last.get("tokens_per_s")}
  status = "stopped by signal" if signum is not None else "done"
  s["line"] = (f"{status}: step {step}/{steps}, loss {_fmt(s['loss'])}, eval loss "
               f"{_fmt(eval_loss)} (unigram baseline {_fmt(baseline)}), max logit seen "
               f"{_fmt(max_logit)}, heads ever clipped {_fmt(s['clipped_heads_ever_frac'], '.1%')}, "
               f"skipped steps {s['skipped_steps']}, {_fmt(s['tokens_per_s'], '.0f')} tokens/s")
  return s


def files_line(workdir: str) -> str:
  """Where a run's files are and the commands that read them (start and end of a run)."""
  return (f"run files in {workdir}: metrics.jsonl, checkpoints/, train.log, tensorboard/ "
          f"(tensorboard --logdir {os.path.join(workdir, 'tensorboard')}); curves: "
          f"python -m k2jax.plot {workdir}")


def _fmt(x, spec=".4f"):
  return "n/a" if x is None or (isinstance(x, float) and np.isnan(x)) else format(x, spec)


def _resolve_preset(argv):
  """Let --config name a preset (tiny, kimi_k2, ...) as well as a file."""
  out = []
  for i, a in enumerate(argv):
    for prefix in ("--config=",):
      if a.startswith(prefix) and a[len(prefix):] in configs.PRESETS:
        a = prefix + os.path.join(os.path.dirname(configs.__file__), a[len(prefix):] + ".py")
    if i > 0 and argv[i - 1] == "--config" and a in configs.PRESETS:
      a = os.path.join(os.path.dirname(configs.__file__), a + ".py")
    out.append(a)
  return out


def _config_path(argv) -> str | None:
  for i, a in enumerate(argv):
    if a.startswith("--config="):
      return a[len("--config="):]
    if a == "--config" and i + 1 < len(argv):
      return argv[i + 1]
  return None


def _config_file_error(path: str | None, e: BaseException) -> str | None:
  """One line for a config FILE that cannot be loaded, or None if `e` is something else."""
  if path is None:
    return None
  presets = ", ".join(configs.PRESETS)
  if not os.path.exists(path):
    return f"--config {path}: no such file; give a config file or a preset ({presets})"
  if isinstance(e, SyntaxError):
    return f"--config {path}: syntax error on line {e.lineno}: {e.msg}; fix the file"
  if isinstance(e, AttributeError) and "get_config" in str(e):
    return (f"--config {path} defines no get_config(); a config file must define get_config() "
            "returning a ConfigDict (see k2jax/configs/tiny.py)")
  return None


def usage(prog: str = "k2jax.train", extra: str = "", preset: str | None = None,
          more: Sequence[str] = ()) -> str:
  """--help: the command, the presets, every config group with its keys (of `preset`, default
  the base config), and the flags (`more`: the command's own, a line each)."""
  from k2jax.configs import base
  cfg = configs.get_config(preset) if preset else base.get_config()
  lines = [f"usage: python -m {prog} --config PRESET|FILE[:ARG] --workdir DIR "
           f"[--config.GROUP.KEY=VALUE ...]{extra}", "",
           f"presets: {', '.join(configs.PRESETS)} (or a config file defining get_config())",
           "", "config groups; override any key with --config.GROUP.KEY=VALUE "
           "(e.g. --config.train.steps=100):"]
  for group in cfg:
    if isinstance(cfg[group], type(cfg)):
      lines.append(f"  {group}: {', '.join(cfg[group])}")
  lines += ["", "flags:"]
  for name in ("workdir", "distributed", "coordinator_address", "num_processes", "process_id",
               "compilation_cache", "heartbeat_timeout"):
    if name in flags.FLAGS:
      lines.append(f"  --{name}: {flags.FLAGS[name].help}")
  return "\n".join(lines + [f"  {line}" for line in more])


def _check(config) -> None:
  """UserError (one line) for a config any of its groups' checks refuses."""
  try:
    configs.validate(config)
    optim.validate(config)
    layout.validate(config)
    schedules.validate(config)
  except ValueError as e:
    raise UserError(str(e)) from None


def parse(argv, prog: str = "k2jax.train", extra_usage: str = "", help_preset=None,
          more_help: Sequence[str] = ()):
  """-> (config, workdir), or UserError with one line saying what is wrong. --help / -h
  prints `usage` and exits 0."""
  if any(a in ("--help", "-h", "--helpfull") for a in argv[1:]):
    print(usage(prog, extra_usage, help_preset, more_help))
    raise SystemExit(0)
  config = load_config(argv)
  if not _WORKDIR.value:
    raise UserError("--workdir is required: the directory for checkpoints and metrics")
  return config, _WORKDIR.value


def _unknown_key(error, argv) -> str | None:
  """The one line for an override naming a key the config lacks (ml_collections raises a
  KeyError, or an AttributeError wrapping one, whose text is the quoted key and a hint)."""
  while error.args and isinstance(error.args[0], BaseException):
    error = error.args[0]
  if not error.args or not isinstance(error.args[0], str):
    return None
  first, _, hint = error.args[0].partition("\n")
  key = first.strip().strip("'\"")
  bad = next((a for a in argv if a.startswith("--config.")
              and f".{key}" in a.split("=")[0]), None)
  if bad is None:
    return None
  hint = hint.strip().replace('"', "")
  hint = f"did you mean {hint.split()[3]}?" if hint.startswith("Did you mean") else \
      "see the config file for the valid keys"
  return f"unknown config key in {bad}: {hint}"


def load_config(argv):
  """The validated config of `argv` (--config PRESET | FILE[:arg], --config.KEY=VALUE ...), or
  UserError with one line saying what is wrong. Also used by `params` and `plan`."""
  argv = _resolve_preset(list(argv))
  path = _config_path(argv)
  if path is not None and not os.path.exists(path.split(":")[0]):
    raise UserError(_config_file_error(path.split(":")[0], FileNotFoundError(path)))
  saved_argv = sys.argv
  sys.argv = argv  # ml_collections registers the --config.* override flags from sys.argv
  try:
    flags.FLAGS(argv)  # once per process: config_flags cannot register its overrides twice
    config = _CONFIG.value
  except Exception as e:  # the config file runs user code: anything may come out of it
    cause = e.__cause__ or e.__context__ or e
    line = _config_file_error(path, e) or _config_file_error(path, cause)
    if line:
      raise UserError(line) from None
    if isinstance(e, (AttributeError, KeyError)):  # ml_collections: an override's key is unknown
      line = _unknown_key(e, argv)
      if line:
        raise UserError(line) from None
    if isinstance(e, (flags.Error, OSError, KeyError, TypeError, ValueError)):
      text = e.args[0] if isinstance(e, KeyError) and e.args else str(e)  # not KeyError's repr
      raise UserError(str(text).strip().splitlines()[0]) from None
    raise UserError(f"--config {path}: loading it raised {type(e).__name__}: "
                    f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}; fix the file"
                    ) from None
  finally:
    sys.argv = saved_argv
  if config is None:
    raise UserError("--config is required, e.g. --config k2jax/configs/tiny.py")
  _check(config)
  return config


def init_distributed():
  """jax.distributed.initialize from the flags (before any other JAX call)."""
  if _DISTRIBUTED.value or _COORDINATOR.value:
    start_distributed(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value,
                      _HEARTBEAT.value)


def start_distributed(coordinator=None, num_processes=None, process_id=None,
                      heartbeat: int = _HEARTBEAT.default) -> None:
  """jax.distributed.initialize (None: detected from the cluster), a dead peer given up on
  after `heartbeat` seconds; logs where this process stands."""
  jax.distributed.initialize(
      coordinator_address=coordinator, num_processes=num_processes, process_id=process_id,
      heartbeat_timeout_seconds=heartbeat, shutdown_timeout_seconds=heartbeat)
  log.info("process %d of %d, %d local / %d global devices", jax.process_index(),
           jax.process_count(), jax.local_device_count(), jax.device_count())


def enable_compilation_cache():
  if _CACHE.value and not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    jax.config.update("jax_compilation_cache_dir", _CACHE.value)
  if not os.environ.get("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"):
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


def main(argv=None):
  argv = sys.argv if argv is None else argv
  try:
    config, workdir = parse(argv)
    enable_compilation_cache()
    init_distributed()
    train(config, workdir)
  except UserError as e:
    print(f"k2jax.train: error: {e}", file=sys.stderr)
    raise SystemExit(2)
  except TrainingDiverged as e:
    print(f"k2jax.train: {e}", file=sys.stderr)
    raise SystemExit(1)
  except jax.errors.JaxRuntimeError as e:
    if jax.process_count() == 1:
      raise
    # A collective failed: almost always a peer process that died. Say so in one line and
    # leave at once: jax.distributed's shutdown barrier would wait for the dead peer.
    print(f"k2jax.train: process {jax.process_index()}: a collective failed, most likely "
          f"because another process of the run died ({str(e).splitlines()[0][:160]}); rerun "
          f"the same command on all processes to resume from the last checkpoint",
          file=sys.stderr, flush=True)
    os._exit(1)


if __name__ == "__main__":
  main()
