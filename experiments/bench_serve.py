"""k2jax.serve throughput and latency: 1 / 8 / 32 concurrent clients with mixed lengths, against
static batching and against transformers' generate at the same batch; short requests among
long ones; an agent loop with prefix reuse.

    python experiments/bench_serve.py                 # the bench model (random weights), this CPU
    python experiments/bench_serve.py --requests 128 --max_tokens 32

The model is bench_decode's (hidden 256, 4 layers, 16 experts top-2; vocab 264 for the byte
tokenizer), random weights written in the published layout and read by k2jax.interop.hf, so
transformers' DeepseekV3 runs the same weights. Each setting starts the real server
(Starlette + uvicorn, in this process) and drives it with the official `openai` client from N
threads, greedy and without stops, so every request gets exactly the tokens it asks for:
"mixed" requests ask, by turns, max_tokens / 4 and 2 max_tokens tokens (short requests among
long ones). Rows, each a ratio to the one-client baseline measured in the same run:
- continuous: `k2jax.serving.engine` as served (rows join and leave between dispatches);
- static: the same engine admitting a batch only when the last one has ended (what the
  server did before continuous batching, `StaticEngine` below);
- transformers: `generate` on the same prompts in batches of N (left-padded), each batch
  running to its longest request; only the requested tokens count (no server: its ceiling).
"short req s" is the short requests' mean latency. `--only_constrained`: 15 plain clients'
throughput with and without one client beside them whose requests are grammar-constrained
(response_format json_schema), today's engine against an earlier one from git (`--before`),
in the same run: constrained.csv. Every batch bucket is compiled first
(Engine.warmup), then the requests run once as a warm-up. The machine's ceiling (a measured
f32 matmul rate) is printed beside it. CSV: experiments/results/serve/throughput.csv and
agent_loop.csv (--out picks the folder).
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
# k2jax when not installed; last, so that the root's kernels/ hides no installed package
sys.path.append(os.path.dirname(HERE))

from k2jax.serving import chat  # noqa: E402
from k2jax.data import ByteTokenizer  # noqa: E402
from k2jax.serving.engine import Engine  # noqa: E402
from k2jax.serving.serve import Background, make_app  # noqa: E402


class StaticEngine(Engine):
  """Static batching, the baseline: waiting requests are admitted only when every row of the
  running batch has ended (a short request waits for its batch's longest)."""

  def _admit(self) -> None:
    if not any(self._rows):
      super()._admit()


def bench_model():
  """bench_decode's model with the byte tokenizer's vocabulary and a 4k context, random
  weights: (k2jax cfg, params, the transformers model with the same weights)."""
  from bench_decode import bench_model as build
  tok = ByteTokenizer()
  cfg, params, tmodel, _ = build(vocab_size=tok.vocab_size, max_position_embeddings=4096,
                                 bos_token_id=tok.bos_id, eos_token_id=tok.eos_id)
  tmodel.generation_config.pad_token_id = tok.pad_id
  return cfg, params, tmodel


def prompt_text(i: int) -> str:
  return f"request {i}: " + "ab" * (i % 7)


def wanted(i: int, max_tokens: int, mixed: bool) -> int:
  return (max(1, max_tokens // 4) if i % 2 == 0 else 2 * max_tokens) if mixed else max_tokens


def transformers_tokens_per_s(tmodel, *, batch, requests, max_tokens, mixed):
  """transformers' generate over the same prompts in batches of `batch` (left-padded), each
  batch to its longest request; the requested tokens per second."""
  import torch
  tok = ByteTokenizer()
  prompts = [chat.encode([{"role": "user", "content": prompt_text(i)}], tokenizer=tok)
             for i in range(requests)]

  def run(n):
    total = 0
    for s in range(0, n, batch):
      group = prompts[s:s + batch]
      width = max(len(p) for p in group)
      ids = torch.full((len(group), width), tok.pad_id, dtype=torch.long)
      mask = torch.zeros((len(group), width), dtype=torch.long)
      for j, p in enumerate(group):
        ids[j, width - len(p):] = torch.as_tensor(p)
        mask[j, width - len(p):] = 1
      want = [wanted(s + j, max_tokens, mixed) for j in range(len(group))]
      with torch.no_grad():
        tmodel.generate(ids, attention_mask=mask, max_new_tokens=max(want), do_sample=False)
      total += sum(want)
    return total
  run(min(batch, requests))                                         # warm-up
  t0 = time.perf_counter()
  total = run(requests)
  return total / (time.perf_counter() - t0)


def matmul_gflops(n=1024, reps=5):
  a = jnp.ones((n, n), jnp.float32)
  f = jax.jit(lambda x: x @ x)
  f(a).block_until_ready()
  t0 = time.perf_counter()
  for _ in range(reps):
    f(a).block_until_ready()
  return 2 * n ** 3 * reps / (time.perf_counter() - t0) / 1e9


def run(cfg, params, *, clients, max_batch, requests, max_tokens, window_ms, mixed=False,
        static=False):
  """Drive a server with `clients` threads; mixed: every other request asks max_tokens / 4
  tokens and the others 2 max_tokens (short requests among long ones: what continuous
  batching lets leave early); static: `StaticEngine`. -> throughput, and the mean latency of
  the shortest requests."""
  import openai
  engine = (StaticEngine if static else Engine)(cfg, params, ByteTokenizer(),
                                                max_batch=max_batch, window_s=window_ms / 1e3)
  engine.warmup(prompt_tokens=180, max_tokens=max_tokens, sampled=False)   # every batch bucket
  server = Background(make_app(engine, "tiny"))
  client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=600)
  want = lambda i: wanted(i, max_tokens, mixed)

  def one(i):
    t0 = time.perf_counter()
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": prompt_text(i)}],
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
  # a long shared prefix, as agents send (the issue's 2k-token system prompt + tools)
  system = {"role": "system", "content": "You are an agent with tools. Be brief. " * 52}

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


def engine_class(rev: str | None):
  """k2jax.serving.engine.Engine as it is, or as it was at git revision `rev`."""
  if rev is None:
    return Engine
  from from_git import module_at
  return module_at(rev, ("k2jax/serving/engine.py", "k2jax/engine.py"), f"engine_{rev}").Engine


def beside_json(cfg, params, *, engine_cls, json_client: bool, clients: int, requests: int,
                max_tokens: int, window_ms: float) -> dict:
  """`clients` plain clients' greedy requests of `max_tokens`, with (json_client) one more
  client sending response_format json_schema requests back to back the whole time: the
  plain requests' tokens per second, and the JSON client's."""
  import threading

  import openai
  engine = engine_cls(cfg, params, ByteTokenizer(), max_batch=clients + 1,
                      window_s=window_ms / 1e3)
  server = Background(make_app(engine, "tiny"))
  client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=600)
  schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 24}},
            "required": ["s"]}
  stop, json_tokens = threading.Event(), [0]

  def plain(i):
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": prompt_text(i)}],
        max_tokens=max_tokens, temperature=0, stop=None)
    return r.usage.completion_tokens

  def constrained():
    while not stop.is_set():
      r = client.chat.completions.create(
          model="tiny", messages=[{"role": "user", "content": "json please"}],
          max_tokens=max_tokens, temperature=1.0, response_format={
              "type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
      json_tokens[0] += r.usage.completion_tokens
  try:
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
      list(pool.map(plain, range(clients)))                      # compiles
      side = threading.Thread(target=constrained, daemon=True) if json_client else None
      if side:
        side.start()
        time.sleep(1.0)                                          # its grammar is in
      t0 = time.perf_counter()
      tokens = sum(pool.map(plain, range(requests)))
      dt = time.perf_counter() - t0
      stop.set()
      if side:
        side.join()
    return dict(plain_tokens_per_s=tokens / dt, json_tokens_per_s=json_tokens[0] / dt,
                seconds=dt)
  finally:
    server.stop()
    engine.close()


def constrained_rows(cfg, params, args, gflops):
  rows = []
  for engine_name, rev in (("now", None), ("before", args.before)):
    for json_client in (False, True):
      r = beside_json(cfg, params, engine_cls=engine_class(rev), json_client=json_client,
                      clients=15, requests=args.requests, max_tokens=args.max_tokens,
                      window_ms=args.window_ms)
      rows.append(dict(engine=engine_name if rev is None else f"before ({rev})",
                       json_client=json_client, **r))
      print(rows[-1], flush=True)
  for r in rows:
    alone = next(x for x in rows if x["engine"] == r["engine"] and not x["json_client"])
    r["plain_vs_alone"] = r["plain_tokens_per_s"] / alone["plain_tokens_per_s"]
  path = os.path.join(args.out, "constrained.csv")
  with open(path, "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=list(rows[0]) + ["max_tokens", "matmul_gflops"])
    w.writeheader()
    w.writerows([dict(r, max_tokens=args.max_tokens, matmul_gflops=round(gflops, 1))
                 for r in rows])
  print(f"\n15 plain clients, {args.requests} greedy requests of {args.max_tokens} tokens, "
        "with and without a client sending JSON-schema requests beside them")
  print(f"{'engine':18s} {'JSON client':>11s} {'plain tok/s':>11s} {'vs alone':>8s} "
        f"{'JSON tok/s':>10s}")
  for r in rows:
    print(f"{r['engine']:18s} {str(r['json_client']):>11s} {r['plain_tokens_per_s']:11.1f} "
          f"{r['plain_vs_alone']:7.2f}x {r['json_tokens_per_s']:10.1f}")
  print(f"-> {path}")


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--requests", type=int, default=128)
  p.add_argument("--clients", type=int, nargs="+", default=[8, 32])
  p.add_argument("--max_tokens", type=int, default=32)
  p.add_argument("--window_ms", type=float, default=20.0, help="the server's batch window "
                 "(k2jax.serve --batch_window_ms)")
  p.add_argument("--turns", type=int, default=6, help="turns of the agent loop")
  p.add_argument("--only_loop", action="store_true", help="run the agent loop rows only")
  p.add_argument("--only_constrained", action="store_true",
                 help="run the rows of plain clients beside a JSON client only")
  p.add_argument("--before", default="fcba314", help="--only_constrained: the engine to "
                 "compare with (default: the last that ran every row one step a dispatch "
                 "while any row was constrained)")
  p.add_argument("--out", default=os.path.join(HERE, "results", "serve"))
  args = p.parse_args()
  cfg, params, tmodel = bench_model()
  gflops = matmul_gflops()
  os.makedirs(args.out, exist_ok=True)
  print(f"{jax.devices()[0].platform} f32 1024^3 matmul {gflops:.0f} GFLOP/s")
  if args.only_constrained:
    return constrained_rows(cfg, params, args, gflops)
  if not args.only_loop:
    throughput(cfg, params, tmodel, args, gflops)
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
        "~2k tokens) and the turns before, 16 tokens a reply, streamed")
  print(f"{'setting':28s} {'TTFT s':>8s} {'vs off':>7s} {'reused':>7s} {'seconds':>8s}")
  for r in loop:
    print(f"{r['setting']:28s} {r['ttft_s']:8.3f} {r['ttft_vs_off']:6.2f}x "
          f"{r['reused_tokens']:7d} {r['seconds']:8.2f}")
  print(f"-> {path}")


def throughput(cfg, params, tmodel, args, gflops):
  settings = [("1 client", 1, False, "continuous"), ("1 client, mixed", 1, True, "continuous")]
  for n in args.clients:
    settings += [(f"{n} clients, mixed", n, True, kind)
                 for kind in ("continuous", "static", "transformers")]
  rows = []
  for name, clients, mixed, kind in settings:
    if kind == "transformers":
      tps = transformers_tokens_per_s(tmodel, batch=clients, requests=args.requests,
                                      max_tokens=args.max_tokens, mixed=mixed)
      r = dict(requests_per_s=float("nan"), tokens_per_s=tps, rows_per_step=float(clients),
               short_tokens=wanted(0, args.max_tokens, mixed), short_latency_s=float("nan"),
               seconds=float("nan"))
    else:
      r = run(cfg, params, clients=clients, max_batch=max(clients, 8), requests=args.requests,
              max_tokens=args.max_tokens, window_ms=args.window_ms, mixed=mixed,
              static=kind == "static")
    rows.append(dict(setting=name, batching=kind, clients=clients, **r))
    print(f"{name} ({kind}): {r}", flush=True)
  base = rows[0]
  for r in rows:
    r["tokens_vs_1_client"] = r["tokens_per_s"] / base["tokens_per_s"]
    same = [x for x in rows if x["setting"] == r["setting"]]
    r["vs_static"] = r["tokens_per_s"] / next((x["tokens_per_s"] for x in same
                                               if x["batching"] == "static"), float("nan"))
    r["vs_transformers"] = r["tokens_per_s"] / next(
        (x["tokens_per_s"] for x in same if x["batching"] == "transformers"), float("nan"))
  path = os.path.join(args.out, "throughput.csv")
  with open(path, "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=list(rows[0]) + ["max_tokens", "window_ms",
                                                      "matmul_gflops"])
    w.writeheader()
    w.writerows([dict(r, max_tokens=args.max_tokens, window_ms=args.window_ms,
                      matmul_gflops=round(gflops, 1)) for r in rows])
  print(f"\nbench model, {args.requests} requests (mixed: {args.max_tokens // 4} and "
        f"{2 * args.max_tokens} tokens by turns; else {args.max_tokens}), greedy, batch window "
        f"{args.window_ms:g} ms; {gflops:.0f} GFLOP/s f32 matmul")
  print(f"{'setting':18s} {'batching':>12s} {'tok/s':>8s} {'vs 1 client':>11s} {'vs static':>9s} "
        f"{'vs transf.':>10s} {'rows/step':>9s} {'short req s':>11s}")
  for r in rows:
    print(f"{r['setting']:18s} {r['batching']:>12s} {r['tokens_per_s']:8.1f} "
          f"{r['tokens_vs_1_client']:10.2f}x {r['vs_static']:8.2f}x {r['vs_transformers']:9.2f}x "
          f"{r['rows_per_step']:9.2f} {r['short_latency_s']:11.3f}")
  print(f"-> {path}")


if __name__ == "__main__":
  main()
