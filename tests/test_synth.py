"""k2jax.synth: chunking and the fidelity checks, resumable output, the three pipelines end to
end (decisions scripted through the client interface; a real k2jax.serve endpoint for the
HTTP path and a kill -9 resume), and that k2jax.train / k2jax.sft read what they write."""

import copy
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from k2jax.serving import chat
from k2jax.synth import Client, ScriptedClient, agentic, cli, dryrun, rephrase
from k2jax.synth.client import Reply
from k2jax.synth.dryrun import agent_model
from k2jax.synth.rephrase import Settings, overlap, split_chunks
from k2jax.synth.store import Output, in_shard, item_seed

DOCS = [
    {"id": "lovelace", "text": "Ada Lovelace wrote the first published algorithm in 1843.\n\n"
     "It computed Bernoulli numbers on the Analytical Engine designed by Charles Babbage. "
     "The notes ran to 65 pages, three times the length of the article they annotated."},
    {"id": "water", "text": "Water boils at 100 degrees Celsius at sea level and freezes at 0."},
    {"id": "plain", "text": "a short note with no numbers and no names at all."},
]


def test_chunks_cover_the_text_in_order_and_respect_the_size():
  text = " ".join(f"Sentence number {i} says something." for i in range(200)) + "\n\n" + \
      "x" * 2500 + "\n\nlast paragraph."
  for size in (50, 333, 1500):
    chunks = split_chunks(text, size)
    assert all(len(c) <= size for c in chunks)
    assert re.sub(r"\s", "", "".join(chunks)) == re.sub(r"\s", "", text)


def test_overlap_catches_dropped_and_invented_numbers_and_names():
  src = DOCS[0]["text"]
  assert overlap(src, src) == {"number_recall": 1.0, "numbers_invented": 0.0, "name_recall": 1.0}
  dropped = overlap(src, src.replace("1843", "the nineteenth century"))
  assert dropped["number_recall"] == pytest.approx(1 / 2)       # of {1843, 65}
  invented = overlap(src, src + " It sold 500 copies.")
  assert invented["numbers_invented"] == pytest.approx(1 / 3)   # 500 of {1843, 65, 500}
  names = overlap(src, src.replace("Babbage", "someone").replace("Bernoulli", "some"))
  assert names["name_recall"] < 1.0


def _source(request) -> str:
  """The last <<< >>> block of a request (what a rewrite request asks to rewrite)."""
  return re.findall(r"<<<\n(.*?)\n>>>", request.messages[-1]["content"], re.S)[-1]


def faithful(request):
  """A scripted model: rewrites keep the text (marked, so a prompt shows which it holds);
  the judge scores 9."""
  return dryrun.faithful(request, prefix="In other words: ")


def test_rephrase_records_carry_provenance_and_pass_both_checks():
  client = ScriptedClient(faithful)
  s = Settings(chunk_chars=80)
  recs = [rephrase.rephrase(client, DOCS[0], k, seed=3, settings=s) for k in range(3)]
  assert len({r["style"] for r in recs}) == 3                 # k draws distinct styles
  for r in recs:
    assert r["source_id"] == "lovelace" and r["fidelity"] == 9
    assert [c["chunk"] for c in r["chunks"]] == list(range(len(split_chunks(DOCS[0]["text"], 80))))
    assert "1843" in r["text"] and "Babbage" in r["text"]
  # the second chunk's prompt shows the original and the rewrite before it (Figure 4)
  second = [q for q in client.requests if "The document so far" in q.messages[-1]["content"]]
  assert second and "In other words:" in second[0].messages[-1]["content"]
  again = rephrase.rephrase(ScriptedClient(faithful), DOCS[0], 1, seed=3, settings=s)
  assert again == recs[1]


@pytest.mark.parametrize("model, reason", [
    (lambda r: "Does the rewrite" in r.messages[-1]["content"] and '{"score": 9}' or
     _source(r).replace("1843", "long ago"), "dropped content"),
    (lambda r: "Does the rewrite" in r.messages[-1]["content"] and '{"score": 9}' or
     _source(r) + " In 2024 it sold 12 copies.", "invented content"),
    (lambda r: "Does the rewrite" in r.messages[-1]["content"] and '{"score": 3}' or
     _source(r), "judge: chunk 0 scored 3"),
    (lambda r: "Does the rewrite" in r.messages[-1]["content"] and "I think it is fine" or
     _source(r), "judge malformed"),
    (lambda r: Reply(_source(r), finish_reason="length"), "truncated"),
])
def test_unfaithful_rewrites_are_dropped_with_their_reason(model, reason):
  with pytest.raises(rephrase.Dropped, match=reason):
    rephrase.rephrase(ScriptedClient(model), DOCS[0], 0, seed=0, settings=Settings())


