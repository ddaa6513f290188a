"""What the multi-device test files share: simulated CPU devices run in subprocesses (the device
count is fixed when JAX starts), whose results come back as one JSON line."""

import contextlib
import fcntl
import json
import os
import socket
import subprocess
import sys
import tempfile

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A constant learning rate from step 1 (warmup 1, no decay): every update matters, and the
# first steps do not depend on train.steps, so a long run's prefix equals a short run.
CLI = ["--config=tiny", "--config.model.num_hidden_layers=2", "--config.train.batch_size=8",
       "--config.train.seq_len=32", "--config.train.log_every=1", "--config.train.steps=4",
       "--config.train.eval_batches=0", "--config.data.max_corpus_bytes=300000",
       "--config.optimizer.warmup_steps=1", "--config.optimizer.decay_steps=0",
       "--config.train.async_checkpoint=False"]
NO_CHECKPOINTS = ["--config.train.checkpoint_every=0"]


# XLA:CPU's machine code at LLVM -O0 in these subprocesses: each compiles multi-device steps
# (pipelined ones above all) and runs them for a few steps, so optimized code never pays back
# its compile. Measured here: the pipelined step of test_no_weight_moves_between_pipeline_devices
# 149 s -> 98 s; in a full run the pipeline meshes fixture 480 s -> 340 s. Not for the whole
# suite: with it in every process, tests that train longer slowed (test_sft's CLI 70 -> 109 s,
# test_train's host_state 71 -> 131 s) and the run took 45:52 against 37:47. It changes LLVM's
# work only, not XLA's HLO passes or buffer assignment.
CPU_COMPILE_FLAGS = "--xla_backend_optimization_level=0"


def env(devices, cache=True):
  e = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} "
           f"{CPU_COMPILE_FLAGS}")
  if not cache:
    # Pipelined steps put collectives inside conditionals. Loaded from the persistent
    # compilation cache (tests/conftest.py), such a step has deadlocked XLA:CPU 0.10
    # (pipeline 2 x data 2 x expert 2: four devices at the ring's collective-permute, four at
    # an all-gather inside a branch) where the fresh compile of the same step runs.
    e.pop("JAX_COMPILATION_CACHE_DIR", None)
  return e


# `python -m tests.X ARGS` with nothing of the repository on sys.path (tests/conftest.py):
# tests/ is registered as the package `tests` by its path, then X runs as __main__.
_LAUNCH = ("import importlib.util, os, runpy, sys; "
           "spec = importlib.util.spec_from_file_location('tests', os.path.join(sys.argv[1], "
           "'__init__.py'), submodule_search_locations=[sys.argv[1]]); "
           "sys.modules['tests'] = module = importlib.util.module_from_spec(spec); "
           "spec.loader.exec_module(module); del sys.argv[:2]; "
           "runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)")


def python_module(module: str, *args) -> list[str]:
  """The command line that runs tests/ module `module` ("tests.parallel_worker") as a script."""
  return [sys.executable, "-c", _LAUNCH, os.path.join(REPO, "tests"), module, *args]


def start_worker(devices, *args, cache=True):
  return subprocess.Popen(python_module("tests.parallel_worker", *args), cwd=REPO,
                          env=env(devices, cache), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)


def result(proc):
  out, err = proc.communicate(timeout=900)
  assert proc.returncode == 0, err[-3000:]
  return json.loads(next(l for l in out.splitlines() if l.startswith("RESULT "))[7:])


def worker(devices, *args):
  return result(start_worker(devices, *args))


def cli(devices, workdir, *extra, stderr=subprocess.PIPE):
  """`stderr`: a file, for a test that reads the output while the run goes on."""
  return subprocess.Popen([sys.executable, "-m", "k2jax.train", *CLI, f"--workdir={workdir}",
                           *extra], cwd=REPO, env=env(devices), stdout=subprocess.DEVNULL,
                          stderr=stderr, text=True)


def finish(proc, timeout=900):
  _, err = proc.communicate(timeout=timeout)
  assert proc.returncode == 0, err[-3000:]
  return err


def losses(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return {str(r["step"]): [r["loss"], r["max_logit"]] for r in map(json.loads, f)}


def assert_close(got, want, rtol=1e-5, steps=None):
  steps = steps or sorted(want, key=int)
  np.testing.assert_allclose([got[s] for s in steps], [want[s] for s in steps], rtol=rtol)


def assert_states_close(got_dir, want_dir, rtol=1e-5):
  """Every leaf of two runs' final train states (parallel_worker._save_state: params,
  optimizer moments, master weights, QK-Clip's record, counters) agrees: floats within
  `rtol` of the reference leaf's norm, the rest exactly. The moments sum each step's
  gradients, so this compares every gradient leaf of every step."""
  got, want = (np.load(os.path.join(str(d), "state.npz")) for d in (got_dir, want_dir))
  assert sorted(got.files) == sorted(want.files), set(got.files) ^ set(want.files)
  bad = []
  for k in want.files:
    a, b = got[k], want[k]
    assert a.shape == b.shape, (k, a.shape, b.shape)
    if np.issubdtype(b.dtype, np.floating):
      a, b = a.astype(np.float64), b.astype(np.float64)
      rel = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)
      if not rel <= rtol:
        bad.append(f"{k}: {rel:.1e}")
    elif not np.array_equal(a, b):
      bad.append(f"{k}: {np.sum(a != b)} of {a.size} differ")
  assert not bad, f"{len(bad)} of {len(want.files)} state leaves differ: " + "; ".join(bad[:8])


def free_port():
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


@contextlib.contextmanager
def cores_to_itself():
  """A lock across pytest-xdist's workers (a file lock: one machine). Held by the tests whose
  subprocesses need the machine's cores: two jax.distributed processes must set up gloo's
  contexts within its fixed 30 s, which failed (DEADLINE_EXCEEDED) while the other worker's
  pipeline meshes ran beside them on 2 cores; the pipeline tests hold it too, so the two
  never overlap while the rest of the suite still runs beside either."""
  with open(os.path.join(tempfile.gettempdir(), "k2jax-tests-cores.lock"), "w") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)
