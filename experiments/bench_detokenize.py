"""The engine's host work per generated token, by the reply's length: today's engine against
an earlier one (from git) in the same run.

    python experiments/bench_detokenize.py [--tokens 32768] [--before c0143b6]

Feeds one row a long reply a token at a time through `Engine._on_token` (what the engine's
thread runs for every token it hands a row: text, stop strings, held markers, the streamed
delta), with no model: the reply is English text with a few multi-byte characters, byte
tokens (k2jax.data.ByteTokenizer: the most tokens per character), two stop strings that
never occur and the tool-call section held, as a chat request with tools has them. Reports
the mean host time per token over the 256 tokens before 1k, 8k and 32k tokens, and the ratio
before / now. The floor beside it: the tokenizer's decode() of one token. Writes
experiments/results/serve/detokenize.csv.
"""

import argparse
import csv
import os
import sys
import time

# k2jax when not installed; last, so that the root's kernels/ hides no installed package
sys.path.append(os.path.join(os.path.dirname(__file__), ".."))
sys.path.append(os.path.dirname(os.path.abspath(__file__)))      # from_git

from k2jax import configs  # noqa: E402
from k2jax.data import ByteTokenizer  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "experiments", "results", "serve")
WINDOW = 256


def engine_module(rev: str | None):
  """k2jax.serving.engine as it is, or as it was at git revision `rev`."""
  if rev is None:
    from k2jax.serving import engine
    return engine
  from from_git import module_at
  return module_at(rev, ("k2jax/serving/engine.py", "k2jax/engine.py"), f"engine_{rev}")


def reply_ids(tok, n: int) -> list[int]:
  text = ("The engine hands each row its token; caf\u00e9 na\u00efve \u4e2d\u6587 "
          "and a long answer follows, line after line.\n")
  ids = list(tok.encode(text * (n // len(text.encode()) + 1)))
  return [int(i) for i in ids[:n]]


def per_token(mod, tok, ids, marks) -> dict[int, float]:
  """Seconds per token over the WINDOW tokens before each mark."""
  cfg = configs.get_config("tiny").model
  engine = mod.Engine(cfg, None, tok, max_batch=1, max_len=cfg.max_position_embeddings)
  job = mod.Job(prompt=[0], max_tokens=len(ids) + 1, emit=lambda e: None,
                stop=["</answer>", "Observation:"], hold_tool_calls=True)
  row = mod._Row(job, 0, engine.stop_text, 0)
  row.slot = 0
  engine._rows[0] = row
  times = []
  for i in ids:
    t0 = time.perf_counter()
    engine._on_token(row, i)
    times.append(time.perf_counter() - t0)
  engine.close()
  return {m: sum(times[m - WINDOW:m]) / WINDOW for m in marks}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--tokens", type=int, default=32768)
  p.add_argument("--before", default="c0143b6",
                 help="the git revision of the engine to compare with (default: the last "
                 "one that decoded every id again each token)")
  a = p.parse_args(argv)
  tok = ByteTokenizer()
  marks = [m for m in (1024, 8192, 32768) if m <= a.tokens]
  ids = reply_ids(tok, max(marks))
  t0 = time.perf_counter()
  for i in ids[:4096]:
    tok.decode([i])
  floor = (time.perf_counter() - t0) / 4096
  now = per_token(engine_module(None), tok, ids, marks)
  before = per_token(engine_module(a.before), tok, ids, marks)
  rows = [dict(tokens=m, now_us=round(now[m] * 1e6, 1), before_us=round(before[m] * 1e6, 1),
               before_over_now=round(before[m] / now[m], 1),
               decode_one_token_us=round(floor * 1e6, 2)) for m in marks]
  print(f"host time per token of one row (mean of the {WINDOW} tokens before each length); "
        f"floor: decode() of one token {floor * 1e6:.2f} us")
  print("tokens | now us | before us | before / now")
  for r in rows:
    print(f"{r['tokens']} | {r['now_us']} | {r['before_us']} | {r['before_over_now']}")
  os.makedirs(OUT, exist_ok=True)
  with open(os.path.join(OUT, "detokenize.csv"), "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows(rows)


if __name__ == "__main__":
  main()
