"""`python -m k2jax.synth rephrase|math|agentic`: the synthesis pipelines over a corpus.

    python -m k2jax.synth rephrase --input 'docs/*.jsonl' --output out/rephrased.jsonl \\
        --endpoint http://127.0.0.1:8000/v1 -k 2          # any OpenAI-compatible server
    python -m k2jax.synth math --input 'math/*.md' --output out/notes.jsonl --workdir runs/sft
    python -m k2jax.synth agentic --tools 'tools/*.json' --evolve 2,2,3 --items 100 \\
        --output out/agentic.jsonl --endpoint ... --shard 0/4

Inputs: .txt / .md files (one document each, id = the path) or .jsonl (one document per
line, fields --text_field / --id_field; id defaults to file:line). The model: --endpoint
(+ --model), or in process from --workdir (a k2jax run) / --hf (a checkpoint), or none
(--dry_run: scripted replies, for the plumbing and the record format).

Every run is resumable and shardable: items are split between `--shard i/n` processes by a
hash of their id, results are appended per item (`store.Output`), and a rerun of the same
command skips what is done. Each item's requests are seeded from (--seed, item id), so a
deterministic backend gives the same records. Items that fail a check are counted and
logged in OUTPUT.drops with the reason; `--redo_drops` tries them again. OUTPUT.settings.json
records what shapes the records (pipeline, model, seed, styles, thresholds, ...): a rerun with
other ones ends in one line listing each as old -> new, unless --overwrite starts OUTPUT
afresh (the old files kept as .prev).
Rephrase / math records carry "text" (for `k2jax.train --config.data.files=OUT`); agentic
records carry "messages" + "tools" (for `k2jax.sft`).
"""

import argparse
import concurrent.futures
import contextlib
import glob
import json
import logging
import os
import sys
import traceback
import urllib.parse

from k2jax.training import console, interrupt
from k2jax.synth import agentic, dryrun, mathnotes, rephrase, store
from k2jax.synth.client import LocalClient, ModelError, OpenAIClient, ScriptedClient, Unreachable
from k2jax.synth.rephrase import Dropped, Settings
from k2jax.synth.store import Output, in_shard, parse_shard

log = logging.getLogger("k2jax.synth")


class UserError(ValueError):
  pass


def read_documents(pattern: str, text_field: str = "text", id_field: str = "id") -> list[dict]:
  """[{"id", "text"}] from .txt / .md / .jsonl files (UserError naming a bad file or line)."""
  paths = sorted(glob.glob(pattern, recursive=True))
  if not paths:
    raise UserError(f"--input {pattern}: matches no file")
  docs = []
  for path in paths:
    if path.endswith(".jsonl"):
      with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
          if not line.strip():
            continue
          try:
            d = json.loads(line)
          except json.JSONDecodeError as e:
            raise UserError(f"{path}:{n}: not valid JSON ({e.msg} at column {e.colno}); each "
                            "line of a .jsonl file must be one JSON object") from None
          if not isinstance(d, dict):
            raise UserError(f"{path}:{n}: a JSON {type(d).__name__}, not an object; each line "
                            "of a .jsonl file must be one JSON object") from None
          if text_field not in d:
            raise UserError(f"{path}:{n}: no {text_field!r} field (it has "
                            f"{', '.join(map(repr, d)) or 'none'}); name the text's field "
                            "with --text_field") from None
          text = d[text_field]
          docs.append({"id": str(d.get(id_field, f"{path}:{n}")), "text": str(text)})
    elif path.endswith((".txt", ".md")):
      with open(path, encoding="utf-8", errors="replace") as f:
        docs.append({"id": path, "text": f.read()})
    else:
      raise UserError(f"{path}: not .txt, .md or .jsonl")
  docs = [d for d in docs if d["text"].strip()]
  if not docs:
    raise UserError(f"--input {pattern}: the files hold no text")
  if len({d["id"] for d in docs}) < len(docs):
    raise UserError(f"--input {pattern}: document ids repeat; give each line a unique "
                    f"{id_field!r} (items are resumed by id)")
  return docs


