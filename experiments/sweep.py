"""A resumable sweep driver for the report's small-scale experiments (experiments/*_sweep.py).

Each sweep is a list of `Run`s: a name and config overrides on top of one base config. Runs
go through the public trainer, `k2jax.training.train.train(config, workdir)`, one workdir each under
experiments/out/<sweep>/ (gitignored). A finished run leaves summary.json there and is not
repeated; an interrupted one resumes from its newest checkpoint (the trainer's own exact
resume), so a killed sweep continues where it stopped when rerun with the same arguments.

    runs = [Run(f"e{e}_s{s}", {"model.n_routed_experts": e, "train.seed": s},
                {"experts": e, "seed": s}) for e in (8, 16) for s in (0, 1)]
    rows = run_sweep("sparsity", runs, base_config(args), args)

`--scale gpu` makes the base model, batch and run length large enough to mean something on
an accelerator; the default (`cpu`) keeps every sweep under an hour on 2 CPU cores.
"""

import argparse
import csv
import dataclasses
import json
import logging
import math
import os
import sys
import time

import numpy as np
from tqdm import tqdm

HERE = os.path.dirname(os.path.abspath(__file__))
# k2jax when not installed; last, so that the root's kernels/ hides no installed package
sys.path.append(os.path.dirname(HERE))

from k2jax import configs  # noqa: E402
from k2jax.training import metrics
from k2jax.training.train import train  # noqa: E402

# Base sizes per scale: (hidden, layers, steps, batch, seq_len, eval_batches).
SCALES = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, steps=2, batch_size=2, seq_len=32,
                 eval_batches=1, eval_every=2, log_every=1, corpus=300_000),  # tests only
    "cpu": dict(hidden_size=128, num_hidden_layers=4, steps=500, batch_size=8, seq_len=128,
                eval_batches=8, eval_every=100, log_every=5),
    "gpu": dict(hidden_size=512, num_hidden_layers=8, steps=4000, batch_size=64, seq_len=512,
                eval_batches=32, eval_every=500, log_every=20),
}


@dataclasses.dataclass(frozen=True)
class Run:
  name: str                 # unique in the sweep: the workdir's name
  overrides: dict           # "group.key" -> value, applied to the base config
  labels: dict              # columns of the results table (e.g. experts, seed)


def parser(description: str, default_out: str) -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=description)
  p.add_argument("--scale", choices=sorted(SCALES), default="cpu",
                 help="cpu: < 1 h on 2 cores; gpu: sizes that mean something on an accelerator")
  p.add_argument("--seeds", type=int, default=3)
  p.add_argument("--steps", type=int, default=None, help="override the scale's run length")
  p.add_argument("--out", default=os.path.join(HERE, "results", default_out),
                 help="CSV + PNG destination")
  p.add_argument("--workdir", default=None, help="run directories (default experiments/out/...)")
  p.add_argument("--fresh", action="store_true", help="discard finished runs and start over")
  return p


def base_config(args, **model_overrides):
  """The tiny preset at the chosen scale, with a WSD schedule proportional to the run length
  (8% warmup, cosine over the last 25%) and checkpoints every quarter (resumable)."""
  s = dict(SCALES[args.scale])
  steps = args.steps or s.pop("steps")
  s.pop("steps", None)
  c = configs.get_config("tiny")
  c.data.max_corpus_bytes = s.pop("corpus", 0)
  c.model.update(dict(hidden_size=s.pop("hidden_size"), num_hidden_layers=s.pop("num_hidden_layers"),
                      **model_overrides))
  c.optimizer.update(dict(learning_rate=1e-2, end_learning_rate=1e-3,
                          warmup_steps=max(1, steps // 13), decay_steps=steps // 4))
  c.train.update(dict(steps=steps, checkpoint_every=max(1, steps // 4), keep_checkpoints=1,
                      async_checkpoint=False, **s))
  return c


def _apply(config, overrides: dict):
  c = config.copy_and_resolve_references()
  for key, value in overrides.items():
    group, _, rest = key.partition(".")
    node = c[group]
    *path, last = rest.split(".")
    for p in path:
      node = node[p]
    node[last] = value
  return c


def summarize(rows: list[dict], steps: int) -> dict:
  """Final numbers of one run: eval loss at the end, train loss averaged over the last 10%
  of steps, the max logit's peak and end, and the measured step throughput."""
  col = lambda k, rs=rows: np.array([r[k] for r in rs if k in r], float)
  tail = [r for r in rows if r.get("step", 0) > 0.9 * steps and "loss" in r]
  tps = col("tokens_per_s")
  return dict(final_eval_loss=float(col("eval_loss")[-1]) if len(col("eval_loss")) else math.nan,
              final_train_loss=float(np.mean(col("loss", tail))) if tail else math.nan,
              peak_max_logit=float(col("max_logit").max()),
              final_max_logit=float(col("max_logit")[-1]),
              clipped_heads_ever_frac=float(col("clipped_heads_ever_frac")[-1]),
              tokens_per_s=float(np.median(tps[1:] if len(tps) > 1 else tps)))


def run_sweep(sweep: str, runs: list[Run], base, args) -> list[dict]:
  """Train every run (skipping finished ones) -> one row per run: labels + summary."""
  workdir = args.workdir or os.path.join(HERE, "out", sweep)
  os.makedirs(workdir, exist_ok=True)
  logging.getLogger("k2jax").setLevel(logging.WARNING)
  rows = []
  bar = tqdm(runs, desc=sweep, unit="run")
  for run in bar:
    wd = os.path.join(workdir, run.name)
    done = os.path.join(wd, "summary.json")
    if args.fresh and os.path.exists(wd):
      import shutil
      shutil.rmtree(wd)
    if not os.path.exists(done):
      bar.set_postfix_str(run.name)
      config = _apply(base, run.overrides)
      t0 = time.perf_counter()
      train(config, wd)
      summary = dict(summarize(metrics.read(wd), config.train.steps),
                     wall_s=round(time.perf_counter() - t0, 1))
      with open(done, "w") as f:
        json.dump(summary, f)
    with open(done) as f:
      rows.append({"run": run.name, **run.labels, **json.load(f)})
  return rows


def curves(sweep: str, runs: list[Run], args, key: str) -> dict:
  """{run name: (steps, values of `key`)} from each run's metrics.jsonl."""
  workdir = args.workdir or os.path.join(HERE, "out", sweep)
  out = {}
  for run in runs:
    rs = [r for r in metrics.read(os.path.join(workdir, run.name)) if key in r]
    out[run.name] = (np.array([r["step"] for r in rs]), np.array([r[key] for r in rs], float))
  return out


def mean_sem(values) -> tuple[float, float]:
  """Mean and standard error over seeds (0 for one seed)."""
  v = np.asarray(values, float)
  return float(v.mean()), float(v.std(ddof=1) / math.sqrt(len(v))) if len(v) > 1 else 0.0


def write_csv(path: str, rows: list[dict]) -> None:
  os.makedirs(os.path.dirname(path), exist_ok=True)
  fields = list(dict.fromkeys(k for r in rows for k in r))
  with open(path, "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=fields)
    w.writeheader()
    w.writerows(rows)


def claim_table(rows: list[tuple[str, str, str]]) -> str:
  """Print-ready lines: the report's claim, our number, verdict."""
  lines = []
  for claim, ours, verdict in rows:
    lines += [f"report: {claim}", f"  ours: {ours}", f"  -> {verdict}"]
  return "\n".join(lines)
