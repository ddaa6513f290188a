"""Moonshot's K2 Vendor Verifier (tool-call schema accuracy) against k2jax.serve, end to end.

Prerequisites (the verifier is not vendored here: it is Moonshot's, and we run it unmodified):

    git clone https://github.com/MoonshotAI/K2-Vendor-Verifier /tmp/k2vv     # tool_calls_eval.py
    python3 -m venv /tmp/k2vv-venv && /tmp/k2vv-venv/bin/pip install megfile loguru \\
        jsonschema openai httpx tqdm 'transformers>=4.57'   # torch is not needed to import it
    python -m k2jax.train --config k2jax/configs/tiny.py --workdir runs/tiny      # 2 min
    python -m k2jax.sft --config tiny_sft --workdir runs/sft --init runs/tiny     # 6 min

Run:

    python experiments/k2vv_serve.py --workdir runs/sft \\
        --python /tmp/k2vv-venv/bin/python --verifier /tmp/k2vv/tool_calls_eval.py

Starts the real server (make_app over an Engine, in this process, on a free port) on the SFT
run and runs `tool_calls_eval.py TESTSET --base-url ... --model ...` as a subprocess. The
verifier sends each JSONL line as a chat request (streamed ones are reassembled from their
deltas), and counts a reply whose finish_reason is "tool_calls" as valid when every call's
arguments parse as JSON and validate against the tool's `parameters` schema. Its official test
set is not public, so we build one in its format: held-out arithmetic problems (k2jax.rl.envs'
"heldout" split, which no SFT dialog contains), each a user turn with k2jax.sft's calculator
tool and tool_choice "auto", once streamed and once not (same problem, so the two replies can
be compared). It is kept as a fixture, experiments/k2vv/calculator_heldout.jsonl (--rebuild
writes it again).

Prints one table (streamed / not streamed / all: requests, finish tool_calls, valid, invalid,
stop, others, failed, schema accuracy = valid / tool_calls) and writes
experiments/results/serve/k2vv.csv (--out picks the folder). Besides the verifier's verdict we
check every returned call ourselves (jsonschema, id / type / name shape) and that each
streamed reply has the structure of its non-streamed twin; a failing reply is printed with
its request. The verifier's own files (results.jsonl, summary.json, its log) are kept under
experiments/out/k2vv/ (--keep).

The tiny model after tiny_sft's 300 steps opens a call section for every request (its SFT
dialogs carry tools exactly when they call one), so all 128 replies end in tool_calls; under
"auto" the section it opens is sampled under the schema (k2jax.serving.chat.ToolSectionConstraint),
which is what the verifier's schema accuracy measures here. The expressions themselves are
wrong at 300 steps (none of the 64 is the question's; a schema does not check that, and
experiments/rl_arithmetic.py trains 2,500 steps for it). Two cores: ~1 minute for 128 requests.
"""

import argparse
import csv
import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# k2jax when not installed; last, so that the root's kernels/ hides no installed package
sys.path.append(os.path.dirname(HERE))

FIXTURE = os.path.join(HERE, "k2vv", "calculator_heldout.jsonl")
CALL_ID = re.compile(r"functions\.([\w\.]+):(\d+)$")   # K2's call ids, as the verifier parses them


def build_testset(problems: int, seed: int, max_tokens: int, temperature: float) -> list[dict]:
  """Request bodies in the verifier's format: `problems` distinct held-out arithmetic problems,
  each once with "stream": false and once with "stream": true (half the set streamed)."""
  from k2jax import sft
  # Unit conversions are left out: k2jax.sft draws them from a few hundred cases that training
  # also sees, so only the arithmetic "heldout" split is held out. Both the tool and no-tool
  # dialogs of the split are used (we keep only the user turn), and every request carries the
  # tools: under "auto" it is the model that decides whether to call.
  seen, out = set(), []
  for d in sft.default_dialogs(n=problems * 4, seed=seed, split="heldout", conversions=0.0):
    prompt = []
    for m in d["messages"]:     # system / user turns up to the first assistant turn
      if m["role"] == "assistant":
        break
      prompt.append(m)
    key = json.dumps(prompt)
    if key in seen:
      continue
    seen.add(key)
    for stream in (False, True):
      out.append({"model": "tiny", "messages": prompt, "tools": sft.CALCULATOR,
                  "tool_choice": "auto", "stream": stream, "max_tokens": max_tokens,
                  "temperature": temperature})
    if len(seen) == problems:
      return out
  raise SystemExit(f"only {len(seen)} distinct held-out problems in {problems * 4} dialogs")