def run_items(items: list[tuple[str, object]], work, out: Output, concurrency: int,
              desc: str) -> None:
  """work(payload) -> list of records, for each item not yet done, `concurrency` at a time;
  results are written in input order (a deterministic file), drops counted with reasons."""
  from tqdm import tqdm

  def guarded(payload):
    try:
      return work(payload)
    except Dropped as e:
      return e
    except ModelError as e:
      return Dropped(f"model error: {e}")
    except Exception as e:   # a bug or an odd reply must not end the corpus: count, log
      log.error("item failed:\n%s", traceback.format_exc())
      return Dropped(f"error: {type(e).__name__}: {e}")

  todo = [(i, p) for i, p in items if i not in out.seen]
  log.info("%s: %d items, %d already done, %d to do", desc, len(items), len(items) - len(todo),
           len(todo))
  # not `with`: on Ctrl-C / SIGTERM (interrupt.Interrupted) its exit would wait for every
  # item in flight (minutes of requests); queued items are cancelled instead, and main leaves
  pool = concurrent.futures.ThreadPoolExecutor(max(1, concurrency))
  bar = tqdm(total=len(todo), desc=desc, unit="item")
  try:
    for (item, _), result in zip(todo, pool.map(guarded, [p for _, p in todo])):
      if isinstance(result, Dropped):
        out.drop(item, str(result))
        log.info("dropped %s: %s", item, result)
      else:
        out.keep(item, result)
      bar.update()
      bar.set_postfix(kept=out.kept, dropped=out.dropped)
  finally:
    bar.close()
    pool.shutdown(wait=False, cancel_futures=True)


def _client(args):
  if args.mesh and not (args.workdir or args.hf):
    raise UserError(f"--mesh {args.mesh}: decodes in this process, so it goes with --workdir "
                    "or --hf (a server at --endpoint has its own devices)")
  if args.dry_run:
    return ScriptedClient(dryrun.agent_model() if args.pipeline == "agentic" else dryrun.faithful)
  if args.endpoint:
    url = urllib.parse.urlparse(args.endpoint)
    if url.scheme not in ("http", "https") or not url.netloc:
      raise UserError(f"--endpoint {args.endpoint}: not an http(s) URL; give the server's "
                      "base URL, e.g. http://127.0.0.1:8000/v1")
    c = OpenAIClient(args.endpoint, args.model, api_key=os.environ.get("OPENAI_API_KEY", "unused"),
                     concurrency=args.concurrency, retries=args.retries, timeout=args.timeout)
    try:
      c.check()
    except Unreachable as e:
      raise UserError(str(e)) from None
    return c
  from k2jax.serving.generate import UserError as LoadError
  from k2jax.serving.generate import _check_run_dir
  try:
    if args.workdir:
      _check_run_dir(args.workdir)
    return LocalClient.from_run(args.workdir, args.hf, mesh=args.mesh,
                                concurrency=args.concurrency)
  except LoadError as e:
    raise UserError(str(e)) from None


def _fail(line: str):
  print(f"k2jax.synth: error: {line}", file=sys.stderr)
  raise SystemExit(2)


def _model_name(args, client) -> str:
  """What answers the requests, as recorded in OUTPUT.settings.json: an endpoint's model
  name (not its URL: a server may move), a local run's path, dry_run, or a caller's client."""
  if args.dry_run:
    return "dry_run"
  if args.workdir or args.hf:
    return f"{'workdir' if args.workdir else 'hf'} {os.path.abspath(args.workdir or args.hf)}"
  if isinstance(client, OpenAIClient):
    return str(client.model)
  return getattr(client, "name", type(client).__name__)


