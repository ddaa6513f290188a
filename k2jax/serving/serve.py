"""An OpenAI-compatible HTTP server over a k2jax run or a published checkpoint.

    python -m k2jax.serve --workdir runs/tiny                 # newest checkpoint of a run
    python -m k2jax.serve --hf /path/to/Kimi-K2-Instruct --host 0.0.0.0 --port 8000

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}])

Endpoints: `GET /v1/models`, `POST /v1/chat/completions` (messages, tools, tool_choice,
parallel_tool_calls, temperature, top_p, max_tokens / max_completion_tokens, stop, seed, n,
presence / frequency penalties, logit_bias, stream with server-sent events,
stream_options.include_usage, logprobs / top_logprobs, response_format json_object /
json_schema; `top_k`, `repetition_penalty` and `min_tokens` as vLLM has them),
`POST /v1/completions` (text or token prompts, echo, logprobs, the same sampling fields),
`GET /health` and `GET /metrics` (Prometheus). Dialogs are rendered in K2's chat format
(`k2jax.serving.chat`); an assistant turn's tool calls come back parsed as `tool_calls` (`k2jax.serving.chat.parse_tool_calls`),
and with `tool_choice` "required" or a named function they are sampled under the tools' JSON
schemas (`k2jax.serving.chat.ToolCallConstraint`), as is a section the model opens under "auto"
(`k2jax.serving.chat.ToolSectionConstraint`); a JSON response_format is sampled under its schema
the same way (`k2jax.serving.chat.JSONConstraint`). Each constraint knows the request's budget: a
call or JSON reply closes inside max_tokens whenever that holds its shortest ending. Concurrent requests share decode steps, joining
and leaving the running batch between dispatches (continuous batching over a slotted cache:
`k2jax.serving.engine`). `--api-key` makes /v1 need a bearer key; `--max_queue` bounds the rows
waiting for a slot (429 past it).

`max_tokens` is clamped to the context the prompt leaves (the reply ends with finish_reason
"length" when it runs into it); only a prompt that fills the context is refused.

A bad request gets OpenAI's error object ({"error": {"message", "type", "param", "code"}})
with status 400 (404 for an unknown model or path), one line saying what to change; the
server goes on serving. We use Starlette + uvicorn (the ASGI stack vLLM / SGLang's servers
stand on) rather than a hand-written HTTP loop: keep-alive, chunked streaming and disconnect
detection are theirs.
"""

import argparse
import asyncio
import json
import logging
import os
import socket
import sys
import time
import uuid

from k2jax.serving import chat
from k2jax.serving.engine import Engine, Event, Job, Unfit
from k2jax.serving.generate import MESH_HELP
# the request formats; their names stay importable from here (serve.parse, ...)
from k2jax.serving.openai_api import (MAX_N, MAX_STOP, MAX_TOP_LOGPROBS,  # noqa: F401
                                      RequestError, parse, parse_completion)
from k2jax.training import console, interrupt

log = logging.getLogger("k2jax.serve")


def _token(tokenizer, i: int) -> tuple[str, list[int]]:
  b = tokenizer.token_bytes(i)
  return b.decode("utf-8", errors="replace"), list(b)


def _chat_logprobs(tokenizer, entries) -> dict | None:
  """Chat's `logprobs` of a choice from the engine's entries (Event.logprobs)."""
  if entries is None:
    return None
  content = []
  for i, lp, alts in entries:
    token, raw = _token(tokenizer, i)
    tops = []
    for j, v in alts:
      t, r = _token(tokenizer, j)
      tops.append({"token": t, "logprob": v, "bytes": r})
    content.append({"token": token, "logprob": lp, "bytes": raw, "top_logprobs": tops})
  return {"content": content, "refusal": None}


def _completion_logprobs(tokenizer, entries, offset: int = 0) -> dict:
  """Completions' `logprobs` (tokens, token_logprobs, top_logprobs, text_offset) of entries;
  None entries (a prompt's first token) have no log probability."""
  out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
  for e in entries:
    i, lp, alts = e
    token = _token(tokenizer, i)[0]
    out["tokens"].append(token)
    out["token_logprobs"].append(lp)
    out["top_logprobs"].append(
        None if lp is None else {_token(tokenizer, j)[0]: v for j, v in alts})
    out["text_offset"].append(offset)
    offset += len(token)
  return out