def calls_of(result: dict) -> list[dict]:
  """The tool calls of a verifier result's first choice ([] for a failed request)."""
  choice = ((result.get("response") or {}).get("choices") or [{}])[0]
  return (choice.get("message") or {}).get("tool_calls") or []


def check_call(call: dict, tools: list[dict]) -> str | None:
  """What is wrong with one returned tool call (our own check, independent of the verifier's),
  or None. The verifier only validates arguments; a client also needs the id / type / name."""
  import jsonschema
  fn = call.get("function") or {}
  schemas = {t["function"]["name"]: t["function"].get("parameters") for t in tools}
  if call.get("type") != "function":
    return f"type {call.get('type')!r}"
  if fn.get("name") not in schemas:
    return f"name {fn.get('name')!r} is not among the tools {sorted(schemas)}"
  m = CALL_ID.match(call.get("id") or "")
  if not m or m.group(1) != fn.get("name"):
    return f"id {call.get('id')!r} is not functions.{fn.get('name')}:N"
  if not isinstance(fn.get("arguments"), str):
    return f"arguments of type {type(fn.get('arguments')).__name__}, not a JSON string"
  try:
    args = json.loads(fn["arguments"])
  except json.JSONDecodeError as e:
    return f"arguments are not JSON ({e.msg}): {fn['arguments']!r}"
  try:
    jsonschema.validate(args, schemas[fn["name"]])
  except jsonschema.ValidationError as e:
    return f"arguments {fn['arguments']!r}: {e.message}"
  return None


def shape(result: dict) -> dict:
  """A reply's structure, the part streaming must not change: finish_reason, and per call its
  index in the id, type, name and argument keys. The message's other fields differ by
  construction (the verifier rebuilds a streamed message from deltas, with content "" where a
  non-streamed one has null), so they are left out."""
  out = []
  for c in calls_of(result):
    fn = c.get("function") or {}
    try:
      keys = sorted(json.loads(fn.get("arguments") or ""))
    except (json.JSONDecodeError, TypeError):
      keys = None
    out.append((c.get("id"), c.get("type"), fn.get("name"), keys))
  return {"finish_reason": result.get("finish_reason"), "calls": out}


def tally(results: list[dict]) -> dict:
  """The verifier's summary counts (its compute_summary's rules) over `results`."""
  t = dict(requests=len(results), tool_calls=0, valid=0, invalid=0, stop=0, others=0, failed=0)
  for r in results:
    t["failed"] += r.get("status") != "success"
    f = r.get("finish_reason")
    if f == "tool_calls":
      t["tool_calls"] += 1
      t["valid" if r.get("tool_calls_valid") else "invalid"] += 1
    elif f == "stop":
      t["stop"] += 1
    elif f:
      t["others"] += 1
  t["schema_accuracy"] = t["valid"] / t["tool_calls"] if t["tool_calls"] else None
  return t