def _settings(args, client) -> dict:
  """The settings that shape OUTPUT's records: a rerun into OUTPUT must keep them (a rerun
  skips done items by id, so records of other settings would be mixed in silently). Those
  that only add items (--input growing, -k, --items) or pace the run may change."""
  s = {"pipeline": args.pipeline, "model": _model_name(args, client), "seed": args.seed,
       "max_tokens": args.max_tokens}
  if args.pipeline == "agentic":
    s.update(tools=args.tools, evolve=args.evolve, max_turns=args.max_turns,
             max_tools=args.max_tools)
  else:
    s.update(text_field=args.text_field, id_field=args.id_field, chunk_chars=args.chunk_chars,
             judge=not args.no_judge, min_score=None if args.no_judge else args.min_score)
    if args.pipeline == "rephrase":
      s["styles"] = sorted(args.styles.split(","))
  return s


def _changed_line(output: str, changes: list[str]) -> str:
  fix = "or pass --overwrite to start it afresh (its files are kept as .prev)"
  pipeline = next((c for c in changes if c.startswith("pipeline:")), None)
  if pipeline:
    old, new = pipeline[len("pipeline: "):].split(" -> ")
    return (f"--output {output} holds {old} records ({'; '.join(changes)}): give {new} its "
            f"own --output, {fix}")
  return (f"--output {output} was written with other settings ({'; '.join(changes)}): rerun "
          f"with those, give another --output, {fix}")


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m k2jax.synth", description=__doc__.splitlines()[0])
  sub = p.add_subparsers(dest="pipeline", required=True)
  common = argparse.ArgumentParser(add_help=False)
  src = common.add_mutually_exclusive_group()
  src.add_argument("--endpoint", help="an OpenAI-compatible base URL, e.g. http://host:8000/v1")
  src.add_argument("--workdir", help="a k2jax run, decoded in this process")
  src.add_argument("--hf", help="a Hugging Face checkpoint, decoded in this process")
  src.add_argument("--dry_run", action="store_true", help="no model: scripted replies "
                   "(k2jax.synth.dryrun: rewrites copy their source, the agent calls its first "
                   "tool, every judge passes), to try the plumbing and the trainers on records")
  common.add_argument("--mesh", default=None, help="with --workdir / --hf: the devices to "
                      "decode on, e.g. data=2,expert=4 (the weights load straight into their "
                      "shards; default: one device)")
  common.add_argument("--model", help="the endpoint's model name (default: its first)")
  common.add_argument("--output", required=True, help="JSONL to append to (resumable)")
  common.add_argument("--shard", default="0/1", help="i/n: this process's share of the items")
  common.add_argument("--seed", type=int, default=0)
  common.add_argument("--concurrency", type=int, default=8, help="items in flight")
  common.add_argument("--retries", type=int, default=4)
  common.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
  common.add_argument("--redo_drops", action="store_true",
                      help="try the items of OUTPUT.drops again (the old file is kept as .prev)")
  common.add_argument("--overwrite", action="store_true",
                      help="start OUTPUT afresh, e.g. with settings other than those in "
                      "OUTPUT.settings.json (its files are kept as .prev)")
  docs = argparse.ArgumentParser(add_help=False)
  docs.add_argument("--input", required=True, help="glob of .txt / .md / .jsonl documents")
  docs.add_argument("--text_field", default="text")
  docs.add_argument("--id_field", default="id")
  docs.add_argument("--chunk_chars", type=int, default=1500)
  docs.add_argument("--max_tokens", type=int, default=1024, help="per rewritten chunk (a "
                    "k2jax.serve model with less context left clamps it; others may refuse)")
  docs.add_argument("--min_score", type=float, default=7.0, help="the judge's bar (0-10)")
  docs.add_argument("--no_judge", action="store_true", help="the cheap check only")
  r = sub.add_parser("rephrase", parents=[common, docs], help="knowledge rephrasing (2.2)")
  r.add_argument("-k", type=int, default=2, help="rephrasings per document")
  r.add_argument("--styles", default=",".join(sorted(rephrase.STYLES)))
  sub.add_parser("math", parents=[common, docs], help="math learning notes (2.2)")
  a = sub.add_parser("agentic", parents=[common], help="tool-use trajectories (3.1.1)")
  a.add_argument("--tools", help="glob of JSON tool specs (OpenAI or MCP)")
  a.add_argument("--evolve", help="C,D,T: also evolve C categories x D domains x T tools")
  a.add_argument("--items", type=int, default=100, help="trajectories to attempt")
  a.add_argument("--max_turns", type=int, default=6)
  a.add_argument("--max_tools", type=int, default=4, help="tools per agent")
  a.add_argument("--max_tokens", type=int, default=1024, help="per reply (clamped by "
                 "k2jax.serve to the context left)")
  return p