def _message(text: str, finish: str, tools) -> tuple[dict, str]:
  """The assistant message of a finished choice (tool calls parsed when tools were given).
  Call ids are K2's `functions.NAME:IDX` with IDX counting the reply's calls, whatever index
  the model wrote (two calls must not share an id). A reply cut by max_tokens inside its
  call section keeps finish_reason "length" and lists the complete calls before the cut.
  Arguments are the JSON text the model wrote (what a stream sends piece by piece). A
  `<think>` block goes to reasoning_content (chat.split_reasoning)."""
  reasoning, text = chat.split_reasoning(text)
  msg, finish = _reply(text, finish, tools)
  if reasoning is not None:
    msg["reasoning_content"] = reasoning
  return msg, finish


def _reply(text: str, finish: str, tools) -> tuple[dict, str]:
  if tools:
    try:
      content, calls = chat.parse_tool_calls(text)
    except chat.ToolCallParseError:
      content, calls = text, []      # a malformed section stays visible as text
    if calls:
      return {"role": "assistant", "content": content or None, "tool_calls": [
          {"id": f"functions.{c['name']}:{k}", "type": "function",
           "function": {"name": c["name"], "arguments": c["raw"]}}
          for k, c in enumerate(calls)]}, ("length" if finish == "length" and
                                            chat.section_cut(text) else "tool_calls")
    text = content
  return {"role": "assistant", "content": text}, finish


class _Metrics:
  """The server's Prometheus metrics at GET /metrics, in the text format vLLM and SGLang
  export (prometheus_client writes it; a registry per app, so several apps can live in one
  process): finished choices by finish reason, prompt and generated tokens, rows decoding
  and waiting for a slot, refused requests by status, time to first token and end-to-end
  latency."""

  def __init__(self, engine: Engine):
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
    self.registry = r = CollectorRegistry()
    self.finished = Counter("k2jax_request_success", "Choices finished, by finish reason",
                            ["finish_reason"], registry=r)
    self.prompt = Counter("k2jax_prompt_tokens", "Prompt tokens of accepted requests",
                          registry=r)
    self.generated = Counter("k2jax_generation_tokens", "Tokens generated", registry=r)
    self.refused = Counter("k2jax_request_refused", "Requests refused, by HTTP status",
                           ["status"], registry=r)
    latency = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
    self.ttft = Histogram("k2jax_time_to_first_token_seconds", "Request to its first token",
                          buckets=latency, registry=r)
    self.e2e = Histogram("k2jax_e2e_request_latency_seconds", "Request to its last token",
                         buckets=latency, registry=r)
    Gauge("k2jax_num_requests_running", "Rows decoding in slots",
          registry=r).set_function(engine.running_rows)
    Gauge("k2jax_num_requests_waiting", "Rows waiting for a slot",
          registry=r).set_function(engine.waiting_rows)
    Gauge("k2jax_slots", "Rows the engine decodes together at most",
          registry=r).set(engine.max_batch)

  def watch(self, job: Job, emit):
    """`emit` wrapped to observe a job's latencies and tokens as its events come."""
    t0, left, first = time.perf_counter(), [job.n], []
    self.prompt.inc(len(job.prompt))

    def observe(e: Event):
      if e.kind in ("delta", "done") and not first:
        first.append(True)
        self.ttft.observe(time.perf_counter() - t0)
      if e.kind == "done":
        self.finished.labels(e.finish_reason).inc()
        self.generated.inc(e.tokens)
        left[0] -= 1
        if not left[0]:
          self.e2e.observe(time.perf_counter() - t0)
      emit(e)
    return observe

  def text(self) -> bytes:
    from prometheus_client import generate_latest
    return generate_latest(self.registry)