def test_output_resumes_an_item_cut_off_mid_write(tmp_path):
  path = str(tmp_path / "out.jsonl")
  out = Output(path)
  out.keep("a", [{"text": "1"}])
  out.keep("b", [{"text": "2"}, {"text": "3"}, {"text": "4"}])
  out.drop("c", "judge: low")
  out.close()
  data = open(path, "rb").read()
  cut = data.rfind(b'{"text": "4"') + 5      # killed inside b's third line
  open(path, "wb").write(data[:cut])
  again = Output(path)
  assert again.seen == {"a", "c"}            # b is redone, from its first record
  assert [json.loads(x)["item"] for x in open(path)] == ["a"]
  again.keep("b", [{"text": "2"}, {"text": "3"}, {"text": "4"}])
  again.close()
  assert [json.loads(x)["text"] for x in open(path)] == ["1", "2", "3", "4"]
  data = open(path, "rb").read()             # cut between two lines of b
  open(path, "wb").write(data[:data.find(b'{"text": "3"')])
  assert Output(path).seen == {"a", "c"}


def test_shards_split_the_items_exactly():
  ids = [f"doc-{i}" for i in range(500)]
  parts = [[i for i in ids if in_shard(i, (k, 3))] for k in range(3)]
  assert sorted(sum(parts, [])) == sorted(ids) and min(map(len, parts)) > 100
  assert item_seed(1, "a", 2) == item_seed(1, "a", 2) != item_seed(2, "a", 2)


def _write_docs(tmp_path):
  path = tmp_path / "docs.jsonl"
  path.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
  return str(path)


def test_rephrase_and_math_cli_write_what_train_reads(tmp_path, capsys):
  from k2jax.data.corpus import file_documents
  docs = _write_docs(tmp_path)
  out = str(tmp_path / "re.jsonl")
  cli.main(["rephrase", "--input", docs, "--output", out, "-k", "2", "--chunk_chars", "90"],
           client=ScriptedClient(faithful))
  recs = [json.loads(x) for x in open(out)]
  assert sorted(r["item"] for r in recs) == sorted(f"{d['id']}#{k}" for d in DOCS for k in (0, 1))
  assert "kept 6 records; dropped 0" in capsys.readouterr().out
  assert len(file_documents(out)) == 6
  cli.main(["rephrase", "--input", docs, "--output", out, "-k", "2", "--chunk_chars", "90"],
           client=ScriptedClient(lambda r: pytest.fail("a finished item was redone")))
  shards = [str(tmp_path / f"s{k}.jsonl") for k in range(2)]
  for k, path in enumerate(shards):
    cli.main(["rephrase", "--input", docs, "--output", path, "-k", "2", "--chunk_chars", "90",
              "--shard", f"{k}/2"], client=ScriptedClient(faithful))
  sharded = sorted(json.dumps(json.loads(x), sort_keys=True) for p in shards for x in open(p))
  assert sharded == sorted(json.dumps(r, sort_keys=True) for r in recs)   # seeded per item
  notes = str(tmp_path / "notes.jsonl")
  src = tmp_path / "math.jsonl"
  src.write_text(json.dumps({"id": "ru", "text": "Найдите сумму 2 + 3 = 5."}) + "\n" +
                 json.dumps({"id": "en", "text": "Find the sum: 2 + 3 = 5."}) + "\n")
  cli.main(["math", "--input", str(src), "--output", notes], client=ScriptedClient(faithful))
  got = {r["source_id"]: r for r in map(json.loads, open(notes))}
  assert got["ru"]["translated"] and not got["en"]["translated"]
  assert got["en"]["style"] == "learning_note" and "2 + 3 = 5" in got["en"]["text"]
  assert len(file_documents(notes)) == 2


ADD = {"type": "function", "function": {"name": "add", "description": "add integers",
       "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                       "b": {"type": "integer"}},
                      "required": ["a", "b"]}}}
MCP_NOTE = {"name": "save_note", "description": "store a note",
            "inputSchema": {"type": "object", "properties": {"text": {"type": "string"}}}}


def test_agentic_trajectory_executes_code_tools_and_simulates_the_others():
  from k2jax.rl import sandbox
  code_add = dict(ADD, **{"x-k2jax-code": "def run(args):\n  return {'sum': args['a'] + args['b']}",
                          "x-k2jax-domain": "math"})
  try:
    sandbox.check()
    run = None
  except sandbox.SandboxUnavailable:       # the plumbing still runs, with a stand-in runner
    run = lambda program, stdin, timeout_s: sandbox.run(program, stdin=stdin,   # noqa: E731
                                                        timeout_s=timeout_s, isolation="limits")
  tools = [agentic.normalize_tool(code_add)]
  rec = agentic.trajectory(ScriptedClient(agent_model(arguments={"a": 2, "b": 3})), tools, 0,
                          seed=1, sandbox_run=run)
  roles = [m["role"] for m in rec["messages"]]
  assert roles == ["system", "user", "assistant", "tool", "assistant"]
  assert json.loads(rec["messages"][3]["content"]) == {"sum": 5}      # really executed
  assert rec["judge"]["pass"] and rec["rubric"] == ["calls a tool", "reports the result"]
  assert rec["tools"] == [ADD] and rec["ended"] == "user_done"
  sim = agentic.normalize_tool(MCP_NOTE, "notes")
  rec = agentic.trajectory(ScriptedClient(agent_model(call="save_note")), [sim], 0, seed=1)
  assert rec["messages"][3]["content"] == '{"ok": true}'
  assert rec["tools"][0]["function"]["parameters"] == MCP_NOTE["inputSchema"]
  ids, mask = chat.encode_with_mask(rec["messages"], rec["tools"])   # what sft trains on
  assert any(mask) and not all(mask)


