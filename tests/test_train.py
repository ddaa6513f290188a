"""The training CLI end to end: errors, resume exactness after SIGTERM and after a corrupt
checkpoint, NaN skipping, learning on the embedded corpus."""

import os
import signal
import subprocess
import sys
import time

import jax.numpy as jnp
import numpy as np
import pytest

from k2jax import configs
from k2jax.training import metrics, step as step_lib, train

# A small, fast variant of the tiny preset (one dense + one MoE layer, short rows).
SMALL = ["--config.model.num_hidden_layers=2", "--config.train.batch_size=4",
         "--config.train.seq_len=32", "--config.train.log_every=1",
         "--config.data.max_corpus_bytes=400000", "--config.train.eval_batches=2",
         "--config.optimizer.warmup_steps=5", "--config.optimizer.decay_steps=10"]


def small_config(**train_kw):
  cfg = configs.get_config("tiny")
  cfg.model.num_hidden_layers = 2
  cfg.train.update(dict(dict(batch_size=4, seq_len=32, log_every=1, eval_batches=2), **train_kw))
  cfg.data.max_corpus_bytes = 400_000
  cfg.optimizer.update(dict(warmup_steps=5, decay_steps=10))
  return cfg


def run_cli(workdir, *extra, check=True, timeout=600):
  cmd = [sys.executable, "-m", "k2jax.train", "--config", "tiny", f"--workdir={workdir}",
         *SMALL, *extra]
  p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
  if check and p.returncode != 0:
    raise AssertionError(f"rc={p.returncode}\n{p.stderr[-3000:]}")
  return p


def losses(workdir):
  return {r["step"]: r["loss"] for r in metrics.read(str(workdir)) if "loss" in r}


# The table of user mistakes: (id, extra files, argv after `python -m k2jax.train`, env, the
# fragment the one error line must contain). Every case must exit 2 with exactly one
# "k2jax.train: error:" line and no traceback. {tmp} is the case's temporary directory.
BAD_INPUTS = [
    ("unknown-key", ["--config", "tiny", "--workdir={tmp}/w", "--config.train.nosuchkey=3"],
     "unknown config key in --config.train.nosuchkey=3"),
    ("misspelt-key", ["--config", "tiny", "--workdir={tmp}/w", "--config.train.stepz=3"],
     "unknown config key in --config.train.stepz=3: did you mean steps?"),
    ("misspelt-group", ["--config", "tiny", "--workdir={tmp}/w", "--config.trainz.steps=3"],
     "unknown config key in --config.trainz.steps=3: did you mean train?"),
    ("not-a-number", ["--config", "tiny", "--workdir={tmp}/w", "--config.train.steps=abc"],
     "--config.train.steps=abc"),
    ("invalid-value", ["--config", "tiny", "--workdir={tmp}/w",
                       "--config.model.num_experts_per_tok=99"],
     "model.num_experts_per_tok = 99: must be <= n_routed_experts (16)"),
    ("unknown-optimizer", ["--config", "tiny", "--workdir={tmp}/w", "--config.optimizer.name=lion"],
     "optimizer.name = 'lion': must be one of muonclip, muon, adamw, sgd, adamw_qk_clip"),
    ("seq-too-long", ["--config", "tiny", "--workdir={tmp}/w", "--config.train.seq_len=4096"],
     "train.seq_len = 4096: must be <= model.max_position_embeddings (1024)"),
    ("mesh-devices", ["--config", "tiny", "--workdir={tmp}/w", "--config.mesh.data=3"],
     "mesh pipeline x data x context x expert = 1 x 3 x 1 x 1 = 3 devices"),
    ("accum-split", ["--config", "tiny", "--workdir={tmp}/w", "--config.mesh.data=2",
                     "--config.mesh.expert=4", "--config.train.batch_size=8",
                     "--config.train.grad_accum=2", "DEVICES=8"],
     "make train.batch_size a multiple of 16"),
    ("pipeline-microbatches", ["--config", "tiny", "--workdir={tmp}/w", "--config.mesh.pipeline=2",
                               "--config.train.grad_accum=3", "--config.train.batch_size=12",
                               "DEVICES=2"],
     "train.grad_accum = 3: must be a multiple of mesh.pipeline (2) for the 1f1b schedule"),
    ("pipeline-too-few-microbatches", ["--config", "tiny", "--workdir={tmp}/w",
                                       "--config.mesh.pipeline=2", "DEVICES=2"],
     "train.grad_accum = 1: must be >= mesh.pipeline (2)"),
    ("no-workdir", ["--config", "tiny"], "--workdir is required"),
    ("unknown-flag", ["--config", "tiny", "--workdir={tmp}/w", "--bogus"],
     "Unknown command line flag 'bogus'"),
    ("config-missing", ["--config", "{tmp}/missing.py", "--workdir={tmp}/w"],
     "missing.py: no such file; give a config file or a preset"),
    ("config-syntax", ["--config", "{tmp}/syntax.py", "--workdir={tmp}/w"],
     "syntax.py: syntax error on line 1"),
    ("config-raises", ["--config", "{tmp}/raises.py", "--workdir={tmp}/w"],
     "raises.py: loading it raised RuntimeError: boom"),
    ("config-no-get-config", ["--config", "{tmp}/noget.py", "--workdir={tmp}/w"],
     "noget.py defines no get_config()"),
    ("workdir-is-file", ["--config", "tiny", "--workdir={tmp}/afile"],
     "afile is a file, not a directory"),
    ("workdir-unwritable", ["--config", "tiny", "--workdir=/proc/k2jax-run"],
     "--workdir /proc/k2jax-run is not a writable directory"),
    ("files-missing", ["--config", "tiny", "--workdir={tmp}/w",
                       "--config.data.files=/nonexistent/*.txt"], "data.files"),
    ("corpus-empty", ["--config", "tiny", "--workdir={tmp}/w", "--config.data.files={tmp}/empty.txt"],
     "hold no text"),
    ("corpus-too-small", ["--config", "tiny", "--workdir={tmp}/w",
                          "--config.data.files={tmp}/small.txt"],
     "fewer than one batch of train.batch_size = 16: it needs at least 2049 tokens"),
    ("no-eval-split", ["--config", "tiny", "--workdir={tmp}/w", "--config.data.files={tmp}/one.txt",
                       "--config.train.batch_size=4", "--config.train.seq_len=32"],
     "no eval split: 1 document(s) cannot be split"),
]
FILES = {"syntax.py": "def get_config(:\n", "raises.py": "def get_config():\n  raise RuntimeError('boom')\n",
         "noget.py": "x = 1\n", "afile": "", "empty.txt": "  \n", "small.txt": "hello\n",
         "one.txt": "one document of plain text. " * 200}


