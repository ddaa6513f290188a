"""Plot a run's curves: `python -m k2jax.plot DIR [--out DIR/curves.png]`.

Left: training and eval loss (an RL run: mean reward per iteration, overall and per
environment). Right: max attention logit per step (overall and, where logged, per layer),
with the QK-Clip threshold tau when some head went past it (the run clipped). An RL run has a
second row: greedy accuracy on each environment's fixed eval set with the fraction of samples
truncated, and the sampler-vs-trainer log-probability gap with the KL to the initial policy.
DIR is a run directory of k2jax.train, k2jax.sft or k2jax.rl, or its metrics.jsonl.
"""

import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from k2jax.training import metrics  # noqa: E402


def _paths(workdir: str, out: str | None) -> tuple[str, str]:
  """(run directory, output image) or ValueError naming the problem and the fix."""
  if os.path.isfile(workdir) and os.path.basename(workdir) == "metrics.jsonl":
    workdir = os.path.dirname(os.path.abspath(workdir))   # the file itself: its run
  if not os.path.isdir(workdir):
    raise ValueError(f"{workdir}: no such run directory; pass the --workdir of a k2jax.train, "
                     "sft or rl run")
  out = out or os.path.join(workdir, "curves.png")
  ext = os.path.splitext(out)[1].lower().lstrip(".")
  formats = plt.gcf().canvas.get_supported_filetypes()
  plt.close("all")
  if ext not in formats:
    what = f".{ext}" if ext else "a file without an extension"
    raise ValueError(f"--out {out}: matplotlib cannot write {what}; use one of "
                     + ", ".join("." + f for f in ("png", "pdf", "svg") if f in formats))
  if not os.path.isdir(os.path.dirname(os.path.abspath(out))):
    raise ValueError(f"--out {out}: its directory does not exist")
  return workdir, out


def plot(workdir: str, out: str | None = None) -> str:
  """Draws the run's curves into `out` (default DIR/curves.png) and returns its path.

  Raises ValueError (one line) for a path that is not a run, an output format matplotlib
  cannot write, or a run that has logged nothing yet."""
  workdir, out = _paths(workdir, out)
  rows = metrics.read(workdir)
  if not rows:
    raise ValueError(f"{os.path.join(workdir, 'metrics.jsonl')} has no rows yet: plot after "
                     "the run has logged a step")
  cfg_path = os.path.join(workdir, "config.json")
  try:
    with open(cfg_path) as f:
      opt = json.load(f).get("optimizer", {})
  except (OSError, ValueError):
    opt = {}
  fig = draw(rows, opt, os.path.basename(os.path.abspath(workdir)))
  fig.savefig(out, dpi=120)
  plt.close(fig)
  return out


def _lines(ax, rows, keys, style=""):
  for k in keys:
    pts = [(r["step"], r[k]) for r in rows if r.get(k) is not None]
    if pts:
      ax.plot(*zip(*pts), style, lw=1, label=k)


def _rl_panels(rows, ax_eval, ax_gap):
  """An RL run's second row: held-out greedy accuracy per environment and the fraction of
  samples truncated; the sampler-vs-trainer log-probability gap and the KL to the initial
  policy (log scale: the gap should sit near float rounding)."""
  keys = sorted({k for r in rows for k in r if k.startswith("eval_accuracy/")})
  _lines(ax_eval, rows, keys, "o-")
  _lines(ax_eval, rows, ["truncated_frac"], ":")
  ax_eval.set(xlabel="iteration", ylabel="fraction", title="greedy eval accuracy; truncated")
  if ax_eval.get_legend_handles_labels()[0]:     # a run logging none of them draws no lines
    ax_eval.legend(fontsize=7)
  _lines(ax_gap, rows, ["logp_gap_sampler_trainer", "kl_to_init"])
  if any(r.get(k, 0) > 0 for r in rows for k in ("logp_gap_sampler_trainer", "kl_to_init")):
    ax_gap.set_yscale("log")
    ax_gap.legend(fontsize=7)
  ax_gap.set(xlabel="iteration", title="|log pi_sampler - log pi_trainer|; KL to init")


def draw(rows: list[dict], opt: dict, title: str):
  """The figure of metrics rows (`opt`: the run's optimizer config, for tau)."""
  rl = any("mean_reward" in r for r in rows)
  if rl:
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    (ax_left, ax_logit), (ax_eval, ax_gap) = axes
    _rl_panels(rows, ax_eval, ax_gap)
  else:
    fig, (ax_left, ax_logit) = plt.subplots(1, 2, figsize=(11, 4))
  if rl:   # an RL run
    keys = ["mean_reward"] + sorted({k for r in rows for k in r if k.startswith("reward/")})
    for k in keys:
      pts = [(r["step"], r[k]) for r in rows if r.get(k) is not None]
      if pts:
        ax_left.plot(*zip(*pts), "k" if k == "mean_reward" else "", lw=1.5 if k == "mean_reward"
                     else 0.8, label=k.replace("mean_reward", "mean reward"))
    ax_left.set(xlabel="iteration", ylabel="reward", title="reward")
  else:
    tr = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    ev = [(r["step"], r["eval_loss"]) for r in rows if r.get("eval_loss") is not None]
    if tr:
      ax_left.plot(*zip(*tr), label="train loss")
    if ev:
      ax_left.plot(*zip(*ev), "o-", label="eval loss")
    ax_left.set(xlabel="step", ylabel="loss (nats/token)", title="loss")
  ax_left.legend(fontsize=7)
  ml = [r for r in rows if r.get("max_logit") is not None]
  if ml:
    steps = [r["step"] for r in ml]
    per_layer = [r["max_logits_per_layer"] for r in ml if "max_logits_per_layer" in r]
    if len(per_layer) == len(ml):
      for i, layer in enumerate(zip(*per_layer)):
        ax_logit.plot(steps, layer, lw=0.8, alpha=0.6, label=f"layer {i}")
    ax_logit.plot(steps, [r["max_logit"] for r in ml], "k", lw=1.5, label="max")
  clipped = any((r.get("clipped_heads") or 0) > 0 or (r.get("clipped_heads_ever_frac") or 0) > 0
                for r in rows)
  if clipped and "tau" in opt:
    ax_logit.axhline(opt["tau"], color="r", ls="--", label=f"tau = {opt['tau']:g}")
  ax_logit.set(xlabel="step", ylabel="max scaled attention logit", title="max logits")
  if ml:
    ax_logit.legend(fontsize=7, ncol=2)
  fig.suptitle(title)
  fig.tight_layout()
  return fig


def main(argv=None):
  p = argparse.ArgumentParser(prog="python -m k2jax.plot", description=__doc__.splitlines()[0])
  p.add_argument("workdir", help="a run directory (or its metrics.jsonl)")
  p.add_argument("--out", default=None, help="image to write (.png, .pdf, .svg; default "
                 "DIR/curves.png)")
  args = p.parse_args(argv)
  try:
    print(plot(args.workdir, args.out))
  except (OSError, ValueError) as e:
    print(f"k2jax.plot: error: {str(e).splitlines()[0]}", file=sys.stderr)
    raise SystemExit(2)


if __name__ == "__main__":
  main()
