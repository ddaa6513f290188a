"""What the synthesis pipelines ask of a model per 1,000 items: requests and tokens.

    python experiments/synth_cost.py

Runs each pipeline with a scripted model that answers every request the way a faithful model
would (a rewrite as long as its source, a passing judge, one tool call per dialog:
`k2jax.synth.dryrun`), counting the requests and the characters sent and received. A
request's characters are its messages' contents and tool calls, plus its tools' JSON once
(a server renders the declarations once per prompt). Tokens are characters / 4 (English text
under a ~160k BPE vocabulary such as K2's; an estimate, printed as such). Documents are
English prose of 2,000 and 8,000 characters (chunked at the default 1,500). The agentic row
is one tool call per dialog, simulated; real dialogs run longer. Reruns with a real endpoint
count the same way through `Reply.prompt_tokens` / `completion_tokens`.
CSV: experiments/results/synth/cost_per_1k_items.csv
"""

import csv
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# k2jax when not installed; last, so that the root's kernels/ hides no installed package
sys.path.append(os.path.dirname(HERE))

from k2jax.synth import ScriptedClient, agentic, mathnotes, rephrase  # noqa: E402
from k2jax.synth.dryrun import agent_model, faithful  # noqa: E402
from k2jax.synth.rephrase import Settings  # noqa: E402

SENTENCE = ("In 1906 the survey team mapped 214 kilometres of the northern coast, recording "
            "tides, currents and the depth of every harbour they passed. ")
NOTE = {"name": "save_note", "description": "store a note",
        "inputSchema": {"type": "object", "properties": {"text": {"type": "string"}}}}


def sent_chars(request) -> int:
  """Characters of one request's prompt: every message's content and tool calls, and the
  tools' declarations once per request (they were counted once per message before)."""
  n = len(json.dumps(request.tools)) if request.tools else 0
  for m in request.messages:
    n += len(m.get("content") or "")
    n += len(json.dumps(m["tool_calls"])) if m.get("tool_calls") else 0
  return n


def counted(fn):
  client = ScriptedClient(fn)
  recv = 0
  inner = client.fn

  def wrapped(r):
    nonlocal recv
    out = inner(r)
    recv += len(out if isinstance(out, str) else out.content)
    return out
  client.fn = wrapped
  return client, lambda: (len(client.requests), sum(map(sent_chars, client.requests)), recv)


def main():
  rows = []
  for chars in (2000, 8000):
    doc = {"id": "d", "text": (SENTENCE * (chars // len(SENTENCE) + 1))[:chars]}
    for name, run in [("rephrase", lambda c: rephrase.rephrase(c, doc, 0, seed=0,
                                                               settings=Settings())),
                      ("math", lambda c: mathnotes.learning_note(c, doc, seed=0,
                                                                 settings=Settings()))]:
      client, stats = counted(faithful)
      run(client)
      rows.append((name, f"{chars}-char document", *stats()))
  client, stats = counted(agent_model())
  agentic.trajectory(client, [agentic.normalize_tool(NOTE, "notes")], 0, seed=0)
  rows.append(("agentic", "1 tool call per dialog", *stats()))
  os.makedirs(os.path.join(HERE, "results", "synth"), exist_ok=True)
  path = os.path.join(HERE, "results", "synth", "cost_per_1k_items.csv")
  out = []
  print(f"{'pipeline':9s} {'item':24s} {'requests':>9s} {'prompt tok':>11s} {'completion tok':>15s}"
        "   (per 1,000 items; tokens = chars / 4)")
  for name, item, n, sent, recv in rows:
    r = dict(pipeline=name, item=item, requests=n * 1000, prompt_tokens=sent * 1000 // 4,
             completion_tokens=recv * 1000 // 4)
    out.append(r)
    print(f"{name:9s} {item:24s} {r['requests']:9,d} {r['prompt_tokens']:11,d} "
          f"{r['completion_tokens']:15,d}")
  with open(path, "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=list(out[0]))
    w.writeheader()
    w.writerows(out)
  print(f"-> {path}")


if __name__ == "__main__":
  main()