def main(argv=None, *, client=None):
  """The CLI; `client` (any synth.Client, e.g. a ScriptedClient) replaces --endpoint /
  --workdir / --hf for programmatic runs and tests.

  As the command (argv None), SIGINT / SIGTERM: the items written so far stay (each is
  fsynced as it is written), the ones in flight are redone by a rerun; one line, exit 130 /
  143. A program calling main(argv) keeps its own handling (KeyboardInterrupt)."""
  args = parser().parse_args(argv)
  console.setup()
  done = []   # the Output, once open: what the stop line reports
  try:
    with interrupt.raising() if argv is None else contextlib.nullcontext():
      _main(args, client, done)
  except interrupt.Interrupted as e:
    what = (f"{done[0].summary()} -> {args.output}" if done else "nothing written")
    print(f"k2jax.synth {args.pipeline}: stopped by {e.name}: {what}; run the same command "
          "to resume", file=sys.stderr, flush=True)
    sys.stdout.flush()
    # at once: the interpreter's exit would join the pool's threads, each in a request
    os._exit(e.exit_code)


def _checked(args):
  """(shard, evolve counts or None, tools, documents) of the command line, or UserError /
  ValueError with one line naming the flag."""
  shard = parse_shard(args.shard)
  for flag in ("concurrency", "retries", "timeout") + (
      ("chunk_chars", "max_tokens") if args.pipeline != "agentic" else
      ("items", "max_turns", "max_tokens")):
    if getattr(args, flag) < (0 if flag == "retries" else 1):
      raise UserError(f"--{flag} {getattr(args, flag)}: must be >= 1")
  if args.pipeline == "rephrase":
    styles = args.styles.split(",")
    unknown = sorted(set(styles) - set(rephrase.STYLES))
    if unknown or args.k < 1:
      raise UserError(f"--styles {unknown} unknown (have {sorted(rephrase.STYLES)})" if unknown
                      else f"-k {args.k}: must be >= 1")
  evolve, tools, documents = None, [], []
  if args.pipeline == "agentic":
    if not args.tools and not args.evolve:
      raise UserError("give --tools (JSON specs) and / or --evolve C,D,T")
    evolve = [int(x) for x in args.evolve.split(",")] if args.evolve else None
    if evolve is not None and (len(evolve) != 3 or min(evolve) < 1):
      raise UserError(f"--evolve {args.evolve}: must be three counts >= 1, e.g. 2,2,3")
    try:
      tools = agentic.load_tools(args.tools) if args.tools else []
    except (OSError, ValueError) as e:
      raise UserError(f"--tools {args.tools}: {str(e).splitlines()[0]}") from None
    if args.tools and not tools:
      raise UserError(f"--tools {args.tools}: matches no tool spec")
  else:
    documents = read_documents(args.input, args.text_field, args.id_field)
  if os.path.isdir(args.output):
    raise UserError(f"--output {args.output} is a directory; name a .jsonl file")
  return shard, evolve, tools, documents