@pytest.mark.parametrize("kw, reason", [
    (dict(call="nope"), "unknown tool: the agent called 'nope'"),
    (dict(verdict=False), "rubric: reports the result"),
    (dict(sim_json=False), "malformed JSON from the tool"),
    (dict(arguments={"text": 5}), "bad arguments: save_note: text: 5 is not of type 'string'"),
    (dict(arguments={"txt": "5"}), r"bad arguments: save_note: .*\('txt' was unexpected\)")])
def test_agentic_drops_say_why(kw, reason):
  tools = [agentic.normalize_tool(MCP_NOTE, "notes")]
  with pytest.raises(rephrase.Dropped, match=reason):
    agentic.trajectory(ScriptedClient(agent_model(**kw)), tools, 0, seed=1)


CURRENCY = agentic.normalize_tool({"name": "convert_currency", "parameters": {
    "type": "object", "properties": {"amount": {"type": "number"},
                                     "to": {"type": "string", "enum": ["EUR", "USD"]},
                                     "legs": {"type": "array", "items": {"type": "integer"}}},
    "required": ["amount"]}})


@pytest.mark.parametrize("args, errors", [
    ({"amount": 5}, []),
    ({"amount": 5.5, "to": "EUR", "legs": [1, 2]}, []),
    ({"text": "5"}, ["arguments: 'amount' is a required property",
                     "arguments: Additional properties are not allowed ('text' was unexpected)"]),
    ({"amount": "5"}, ["amount: '5' is not of type 'number'"]),
    ({"amount": True}, ["amount: True is not of type 'number'"]),
    ({"amount": 1, "to": "GBP"}, ["to: 'GBP' is not one of ['EUR', 'USD']"]),
    ({"amount": 1, "legs": [1, "x"]}, ["legs/1: 'x' is not of type 'integer'"]),
])
def test_tool_call_arguments_are_checked_against_the_schema(args, errors):
  """The audit's case (convert_currency({"text": "5"}) was kept) and the schema kinds tool
  specs use; expected errors written by hand from the JSON Schema rules."""
  assert agentic.argument_errors(CURRENCY, args) == errors


def test_a_schema_may_allow_undeclared_arguments_and_must_be_valid():
  open_ = agentic.normalize_tool({"name": "f", "parameters": {
      "type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": True}})
  assert agentic.argument_errors(open_, {"a": "x", "b": 1}) == []
  with pytest.raises(ValueError, match="tool g: parameters are not a valid JSON schema"):
    agentic.normalize_tool({"name": "g", "parameters": {"type": "object", "properties": {
        "a": {"type": "strin"}}}})


def test_agentic_cli_evolves_tools_and_writes_what_sft_reads(tmp_path, capsys):
  from k2jax import sft
  tools = tmp_path / "tools.json"
  tools.write_text(json.dumps({"domain": "notes", "tools": [MCP_NOTE]}))
  out = str(tmp_path / "agentic.jsonl")
  # every agent calls its tool with {"text": "5"}: right for save_note, wrong for
  # convert_currency({amount}), whose trajectories must be dropped as bad arguments
  cli.main(["agentic", "--tools", str(tools), "--evolve", "2,1,2", "--items", "8",
            "--output", out], client=ScriptedClient(agent_model(arguments={"text": "5"})))
  evolved = json.load(open(out + ".tools.json"))
  assert [t["function"]["name"] for t in evolved] == ["convert_currency"] * 2   # 'bad name!' out
  assert {t["x-k2jax-domain"] for t in evolved} == {"finance / budgeting", "travel / budgeting"}
  dialogs = sft.read_dialogs(out)
  drops = [json.loads(x) for x in open(out + ".drops")]
  assert dialogs and drops and len(dialogs) + len(drops) == 8
  assert all(d["tools"][0]["function"]["name"] == "save_note" and
             d["messages"][-1]["role"] == "assistant" for d in dialogs)
  assert all(x["reason"].startswith("bad arguments: convert_currency: ") for x in drops)
  assert (f"kept {len(dialogs)} records; dropped {len(drops)} items ({len(drops)} bad arguments)"
          in capsys.readouterr().out)


def _files(tmp_path):
  return {f.name: f.read_bytes() for f in tmp_path.iterdir() if f.is_file()}