@pytest.fixture(scope="module")
def bad_input_results(tmp_path_factory):
  """Run every case of BAD_INPUTS at once (each is a short process that fails early)."""
  procs = {}
  for name, argv, _ in BAD_INPUTS:
    tmp = tmp_path_factory.mktemp(name)
    for f, text in FILES.items():
      (tmp / f).write_text(text)
    env = dict(os.environ)
    args = []
    for a in argv:
      if a.startswith("DEVICES="):
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={a[8:]}"
      else:
        args.append(a.replace("{tmp}", str(tmp)))
    procs[name] = subprocess.Popen([sys.executable, "-m", "k2jax.train", *args], env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  return {name: (p.wait(timeout=600), p.stderr.read()) for name, p in procs.items()}


@pytest.mark.parametrize("name,fragment", [(n, f) for n, _, f in BAD_INPUTS],
                         ids=[n for n, _, _ in BAD_INPUTS])
def test_bad_input_is_one_line_and_exit_code_2(bad_input_results, name, fragment):
  rc, err = bad_input_results[name]
  assert rc == 2, err[-2000:]
  assert "Traceback" not in err, err[-2000:]
  err_lines = [l for l in err.splitlines() if l.startswith("k2jax.train: error:")]
  assert len(err_lines) == 1 and fragment in err_lines[0], err[-2000:]


def _tree_digest(root):
  out = {}
  for dirpath, _, files in os.walk(root):
    for f in files:
      path = os.path.join(dirpath, f)
      with open(path, "rb") as fh:
        out[os.path.relpath(path, root)] = hash(fh.read())
  return out


def test_resume_with_a_changed_config_never_destroys_anything(tmp_path):
  """Changes that cannot resume end in one line naming each key old -> new, exit 2, every
  file as it was; changes that can resume do, say so, and continue the same run."""
  steps = ["--config.train.checkpoint_every=2", "--config.train.eval_every=2"]
  run_cli(tmp_path, "--config.train.steps=4", *steps)
  before, want = _tree_digest(tmp_path), losses(tmp_path)
  p = run_cli(tmp_path, "--config.train.steps=4", *steps, "--config.model.hidden_size=256",
              "--config.optimizer.name=adamw", check=False)
  assert p.returncode == 2, p.stderr[-2000:]
  (line,) = [l for l in p.stderr.splitlines() if l.startswith("k2jax.train: error:")]
  assert "model.hidden_size: 128 -> 256" in line and "optimizer.name: 'muonclip' -> 'adamw'" in line
  assert _tree_digest(tmp_path) == before      # nothing moved, rewritten or appended
  p = run_cli(tmp_path, "--config.train.steps=6", *steps, "--config.optimizer.learning_rate=1e-3")
  assert ("resuming with changed settings: optimizer.learning_rate: 0.002 -> 0.001; "
          "train.steps: 4 -> 6") in p.stderr
  assert "resumed from checkpoint step 4" in p.stderr
  got = losses(tmp_path)
  assert sorted(got) == list(range(1, 7)) and all(got[s] == want[s] for s in want)
  assert not os.path.exists(tmp_path / "corrupt_checkpoints")


def test_a_workdir_that_is_not_a_run_is_refused_and_left_alone(tmp_path):
  """A non-empty workdir without config.json (another tool's checkpoints/8 and notes) is not
  ours: train (and sft, which trains through it) refuse it before writing anything. A
  workdir holding only what a run writes before its config.json (lock and log: a run that
  stopped before it began) or nothing at all is a new run."""
  from k2jax.training import resume
  foreign = tmp_path / "foreign"
  (foreign / "checkpoints" / "8").mkdir(parents=True)
  (foreign / "notes.txt").write_text("mine")
  with pytest.raises(train.UserError, match=r"foreign is not a k2jax run: it holds "
                                            r"checkpoints, notes.txt but no config.json"):
    train.train(small_config(steps=1), str(foreign))
  assert sorted(str(p.relative_to(foreign)) for p in foreign.rglob("*")) == [
      "checkpoints", "checkpoints/8", "notes.txt"]
  assert (foreign / "notes.txt").read_text() == "mine"
  stopped = tmp_path / "stopped"
  stopped.mkdir()
  (stopped / ".lock").write_text("{}")
  (stopped / "train.log").write_text("")
  (tmp_path / "empty").mkdir()
  for d in ("stopped", "empty", "missing"):
    assert resume.check(str(tmp_path / d), small_config()) == []


def test_a_checkpoint_of_another_state_is_reported_not_quarantined(tmp_path):
  """A readable checkpoint whose tree differs (other code or config) is a mismatch: the
  error names the first differing leaf and the checkpoint stays where it is."""
  import functools
  import jax
  from k2jax import optim
  from k2jax.training.checkpoint import Checkpointer, CheckpointMismatch
  from k2jax.training.step import init_state
  cfg = small_config(steps=1)
  state = init_state(cfg, optim.optimizer(cfg), jax.random.key(0))
  data = __import__("k2jax.data", fromlist=["build"]).build(cfg.data, cfg.train,
                                                             cfg.model.vocab_size)
  ckpt = Checkpointer(str(tmp_path), keep=2, use_async=False)
  ckpt.save(1, state, data.train_iter(), {"step": 1})
  ckpt.wait()
  other = small_config(steps=1)
  other.model.hidden_size = 64
  tx = optim.optimizer(other)
  abstract = jax.eval_shape(functools.partial(init_state, other, tx), jax.random.key(0))
  with pytest.raises(CheckpointMismatch, match=r"checkpoint step 1 .* \(\S+: saved "
                                               r"float32\[\d+, 128\], expected float32\[\d+, 64\]"):
    ckpt.restore_latest(abstract, data.train_iter)
  ckpt.close()
  assert os.path.isdir(tmp_path / "checkpoints" / "1")
  assert not os.path.exists(tmp_path / "corrupt_checkpoints")


def test_sigterm_then_resume_reproduces_the_uninterrupted_run(tmp_path):
  steps = ["--config.train.steps=24", "--config.train.checkpoint_every=8",
           "--config.train.eval_every=12"]
  run_cli(tmp_path / "straight", *steps)
  want = losses(tmp_path / "straight")

  # Interrupt a second run with SIGTERM once it has logged a few steps.
  cmd = [sys.executable, "-m", "k2jax.train", "--config", "tiny",
         f"--workdir={tmp_path / 'stopped'}", *SMALL, *steps]
  proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  path = tmp_path / "stopped" / "metrics.jsonl"
  deadline = time.time() + 300
  while time.time() < deadline and proc.poll() is None:
    if path.exists() and len(path.read_text().splitlines()) >= 3:
      proc.send_signal(signal.SIGTERM)
      break
    time.sleep(0.05)
  _, err = proc.communicate(timeout=300)
  assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
  stopped_at = max(losses(tmp_path / "stopped"))
  assert 3 <= stopped_at < 24
  saved = sorted(int(d) for d in os.listdir(tmp_path / "stopped" / "checkpoints") if d.isdigit())
  assert saved[-1] == stopped_at  # the signal saved the step it stopped at

  run_cli(tmp_path / "stopped", *steps)  # same command: resumes
  got = losses(tmp_path / "stopped")
  assert sorted(got) == sorted(want)
  assert got == want  # bit-exact on CPU


def test_corrupt_latest_checkpoint_falls_back_to_previous(tmp_path):
  steps = ["--config.train.steps=12", "--config.train.checkpoint_every=6",
           "--config.train.eval_every=6"]
  run_cli(tmp_path, *steps)
  want = losses(tmp_path)
  # Damage the newest checkpoint's array data: truncate every data file of step 12.
  for root, _, files in os.walk(tmp_path / "checkpoints" / "12" / "state"):
    for f in files:
      if os.sep + "d" in root:
        with open(os.path.join(root, f), "r+b") as fh:
          fh.truncate(10)
  p = run_cli(tmp_path, *steps)
  assert "checkpoint step 12 is damaged (state/" in p.stderr
  assert os.path.isdir(tmp_path / "corrupt_checkpoints" / "12")
  assert "resumed from checkpoint step 6" in p.stderr
  assert losses(tmp_path) == want


def test_nan_steps_are_skipped_and_counted(tmp_path, monkeypatch):
  original = step_lib.lm_loss

  def flaky(mcfg, params, batch):  # NaN on every third batch (by content), else normal
    ce, n, aux = original(mcfg, params, batch)
    bad = jnp.sum(batch["inputs"]) % 3 == 0
    return jnp.where(bad, jnp.nan, ce), n, aux

  monkeypatch.setattr(step_lib, "lm_loss", flaky)
  summary = train.train(small_config(steps=12, checkpoint_every=12, eval_every=12), str(tmp_path))
  rows = metrics.read(str(tmp_path))
  assert summary["step"] == 12 and rows[-1]["skipped_steps"] > 0
  finite = [r["loss"] for r in rows if np.isfinite(r["loss"])]
  assert len(finite) == 12 - rows[-1]["skipped_steps"]
  assert finite[-1] < finite[0]  # the skipped updates left the params intact: it still learns


def test_persistent_nan_stops_with_a_clear_message(tmp_path, monkeypatch):
  original = step_lib.lm_loss
  monkeypatch.setattr(step_lib, "lm_loss",
                      lambda *a: (lambda ce, n, aux: (ce * jnp.nan, n, aux))(*original(*a)))
  with pytest.raises(train.TrainingDiverged, match="NaN/Inf for 3 consecutive steps"):
    train.train(small_config(steps=20, max_nan_steps=3), str(tmp_path))
  # Between log steps too: the streak is read every step, not only when metrics are logged.
  with pytest.raises(train.TrainingDiverged, match=r"NaN/Inf for 3 consecutive steps \(step 3\)"):
    train.train(small_config(steps=40, max_nan_steps=3, log_every=50, checkpoint_every=0),
                str(tmp_path / "sparse_logs"))


def test_learns_below_the_unigram_baseline(tmp_path):
  cfg = small_config(steps=80, eval_every=80, checkpoint_every=80)
  cfg.train.update(dict(batch_size=8, seq_len=64))
  cfg.data.max_corpus_bytes = 4_000_000  # enough files for a representative held-out split
  summary = train.train(cfg, str(tmp_path))
  assert summary["eval_loss"] < summary["unigram_baseline"] - 0.2
  from k2jax.tools import plot
  assert os.path.getsize(plot.plot(str(tmp_path))) > 10_000


def test_the_progress_bar_keeps_the_last_loss_on_eval_only_rows():
  """An eval step that is no log step writes a row of eval_loss alone: the bar showed
  loss=nan, max_logit=nan."""
  from k2jax.training.train import postfix
  shown = {}
  assert postfix(shown, {"loss": 2.5, "max_logit": 11.25, "grad_norm": 1.0}) == {
      "loss": "2.500", "max_logit": "11.2"}
  assert postfix(shown, {"eval_loss": 2.75}) == {"loss": "2.500", "max_logit": "11.2",
                                                 "eval_loss": "2.750"}


def test_help_lists_the_config_groups_and_how_to_override_them():
  procs = {m: subprocess.Popen([sys.executable, "-m", m, "--help"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
           for m in ("k2jax.train", "k2jax.sft", "k2jax.rl")}
  for m, p in procs.items():
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-2000:]
    assert out.startswith(f"usage: python -m {m} --config PRESET|FILE")
    assert "--config.GROUP.KEY=VALUE" in out and "  train: " in out and "--workdir:" in out
    assert ("  rl: " in out) == (m == "k2jax.rl")
    # the starting weights: what they may be, which preset to pair, whose tokenizer
    assert ("  --init: " in out) == (m != "k2jax.train"), out[-800:]
    if m != "k2jax.train":
      assert "Hugging Face" in out and "kimi_k2" in out and "tokenizer" in out


def test_host_state_keeps_optimizer_states_in_host_memory_and_changes_nothing(tmp_path):
  """optimizer.host_state (report 2.4.2: optimizer states offloaded to CPU): the ZeRO-1
  leaves live in host memory between steps, come to the device for the update and go back;
  the trajectory is the device-resident one bit for bit, through a checkpoint and resume."""
  import functools
  import jax
  import numpy as np
  from k2jax import model, optim, parallel
  from k2jax.training.step import init_state, train_step
  cfg = small_config()
  cfg.optimizer.host_state = True
  tx = optim.optimizer(cfg)
  key = jax.random.key(0)
  abstract = jax.eval_shape(functools.partial(init_state, cfg, tx), key)
  mesh = parallel.make_mesh(cfg.mesh)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, cfg.model.vocab_size, (4, 33))
  batch = dict(inputs=tokens[:, :-1], targets=tokens[:, 1:], loss_mask=np.ones((4, 32), bool),
               positions=np.tile(np.arange(32), (4, 1)), segment_ids=np.ones((4, 32), np.int32))
  sched = optim.learning_rate_schedule(cfg)
  kinds, runs = {}, {}
  for host in (True, False):
    c = cfg.copy_and_resolve_references()
    c.optimizer.host_state = host
    sh = parallel.state_shardings(model.param_specs(c.model), mesh, abstract, tx, host_state=host)
    with jax.set_mesh(mesh):
      state = jax.jit(functools.partial(init_state, c, tx), out_shardings=sh)(key)
      step = jax.jit(functools.partial(train_step, c, tx, sched), out_shardings=(sh, None))
      for _ in range(3):
        state, m = step(state, batch)
    if host:   # every state mirroring a parameter is on the host; QK-Clip's flags stay
      kinds = {}
      for a in jax.tree.leaves(state.opt_state):
        kinds[a.sharding.memory_kind] = kinds.get(a.sharding.memory_kind, 0) + a.nbytes
    runs[host] = (jax.device_get(state), float(m["loss"]))
  assert kinds["pinned_host"] > 50 * kinds.get("device", 0), kinds
  assert runs[True][1] == runs[False][1]
  for a, b in zip(jax.tree.leaves(runs[True][0]), jax.tree.leaves(runs[False][0])):
    np.testing.assert_array_equal(a, b)
  # the trainer: 2 steps, checkpoint, resume to 4; the same with device states
  for name, host in (("dev", False), ("host", True)):
    c = small_config(steps=2, checkpoint_every=2, eval_every=4)
    c.optimizer.host_state = host
    train.train(c, str(tmp_path / name))
    c.train.steps = 4
    train.train(c, str(tmp_path / name))
  assert losses(tmp_path / "host") == losses(tmp_path / "dev")
  assert sorted(losses(tmp_path / "host")) == [1, 2, 3, 4]
