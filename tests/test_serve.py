"""k2jax.serve driven by the official `openai` client: chat, seeds, streaming, stop strings, n,
tool calls, concurrent requests sharing batches, bad requests, the CLI."""

import concurrent.futures
import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import jax
import pytest

import openai

from k2jax import configs, model
from k2jax.serving import chat
from k2jax.data import ByteTokenizer
from k2jax.serving.engine import Engine
from k2jax.serving.generate import generate
from k2jax.serving.serve import Background, make_app

# Bounded schemas: a random model under a grammar writes unbounded integers / strings forever.
TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "maximum": 99,
                                                          "minimum": 0},
                                                    "b": {"type": "integer", "maximum": 99,
                                                          "minimum": 0}},
                   "required": ["a", "b"], "additionalProperties": False}}},
         {"type": "function", "function": {
    "name": "echo", "parameters": {"type": "object", "properties": {"text": {
        "type": "string", "enum": ["hi", "yes"]}}, "required": ["text"],
        "additionalProperties": False}}}]
USER = [{"role": "user", "content": "what is 2 + 3?"}]


@pytest.fixture(scope="module")
def served():
  """A random tiny model behind the server: (base url, engine, cfg, params, tokenizer)."""
  cfg = configs.get_config("tiny").model
  params = model.init(cfg, jax.random.key(7))
  tok = ByteTokenizer()
  engine = Engine(cfg, params, tok, max_batch=16, window_s=0.05)
  with Background(make_app(engine, "tiny", default_max_tokens=24)) as server:
    yield server.url.removesuffix("/v1"), engine, cfg, params, tok
  engine.close()


@pytest.fixture(scope="module")
def client(served):
  return openai.OpenAI(base_url=served[0] + "/v1", api_key="unused", max_retries=0)


def test_models_and_a_greedy_answer_equal_to_generate(served, client):
  url, engine, cfg, params, tok = served
  assert [m.id for m in client.models.list().data] == ["tiny"]
  r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=12, temperature=0)
  ids = generate(cfg, params, [chat.encode(USER, tokenizer=tok)], max_new_tokens=12,
                 stop_ids=[tok.eos_id])[0]
  assert r.choices[0].message.content == tok.decode(ids).split("<|im_end|>")[0]
  assert r.choices[0].finish_reason in ("length", "stop")
  assert r.usage.prompt_tokens == len(chat.encode(USER, tokenizer=tok))
  assert r.usage.completion_tokens == len(ids) and r.object == "chat.completion"


def test_a_seed_repeats_and_the_stream_equals_the_answer(client):
  kw = dict(model="tiny", messages=USER, max_tokens=20, temperature=1.0, seed=11)
  a = client.chat.completions.create(**kw).choices[0].message.content
  b = client.chat.completions.create(**kw).choices[0].message.content
  assert a == b
  chunks = list(client.chat.completions.create(**kw, stream=True,
                                               stream_options={"include_usage": True}))
  text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
  assert text == a
  assert chunks[-1].usage.completion_tokens == 20 and not chunks[-1].choices
  assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_stop_strings_cut_the_text_before_them(client):
  kw = dict(model="tiny", messages=USER, max_tokens=24, temperature=1.0, seed=5)
  full = client.chat.completions.create(**kw).choices[0].message.content
  stop = full[6:8]
  assert stop, full
  r = client.chat.completions.create(**kw, stop=[stop, "\x00never"])
  assert r.choices[0].message.content == full[:full.index(stop)]
  assert r.choices[0].finish_reason == "stop"
  streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
      **kw, stop=stop, stream=True) if c.choices)
  assert streamed == full[:full.index(stop)]


def test_n_choices_share_the_request(client):
  r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=8, n=3, seed=2)
  assert [c.index for c in r.choices] == [0, 1, 2]
  assert 3 <= r.usage.completion_tokens <= 3 * 8
  assert all(c.finish_reason in ("length", "stop") for c in r.choices)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "echo"}}])
def test_constrained_tool_calls_come_back_parsed(client, choice):
  r = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice=choice,
                                     max_tokens=300, temperature=0.7, seed=3)
  c = r.choices[0]
  assert c.finish_reason == "tool_calls", c
  for call in c.message.tool_calls:
    args = json.loads(call.function.arguments)
    if call.function.name == "add":
      assert set(args) == {"a", "b"} and all(type(v) is int for v in args.values())
    else:
      assert call.function.name == "echo" and isinstance(args["text"], str)
    assert call.id.startswith(f"functions.{call.function.name}:")
  if isinstance(choice, dict):
    assert {call.function.name for call in c.message.tool_calls} == {"echo"}
  chunks = list(client.chat.completions.create(
      model="tiny", messages=USER, tools=TOOLS, tool_choice=choice, max_tokens=300,
      temperature=0.7, seed=3, stream=True))
  # streamed incrementally (OpenAI's way: each call's id and name, then its arguments in
  # pieces), assembling to exactly the non-streamed calls
  pieces = [t for ch in chunks for t in (ch.choices[0].delta.tool_calls or [])]
  assembled: dict[int, dict] = {}
  for t in pieces:
    call = assembled.setdefault(t.index, {"id": None, "name": None, "arguments": ""})
    call["id"] = t.id or call["id"]
    call["name"] = (t.function.name if t.function else None) or call["name"]
    call["arguments"] += (t.function.arguments or "") if t.function else ""
  assert [assembled[k] for k in sorted(assembled)] == [
      {"id": t.id, "name": t.function.name, "arguments": t.function.arguments}
      for t in c.message.tool_calls]
  assert len(pieces) > 2 * len(assembled)          # the arguments came in several pieces
  assert "<|tool" not in "".join(ch.choices[0].delta.content or "" for ch in chunks)