def test_a_rerun_with_other_settings_ends_in_one_line_unless_overwrite(tmp_path, capsys):
  """OUTPUT.settings.json records what shapes the records; a rerun that changes any of them
  (another --seed once reported 'kept 0 records': every item skipped by id) or another
  pipeline into the same --output (math records appended to a rephrase file) is refused in
  one line listing old -> new, every file left as it was; --overwrite starts afresh."""
  docs = _write_docs(tmp_path)
  out = str(tmp_path / "re.jsonl")
  base = ["rephrase", "--input", docs, "--output", out, "-k", "1"]
  cli.main(base, client=ScriptedClient(faithful))
  recorded = json.load(open(out + ".settings.json"))
  assert recorded["pipeline"] == "rephrase" and recorded["seed"] == 0
  assert recorded["model"] == "ScriptedClient" and recorded["styles"] == sorted(rephrase.STYLES)
  assert recorded["min_score"] == 7.0 and recorded["judge"] is True
  capsys.readouterr()
  never = ScriptedClient(lambda r: pytest.fail("a refused run sent a request"))
  styles = sorted(rephrase.STYLES)
  for argv, fragment in [
      (base + ["--seed", "1"], "(seed: 0 -> 1)"),
      (base + ["--styles", styles[0]], f"(styles: {','.join(styles)} -> {styles[0]})"),
      (base + ["--no_judge"], "(judge: True -> False; min_score: 7.0 -> None)"),
      (["math", "--input", docs, "--output", out], "holds rephrase records (pipeline: rephrase "
       "-> math): give math its own --output"),
  ]:
    before = _files(tmp_path)
    with pytest.raises(SystemExit) as e:
      cli.main(argv, client=never)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("k2jax.synth: error: "
                                                                     f"--output {out} ")
    assert fragment in err[0] and err[0].endswith("or pass --overwrite to start it afresh "
                                                  "(its files are kept as .prev)"), err[0]
    assert _files(tmp_path) == before
  # an output written before settings were recorded: its first record names the pipeline
  os.remove(out + ".settings.json")
  with pytest.raises(SystemExit):
    cli.main(["math", "--input", docs, "--output", out], client=never)
  assert "give math its own --output" in capsys.readouterr().err
  # what only adds items may change: -k 2 does the second rephrasing of each document
  cli.main(base[:-1] + ["2"], client=ScriptedClient(faithful))
  assert "kept 3 records" in capsys.readouterr().out
  old = open(out).read()
  cli.main(base + ["--seed", "1", "--overwrite"], client=ScriptedClient(faithful))
  assert "kept 3 records" in capsys.readouterr().out
  assert open(out + ".prev").read() == old and json.load(open(out + ".settings.json"))["seed"] == 1


def _no_tools_model(request):
  """An evolver that names categories and domains but designs no valid tool."""
  text = request.messages[-1]["content"]
  return '["finance"]' if "short names" in text else '[{"name": "bad name!"}]'


def test_an_empty_evolution_is_never_cached_and_its_error_names_the_cache(tmp_path, capsys):
  out = str(tmp_path / "agentic.jsonl")
  argv = ["agentic", "--evolve", "1,1,1", "--items", "2", "--output", out]
  for _ in range(2):    # the rerun asks the model again
    client = ScriptedClient(_no_tools_model)
    with pytest.raises(SystemExit) as e:
      cli.main(argv, client=client)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err[-1] == (
        f"k2jax.synth: error: --evolve 1,1,1: the model evolved no usable tool, so nothing "
        f"was cached in {out}.tools.json and a rerun evolves again: use a more capable "
        "--model, or give --tools")
    assert client.requests and not os.path.exists(out + ".tools.json")
  # a cache of none, as older versions wrote it: named, with the fix
  out = str(tmp_path / "old.jsonl")
  (tmp_path / "old.jsonl.tools.json").write_text("[]")
  with pytest.raises(SystemExit):
    cli.main(argv[:-1] + [out, "--dry_run"])
  assert capsys.readouterr().err.strip().splitlines()[-1] == (
      f"k2jax.synth: error: {out}.tools.json holds no tools (an earlier --evolve 1,1,1 evolved "
      "none): delete it to evolve again, or give --tools")


EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                        "synth")


def test_dry_run_on_the_readme_inputs_writes_what_the_trainers_read(tmp_path, capsys):
  """README's tiny-scale inputs exist and load; --dry_run (scripted replies) keeps every item;
  the records are what k2jax.train / k2jax.sft read."""
  from k2jax import sft
  from k2jax.data.corpus import file_documents
  from k2jax.rl import sandbox
  try:
    sandbox.check()
  except sandbox.SandboxUnavailable:
    pytest.skip("the example's add tool runs in the RL sandbox, unavailable here")
  ex = EXAMPLES
  for pipeline, argv, n in [
      ("rephrase", ["--input", f"{ex}/docs.jsonl", "-k", "2", "--chunk_chars", "300"], 6),
      ("math", ["--input", f"{ex}/math/*.md", "--chunk_chars", "300"], 2),
      ("agentic", ["--tools", f"{ex}/tools/*.json", "--items", "6"], 6)]:
    out = str(tmp_path / f"{pipeline}.jsonl")
    cli.main([pipeline, *argv, "--output", out, "--dry_run"])
    assert f"k2jax.synth {pipeline}: kept {n} records; dropped 0" in capsys.readouterr().out
    if pipeline == "agentic":
      dialogs = sft.read_dialogs(out)
      assert {d["domain"] for d in dialogs} == {"notes", "arithmetic"}
      added = [json.loads(m["content"]) for d in dialogs for m in d["messages"]
               if m.get("name") == "add"]
      assert added and all(x == {"sum": 2} for x in added)    # executed: 1 + 1
    else:
      assert len(file_documents(out)) == n
  notes = {r["source_id"]: r for r in map(json.loads, open(tmp_path / "math.jsonl"))}
  assert notes[f"{ex}/math/rectangle_ru.md"]["translated"]
  assert not notes[f"{ex}/math/odd_squares.md"]["translated"]