def newest_step(workdir: str) -> int | None:
  steps = [int(s) for s in os.listdir(os.path.join(workdir, "checkpoints")) if s.isdigit()]
  return max(steps) if steps else None


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--workdir", required=True, help="the SFT run to serve (k2jax.sft's workdir)")
  p.add_argument("--verifier", required=True,
                 help="path to K2-Vendor-Verifier's tool_calls_eval.py (run unmodified)")
  p.add_argument("--python", default=sys.executable,
                 help="the interpreter with the verifier's dependencies (a separate venv)")
  p.add_argument("--testset", default=FIXTURE, help="JSONL of request bodies (built if absent)")
  p.add_argument("--rebuild", action="store_true", help="write --testset again")
  p.add_argument("--problems", type=int, default=64,
                 help="distinct problems when building (each sent streamed and not)")
  p.add_argument("--seed", type=int, default=1, help="default_dialogs seed when building")
  # the prompt (tool declaration + default system turn + question) is ~445 byte tokens of the
  # tiny model's 1024; a call section is ~175 (the byte tokenizer spells K2's call markers out
  # byte by byte), so 256 holds a call with room to spare and still fits the context
  p.add_argument("--max_tokens", type=int, default=256)
  p.add_argument("--temperature", type=float, default=0.0,
                 help="in each request; 0 (greedy) makes the streamed and non-streamed twins "
                      "comparable call for call")
  p.add_argument("--limit", type=int, help="send only the first N lines (a quick probe)")
  p.add_argument("--concurrency", type=int, default=8, help="the verifier's --concurrency")
  p.add_argument("--max_batch", type=int, default=8, help="the engine's decode slots")
  p.add_argument("--model", default="tiny", help="the name served and passed as --model")
  p.add_argument("--out", default=os.path.join(HERE, "results", "serve"))
  p.add_argument("--keep", default=os.path.join(HERE, "out", "k2vv"),
                 help="folder for the verifier's results.jsonl, summary.json and log")
  args = p.parse_args()

  if args.rebuild or not os.path.exists(args.testset):
    reqs = build_testset(args.problems, args.seed, args.max_tokens, args.temperature)
    os.makedirs(os.path.dirname(os.path.abspath(args.testset)), exist_ok=True)
    with open(args.testset, "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in reqs)
    print(f"wrote {len(reqs)} requests -> {args.testset}")
  os.makedirs(args.keep, exist_ok=True)
  testset = args.testset
  if args.limit:
    with open(args.testset) as f:
      lines = [line for line in f if line.strip()][:args.limit]
    testset = os.path.join(args.keep, "testset.jsonl")
    with open(testset, "w") as f:
      f.writelines(lines)
  results_path = os.path.join(args.keep, "results.jsonl")
  summary_path = os.path.join(args.keep, "summary.json")
  log_path = os.path.join(args.keep, "verifier.log")

  from k2jax.serving.engine import Engine
  from k2jax.serving.generate import load
  from k2jax.serving.serve import Background, make_app
  cfg, params, tok = load(argparse.Namespace(workdir=args.workdir, hf=None))
  engine = Engine(cfg, params, tok, max_batch=args.max_batch, window_s=0.01)
  with Background(make_app(engine, args.model)) as server:
    cmd = [args.python, args.verifier, testset, "--base-url", server.url, "--model", args.model,
           # the client refuses to start without a key; the server (no --api-key) ignores it
           "--api-key", "unused", "--concurrency", str(args.concurrency),
           "--output", results_path, "--summary", summary_path]
    print("$ " + " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
      # cwd: the verifier writes nothing else, but keep any stray file out of the checkout
      run = subprocess.run(cmd, cwd=args.keep, stdout=log, stderr=subprocess.STDOUT, text=True)
    seconds = time.perf_counter() - t0
  engine.close()
  if run.returncode:
    print(open(log_path).read()[-5000:])
    raise SystemExit(f"the verifier failed (exit {run.returncode}); log: {log_path}")

  with open(results_path) as f:
    results = [json.loads(line) for line in f if line.strip()]
  summary = json.load(open(summary_path))
  total = tally(results)
  # our tally follows the verifier's rules; a mismatch would mean we misread its files
  for ours, theirs in (("tool_calls", "finish_tool_calls"), ("valid", "successful_tool_call_count"),
                       ("invalid", "schema_validation_error_count"), ("stop", "finish_stop"),
                       ("others", "finish_others"), ("failed", "failure_count")):
    if total[ours] != summary[theirs]:
      raise SystemExit(f"results.jsonl gives {ours} = {total[ours]}, summary.json {theirs} = "
                       f"{summary[theirs]}")

  # our own check of every returned call, whatever finish_reason the reply has
  # (and every request the verifier gave up on: its error object is the "response")
  problems = []
  for r in results:
    whys = [why for c in calls_of(r) for why in [check_call(c, r["request"].get("tools") or [])]
            if why]
    if r.get("status") != "success":
      whys.append("the request failed")
    elif r.get("finish_reason") == "tool_calls" and not r.get("tool_calls_valid") and not whys:
      whys.append("the verifier counts it invalid")
    problems += [(r, why) for why in whys]

  # streamed vs not: the twins of a problem (same messages) must have the same structure
  twins: dict[str, dict] = {}
  for r in results:
    twins.setdefault(json.dumps(r["request"]["messages"]), {})[bool(r["request"].get("stream"))] = r
  pairs = [(t[False], t[True]) for t in twins.values() if len(t) == 2]
  differ = [(a, b) for a, b in pairs if shape(a) != shape(b)]
  args_of = lambda r: [c["function"]["arguments"] for c in calls_of(r)]
  same_args = sum(args_of(a) == args_of(b) for a, b in pairs)

  rows = []
  for mode, pick in (("not streamed", False), ("streamed", True), ("all", None)):
    part = [r for r in results if pick is None or bool(r["request"].get("stream")) == pick]
    t = tally(part)
    own = sum(check_call(c, r["request"].get("tools") or []) is None
              for r in part for c in calls_of(r))
    rows.append(dict(mode=mode, **t, calls_returned=sum(len(calls_of(r)) for r in part),
                     calls_valid_own_check=own, workdir=args.workdir,
                     step=newest_step(args.workdir), testset=os.path.relpath(
                         testset, os.path.dirname(HERE)), seconds=None))
  rows[-1]["seconds"] = round(seconds, 1)

  print(f"\nK2 Vendor Verifier tool_calls_eval.py -> k2jax.serve ({args.workdir}, step "
        f"{rows[0]['step']}), tool_choice auto, {len(results)} requests, {seconds:.0f} s\n")
  head = ("", "requests", "tool_calls", "valid", "invalid", "stop", "others", "failed",
          "schema acc")
  print("{:<13}{:>9}{:>11}{:>7}{:>9}{:>6}{:>8}{:>8}{:>12}".format(*head))
  for row in rows:
    acc = "-" if row["schema_accuracy"] is None else f"{row['schema_accuracy']:.1%}"
    print("{:<13}{:>9}{:>11}{:>7}{:>9}{:>6}{:>8}{:>8}{:>12}".format(
        row["mode"], row["requests"], row["tool_calls"], row["valid"], row["invalid"],
        row["stop"], row["others"], row["failed"], acc))
  print(f"\nour check: {rows[-1]['calls_valid_own_check']} of {rows[-1]['calls_returned']} "
        "returned calls validate (jsonschema; id functions.NAME:N, type, name)")
  print(f"streamed vs not: {len(pairs) - len(differ)} of {len(pairs)} twin replies have the same "
        f"structure; {same_args} of {len(pairs)} have identical call arguments")
  print(f"verifier summary: {summary_path}; results: {results_path}")
  for a, b in differ:
    print(f"\nstructure differs (data_index {a['data_index']} vs {b['data_index']}):\n"
          f"  not streamed: {shape(a)}\n  streamed:     {shape(b)}")
  for r, why in problems:
    print(f"\nFAILING (data_index {r['data_index']}): {why}\n  request:  "
          f"{json.dumps(r['request'])}\n  response: {json.dumps(r['response'])}")

  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, "k2vv.csv")
  with open(path, "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows(rows)
  print(f"-> {path}")
  if problems or differ:
    raise SystemExit(1)


if __name__ == "__main__":
  main()
