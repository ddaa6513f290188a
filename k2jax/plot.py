"""Plot a run's curves: `python -m k2jax.plot DIR [--out DIR/curves.png]`.

Left: training and eval loss. Right: max attention logit per step (overall and per layer),
with the QK-Clip threshold tau when the run clipped.
"""

import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from k2jax import metrics  # noqa: E402


def plot(workdir: str, out: str | None = None) -> str:
  rows = metrics.read(workdir)
  out = out or os.path.join(workdir, "curves.png")
  cfg_path = os.path.join(workdir, "config.json")
  opt = json.load(open(cfg_path)).get("optimizer", {}) if os.path.exists(cfg_path) else {}
  fig, (ax_loss, ax_logit) = plt.subplots(1, 2, figsize=(11, 4))
  tr = [(r["step"], r["loss"]) for r in rows if "loss" in r]
  ev = [(r["step"], r["eval_loss"]) for r in rows if r.get("eval_loss") is not None]
  if tr:
    ax_loss.plot(*zip(*tr), label="train loss")
  if ev:
    ax_loss.plot(*zip(*ev), "o-", label="eval loss")
  ax_loss.set(xlabel="step", ylabel="loss (nats/token)", title="loss")
  ax_loss.legend()
  ml = [r for r in rows if "max_logit" in r]
  if ml:
    steps = [r["step"] for r in ml]
    per_layer = list(zip(*[r["max_logits_per_layer"] for r in ml]))
    for i, layer in enumerate(per_layer):
      ax_logit.plot(steps, layer, lw=0.8, alpha=0.6, label=f"layer {i}")
    ax_logit.plot(steps, [r["max_logit"] for r in ml], "k", lw=1.5, label="max")
  if opt.get("name") in ("muonclip", "adamw_qk_clip"):
    ax_logit.axhline(opt["tau"], color="r", ls="--", label=f"tau = {opt['tau']:g}")
  ax_logit.set(xlabel="step", ylabel="max scaled attention logit", title="max logits")
  ax_logit.legend(fontsize=7, ncol=2)
  fig.suptitle(os.path.basename(os.path.abspath(workdir)))
  fig.tight_layout()
  fig.savefig(out, dpi=120)
  plt.close(fig)
  return out


def main(argv=None):
  p = argparse.ArgumentParser(prog="python -m k2jax.plot", description=__doc__)
  p.add_argument("workdir")
  p.add_argument("--out", default=None)
  args = p.parse_args(argv)
  try:
    print(plot(args.workdir, args.out))
  except FileNotFoundError as e:
    print(f"k2jax.plot: error: {e}", file=sys.stderr)
    raise SystemExit(2)


if __name__ == "__main__":
  main()
