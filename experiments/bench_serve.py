"""k2jax.serve throughput and latency: 1 client vs 16 concurrent clients, batched vs one request
at a time, and short requests among long ones.

    python experiments/bench_serve.py                 # tiny model (random weights), this CPU
    python experiments/bench_serve.py --requests 64 --max_tokens 64

Each setting starts the real server (Starlette + uvicorn, in this process) and drives it with
the official `openai` client from N threads; every request asks for exactly --max_tokens
tokens (greedy, no stop: the batch's work is fixed). Rows: requests/s and generated tokens/s,
and their ratio to the one-client baseline measured in the same run. "one at a time" is the
same 16 clients against a server with --max_batch 1. "mixed": every other request asks for
max_tokens / 4 tokens, the others 2 max_tokens; "short req s" is the short ones' mean
latency (with static batching they wait for the long rows of their batch). Every batch-size
bucket is compiled first (Engine.warmup), then the same requests run once as a warm-up. The machine's ceiling
(a measured f32 matmul rate) is printed beside it.
CSV: experiments/results/serve/throughput_window20ms.csv (the name carries --window_ms;
--out picks the folder).
"""

import argparse
import concurrent.futures
import csv
import os
import sys
import time

import jax
import jax.numpy as jnp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from k2jax import configs, model  # noqa: E402
from k2jax.data import ByteTokenizer  # noqa: E402
from k2jax.engine import Engine  # noqa: E402
from k2jax.serve import Background, make_app  # noqa: E402


def matmul_gflops(n=1024, reps=5):
  a = jnp.ones((n, n), jnp.float32)
  f = jax.jit(lambda x: x @ x)
  f(a).block_until_ready()
  t0 = time.perf_counter()
  for _ in range(reps):
    f(a).block_until_ready()
  return 2 * n ** 3 * reps / (time.perf_counter() - t0) / 1e9