@pytest.mark.parametrize("argv, fragment", [
    (["rephrase", "--input", "{tmp}/none*.jsonl", "--output", "{tmp}/o.jsonl"], "matches no file"),
    (["rephrase", "--input", "{docs}", "--output", "{tmp}/o.jsonl", "--shard", "2/2"],
     "--shard '2/2': must be i/n"),
    (["rephrase", "--input", "{docs}", "--output", "{tmp}/o.jsonl", "--styles", "poem"],
     "--styles ['poem'] unknown"),
    (["rephrase", "--input", "{docs}", "--output", "{tmp}/o.jsonl", "--endpoint",
      "http://127.0.0.1:9/v1"], "is the server running"),
    (["agentic", "--output", "{tmp}/o.jsonl", "--endpoint", "http://x"], "give --tools"),
    (["agentic", "--output", "{tmp}/o.jsonl", "--evolve", "2,2", "--endpoint", "http://x"],
     "--evolve 2,2: must be three counts"),
    (["math", "--input", "{bad}", "--output", "{tmp}/o.jsonl", "--endpoint", "http://x"],
     "bad.jsonl:1: no 'text' field (it has 'body'); name the text's field with --text_field"),
    (["math", "--input", "{notjson}", "--output", "{tmp}/o.jsonl", "--endpoint", "http://x"],
     "notjson.jsonl:2: not valid JSON (Expecting value at column 1); each line of a .jsonl "
     "file must be one JSON object"),
    (["math", "--input", "{docs}", "--output", "{tmp}/o.jsonl", "--endpoint", "not-a-url"],
     "--endpoint not-a-url: not an http(s) URL; give the server's base URL, e.g. "
     "http://127.0.0.1:8000/v1"),
    (["math", "--input", "{docs}", "--output", "{tmp}", "--endpoint", "http://x"],
     "is a directory"),
])
def test_cli_bad_input_is_one_line_and_exit_2(tmp_path, argv, fragment):
  docs = _write_docs(tmp_path)
  (tmp_path / "bad.jsonl").write_text('{"body": "x"}\n')
  (tmp_path / "notjson.jsonl").write_text('{"text": "x"}\nplain text\n')
  argv = [a.format(tmp=tmp_path, docs=docs, bad=tmp_path / "bad.jsonl",
                   notjson=tmp_path / "notjson.jsonl") for a in argv]
  p = subprocess.run([sys.executable, "-m", "k2jax.synth", *argv], capture_output=True,
                     text=True, timeout=120)
  assert p.returncode == 2, p.stderr
  assert p.stderr.strip().splitlines()[-1].startswith("k2jax.synth: error:")
  assert fragment in p.stderr.strip().splitlines()[-1]
  assert not os.path.exists(tmp_path / "o.jsonl")


@pytest.fixture(scope="module")
def served():
  """The random tiny model (1024-token context, byte tokens) behind k2jax.serve on a thread:
  (the /v1 base URL, the engine)."""
  import jax

  from k2jax import configs, model
  from k2jax.data import ByteTokenizer
  from k2jax.serving.engine import Engine
  from k2jax.serving.serve import Background, make_app
  cfg = configs.get_config("tiny").model
  engine = Engine(cfg, model.init(cfg, jax.random.key(0)), ByteTokenizer(), window_s=0.02)
  with Background(make_app(engine, "tiny")) as server:
    yield server.url, engine
  engine.close()


def _done_once(out: str, ids) -> tuple[list[dict], list[dict]]:
  """(kept, dropped) rows of a run, after checking that every item is in exactly one of the
  two files once, and that every drop says why ('kind: detail')."""
  kept = [json.loads(x) for x in open(out)] if os.path.exists(out) else []
  drops = [json.loads(x) for x in open(out + ".drops")] if os.path.exists(out + ".drops") else []
  assert sorted(r["item"] for r in kept + drops) == sorted(ids)
  assert all(re.fullmatch(r"\w[\w ]*: .+", r["reason"], re.S) for r in drops), drops
  return kept, drops


