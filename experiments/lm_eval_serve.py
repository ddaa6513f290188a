"""lm-evaluation-harness against k2jax.serve, end to end and offline: a real harness run.

    pip install "lm_eval>=0.4"          # or a separate venv: --lm_eval /path/to/bin/lm_eval
    python experiments/lm_eval_serve.py                      # the tiny model, random weights
    python experiments/lm_eval_serve.py --workdir runs/tiny  # a trained run

Starts the real server (in this process) and runs the `lm_eval` command on the task in
experiments/lm_eval/ (12 multiple-choice items in a local JSONL: nothing is downloaded) with
the harness's `local-completions` model, the way its users point it at vLLM: log-likelihoods
through /v1/completions (echo + logprobs, max_tokens 0 / 1) and tokens through the server's
/tokenize (tokenizer_backend=remote). Prints the harness's accuracy and what the server
counted; CSV: experiments/results/serve/lm_eval.csv (--out picks the folder). Random weights
score at chance (1/3): the run shows the plumbing, not a model.
"""

import argparse
import csv
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
# k2jax when not installed; last, so that the root's kernels/ hides no installed package
sys.path.append(os.path.dirname(HERE))

TASK = "k2jax_tiny_facts"


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--workdir", help="a k2jax.train run to serve (default: random tiny weights)")
  p.add_argument("--lm_eval", default=shutil.which("lm_eval") or "lm_eval",
                 help="the harness's command")
  p.add_argument("--out", default=os.path.join(HERE, "results", "serve"))
  args = p.parse_args()

  import jax
  from k2jax import configs, model
  from k2jax.data import ByteTokenizer
  from k2jax.serving.engine import Engine
  from k2jax.serving.serve import Background, make_app
  if args.workdir:
    from k2jax.serving.generate import load
    cfg, params, tok = load(argparse.Namespace(workdir=args.workdir, hf=None))
  else:
    cfg = configs.get_config("tiny").model
    params, tok = model.init(cfg, jax.random.key(0)), ByteTokenizer()
  engine = Engine(cfg, params, tok, max_batch=8, window_s=0.01)
  with Background(make_app(engine, "tiny")) as server, tempfile.TemporaryDirectory() as tmp:
    model_args = ",".join([
        "model=tiny", f"base_url={server.url}/completions", "tokenizer_backend=remote",
        "tokenized_requests=True", "num_concurrent=4", "max_retries=1"])
    cmd = [args.lm_eval, "--model", "local-completions", "--model_args", model_args,
           "--tasks", TASK, "--include_path", os.path.join(HERE, "lm_eval"),
           "--output_path", tmp]
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    t0 = time.perf_counter()
    # cwd: the task's data_files path is relative to it
    run = subprocess.run(cmd, cwd=os.path.join(HERE, "lm_eval"), env=env, text=True,
                         capture_output=True)
    seconds = time.perf_counter() - t0
    if run.returncode:
      print(run.stdout[-3000:], run.stderr[-5000:], sep="\n")
      raise SystemExit(f"lm_eval failed (exit {run.returncode})")
    files = glob.glob(os.path.join(tmp, "**", "results_*.json"), recursive=True)
    result = json.load(open(files[0]))["results"][TASK]
    metrics = urllib.request.urlopen(server.url.removesuffix("/v1") + "/metrics").read().decode()
  engine.close()
  served = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("k2jax_request_success_total{"))
  row = dict(task=TASK, model=args.workdir or "tiny (random weights)",
             acc=result["acc,none"], acc_stderr=result.get("acc_stderr,none"),
             completions_served=int(served), seconds=round(seconds, 1))
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, "lm_eval.csv")
  with open(path, "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=list(row))
    w.writeheader()
    w.writerow(row)
  print(f"\nlm-evaluation-harness local-completions -> k2jax.serve: {TASK} "
        f"acc {row['acc']:.3f} (+- {row['acc_stderr'] or 0:.3f}), {row['completions_served']} "
        f"completions served, {seconds:.0f} s\n-> {path}")


if __name__ == "__main__":
  main()