def run(cfg, params, *, clients, max_batch, requests, max_tokens, window_ms, mixed=False):
  """Drive a server with `clients` threads; mixed: every other request asks max_tokens / 4
  tokens and the others 2 max_tokens (short requests among long ones: what continuous
  batching lets leave early). -> throughput, and the mean latency of the shortest requests."""
  import openai
  engine = Engine(cfg, params, ByteTokenizer(), max_batch=max_batch, window_s=window_ms / 1e3)
  engine.warmup(prompt_tokens=180, max_tokens=max_tokens, sampled=False)   # every batch bucket
  server = Background(make_app(engine, "tiny"))
  client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=600)
  want = lambda i: (max(1, max_tokens // 4) if i % 2 == 0 else 2 * max_tokens) if mixed \
      else max_tokens

  def one(i):
    t0 = time.perf_counter()
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": f"request {i}: " + "ab" * (i % 7)}],
        max_tokens=want(i), temperature=0, stop=None)
    return r.usage.completion_tokens, time.perf_counter() - t0

  try:
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
      # warm-up: the same requests compile every program they need (prefills, continued
      # prompts, dispatches: one per shape bucket)
      list(pool.map(one, range(requests)))
      before = dict(engine.stats)
      t0 = time.perf_counter()
      out = list(pool.map(one, range(requests)))
      dt = time.perf_counter() - t0
    shortest = min(want(i) for i in range(requests))
    short = [s for i, (_, s) in enumerate(out) if want(i) == shortest]
    steps = engine.stats.get("steps", 0) - before.get("steps", 0)
    return dict(requests_per_s=requests / dt, tokens_per_s=sum(n for n, _ in out) / dt,
                rows_per_step=(engine.stats.get("row_steps", 0) - before.get("row_steps", 0))
                / max(steps, 1), short_tokens=shortest,
                short_latency_s=sum(short) / len(short), seconds=dt)
  finally:
    server.stop()
    engine.close()


def agent_loop(cfg, params, *, reuse: bool, turns: int, max_tokens: int):
  """One client in an agent loop: every turn resends the dialog so far (a long system prompt,
  the turns before, a new user message) and streams the reply. -> mean time to first token,
  tokens the engine reused, seconds in all."""
  import openai
  engine = Engine(cfg, params, ByteTokenizer(), max_batch=4, window_s=0.0,
                  reuse_min=32 if reuse else None)
  server = Background(make_app(engine, "tiny"))
  client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=600)
  system = {"role": "system", "content": "You are an agent with tools. Be brief. " * 4}

  def run():
    dialog, ttft = [system], []
    for turn in range(turns):
      dialog.append({"role": "user", "content": f"step {turn}: what next?"})
      t0, first, text = time.perf_counter(), None, ""
      for chunk in client.chat.completions.create(model="tiny", messages=dialog, stream=True,
                                                  max_tokens=max_tokens, temperature=0):
        if chunk.choices and chunk.choices[0].delta.content:
          first = first or time.perf_counter() - t0
          text += chunk.choices[0].delta.content
      ttft.append(first or time.perf_counter() - t0)
      dialog.append({"role": "assistant", "content": text})
    return ttft

  try:
    run()                                            # compiles
    run()          # ... and the shapes of a run that starts from the last one's slots
    before = engine.stats["reused_tokens"]
    t0 = time.perf_counter()
    ttft = run()
    return dict(ttft_s=sum(ttft) / len(ttft), reused_tokens=engine.stats["reused_tokens"] -
                before, seconds=time.perf_counter() - t0)
  finally:
    server.stop()
    engine.close()


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--requests", type=int, default=64)
  p.add_argument("--max_tokens", type=int, default=32)
  p.add_argument("--window_ms", type=float, default=20.0, help="the server's batch window "
                 "(k2jax.serve --batch_window_ms)")
  p.add_argument("--turns", type=int, default=6, help="turns of the agent loop")
  p.add_argument("--only_loop", action="store_true", help="run the agent loop rows only")
  p.add_argument("--out", default=os.path.join(HERE, "results", "serve"))
  args = p.parse_args()
  cfg = configs.get_config("tiny").model
  params = model.init(cfg, jax.random.key(0))
  gflops = matmul_gflops()
  os.makedirs(args.out, exist_ok=True)
  print(f"{jax.devices()[0].platform} f32 1024^3 matmul {gflops:.0f} GFLOP/s")
  if not args.only_loop:
    throughput(cfg, params, args, gflops)
  loop = []
  for reuse in (False, True):
    r = agent_loop(cfg, params, reuse=reuse, turns=args.turns, max_tokens=16)
    loop.append(dict(setting=f"agent loop, prefix reuse {'on' if reuse else 'off'}", **r))
    print(f"{loop[-1]['setting']}: {r}", flush=True)
  for r in loop:
    r["ttft_vs_off"] = r["ttft_s"] / loop[0]["ttft_s"]
  path = os.path.join(args.out, "agent_loop.csv")
  with open(path, "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=list(loop[0]) + ["turns", "matmul_gflops"])
    w.writeheader()
    w.writerows([dict(r, turns=args.turns, matmul_gflops=round(gflops, 1)) for r in loop])
  print(f"\nagent loop: {args.turns} turns, each resending the dialog (a system prompt of "
        "~160 bytes) and the turns before, 16 tokens a reply, streamed")
  print(f"{'setting':28s} {'TTFT s':>8s} {'vs off':>7s} {'reused':>7s} {'seconds':>8s}")
  for r in loop:
    print(f"{r['setting']:28s} {r['ttft_s']:8.3f} {r['ttft_vs_off']:6.2f}x "
          f"{r['reused_tokens']:7d} {r['seconds']:8.2f}")
  print(f"-> {path}")


def throughput(cfg, params, args, gflops):
  settings = [("1 client", 1, 16, False), ("16 clients", 16, 16, False),
              ("16 clients, one at a time", 16, 1, False), ("1 client, mixed", 1, 16, True),
              ("16 clients, mixed", 16, 16, True)]
  rows = []
  for name, clients, max_batch, mixed in settings:
    r = run(cfg, params, clients=clients, max_batch=max_batch, requests=args.requests,
            max_tokens=args.max_tokens, window_ms=args.window_ms, mixed=mixed)
    rows.append(dict(setting=name, clients=clients, max_batch=max_batch, **r))
    print(f"{name}: {r}", flush=True)
  base = rows[0]
  for r in rows:
    r["requests_vs_1_client"] = r["requests_per_s"] / base["requests_per_s"]
    r["tokens_vs_1_client"] = r["tokens_per_s"] / base["tokens_per_s"]
  path = os.path.join(args.out, f"throughput_window{args.window_ms:g}ms.csv")
  with open(path, "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=list(rows[0]) + ["window_ms", "matmul_gflops"])
    w.writeheader()
    w.writerows([dict(r, window_ms=args.window_ms, matmul_gflops=round(gflops, 1)) for r in rows])
  print(f"\ntiny model, {args.requests} requests of {args.max_tokens} tokens each, batch window "
        f"{args.window_ms:g} ms")
  print(f"{'setting':28s} {'req/s':>8s} {'tok/s':>8s} {'vs 1 client':>12s} {'rows/step':>9s} "
        f"{'short req s':>11s}")
  for r in rows:
    print(f"{r['setting']:28s} {r['requests_per_s']:8.2f} {r['tokens_per_s']:8.1f} "
          f"{r['tokens_vs_1_client']:11.2f}x {r['rows_per_step']:9.2f} "
          f"{r['short_latency_s']:11.3f}")
  print(f"-> {path}")


if __name__ == "__main__":
  main()