def test_a_tool_call_dialog_renders_back(client):
  """The returned call, sent back with its result, is a valid next request."""
  r = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS,
                                     tool_choice="required", max_tokens=300, seed=4)
  call = r.choices[0].message.tool_calls[0]
  messages = USER + [r.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "5"}]
  # (without the tool declaration: with it the byte-level dialog passes the tiny context)
  r2 = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
  assert r2.usage.prompt_tokens > len(call.function.arguments) + 100
  assert r2.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_max_tokens_past_the_context_is_clamped_to_what_is_left(served, client):
  """A max_tokens sized for a big model answers with the tokens the context has left and
  finish_reason "length" (it was a 400: every synth request at its default failed)."""
  url, engine, cfg, params, tok = served
  bare = len(chat.encode([{"role": "user", "content": ""}], tokenizer=tok))
  room = 5
  messages = [{"role": "user", "content": "y" * (cfg.max_position_embeddings - bare - room)}]
  prompt = chat.encode(messages, tokenizer=tok)
  assert cfg.max_position_embeddings - len(prompt) == room
  ids = generate(cfg, params, [prompt], max_new_tokens=room, stop_ids=[tok.eos_id])[0]
  for key in ("max_tokens", "max_completion_tokens"):
    r = client.chat.completions.create(model="tiny", messages=messages, temperature=0,
                                       **{key: 5000})
    assert r.choices[0].message.content == tok.decode(ids).split("<|im_end|>")[0]
    assert r.usage.completion_tokens == len(ids) <= room
    assert r.choices[0].finish_reason == ("length" if len(ids) == room else "stop")


def test_concurrent_requests_share_batches_and_match_alone(served, client):
  url, engine, cfg, params, tok = served
  prompts = [[{"role": "user", "content": f"question {i}" + "?" * i}] for i in range(8)]
  alone = [tok.decode(generate(cfg, params, [chat.encode(p, tokenizer=tok)], max_new_tokens=10,
                               stop_ids=[tok.eos_id])[0]).split("<|im_end|>")[0]
           for p in prompts]
  before = dict(engine.stats)
  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    got = list(pool.map(lambda p: client.chat.completions.create(
        model="tiny", messages=p, max_tokens=10, temperature=0).choices[0].message.content,
        prompts))
  assert got == alone
  assert _rows_per_step(engine, before) > 1.5      # decode steps were shared


def _rows_per_step(engine, before) -> float:
  """Rows a decode step served on average since the engine's stats were `before`."""
  steps = engine.stats["steps"] - before["steps"]
  return (engine.stats["row_steps"] - before["row_steps"]) / max(steps, 1)


def _post(url, body, method="POST"):
  data = body if isinstance(body, bytes) else json.dumps(body).encode()
  req = urllib.request.Request(url, data=data if method == "POST" else None, method=method,
                               headers={"Content-Type": "application/json"})
  try:
    with urllib.request.urlopen(req, timeout=60) as r:
      return r.status, json.loads(r.read())
  except urllib.error.HTTPError as e:
    return e.code, json.loads(e.read())