class OpenAIServer:
  """The OpenAI-compatible routes over one engine: the state every handler reads (the
  engine, the served name, the key, the queue bound, the metrics) and one method per route,
  as vLLM's serving classes are. `make_app` wraps it in a Starlette application.

  api_key: when set, /v1 routes need `Authorization: Bearer <api_key>` (401 otherwise).
  max_queue: rows that may wait for a slot; a request past it gets 429 (OpenAI's
  rate-limit error, which clients retry) instead of an unbounded wait."""

  def __init__(self, engine: Engine, model: str, *, default_max_tokens: int = 512,
               api_key: str | None = None, max_queue: int | None = None):
    self.engine, self.model = engine, model
    self.default_max_tokens, self.api_key, self.max_queue = default_max_tokens, api_key, max_queue
    self.created = int(time.time())
    self.metrics = _Metrics(engine)

  def app(self):
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.routing import Route
    return Starlette(
        routes=[Route("/v1/models", self.models), Route("/health", self.health),
                Route("/metrics", self.prometheus),
                Route("/tokenize", self.tokenize, methods=["POST"]),
                Route("/detokenize", self.detokenize, methods=["POST"]),
                Route("/tokenizer_info", self.tokenizer_info),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/completions", self.text_completions, methods=["POST"])],
        exception_handlers={RequestError: self.refused, HTTPException: self.http_error,
                            Exception: self.failed})

  # -- requests in, jobs out ---------------------------------------------------------------

  def authorize(self, request):
    import hmac
    if self.api_key is None:
      return
    given = request.headers.get("authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
      raise RequestError("missing or wrong API key: send Authorization: Bearer <the server's "
                         "--api-key>", status=401, code="invalid_api_key")

  async def read(self, request) -> dict:
    self.authorize(request)
    try:
      return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise RequestError(f"the request body is not JSON ({e.msg if hasattr(e, 'msg') else e})")

  def start(self, jobs) -> asyncio.Queue:
    """Submit jobs (after the queue bound); their events arrive tagged (job index, Event)."""
    engine, rows = self.engine, sum(j.n for j in jobs)
    if self.max_queue is not None and engine.waiting_rows() + rows > self.max_queue:
      raise RequestError(f"the server is busy: {engine.waiting_rows()} rows wait for a slot "
                         f"(--max_queue {self.max_queue}); retry later", status=429,
                         kind="requests", code="rate_limit_exceeded", retry_after=1)
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    for k, job in enumerate(jobs):
      job.emit = self.metrics.watch(job, lambda e, k=k: loop.call_soon_threadsafe(
          events.put_nowait, (k, e)))
      engine.submit(job)
    return events

  @staticmethod
  async def finished(jobs, events, request) -> dict | None:
    """Every row's "done" Event, by (job index, row); None when the client went away (its
    jobs cancelled: checked twice a second, since a non-streaming client that leaves is not
    otherwise noticed until the answer is written)."""
    done: dict[tuple, Event] = {}
    checked = time.monotonic()
    try:
      while len(done) < sum(j.n for j in jobs):
        try:
          k, e = await asyncio.wait_for(events.get(), timeout=0.5)
        except asyncio.TimeoutError:
          k, e = None, None
        if time.monotonic() - checked > 0.5:     # (deltas may arrive every few ms)
          checked = time.monotonic()
          if await request.is_disconnected():
            _cancel(jobs)
            return None
        if e is None:
          continue
        if e.kind == "error":     # the request's other rows stop with it
          _cancel(jobs)
          raise _engine_error(e.error)
        if e.kind == "done":
          done[k, e.index] = e
    except asyncio.CancelledError:
      _cancel(jobs)
      raise
    return done

  # -- small routes --------------------------------------------------------------------------

  async def models(self, request):
    from starlette.responses import JSONResponse
    self.authorize(request)
    return JSONResponse({"object": "list", "data": [
        {"id": self.model, "object": "model", "created": self.created, "owned_by": "k2jax"}]})

  async def health(self, request):
    from starlette.responses import JSONResponse
    return JSONResponse({"status": "ok", **self.engine.stats})

  # vLLM's tokenizer endpoints: lm-evaluation-harness (tokenizer_backend=remote) tokenizes
  # through them, so scoring with token ids needs no tokenizer of its own.
  async def tokenize(self, request):
    from starlette.responses import JSONResponse
    body = await self.read(request)
    text = body.get("prompt") if isinstance(body, dict) else None
    if not isinstance(text, str):
      raise RequestError("prompt must be a string", param="prompt")
    tok = self.engine.tok
    ids = [int(i) for i in tok.encode(text)]
    if body.get("add_special_tokens", True):
      ids = [tok.bos_id] + ids
    return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": self.engine.max_len})

  async def detokenize(self, request):
    from starlette.responses import JSONResponse
    body = await self.read(request)
    ids = body.get("tokens") if isinstance(body, dict) else None
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
      raise RequestError("tokens must be a list of token ids", param="tokens")
    return JSONResponse({"prompt": self.engine.tok.decode(ids)})

  async def tokenizer_info(self, request):
    from starlette.responses import JSONResponse
    self.authorize(request)
    # No special token as text: the byte tokenizer would encode its name as bytes.
    return JSONResponse({"eos_token": None, "bos_token": None, "pad_token": None,
                         "model_max_length": self.engine.max_len,
                         "vocab_size": self.engine.cfg.vocab_size})

  async def prometheus(self, request):
    from starlette.responses import Response
    return Response(self.metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

  # -- /v1/chat/completions ------------------------------------------------------------------

  async def chat_completions(self, request):
    from starlette.responses import JSONResponse, Response, StreamingResponse
    body = await self.read(request)
    engine = self.engine
    # in a worker thread: a tool or response_format grammar compiles in the parse (tens of
    # ms for a large schema), which on the event loop would stall every other stream
    job, info = await asyncio.to_thread(
        parse, body, model=self.model, cfg=engine.cfg, tokenizer=engine.tok,
        default_max_tokens=self.default_max_tokens, max_len=engine.max_len,
        max_n=engine.max_batch)
    events = self.start([job])
    rid, now = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
    head = {"id": rid, "created": now, "model": self.model, "system_fingerprint": "k2jax"}
    if info["stream"]:
      return StreamingResponse(self.chat_stream(job, events, head, info),
                               media_type="text/event-stream")
    done = await self.finished([job], events, request)
    if done is None:
      return Response(status_code=499)       # nobody to answer (nginx's "client closed")
    choices = []
    for i in range(job.n):
      e = done[0, i]
      msg, finish = _message(e.text, e.finish_reason, info["tools"])
      choices.append({"index": i, "message": msg, "finish_reason": finish,
                      "logprobs": _chat_logprobs(engine.tok, e.logprobs)})
    used = sum(e.tokens for e in done.values())
    return JSONResponse({**head, "object": "chat.completion", "choices": choices,
                         "usage": _usage(len(job.prompt), used)})

  async def chat_stream(self, job, events, head, info):
    """Server-sent chunks of one chat request's choices as their events come."""
    out = _ChatChunks(self.engine.tok, head)
    finished, used = 0, 0
    try:
      for i in range(job.n):
        yield out.chunk({"role": "assistant", "content": ""}, i)
      while finished < job.n:
        _, e = await events.get()
        if e.kind == "error":
          yield _failed(e)
          break
        if e.kind == "delta":
          yield out.delta(e)
          continue
        if e.kind == "section":
          for c in out.calls(e.index, chat.streamed_calls(e.text)):
            yield c
          continue
        finished, used = finished + 1, used + e.tokens
        for c in out.done(e, info["tools"]):
          yield c
      if info["include_usage"]:
        yield _sse({**head, "object": "chat.completion.chunk", "choices": [],
                    "usage": _usage(len(job.prompt), used)})
      yield "data: [DONE]\n\n"
    finally:       # the client went away (or we are done): its rows stop decoding
      job.cancelled = True

  # -- /v1/completions -----------------------------------------------------------------------

  def echoed(self, job, implicit: bool, e: Event) -> tuple[str, list | None]:
    """The echoed prompt's text and logprob entries (without the BOS a string prompt got)."""
    ids = job.prompt[1:] if implicit else job.prompt
    entries = None
    if e.prompt_logprobs is not None:
      entries = [(job.prompt[0], None, [])] + e.prompt_logprobs[1:]
      entries = entries[1:] if implicit else entries
    return self.engine.tok.decode(ids), entries

  async def text_completions(self, request):
    from starlette.responses import JSONResponse, Response, StreamingResponse
    body = await self.read(request)
    engine = self.engine
    jobs, info = parse_completion(body, model=self.model, cfg=engine.cfg, tokenizer=engine.tok,
                                  max_len=engine.max_len, max_n=engine.max_batch)
    events = self.start(jobs)
    head = {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion",
            "created": int(time.time()), "model": self.model, "system_fingerprint": "k2jax"}
    prompt_tokens = sum(len(j.prompt) for j in jobs)
    if info["stream"]:
      return StreamingResponse(self.completion_stream(jobs, events, head, info, prompt_tokens),
                               media_type="text/event-stream")
    done = await self.finished(jobs, events, request)
    if done is None:
      return Response(status_code=499)
    choices = []
    for (k, i), e in sorted(done.items()):
      text, entries = e.text, e.logprobs
      if info["echo"]:
        prompt, echoed = self.echoed(jobs[k], info["implicit"][k], e)
        text = prompt + text
        entries = None if entries is None else (echoed or []) + entries
      choices.append({"index": k * info["n"] + i, "text": text, "finish_reason": e.finish_reason,
                      "logprobs": None if entries is None else
                      _completion_logprobs(engine.tok, entries)})
    used = sum(e.tokens for e in done.values())
    return JSONResponse({**head, "choices": choices, "usage": _usage(prompt_tokens, used)})

  async def completion_stream(self, jobs, events, head, info, prompt_tokens):
    """Server-sent chunks of one completions request's choices as their events come."""
    tok = self.engine.tok

    def chunk(index, text, finish=None, entries=None, offset=0):
      return _sse({**head, "choices": [{"index": index, "text": text, "finish_reason": finish,
                                        "logprobs": None if entries is None else
                                        _completion_logprobs(tok, entries, offset)}]})
    rows = sum(j.n for j in jobs)
    finished, used, sent, offset = 0, 0, {}, {}
    try:
      while finished < rows:
        k, e = await events.get()
        if e.kind == "error":
          yield _failed(e)
          break
        key, index = (k, e.index), k * info["n"] + e.index
        if info["echo"] and key not in offset:    # the prompt first (its row's first event)
          text, entries = self.echoed(jobs[k], info["implicit"][k], e)
          yield chunk(index, text, entries=entries)
          offset[key] = len(text)
        offset.setdefault(key, 0)
        if e.kind == "delta":
          yield chunk(index, e.text, entries=e.logprobs, offset=offset[key])
          sent[key] = sent.get(key, 0) + len(e.logprobs or ())
          offset[key] += len(e.text)
          continue
        finished, used = finished + 1, used + e.tokens
        rest = None if e.logprobs is None else e.logprobs[sent.get(key, 0):]
        yield chunk(index, "", e.finish_reason, rest, offset[key])
      if info["include_usage"]:
        yield _sse({**head, "choices": [], "usage": _usage(prompt_tokens, used)})
      yield "data: [DONE]\n\n"
    finally:
      _cancel(jobs)

  # -- errors ----------------------------------------------------------------------------

  async def refused(self, request, e: RequestError):
    from starlette.responses import JSONResponse
    self.metrics.refused.labels(str(e.status)).inc()
    headers = {"Retry-After": str(e.retry_after)} if e.retry_after else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)

  async def http_error(self, request, e):
    from starlette.responses import JSONResponse
    msg = str(e.detail)
    if e.status_code in (404, 405):
      msg = (f"no route {request.method} {request.url.path}; this server has GET /v1/models, "
             "POST /v1/chat/completions, POST /v1/completions, GET /health and GET /metrics")
    return JSONResponse(RequestError(msg, status=e.status_code).body(), status_code=e.status_code)

  async def failed(self, request, e: Exception):
    from starlette.responses import JSONResponse
    log.exception("request failed")
    err = _engine_error(e)
    return JSONResponse(err.body(), status_code=err.status)


def _cancel(jobs):
  for job in jobs:
    job.cancelled = True


class _ChatChunks:
  """The chunks of a streamed chat reply: text split into reasoning_content and content as it
  grows, tool calls sent as they are parsed (an id and name first, then the arguments piece
  by piece: OpenAI's streamed tool_calls, which assemble to the non-streamed call), and each
  choice's last chunk with the log-probabilities not yet sent."""

  def __init__(self, tok, head: dict):
    self.tok, self.head = tok, head
    self.sent, self.shown, self.split = {}, {}, {}

  def chunk(self, delta, index=0, finish=None, logprobs=None):
    return _sse({**self.head, "object": "chat.completion.chunk", "choices": [
        {"index": index, "delta": delta, "finish_reason": finish,
         "logprobs": _chat_logprobs(self.tok, logprobs)}]})

  def delta(self, e: Event):
    self.sent[e.index] = self.sent.get(e.index, 0) + len(e.logprobs or ())
    # a <think> block streams as reasoning_content (the engine holds back a marker's partial
    # text, so both parts only grow)
    had = self.split.get(e.index, ("", "", ""))
    text = had[0] + e.text
    reasoning, content = chat.split_reasoning(text)
    reasoning = reasoning or ""
    delta = {k: v for k, v in (("reasoning_content", reasoning[len(had[1]):]),
                               ("content", content[len(had[2]):])) if v}
    self.split[e.index] = (text, reasoning, content)
    return self.chunk(delta or {"content": ""}, e.index, logprobs=e.logprobs)

  def calls(self, index, so_far):
    """Chunks for what `so_far` ([{name, arguments}]) adds to the calls shown of choice
    `index`."""
    seen = self.shown.setdefault(index, [])
    for k, c in enumerate(so_far):
      if k == len(seen):
        seen.append("")
        yield self.chunk({"tool_calls": [{"index": k, "id": f"functions.{c['name']}:{k}",
                                          "type": "function", "function": {
                                              "name": c["name"], "arguments": ""}}]}, index)
      if c["arguments"].startswith(seen[k]) and len(c["arguments"]) > len(seen[k]):
        piece, seen[k] = c["arguments"][len(seen[k]):], c["arguments"]
        yield self.chunk({"tool_calls": [{"index": k, "function": {"arguments": piece}}]},
                         index)

  def done(self, e: Event, tools):
    """The finished choice's remaining calls and its last chunk."""
    msg, finish = _message(e.text, e.finish_reason, tools)
    yield from self.calls(e.index, [{"name": c["function"]["name"],
                                     "arguments": c["function"]["arguments"]}
                                    for c in msg.get("tool_calls", ())])
    rest = None if e.logprobs is None else e.logprobs[self.sent.get(e.index, 0):]
    yield self.chunk({}, e.index, finish, rest)


def make_app(engine: Engine, model: str, *, default_max_tokens: int = 512,
             api_key: str | None = None, max_queue: int | None = None):
  """The Starlette application serving `engine` under the name `model` (`OpenAIServer`'s
  routes; api_key and max_queue as there)."""
  return OpenAIServer(engine, model, default_max_tokens=default_max_tokens, api_key=api_key,
                      max_queue=max_queue).app()


class Background:
  """A server on a thread of this process (notebooks, tests, benchmarks):

      with Background(make_app(engine, "tiny")) as server:
        OpenAI(base_url=server.url, api_key="unused")...

  port 0 picks a free port; `url` is the /v1 base the openai client takes."""

  def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
    import threading

    import uvicorn
    self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    self.thread = threading.Thread(target=self.server.run, daemon=True)
    self.thread.start()
    while not self.server.started:
      if not self.thread.is_alive():
        raise RuntimeError(f"the server did not start on {host}:{port}")
      time.sleep(0.01)
    port = self.server.servers[0].sockets[0].getsockname()[1]
    self.url = f"http://{host}:{port}/v1"

  def stop(self) -> None:
    self.server.should_exit = True
    self.thread.join(timeout=30)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.stop()


def _engine_error(e: BaseException) -> RequestError:
  """What a client hears of an error: the engine's refusal of its request (a 400 saying
  why), or that the server failed (a 500 naming only the exception's type: its text may
  hold the model's config or arrays; the server's log has it)."""
  if isinstance(e, RequestError):
    return e
  if isinstance(e, Unfit):
    return RequestError(str(e))
  return RequestError(f"internal error ({type(e).__name__}); the server's log has the "
                      "details", status=500, kind="server_error")


def _failed(e: Event) -> str:
  """A stream's last event when its request failed: OpenAI's error object."""
  return _sse(_engine_error(e.error).body())


def _sse(obj) -> str:
  return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _usage(prompt: int, completion: int) -> dict:
  return {"prompt_tokens": prompt, "completion_tokens": completion,
          "total_tokens": prompt + completion}


# ---------------------------------------------------------------------------------- CLI


def _port_free(host: str, port: int) -> None:
  from k2jax.serving.generate import UserError
  try:
    with socket.create_server((host, port), reuse_port=False):
      pass
  except OSError as e:
    raise UserError(f"--host {host} --port {port}: cannot listen there ({e.strerror}); pick "
                    "another --port or stop what holds it") from None


def main(argv=None):
  p = argparse.ArgumentParser(prog="python -m k2jax.serve", description=__doc__.splitlines()[0])
  src = p.add_mutually_exclusive_group(required=True)
  src.add_argument("--workdir", help="a k2jax.train / sft / rl run: serves its newest checkpoint")
  src.add_argument("--hf", help="a Hugging Face checkpoint directory (config.json + safetensors)")
  p.add_argument("--host", default="127.0.0.1")
  p.add_argument("--port", type=int, default=8000)
  p.add_argument("--model_name", default=None, help="the name clients pass as `model` "
                 "(default: the run's directory name)")
  p.add_argument("--max_batch", type=int, default=16,
                 help="slots: rows decoded together at most")
  p.add_argument("--max_len", type=int, default=None,
                 help="tokens a slot holds, prompt and completion (default: the model's context; "
                 "the cache is max_batch x max_len latents)")
  p.add_argument("--reuse_min", type=int, default=0,
                 help="a request continues a free slot's cached tokens when they start its "
                 "prompt for at least this many tokens (prefix reuse, e.g. 32; 0: off)")
  p.add_argument("--batch_window_ms", type=float, default=20.0,
                 help="under concurrent load, how long requests reaching an idle server wait "
                 "for more to start with")
  p.add_argument("--max_tokens", type=int, default=512,
                 help="tokens generated when a request does not say (capped by the context)")
  p.add_argument("--seed", type=int, default=0, help="seeds requests that give no seed")
  p.add_argument("--api-key", "--api_key", dest="api_key", default=os.environ.get("K2JAX_API_KEY"),
                 help="require Authorization: Bearer KEY on /v1 (default: $K2JAX_API_KEY; "
                 "none: open)")
  p.add_argument("--max_queue", type=int, default=256,
                 help="rows that may wait for a slot; more get HTTP 429 (clients retry)")
  p.add_argument("--warmup", type=int, default=0, metavar="PROMPT_TOKENS",
                 help="before listening, compile every batch bucket for prompts of this length "
                 "(0: compile on first use)")
  p.add_argument("--mesh", default=None, help=MESH_HELP)
  args = p.parse_args(argv)
  console.setup()
  try:
    # uvicorn takes the signals over while it serves, shuts down gracefully, gives them back
    # and raises the one it caught again: Interrupted then comes out of uvicorn.run
    with interrupt.raising():
      _serve(args)
  except interrupt.Interrupted as e:
    print(f"k2jax.serve: stopped by {e.name}", file=sys.stderr, flush=True)
    raise SystemExit(e.exit_code)


def _serve(args):
  from k2jax.serving.generate import UserError, _check_run_dir, inference_mesh, load
  try:
    if not 0 < args.port < 65536:
      raise UserError(f"--port {args.port}: must be in 1..65535")
    for flag in ("max_batch", "max_tokens", "max_queue"):
      if getattr(args, flag) < 1:
        raise UserError(f"--{flag} {getattr(args, flag)}: must be >= 1")
    if args.reuse_min < 0:
      raise UserError(f"--reuse_min {args.reuse_min}: must be >= 0 (0: no prefix reuse)")
    if args.max_len is not None and args.max_len < 2:
      raise UserError(f"--max_len {args.max_len}: must be >= 2 (a prompt token and one more)")
    if not args.batch_window_ms >= 0:
      raise UserError(f"--batch_window_ms {args.batch_window_ms}: must be >= 0")
    if args.workdir:
      _check_run_dir(args.workdir)
    _port_free(args.host, args.port)         # before minutes of loading
    mesh = inference_mesh(args.mesh)
    cfg, params, tok = load(args, mesh, flag=f"--mesh {args.mesh}")
  except UserError as e:
    print(f"k2jax.serve: error: {e}", file=sys.stderr)
    raise SystemExit(2)
  import uvicorn
  name = args.model_name or os.path.basename(os.path.normpath(args.workdir or args.hf))
  engine = Engine(cfg, params, tok, max_batch=args.max_batch, max_len=args.max_len,
                  window_s=args.batch_window_ms / 1e3, seed=args.seed,
                  reuse_min=args.reuse_min or None, mesh=mesh)
  if args.warmup:
    log.info("compiling prefills of 1..%d rows for %d-token prompts", args.max_batch,
             args.warmup)
    prompt = min(args.warmup, engine.max_len - 1)
    engine.warmup(prompt, min(args.max_tokens, engine.max_len - prompt))
  app = make_app(engine, name, default_max_tokens=args.max_tokens, api_key=args.api_key,
                 max_queue=args.max_queue)
  log.info("serving %s at http://%s:%d/v1", name, args.host, args.port)
  uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
  main()