def test_against_k2jax_serve_every_item_is_done_once_after_a_kill(served, tmp_path):
  """The HTTP path end to end: the tiny model behind k2jax.serve (its random text fails the
  checks; every item must still be kept or dropped with a reason exactly once), killed with
  SIGKILL mid-corpus and rerun."""
  url, _ = served
  docs = tmp_path / "many.jsonl"
  docs.write_text("".join(json.dumps({"id": f"d{i}", "text": f"note {i}: short text."}) + "\n"
                          for i in range(24)))
  out = str(tmp_path / "out.jsonl")
  argv = [sys.executable, "-m", "k2jax.synth", "rephrase", "--input", str(docs), "--output", out,
          "--endpoint", url, "-k", "1", "--max_tokens", "8", "--concurrency", "4", "--no_judge"]
  p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
  deadline = time.time() + 240
  while sum(os.path.getsize(f) for f in (out, out + ".drops") if os.path.exists(f)) < 300:
    assert p.poll() is None and time.time() < deadline, p.stdout.read().decode()[-2000:]
    time.sleep(0.05)
  p.send_signal(signal.SIGKILL)
  p.wait()
  first = sum(1 for f in (out, out + ".drops") if os.path.exists(f) for _ in open(f))
  assert 0 < first < 24
  r = subprocess.run(argv, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-2000:]
  kept, _ = _done_once(out, [f"d{i}#0" for i in range(24)])
  assert all(x["style"] for x in kept)
  assert "k2jax.synth rephrase: kept" in r.stdout


def test_math_against_k2jax_serve_does_every_item_once(served, tmp_path, capsys):
  """math over HTTP with small max_tokens (a translation, a two-chunk note, a note whose
  random rewrite passes the cheap check and meets the judge), then at the default
  --max_tokens 1024 with a prompt that leaves the 1k context a few dozen tokens: the server
  clamps instead of refusing, so the item is a truncation, not a context error."""
  url, _ = served
  src = tmp_path / "math.jsonl"
  src.write_text("".join(json.dumps(d) + "\n" for d in [
      {"id": "ru", "text": "Найдите сумму 2 + 3 = 5."},
      {"id": "two", "text": "The sum 2 + 3 is 5. " * 5 + "\n\nThe product 2 * 3 is 6. " * 4},
      {"id": "plain", "text": "a short note with no numbers and no names at all."}]))
  out = str(tmp_path / "notes.jsonl")
  cli.main(["math", "--input", str(src), "--output", out, "--endpoint", url, "--max_tokens", "8",
            "--chunk_chars", "120", "--concurrency", "3"])
  kept, drops = _done_once(out, ["ru", "two", "plain"])
  reasons = {x["item"]: x["reason"] for x in drops}
  assert not any(r.startswith("model error") for r in reasons.values()), reasons
  printed = capsys.readouterr().out
  assert f"k2jax.synth math: kept {len(kept)} records; dropped {len(drops)} items" in printed
  # one 431-character chunk: its prompt is 956 byte tokens, 68 short of the context
  long = tmp_path / "long.jsonl"
  long.write_text(json.dumps({"id": "long", "text": "Two plus three is five. " * 18}) + "\n")
  out = str(tmp_path / "long_notes.jsonl")
  cli.main(["math", "--input", str(long), "--output", out, "--endpoint", url])
  _, drops = _done_once(out, ["long"])
  assert re.fullmatch(r"truncated: chunk 0 hit the model's context after \d+ tokens",
                      drops[0]["reason"]), drops


def test_agentic_against_k2jax_serve_does_every_item_once(served, tmp_path, capsys):
  """agentic with every part played by the random tiny model over HTTP: whatever fails
  (most items at the task writer's JSON) is dropped once with its reason."""
  url, _ = served
  tools = tmp_path / "tools.json"
  tools.write_text(json.dumps({"domain": "notes", "tools": [MCP_NOTE]}))
  out = str(tmp_path / "agentic.jsonl")
  cli.main(["agentic", "--tools", str(tools), "--items", "4", "--output", out, "--endpoint", url,
            "--max_tokens", "16", "--concurrency", "4"])
  kept, drops = _done_once(out, [f"trajectory-{i}" for i in range(4)])
  assert drops and not any(x["reason"].startswith(("model error", "error")) for x in drops)
  assert f"dropped {len(drops)} items" in capsys.readouterr().out


# A bounded schema: under a grammar a random model writes unbounded strings forever.
ECHO = {"name": "echo", "description": "say a word", "inputSchema": {
    "type": "object", "properties": {"text": {"type": "string", "enum": ["hi", "yes"]}},
    "required": ["text"], "additionalProperties": False}}


class AgentOverHTTP(Client):
  """The agent's turns go over HTTP to the served tiny model: its first turn under
  tool_choice "required" (a call sampled under the tool's schema), its turn after a tool
  result under "none" (text). The parts a random model cannot decide (task writer, user,
  tool simulator, judge) are scripted. Both sides are synth Clients, as the issue asks."""

  def __init__(self, http: Client, scripted: Client):
    self.http, self.scripted, self.turns = http, scripted, []

  def chat(self, request):
    if not request.tools:
      return self.scripted.chat(request)
    after_tool = request.messages[-1]["role"] == "tool"
    request = dataclasses.replace(request, tool_choice="none" if after_tool else "required",
                                  max_tokens=24 if after_tool else 300)
    reply = self.http.chat(request)
    self.turns.append((copy.deepcopy(request), reply))
    return reply