OK = {"model": "tiny", "messages": USER, "max_tokens": 2}
BAD_REQUESTS = [  # (id, body or bytes, status, param, message fragment)
    ("not-json", b"{messages:", 400, None, "not JSON"),
    ("not-object", [1, 2], 400, None, "must be a JSON object"),
    ("unknown-model", {**OK, "model": "gpt-4"}, 404, "model", "is not served here"),
    ("no-messages", {**OK, "messages": []}, 400, "messages", "non-empty list"),
    ("bad-role", {**OK, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages",
     "role 'robot'"),
    ("content-parts", {**OK, "messages": [{"role": "user", "content": [{"type": "text"}]}]},
     400, "messages[0]", "must be a text part"),
    ("image-part", {**OK, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages[0]", "text only"),
    ("temperature", {**OK, "temperature": 3}, 400, "temperature", "[0, 2]"),
    ("top_p", {**OK, "top_p": 0}, 400, "top_p", "(0, 1]"),
    ("n", {**OK, "n": 0}, 400, "n", "[1, 16]"),
    ("max_tokens-type", {**OK, "max_tokens": "ten"}, 400, "max_tokens", "an integer"),
    ("long-prompt", {**OK, "messages": [{"role": "user", "content": "x" * 2000}]}, 400,
     "messages", "context is 1024 tokens: shorten the messages"),
    ("stop", {**OK, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "at most 4"),
    ("tool-choice-name", {**OK, "tools": TOOLS, "tool_choice": {"type": "function", "function":
                                                                {"name": "mul"}}},
     400, "tool_choice", "'mul', which is not among"),
    ("required-without-tools", {**OK, "tool_choice": "required"}, 400, "tool_choice",
     "needs tools"),
    ("tool-without-name", {**OK, "tools": [{"type": "function", "function": {}}]}, 400,
     "tools[0]", "non-empty name"),
    ("logprobs-type", {**OK, "logprobs": 1}, 400, "logprobs", "true or false"),
    ("response-format-type", {**OK, "response_format": {"type": "xml"}}, 400,
     "response_format", "must be {type: text}"),
    ("response-format-with-tools", {**OK, "tools": TOOLS, "response_format": {
        "type": "json_object"}}, 400, "response_format", "with tools"),
    ("top-logprobs-alone", {**OK, "top_logprobs": 2}, 400, "top_logprobs", "needs logprobs"),
    ("top-logprobs-range", {**OK, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs",
     "[0, 20]"),
    ("stream-type", {**OK, "stream": "yes"}, 400, "stream", "true or false"),
    ("stream-options-type", {**OK, "stream": True, "stream_options": "x"}, 400,
     "stream_options", "must be an object"),
    ("tool-choice-function-string", {**OK, "tools": TOOLS, "tool_choice": {
        "type": "function", "function": "add"}}, 400, "tool_choice", "function: {name}"),
    ("presence-penalty", {**OK, "presence_penalty": 2.5}, 400, "presence_penalty",
     "[-2, 2]"),
    ("frequency-penalty", {**OK, "frequency_penalty": "1"}, 400, "frequency_penalty",
     "a number"),
    ("logit-bias-id", {**OK, "logit_bias": {"264": 10}}, 400, "logit_bias", "[0, 264)"),
    ("logit-bias-value", {**OK, "logit_bias": {"50": 101}}, 400, "logit_bias", "[-100, 100]"),
    ("repetition-penalty", {**OK, "repetition_penalty": 0}, 400, "repetition_penalty",
     "(0, 10]"),
    ("min-tokens-past-max", {**OK, "min_tokens": 2**31 - 1}, 400, "min_tokens",
     "is more than"),
    ("min-tokens-range", {**OK, "min_tokens": 2**31}, 400, "min_tokens", "an integer in"),
    ("min-tokens-constrained", {**OK, "min_tokens": 1, "tools": TOOLS,
                                "tool_choice": "required"}, 400, "min_tokens", "constrained"),
    ("parallel-tool-calls-type", {**OK, "tools": TOOLS, "parallel_tool_calls": "no"}, 400,
     "parallel_tool_calls", "true or false"),
    ("json-schema-that-does-not-compile", {**OK, "response_format": {
        "type": "json_schema", "json_schema": {"name": "a", "schema": {
            "type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}}, 400,
     "response_format", "does not compile"),
    ("functions", {**OK, "functions": [{"name": "f"}]}, 400, "functions", "not supported"),
    ("unknown-field", {**OK, "temprature": 0.5}, 400, "temprature", "not a field"),
]


def test_fields_at_values_that_change_nothing_are_accepted(served):
  """A client's defaults (zero penalties, no bias, parallel calls allowed, text format) and
  the request's own metadata are not refused."""
  code, got = _post(served[0] + "/v1/chat/completions", {
      **OK, "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {},
      "parallel_tool_calls": True, "response_format": {"type": "text"}, "logprobs": False,
      "user": "u1", "metadata": {"k": "v"}, "n": None})
  assert code == 200, got


def test_penalties_and_logit_bias_reach_the_sampler_on_both_endpoints(served, client):
  """logit_bias and the penalties are applied (the engine's test checks their math against
  their definitions): a +100 bias writes only that token, streamed or not, on chat and on
  completions; a presence penalty changes a greedy answer, and zero changes nothing."""
  z = {str(ord("z")): 100}
  kw = dict(model="tiny", messages=USER, max_tokens=6, temperature=0)
  assert client.chat.completions.create(logit_bias=z, **kw).choices[0].message.content == "z" * 6
  chunks = client.chat.completions.create(logit_bias=z, stream=True, **kw)
  assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "z" * 6
  code, got = _post(served[0] + "/v1/completions", {"model": "tiny", "prompt": "hi",
                                                     "max_tokens": 4, "logit_bias": z})
  assert code == 200 and got["choices"][0]["text"] == "zzzz", got
  kw["max_tokens"] = 24
  plain = client.chat.completions.create(**kw).choices[0].message.content
  assert client.chat.completions.create(presence_penalty=0, **kw).choices[0].message.content \
      == plain
  assert client.chat.completions.create(presence_penalty=2, **kw).choices[0].message.content \
      != plain


def test_content_parts_and_the_developer_role_read_as_text_and_system(served, client):
  """OpenAI's content parts (also in tool results) are the joined text, and the `developer`
  role is the system role: the greedy answers equal those of the plain messages."""
  plain = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 2 + 3?"}]
  parts = [{"role": "developer", "content": [{"type": "text", "text": "be "},
                                             {"type": "text", "text": "brief"}]},
           {"role": "user", "content": [{"type": "text", "text": "what is 2 + 3?"}]}]
  kw = dict(model="tiny", max_tokens=6, temperature=0)
  a = client.chat.completions.create(messages=plain, **kw).choices[0].message.content
  b = client.chat.completions.create(messages=parts, **kw).choices[0].message.content
  assert a == b
  history = [{"role": "user", "content": "add"},
             {"role": "assistant", "content": None, "tool_calls": [
                 {"id": "functions.add:0", "type": "function",
                  "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]}]
  tool = lambda c: client.chat.completions.create(
      messages=history + [{"role": "tool", "tool_call_id": "functions.add:0", "content": c}],
      tools=TOOLS, **kw).choices[0].message
  assert tool("3") == tool([{"type": "text", "text": "3"}])


def test_call_ids_count_the_replys_calls_and_a_cut_section_says_length():
  """Ids are functions.NAME:IDX with IDX counting the reply's calls (the model may write any
  index), dotted names survive, and a reply cut inside its call section keeps
  finish_reason "length" with the complete calls before the cut, never a repaired one."""
  from k2jax.serving.serve import _message
  call = lambda cid, args: (f"<|tool_call_begin|>{cid}<|tool_call_argument_begin|>{args}"
                            "<|tool_call_end|>")
  text = ("<|tool_calls_section_begin|>" + call("functions.add:0", '{"a": 1, "b": 2}')
          + call("functions.browser.open:0", '{"url": "x"}') + "<|tool_calls_section_end|>")
  msg, finish = _message(text, "stop", TOOLS)
  assert finish == "tool_calls"
  assert [(c["id"], c["function"]["name"]) for c in msg["tool_calls"]] == [
      ("functions.add:0", "add"), ("functions.browser.open:1", "browser.open")]
  cut = text[:text.index('{"url"') + 5]
  msg, finish = _message(cut, "length", TOOLS)
  assert finish == "length"
  assert [c["id"] for c in msg["tool_calls"]] == ["functions.add:0"]
  assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"a": 1, "b": 2}


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_requests_get_openai_errors_and_the_server_goes_on(served, case):
  _, body, status, param, fragment = case
  code, got = _post(served[0] + "/v1/chat/completions", body)
  assert code == status, got
  err = got["error"]
  assert fragment in err["message"] and err["param"] == param and "\n" not in err["message"]
  assert _post(served[0] + "/v1/chat/completions", OK)[0] == 200


def test_unknown_routes_and_methods_are_json_errors(served):
  assert _post(served[0] + "/v1/embeddings", OK)[0] == 404
  code, got = _post(served[0] + "/v1/chat/completions", None, method="GET")
  assert code == 405 and "POST /v1/chat/completions" in got["error"]["message"]
  with pytest.raises(openai.NotFoundError, match="is not served here"):
    openai.OpenAI(base_url=served[0] + "/v1", api_key="x", max_retries=0).chat.completions.create(
        model="other", messages=USER)


def test_a_client_that_leaves_a_stream_frees_its_rows(served, client):
  """A stream's client that goes away after the first chunk: its row leaves its slot long
  before its 800 tokens. min_tokens keeps the random model from ending the row by itself
  (its end-of-text token), so only the cancellation can; the test waits on the engine's
  state, not a time."""
  engine = served[1]
  before = engine.stats["tokens"]
  stream = client.chat.completions.create(model="tiny", messages=USER, max_tokens=800,
                                          stream=True, seed=1, extra_body={"min_tokens": 800})
  next(iter(stream))
  stream.close()
  deadline = time.time() + 60
  while engine.running_rows() and time.time() < deadline:
    time.sleep(0.02)
  assert engine.running_rows() == 0
  assert engine.stats["tokens"] - before < 800, engine.stats["tokens"] - before


def test_a_decoding_failure_is_a_500_that_carries_no_internal_state(served, client,
                                                                    monkeypatch):
  """The engine's exception text (here standing in for the model config a shard_map error
  printed) stays in the server's log: the client gets the error's type only, streamed or
  not, and the server goes on."""
  engine = served[1]
  advance = engine._advance

  def fail():
    raise ValueError("SECRET: num_hidden_layers: 61")
  monkeypatch.setattr(engine, "_advance", fail)
  code, got = _post(served[0] + "/v1/chat/completions", {**OK, "max_tokens": 8})
  assert code == 500 and got["error"]["type"] == "server_error", got
  assert "ValueError" in got["error"]["message"] and "SECRET" not in json.dumps(got)
  events = []
  try:
    for c in client.chat.completions.create(model="tiny", messages=USER, max_tokens=8,
                                            stream=True):
      events.append(c)
  except openai.APIError as e:
    assert "SECRET" not in str(e.body) and "ValueError" in str(e.message), e
  else:
    raise AssertionError(f"the stream ended without its error: {events}")
  monkeypatch.setattr(engine, "_advance", advance)
  assert _post(served[0] + "/v1/chat/completions", OK)[0] == 200


def test_one_refused_prompt_stops_its_siblings_and_is_a_400(served, monkeypatch):
  """A multi-prompt completion whose second prompt the engine refuses (engine.Unfit): the
  answer is a 400 with the engine's reason, and the first prompt's job, which nobody will
  read, is cancelled (its rows leave their slots) instead of decoding to max_tokens."""
  from k2jax.serving.engine import Event, Unfit
  engine = served[1]
  submit, taken = engine.submit, []

  def refuse_the_second(job):
    if job.prompt[-3:] == list(b"!!!"):
      job.emit(Event("error", error=Unfit("a request of 1 rows does not fit (a test)")))
    else:
      taken.append(job)
      submit(job)
  monkeypatch.setattr(engine, "submit", refuse_the_second)
  code, got = _post(served[0] + "/v1/completions", {
      "model": "tiny", "prompt": ["a long one", "refused!!!"], "max_tokens": 200})
  assert code == 400 and "does not fit (a test)" in got["error"]["message"], got
  assert len(taken) == 1 and taken[0].cancelled
  deadline = time.time() + 30
  while engine.running_rows() and time.time() < deadline:
    time.sleep(0.05)
  assert engine.running_rows() == 0


def test_a_non_streaming_client_that_leaves_frees_its_rows(served):
  """The issue's report: a non-streaming client that went away left its rows decoding to
  max_tokens. Two rows of 800 tokens under a JSON schema (a host mask every step: several
  seconds of decoding here, where a free random row often stops early), a client that gives
  up after half a second: the rows leave within about a second, far short of 800 tokens."""
  engine = served[1]
  before = engine.stats["tokens"]
  quick = openai.OpenAI(base_url=served[0] + "/v1", api_key="x", max_retries=0, timeout=0.5)
  schema = {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}
  with pytest.raises(openai.APITimeoutError):
    quick.chat.completions.create(
        model="tiny", messages=USER, max_tokens=800, n=2, seed=1,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
  deadline = time.time() + 30
  while engine.running_rows() and time.time() < deadline:
    time.sleep(0.05)
  assert engine.running_rows() == 0
  assert engine.stats["tokens"] - before < 400, engine.stats["tokens"] - before


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_cli_serves_a_trained_run_and_refuses_bad_input(tmp_path):
  from tests.test_train import small_config
  from k2jax.training import train
  run = tmp_path / "run"
  train.train(small_config(steps=2, checkpoint_every=2, eval_every=2), str(run))
  with socket.socket() as held:
    held.bind(("127.0.0.1", 0))
    held.listen()
    busy = held.getsockname()[1]
    for args, fragment in [(["--workdir", str(tmp_path / "nope")], "no such directory"),
                           (["--workdir", str(run), "--port", str(busy)], "cannot listen there"),
                           (["--workdir", str(run), "--max_batch", "0"], "--max_batch 0"),
                           (["--workdir", str(run), "--max_queue", "0"], "--max_queue 0"),
                           (["--workdir", str(run), "--mesh", "context=64"],
                            "--mesh context=64: needs 64 devices")]:
      p = subprocess.run([sys.executable, "-m", "k2jax.serve", *args], capture_output=True,
                         text=True, timeout=120)
      assert p.returncode == 2 and fragment in p.stderr.strip().splitlines()[-1], p.stderr
  # served, then stopped by SIGTERM (a service manager) and, a second time, by Ctrl-C: one
  # line and 128 + signal, no traceback (SIGINT was a KeyboardInterrupt traceback)
  for signum in (signal.SIGTERM, signal.SIGINT):
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "k2jax.serve", "--workdir", str(run),
                             "--port", str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
      deadline = time.time() + 240
      while True:
        try:
          urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
          break
        except OSError:
          assert proc.poll() is None and time.time() < deadline, proc.stdout.read()[-2000:]
          time.sleep(0.5)
      if signum == signal.SIGTERM:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        assert [m.id for m in c.models.list().data] == ["run"]
        r = c.chat.completions.create(model="run", messages=USER, max_tokens=5)
        assert r.usage.completion_tokens <= 5 and isinstance(r.choices[0].message.content, str)
      proc.send_signal(signum)
      out = proc.communicate(timeout=60)[0]
    finally:
      if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=60)
    assert proc.returncode == 128 + signum, out[-2000:]
    # libraries speak only to warn: orbax's ~30 INFO lines per restore, jax's missing TPU
    assert not [x for x in out.splitlines() if " absl: " in x or " jax._src" in x], out
    assert "Traceback" not in out and out.strip().splitlines()[-1] == \
        f"k2jax.serve: stopped by {signal.Signals(signum).name}", out[-2000:]


def test_seeded_requests_share_a_batch_and_still_repeat(served, client):
  """Per-row sampling keys: a seeded request gives the same text alone and batched with
  other seeded requests (the engine groups them; before, each decoded alone)."""
  engine = served[1]
  kw = dict(model="tiny", max_tokens=12, temperature=1.0)
  prompts = [[{"role": "user", "content": f"tell me {i}"}] for i in range(6)]
  alone = [client.chat.completions.create(messages=p, seed=100 + i, **kw).choices[0].message.content
           for i, p in enumerate(prompts)]
  before = dict(engine.stats)
  with concurrent.futures.ThreadPoolExecutor(6) as pool:
    together = list(pool.map(lambda i: client.chat.completions.create(
        messages=prompts[i], seed=100 + i, **kw).choices[0].message.content, range(6)))
  assert together == alone
  assert _rows_per_step(engine, before) > 1.5
  assert len(set(alone)) > 1


def _metric(text: str, name: str) -> float:
  """The value of one sample (`name` with its labels, as the text format writes it)."""
  return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
             if line.startswith(name + " ") or line.startswith(name + "{") and
             line.split(" ")[0] == name)


def test_an_api_key_metrics_and_a_bound_on_waiting_rows():
  """--api-key refuses clients without it (401, openai.AuthenticationError); /metrics counts
  what the responses say; past --max_queue waiting rows a request gets 429
  (openai.RateLimitError) while the server goes on."""
  cfg = configs.get_config("tiny").model
  tok = ByteTokenizer()
  engine = Engine(cfg, model.init(cfg, jax.random.key(1)), tok, max_batch=1, window_s=0.0)
  gate = threading.Event()
  try:
    with Background(make_app(engine, "tiny", api_key="sekret", max_queue=1)) as server:
      make = lambda key: openai.OpenAI(base_url=server.url, api_key=key, max_retries=0)
      with pytest.raises(openai.AuthenticationError, match="API key"):
        make("wrong").chat.completions.create(model="tiny", messages=USER, max_tokens=2)
      with pytest.raises(openai.AuthenticationError):
        make("wrong").models.list()
      client = make("sekret")
      r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=5,
                                         temperature=0)
      text = urllib.request.urlopen(server.url.removesuffix("/v1") + "/metrics").read().decode()
      reason = r.choices[0].finish_reason
      assert _metric(text, f'k2jax_request_success_total{{finish_reason="{reason}"}}') == 1
      assert _metric(text, "k2jax_generation_tokens_total") == r.usage.completion_tokens
      assert _metric(text, "k2jax_prompt_tokens_total") == r.usage.prompt_tokens
      assert _metric(text, 'k2jax_request_refused_total{status="401"}') == 2
      assert _metric(text, "k2jax_time_to_first_token_seconds_count") == 1
      assert _metric(text, "k2jax_num_requests_running") == 0
      # one slot: a long stream holds it, a second request waits, a third is one too many.
      # min_tokens: a sampled stop token must not end the stream (and free the slot) early;
      # the engine's thread parks after the stream's first dispatch until the checks are
      # done, so the stream holds its slot however slowly the other requests arrive (on a
      # loaded machine its 800 tokens once ended before the second request was queued)
      advance, dispatches = engine._advance, []

      def parked():
        dispatches.append(1)
        if len(dispatches) > 1:
          gate.wait()
        advance()
      engine._advance = parked
      stream = client.chat.completions.create(model="tiny", messages=USER, max_tokens=800,
                                              stream=True, extra_body={"min_tokens": 800})
      next(iter(stream))
      # the role chunk comes before the engine admits the row: wait for its slot, or the
      # stream itself is the waiting row counted below (seen on a loaded CI machine)
      deadline = time.time() + 60
      while engine.running_rows() < 1 and time.time() < deadline:
        time.sleep(0.01)
      with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(client.chat.completions.create, model="tiny", messages=USER,
                              max_tokens=2)
        deadline = time.time() + 60
        while engine.waiting_rows() < 1 and time.time() < deadline:
          time.sleep(0.01)
        assert engine.running_rows() == 1 and engine.waiting_rows() == 1
        with pytest.raises(openai.RateLimitError, match="--max_queue 1") as busy:
          client.chat.completions.create(model="tiny", messages=USER, max_tokens=2)
        assert busy.value.response.headers["retry-after"] == "1"
        gate.set()
        stream.close()                           # frees the slot: the waiting one is served
        assert waiting.result(timeout=120).usage.completion_tokens >= 1
  finally:
    gate.set()
    engine.close()


def _model_logprobs(cfg, params, ids):
  """log softmax of the model's next-token logits at every position of one sequence, by a
  plain forward in float64 on the host (the training form: not the server's prefill /
  absorbed decode path)."""
  import numpy as np
  logits = np.asarray(model.forward(cfg, params, jax.numpy.asarray([ids]))[0][0], np.float64)
  top = logits.max(-1, keepdims=True)
  return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))


def test_chat_logprobs_are_the_models_and_stream_the_same(served, client):
  import numpy as np
  url, engine, cfg, params, tok = served
  kw = dict(model="tiny", messages=USER, max_tokens=6, temperature=0, logprobs=True,
            top_logprobs=3)
  r = client.chat.completions.create(**kw)
  content = r.choices[0].logprobs.content
  assert len(content) == r.usage.completion_tokens
  ids = [t.bytes[0] if len(t.bytes) == 1 else None for t in content]
  assert all(len(t.top_logprobs) == 3 for t in content)
  for t in content:     # greedy: the chosen token is the most likely; alternatives descend
    assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == t.logprob
    assert [a.logprob for a in t.top_logprobs] == sorted((a.logprob for a in t.top_logprobs),
                                                         reverse=True)
  prompt = chat.encode(USER, tokenizer=tok)
  gen = [i for i in ids if i is not None]
  assert len(gen) == len(ids), "a generated token was not a byte: pick another prompt"
  ref = _model_logprobs(cfg, params, prompt + gen)
  want = [ref[len(prompt) - 1 + j, i] for j, i in enumerate(gen)]
  np.testing.assert_allclose([t.logprob for t in content], want, atol=2e-3)
  streamed = []
  for chunk in client.chat.completions.create(stream=True, **kw):
    if chunk.choices and chunk.choices[0].logprobs:
      streamed += chunk.choices[0].logprobs.content
  # the same tokens; log probabilities to float rounding (the stream's prompt continues the
  # slot the first request left: prefix reuse runs it in the absorbed form)
  assert [t.token for t in streamed] == [t.token for t in content]
  np.testing.assert_allclose([t.logprob for t in streamed], [t.logprob for t in content],
                             atol=1e-4)


def test_completions_echo_scores_a_prompt_as_the_model_does(served):
  """/v1/completions as lm-evaluation-harness's local-completions calls it: echo + logprobs
  with max_tokens 0 scores the prompt; text prompts get BOS (not echoed), token prompts are
  taken as given; a batch of prompts x n comes back in order; the stream says the same."""
  import numpy as np
  url, engine, cfg, params, tok = served
  c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
  text = "The cat sat on the mat."
  r = c.completions.create(model="tiny", prompt=text, max_tokens=0, echo=True, logprobs=2)
  lp = r.choices[0].logprobs
  assert r.choices[0].text == text and "".join(lp.tokens) == text
  ids = [tok.bos_id] + [int(i) for i in tok.encode(text)]
  ref = _model_logprobs(cfg, params, ids)
  np.testing.assert_allclose(lp.token_logprobs, [ref[j, i] for j, i in enumerate(ids[1:])],
                             atol=2e-3)
  assert lp.text_offset == list(range(len(text)))
  assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 0
  r = c.completions.create(model="tiny", prompt=ids, max_tokens=0, echo=True, logprobs=0)
  assert r.choices[0].logprobs.token_logprobs[0] is None
  np.testing.assert_allclose(r.choices[0].logprobs.token_logprobs[1:], lp.token_logprobs,
                             atol=1e-6)
  # a batch: 2 prompts x n 2, sampled with a seed; each choice its own prompt's
  r = c.completions.create(model="tiny", prompt=["abc", "xyz"], n=2, max_tokens=4, seed=3,
                           temperature=1.0, echo=True)
  assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
  assert [ch.text[:3] for ch in r.choices] == ["abc", "abc", "xyz", "xyz"]
  assert 4 <= r.usage.completion_tokens <= 16
  streamed = {}
  for chunk in c.completions.create(model="tiny", prompt=["abc", "xyz"], n=2, max_tokens=4,
                                    seed=3, temperature=1.0, echo=True, stream=True):
    for ch in chunk.choices:
      streamed[ch.index] = streamed.get(ch.index, "") + ch.text
  assert [streamed[i] for i in range(4)] == [ch.text for ch in r.choices]
  for body, fragment in [({"prompt": []}, "prompt must be"), ({"prompt": "a", "echo": "y"},
                                                              "echo must be"),
                         ({"prompt": "a", "max_tokens": 0}, "max_tokens 0"),
                         ({"prompt": [[1, 99999]]}, "token ids must be in"),
                         ({"prompt": "a", "suffix": "b"}, "suffix")]:
    code, got = _post(url + "/v1/completions", {"model": "tiny", **body})
    assert code == 400 and fragment in got["error"]["message"], got


def test_parallel_tool_calls_false_allows_one_call_a_turn(client):
  """The grammar allows two calls a turn; parallel_tool_calls false makes it one. The same
  seeded rows with it true write a second call somewhere (so the test can fail)."""
  counts = {}
  for parallel in (True, False):
    r = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS,
                                       tool_choice="required", parallel_tool_calls=parallel,
                                       max_tokens=300, n=8, seed=5, temperature=1.0)
    counts[parallel] = [len(c.message.tool_calls or ()) for c in r.choices]
    assert all(c.finish_reason == "tool_calls" for c in r.choices)
  assert counts[False] == [1] * 8 and max(counts[True]) == 2, counts


def test_a_forced_call_closes_inside_max_tokens_whenever_the_shortest_call_fits(client):
  """The issue's report: a forced call on the random model ran to max_tokens inside its
  arguments' string (finish_reason length, no call). With unbounded strings and numbers, and
  budgets from the shortest call up, every choice (streamed too) is a call that validates;
  half the shortest call is cut, never repaired into a call."""
  import jsonschema
  tools = [{"type": "function", "function": {"name": "search", "parameters": {
      "type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"},
                                       "tags": {"type": "array", "items": {"type": "string"}}},
      "required": ["query", "tags"]}}}]
  shortest = chat.ToolCallConstraint(ByteTokenizer(), tools).shortest
  for budget in (shortest, shortest + 9, 200):
    kw = dict(model="tiny", messages=USER, tools=tools, tool_choice="required",
              max_tokens=budget, temperature=1.0, seed=budget)
    r = client.chat.completions.create(n=2, **kw)
    streamed = list(client.chat.completions.create(stream=True, **kw))
    assert [c.choices[0].finish_reason for c in streamed
            if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    for c in r.choices:
      assert c.finish_reason == "tool_calls" and c.message.tool_calls, (budget, c)
      for call in c.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), tools[0]["function"]["parameters"])
  r = client.chat.completions.create(model="tiny", messages=USER, tools=tools,
                                     tool_choice="required", max_tokens=shortest // 2, seed=0)
  assert r.choices[0].finish_reason == "length" and not r.choices[0].message.tool_calls


def test_response_format_json_schema_gives_json_that_validates(client):
  """response_format json_schema: every choice is JSON valid under the schema (sampled from
  a random model under llguidance's grammar), ending the turn with finish_reason stop."""
  import jsonschema
  schema = {"type": "object", "properties": {
      "answer": {"type": "integer", "minimum": 0, "maximum": 99},
      "unit": {"type": "string", "enum": ["cm", "kg"]}},
      "required": ["answer", "unit"], "additionalProperties": False}
  r = client.chat.completions.create(
      model="tiny", messages=USER, max_tokens=80, n=3, seed=2, temperature=1.0,
      response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
  for ch in r.choices:
    assert ch.finish_reason == "stop", ch
    jsonschema.validate(json.loads(ch.message.content), schema)


def test_grammars_compile_off_the_event_loop_and_the_engines_thread(served, client,
                                                                     monkeypatch):
  """A response_format's grammar (one constraint a choice) is built in the request's parse,
  in a worker thread: not on the event loop, where every other stream waits on it, nor on
  the engine's thread, whose dispatches would."""
  import asyncio
  import threading
  from k2jax.serving import chat as chat_lib
  made, real = [], chat_lib.JSONConstraint

  def recording(*a, **kw):
    try:
      asyncio.get_running_loop()
      where = "the event loop"
    except RuntimeError:
      where = threading.current_thread().name
    made.append(where)
    return real(*a, **kw)
  monkeypatch.setattr(chat_lib, "JSONConstraint", recording)
  r = client.chat.completions.create(
      model="tiny", messages=USER, max_tokens=30, n=3, seed=2, temperature=1.0,
      response_format={"type": "json_object"})
  assert len(r.choices) == 3 and len(made) == 3, made
  assert not {"the event loop", "k2jax-engine"} & set(made), made


def test_a_final_assistant_message_is_continued_not_closed(served, client):
  """A dialog ending in an assistant message (a prefilled reply) is rendered open, and the
  reply is its continuation: what the model generates after that text."""
  url, engine, cfg, params, tok = served
  messages = USER + [{"role": "assistant", "content": "The answer is"}]
  r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8,
                                     temperature=0)
  prompt = chat.encode(messages, add_generation_prompt="continue", tokenizer=tok)
  assert tok.decode(prompt).endswith("<|im_middle|>The answer is")
  assert prompt == chat.encode(messages, add_generation_prompt=False, tokenizer=tok)[
      :-len("<|im_end|>")]
  ids = generate(cfg, params, [prompt], max_new_tokens=8, stop_ids=[tok.eos_id])[0]
  assert r.choices[0].message.content == tok.decode(ids).split("<|im_end|>")[0]


def test_a_think_block_is_reasoning_content_streamed_or_not(served, client, monkeypatch):
  """A reply that opens with <think> (K2-Thinking) gives its block as reasoning_content, the
  rest as content, the same streamed (deltas split as they come) or not; a block left open
  before a tool-call section does not swallow the calls. The model's tokens are forced here
  (a random model writes no <think>)."""
  import numpy as np
  from k2jax.serving import serve
  url, engine, cfg, params, tok = served

  def forcing(script):
    ids = [int(i) for i in tok.encode(script)]

    def processor(row, done):
      mask = np.zeros(cfg.vocab_size, bool)
      mask[ids[len(done)] if len(done) < len(ids) else tok.eos_id] = True
      return mask
    def parse(*a, **kw):
      job, info = real(*a, **kw)
      job.processor = processor
      return job, info
    return parse
  real = serve.parse
  monkeypatch.setattr(serve, "parse", forcing("<think>add them: 2 + 3</think>It is 5."))
  r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=60)
  msg = r.choices[0].message
  assert msg.content == "It is 5." and msg.model_extra["reasoning_content"] == "add them: 2 + 3"
  parts = {"reasoning_content": "", "content": ""}
  for ch in client.chat.completions.create(model="tiny", messages=USER, max_tokens=60,
                                           stream=True):
    delta = ch.choices[0].delta.model_dump() if ch.choices else {}
    for k in parts:
      parts[k] += delta.get(k) or ""
  assert parts == {"reasoning_content": "add them: 2 + 3", "content": "It is 5."}
  call = ('<|tool_calls_section_begin|><|tool_call_begin|>functions.add:0'
          '<|tool_call_argument_begin|>{"a": 2, "b": 3}<|tool_call_end|>'
          '<|tool_calls_section_end|>')
  monkeypatch.setattr(serve, "parse", forcing("<think>I should add" + call))
  r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=200, tools=TOOLS)
  msg = r.choices[0].message
  assert r.choices[0].finish_reason == "tool_calls" and msg.model_extra["reasoning_content"] \
      == "I should add"
  assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [
      ("add", {"a": 2, "b": 3})]


def test_tokenizer_endpoints_round_trip(served):
  """vLLM's /tokenize, /detokenize and /tokenizer_info (lm-evaluation-harness's remote
  tokenizer reads them)."""
  url, engine, cfg, params, tok = served
  text = "Ice is a solid form of water."
  code, got = _post(url + "/tokenize", {"prompt": text, "add_special_tokens": False})
  assert code == 200 and got["tokens"] == [int(i) for i in tok.encode(text)]
  assert _post(url + "/tokenize", {"prompt": text})[1]["tokens"][0] == tok.bos_id
  assert _post(url + "/detokenize", {"tokens": got["tokens"]})[1]["prompt"] == text
  info = json.loads(urllib.request.urlopen(url + "/tokenizer_info").read())
  assert info["model_max_length"] == engine.max_len
  assert _post(url + "/detokenize", {"tokens": "abc"})[0] == 400


def test_lm_eval_scores_a_local_task_through_the_server(served, tmp_path):
  """Where lm-evaluation-harness is installed (the `eval` extra; not in CI, whose suite it
  would slow by minutes): a real `lm_eval` run of experiments/lm_eval's task, local-completions
  against this server, tokens through its /tokenize."""
  import os
  import shutil
  url = served[0]
  lm_eval = shutil.which("lm_eval")
  if lm_eval is None:
    pytest.skip("lm_eval is not installed (pip install -e '.[eval]'): the harness run is "
                "experiments/lm_eval_serve.py")
  here = os.path.join(os.path.dirname(os.path.dirname(__file__)), "experiments", "lm_eval")
  run = subprocess.run(
      [lm_eval, "--model", "local-completions", "--model_args",
       f"model=tiny,base_url={url}/v1/completions,tokenizer_backend=remote,"
       "tokenized_requests=True,num_concurrent=2,max_retries=1", "--tasks", "k2jax_tiny_facts",
       "--include_path", here, "--output_path", str(tmp_path), "--limit", "3"],
      cwd=here, capture_output=True, text=True, timeout=600,
      env=dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1"))
  assert run.returncode == 0, run.stderr[-3000:]
  assert "k2jax_tiny_facts" in run.stdout and "acc" in run.stdout