def _evolved_tools(args, client, evolve, given: list) -> list:
  """--evolve's tools (beside the `given` --tools): evolved once into OUTPUT.tools.json,
  then reused by every rerun and shard; never an empty cache (a rerun with a better --model
  evolves again)."""
  cache = args.output + ".tools.json"
  if os.path.exists(cache):
    with open(cache) as f:
      cached = json.load(f)
    if not cached:    # written by an older k2jax: it would stop every rerun
      _fail(f"{cache} holds no tools (an earlier --evolve {args.evolve} evolved none): "
            "delete it to evolve again, or give --tools")
    return cached
  new = agentic.evolve_tools(client, categories=evolve[0], domains=evolve[1],
                             tools=evolve[2], seed=args.seed, log=log.info)
  if new:
    with open(cache + ".tmp", "w") as f:
      json.dump(new, f, indent=1)
    os.replace(cache + ".tmp", cache)
  elif given:
    log.warning("--evolve %s: the model evolved no usable tool; going on with the %d "
                "of --tools (nothing cached in %s)", args.evolve, len(given), cache)
  else:
    _fail(f"--evolve {args.evolve}: the model evolved no usable tool, so nothing was "
          f"cached in {cache} and a rerun evolves again: use a more capable --model, "
          "or give --tools")
  return new


def _work(args, client, tools, documents):
  """(items [(id, payload)], work(payload) -> records) of the pipeline."""
  if args.pipeline == "agentic":
    items = [(f"trajectory-{i}", i) for i in range(args.items)]
    return items, lambda i: [agentic.trajectory(client, tools, i, seed=args.seed,
                                                max_tools=args.max_tools,
                                                max_turns=args.max_turns,
                                                max_tokens=args.max_tokens)]
  settings = Settings(chunk_chars=args.chunk_chars, max_tokens=args.max_tokens,
                      min_score=args.min_score, judge=not args.no_judge)
  if args.pipeline == "rephrase":
    styles = {s: rephrase.STYLES[s] for s in args.styles.split(",")}
    items = [(f"{d['id']}#{k}", (d, k)) for d in documents for k in range(args.k)]
    return items, lambda p: [rephrase.rephrase(client, p[0], p[1], seed=args.seed,
                                               settings=settings, styles=styles)]
  return [(d["id"], d) for d in documents], lambda d: [
      mathnotes.learning_note(client, d, seed=args.seed, settings=settings)]


def _main(args, client, done):
  try:
    shard, evolve, tools, documents = _checked(args)
    if client is None:
      if not (args.endpoint or args.workdir or args.hf or args.dry_run):
        raise UserError("give the model: --endpoint URL, --workdir RUN, --hf DIR or --dry_run")
      if args.endpoint:     # a quick check, and the model's name when --model is not given
        client = _client(args)
    settings = _settings(args, client)
    changes = store.settings_changes(args.output, settings)   # before loading a local model
    if changes and not args.overwrite:
      raise UserError(_changed_line(args.output, changes))
    if client is None:
      client = _client(args)
  except (UserError, ValueError) as e:
    print(f"k2jax.synth: error: {e}", file=sys.stderr)
    raise SystemExit(2)
  if args.overwrite:
    moved = store.set_aside(args.output)
    if moved:
      log.info("--overwrite: moved %s to .prev; starting %s afresh", ", ".join(moved),
               args.output)
  store.record_settings(args.output, settings)
  if args.redo_drops and os.path.exists(args.output + ".drops"):
    os.replace(args.output + ".drops", args.output + ".drops.prev")
  out = Output(args.output)
  done.append(out)
  try:
    if evolve:
      tools = tools + _evolved_tools(args, client, evolve, tools)
    items, work = _work(args, client, tools, documents)
    run_items([(i, p) for i, p in items if in_shard(i, shard)], work, out, args.concurrency,
              args.pipeline)
  finally:
    out.close()
    if isinstance(client, LocalClient):
      client.engine.close()
  print(f"k2jax.synth {args.pipeline}: {out.summary()} -> {args.output}")