def test_a_kept_agentic_record_comes_through_k2jax_serve(served, tmp_path, capsys):
  import openai

  from k2jax import sft
  from k2jax.synth import OpenAIClient
  url, _ = served
  script = agent_model()

  def scripted(r):     # the user is done once the assistant has answered after a tool result
    text = r.messages[-1]["content"]
    if "You play a user" in text:
      return "DONE" if text.count("\nassistant: ") >= 2 else "Please say a word."
    return script(r)
  tools = tmp_path / "tools.json"
  tools.write_text(json.dumps({"domain": "talk", "tools": [ECHO]}))
  out = str(tmp_path / "agentic.jsonl")
  client = AgentOverHTTP(OpenAIClient(url, "tiny"), ScriptedClient(scripted))
  cli.main(["agentic", "--tools", str(tools), "--items", "2", "--output", out,
            "--concurrency", "1"], client=client)
  kept, drops = _done_once(out, ["trajectory-0", "trajectory-1"])
  assert len(kept) == 2 and "kept 2 records; dropped 0" in capsys.readouterr().out
  direct = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
  assert [q.tool_choice for q, _ in client.turns] == ["required", "none"] * 2  # items in order
  for rec, (call_turn, text_turn) in zip(kept, zip(client.turns[::2], client.turns[1::2])):
    m = rec["messages"]
    calls = m[2]["tool_calls"]
    assert [x["role"] for x in m] == ["system", "user", "assistant"] + ["tool"] * len(calls) + [
        "assistant"] and rec["ended"] == "user_done" and rec["tool_calls"] == len(calls)
    for call, result in zip(calls, m[3:3 + len(calls)]):
      assert call["function"]["name"] == "echo" and call["id"].startswith("functions.echo:")
      assert call["function"]["arguments"] in ({"text": "hi"}, {"text": "yes"})   # the schema
      assert result["tool_call_id"] == call["id"] and result["name"] == "echo"
    # the record holds what the server answered: ask it again (seeded) with the openai client
    request = call_turn[0]
    assert request.messages == m[:2] and text_turn[0].messages == m[:-1]
    again = direct.chat.completions.create(
        model="tiny", messages=request.messages, tools=request.tools, tool_choice="required",
        max_tokens=request.max_tokens, temperature=request.temperature, seed=request.seed)
    assert [(c.id, c.function.name, json.loads(c.function.arguments))
            for c in again.choices[0].message.tool_calls] == [
        (c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls]
    assert m[-1]["content"] == text_turn[1].content
    assert rec["tools"] == [{"type": "function", "function": {
        "name": "echo", "description": "say a word", "parameters": ECHO["inputSchema"]}}]
    ids, mask = chat.encode_with_mask(m, rec["tools"])
    assert any(mask) and not all(mask)
  assert len(sft.read_dialogs(out)) == 2


def test_local_client_and_synth_workdir(tmp_path, capsys):
  """The in-process backend: a LocalClient's greedy reply equals k2jax.generate's and a
  required tool call comes back parsed; `python -m k2jax.synth math --workdir RUN` (the CLI
  loading a trained run into a LocalClient) does every item once."""
  from tests.test_train import small_config
  from k2jax.training import train
  from k2jax.serving.generate import generate
  from k2jax.synth import LocalClient, Request
  run = str(tmp_path / "run")
  train.train(small_config(steps=2, checkpoint_every=2, eval_every=2), run)
  client = LocalClient.from_run(run, concurrency=2)
  try:
    user = [{"role": "user", "content": "what is 2 + 3?"}]
    r = client.chat(Request(messages=user, temperature=0.0, max_tokens=12))
    ids = generate(client.cfg, client.engine.params, [chat.encode(user, tokenizer=client.tok)],
                   max_new_tokens=12, stop_ids=[client.tok.eos_id])[0]
    assert r.content == client.tok.decode(ids).split("<|im_end|>")[0]
    assert r.completion_tokens == len(ids)
    tools = [agentic.public(agentic.normalize_tool(ECHO))]
    r = client.chat(Request(messages=user, tools=tools, tool_choice="required", max_tokens=300,
                            seed=1))
    assert r.finish_reason == "tool_calls" and r.tool_calls
    assert all(c["name"] == "echo" and c["arguments"]["text"] in ("hi", "yes")
               for c in r.tool_calls)
  finally:
    client.engine.close()
  docs = _write_docs(tmp_path)
  out = str(tmp_path / "notes.jsonl")
  cli.main(["math", "--input", docs, "--output", out, "--workdir", run, "--max_tokens", "8",
            "--concurrency", "3"])
  _done_once(out, [d["id"] for d in DOCS])
  assert "k2jax.synth math: kept" in capsys.readouterr().out


def test_train_and_sft_run_on_what_synth_writes(tmp_path):
  """The records feed the trainers as they are: k2jax.train on rephrased text, k2jax.sft
  (CLI) on agentic dialogs, a few steps each."""
  from tests.test_sft import SMALL, run_sft
  from tests.test_train import small_config
  from k2jax.training import metrics, train
  docs = tmp_path / "docs.jsonl"
  docs.write_text("".join(json.dumps({"id": f"d{i}", "text": f"Item {i}. " + DOCS[i % 3]["text"]})
                          + "\n" for i in range(12)))
  out = str(tmp_path / "re.jsonl")
  cli.main(["rephrase", "--input", str(docs), "--output", out, "-k", "1"],
           client=ScriptedClient(faithful))
  cfg = small_config(steps=2, eval_every=2, checkpoint_every=2)
  cfg.data.files = out
  train.train(cfg, str(tmp_path / "pre"))
  assert [r["step"] for r in metrics.read(str(tmp_path / "pre")) if "loss" in r] == [1, 2]
  tools = tmp_path / "tools.json"
  tools.write_text(json.dumps({"domain": "notes", "tools": [MCP_NOTE]}))
  dialogs = str(tmp_path / "agentic.jsonl")
  cli.main(["agentic", "--tools", str(tools), "--items", "8", "--output", dialogs],
           client=ScriptedClient(agent_model(call="save_note")))
  r = run_sft("--config", "tiny_sft", "--workdir", str(tmp_path / "sft"), "--config.train.steps=2",
              f"--config.data.files={dialogs}", *SMALL,
                "--config.train.seq_len=1024", "--config.train.batch_size=2")
  assert r.returncode == 0, r.stderr[-3000:]
  assert any("loss" in json.loads(x) for x in open(tmp_path / "sft" / "metrics.jsonl"))


class _SlowEcho:
  """An OpenAI-compatible stub on a thread: one model; each chat reply, after `delay`
  seconds, is the last user message's text (a rewrite that keeps every fact)."""

  def __init__(self, delay: float):
    import http.server
    import threading
    stub = self

    class Handler(http.server.BaseHTTPRequestHandler):
      def log_message(self, *a):
        pass

      def _send(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

      def do_GET(self):
        self._send({"object": "list", "data": [{"id": "stub", "object": "model",
                                                 "created": 0, "owned_by": "test"}]})

      def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        time.sleep(stub.delay)
        text = _source_text(req["messages"][-1]["content"])
        self._send({"id": "x", "object": "chat.completion", "created": 0, "model": "stub",
                    "choices": [{"index": 0, "finish_reason": "stop", "message": {
                        "role": "assistant", "content": text}}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

    self.delay = delay
    self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
    threading.Thread(target=self.server.serve_forever, daemon=True).start()

  def close(self):
    self.server.shutdown()


def _source_text(content: str) -> str:
  found = re.findall(r"<<<\n(.*?)\n>>>", content, re.S)
  return found[-1] if found else content


def test_synth_sigint_and_sigterm_stop_in_one_line_and_the_rerun_finishes(tmp_path):
  """Ctrl-C, then SIGTERM, mid-corpus against a slow endpoint: one line naming the signal and
  what was kept, exit 130 / 143, no traceback, every line written whole; the third run
  finishes, each item done once."""
  stub = _SlowEcho(delay=0.15)
  docs = tmp_path / "many.jsonl"
  n = 40
  docs.write_text("".join(json.dumps({"id": f"d{i}", "text": f"Note {i} is short."}) + "\n"
                          for i in range(n)))
  out = str(tmp_path / "out.jsonl")
  argv = [sys.executable, "-m", "k2jax.synth", "rephrase", "--input", str(docs), "--output",
          out, "--endpoint", stub.url, "-k", "1", "--concurrency", "2", "--no_judge"]
  lines = lambda: sum(1 for f in (out, out + ".drops") if os.path.exists(f) for _ in open(f))
  try:
    for signum in (signal.SIGINT, signal.SIGTERM):
      before = lines()
      p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
      deadline = time.time() + 120
      while lines() < before + 2:
        assert p.poll() is None and time.time() < deadline, p.communicate()[1][-2000:]
        time.sleep(0.02)
      p.send_signal(signum)
      stdout, stderr = p.communicate(timeout=60)
      assert p.returncode == 128 + signum, stderr[-2000:]
      assert "Traceback" not in stderr, stderr[-2000:]
      assert "HTTP Request" not in stderr      # the HTTP client's INFO line per request
      stops = [x for x in stderr.splitlines() if "stopped by" in x]
      assert len(stops) == 1 and stops[0].startswith(
          f"k2jax.synth rephrase: stopped by {signal.Signals(signum).name}: kept "), stderr
      assert stops[0].endswith(f"-> {out}; run the same command to resume")
      assert before + 2 <= lines() < n
      [json.loads(x) for x in open(out)]      # every line whole
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
  finally:
    stub.close()
  _done_once(out, [f"d{i}#0" for i in range(n)])
