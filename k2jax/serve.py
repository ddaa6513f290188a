"""An OpenAI-compatible HTTP server over a k2jax run or a published checkpoint.

    python -m k2jax.serve --workdir runs/tiny                 # newest checkpoint of a run
    python -m k2jax.serve --hf /path/to/Kimi-K2-Instruct --host 0.0.0.0 --port 8000

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}])

Endpoints: `GET /v1/models`, `POST /v1/chat/completions` (messages, tools, tool_choice,
temperature, top_p, max_tokens / max_completion_tokens, stop, seed, n, stream with
server-sent events, stream_options.include_usage; `top_k` as an extension) and `GET /health`.
Dialogs are rendered in K2's chat format (`k2jax.chat`); an assistant turn's tool calls come
back parsed as `tool_calls` (`k2jax.chat.parse_tool_calls`), and with `tool_choice`
"required" or a named function they are sampled under the tools' JSON schemas
(`k2jax.chat.ToolCallConstraint`). Concurrent requests share decode steps (`k2jax.engine`).

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

from k2jax import chat, console, interrupt
from k2jax.engine import Engine, Event, Job

log = logging.getLogger("k2jax.serve")

MAX_N = 16
MAX_STOP = 4


class RequestError(ValueError):
  """A request the server refuses: HTTP status, OpenAI error type, the offending field."""

  def __init__(self, message: str, param: str | None = None, status: int = 400,
               code: str | None = None, kind: str = "invalid_request_error"):
    super().__init__(message)
    self.param, self.status, self.code, self.kind = param, status, code, kind

  def body(self) -> dict:
    return {"error": {"message": str(self), "type": self.kind, "param": self.param,
                      "code": self.code}}


def _number(body, key, lo, hi, default, *, integer=False, lo_open=False):
  v = body.get(key)
  if v is None:
    return default
  ok = isinstance(v, int) if integer else isinstance(v, (int, float))
  if isinstance(v, bool) or not ok or v != v or v > hi or v < lo or (lo_open and v == lo):
    rng = f"{'(' if lo_open else '['}{lo}, {hi}]"
    raise RequestError(f"{key} {v!r}: must be {'an integer' if integer else 'a number'} in "
                       f"{rng}", param=key)
  return v


# Fields the server reads. A field of OpenAI's chat API it does not honour is refused (400
# naming it) unless it has the value that changes nothing: a client must not believe a
# penalty or a bias was applied. Fields outside both lists are refused too; `user`,
# `metadata` and `store` describe the request and are accepted as such.
_HONOURED = ("model", "messages", "temperature", "top_p", "top_k", "n", "seed", "max_tokens",
             "max_completion_tokens", "stop", "stream", "stream_options", "tools",
             "tool_choice", "user", "metadata", "store")
_NO_OPS = {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1,
           "logit_bias": {}, "parallel_tool_calls": True, "functions": [],
           "function_call": "none", "min_tokens": 0, "logprobs": False, "top_logprobs": 0,
           "response_format": {"type": "text"}}


def _same(value, noop) -> bool:
  """value is the no-op value (numbers by value: 0 and 0.0; booleans only as booleans)."""
  if isinstance(value, bool) or isinstance(noop, bool):
    return value is noop
  if isinstance(noop, (int, float)):
    return isinstance(value, (int, float)) and value == noop
  return value == noop


def _fields(body) -> None:
  """Refuse a field the server would otherwise ignore (`_HONOURED`, `_NO_OPS`)."""
  for key, value in body.items():
    if key in _HONOURED or value is None:
      continue
    if key not in _NO_OPS:
      raise RequestError(f"{key} is not a field k2jax.serve reads: remove it", param=key)
    if not _same(value, _NO_OPS[key]):
      raise RequestError(f"{key} {json.dumps(value)[:60]} is not supported by k2jax.serve "
                         f"(only {json.dumps(_NO_OPS[key])}, which changes nothing)",
                         param=key)


def _content(m, i: int) -> dict:
  """Message i with its content as one string: a list of text parts (OpenAI's content
  parts, also in tool results) is joined; K2's `developer` role is the system role."""
  content = m.get("content", "") if isinstance(m, dict) else None
  if isinstance(content, list):
    texts = []
    for j, part in enumerate(content):
      if (not isinstance(part, dict) or part.get("type") != "text"
          or not isinstance(part.get("text"), str)):
        raise RequestError(f"messages[{i}].content[{j}] must be a text part {{type: text, "
                           "text}} (the model reads text only)", param=f"messages[{i}]")
      texts.append(part["text"])
    content = "".join(texts)
  if not isinstance(m, dict) or not isinstance(content, (str, type(None))):
    raise RequestError(f"messages[{i}] must be an object with string content or a list of "
                       "text parts", param=f"messages[{i}]")
  m = dict(m, content=content)
  if m.get("role") == "developer":
    m["role"] = "system"
  return m


def _tools(body) -> tuple[list | None, dict | str]:
  tools = body.get("tools")
  if tools is not None:
    if not isinstance(tools, list):
      raise RequestError("tools must be a list of {type: function, function: {...}}",
                         param="tools")
    for i, t in enumerate(tools):
      fn = t.get("function") if isinstance(t, dict) else None
      if (not isinstance(fn, dict) or t.get("type", "function") != "function"
          or not isinstance(fn.get("name"), str) or not fn["name"]):
        raise RequestError(f"tools[{i}] must be {{type: function, function: {{name, "
                           "parameters}}}} with a non-empty name", param=f"tools[{i}]")
  choice = body.get("tool_choice", "auto" if tools else "none")
  if isinstance(choice, dict):
    fn = choice.get("function")
    if not isinstance(fn, dict):
      raise RequestError("tool_choice must be {type: function, function: {name}}",
                         param="tool_choice")
    name = fn.get("name")
    names = [t["function"]["name"] for t in tools or ()]
    if name not in names:
      raise RequestError(f"tool_choice names {name!r}, which is not among the request's tools "
                         f"{names}", param="tool_choice")
  elif choice not in ("none", "auto", "required"):
    raise RequestError(f"tool_choice {choice!r}: must be none, auto, required or "
                       "{type: function, function: {name}}", param="tool_choice")
  elif choice == "required" and not tools:
    raise RequestError("tool_choice 'required' needs tools", param="tool_choice")
  return tools or None, choice


def parse(body, *, model: str, cfg, tokenizer, default_max_tokens: int) -> tuple[Job, dict]:
  """A chat-completion request -> (Job without its emit, what the response needs).
  Raises RequestError naming the field."""
  if not isinstance(body, dict):
    raise RequestError("the request body must be a JSON object")
  if body.get("model") not in (None, model):
    raise RequestError(f"model {body.get('model')!r} is not served here; GET /v1/models lists "
                       f"{model!r}", param="model", status=404, code="model_not_found")
  messages = body.get("messages")
  if not isinstance(messages, list) or not messages:
    raise RequestError("messages must be a non-empty list of {role, content}",
                       param="messages")
  messages = [_content(m, i) for i, m in enumerate(messages)]
  _fields(body)
  tools, choice = _tools(body)
  try:
    prompt = chat.encode(messages, tools, tokenizer=tokenizer)
  except (chat.ChatFormatError, KeyError, TypeError) as e:
    raise RequestError(f"messages cannot be rendered in K2's chat format: {e}",
                       param="messages") from None
  room = cfg.max_position_embeddings - len(prompt)
  temperature = _number(body, "temperature", 0, 2, 1.0)
  top_p = _number(body, "top_p", 0, 1, 1.0, lo_open=True)
  top_k = _number(body, "top_k", 1, cfg.vocab_size, None, integer=True)
  n = _number(body, "n", 1, MAX_N, 1, integer=True)
  seed = _number(body, "seed", -2**63, 2**63 - 1, None, integer=True)
  key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
  max_tokens = _number(body, key, 1, 2**31, None, integer=True)
  if room < 1:
    raise RequestError(
        f"the prompt is {len(prompt)} tokens; the model's context is "
        f"{cfg.max_position_embeddings} tokens: shorten the messages",
        param="messages", code="context_length_exceeded")
  stop = body.get("stop")
  stop = [stop] if isinstance(stop, str) else stop or []
  if (not isinstance(stop, list) or len(stop) > MAX_STOP
      or not all(isinstance(s, str) and s for s in stop)):
    raise RequestError(f"stop must be a non-empty string or a list of at most {MAX_STOP}",
                       param="stop")
  stream = body.get("stream", False)
  if not isinstance(stream, bool):
    raise RequestError("stream must be true or false", param="stream")
  processor = None
  if tools and choice not in ("none", "auto"):
    allowed = tools if choice == "required" else [
        t for t in tools if t["function"]["name"] == choice["function"]["name"]]
    try:
      constraints: dict = {}
      def processor(row, ids, allowed=allowed):
        if row not in constraints:
          constraints[row] = chat.ToolCallConstraint(tokenizer, allowed)
        return constraints[row](0, ids)
      processor(-1, [])        # compile the grammar now: a bad schema is the request's fault
    except ValueError as e:
      raise RequestError(f"tools' JSON schemas do not compile: {e}", param="tools") from None
  # A max_tokens past the context is clamped to what is left (the reply then ends with
  # finish_reason "length") rather than refused: a client that sizes max_tokens for a 128k
  # model (the synth pipelines' defaults) still gets answers from the 1k-context tiny model.
  job = Job(prompt=prompt, max_tokens=min(room, max_tokens or default_max_tokens),
            emit=lambda e: None, n=n, temperature=float(temperature),
            top_p=None if top_p >= 1 else float(top_p), top_k=top_k, seed=seed, stop=stop,
            hold_tool_calls=bool(tools) and choice != "none", processor=processor)
  options = body.get("stream_options") or {}
  if not isinstance(options, dict):
    raise RequestError("stream_options must be an object such as {include_usage: true}",
                       param="stream_options")
  include_usage = bool(options.get("include_usage"))
  return job, dict(tools=tools if choice != "none" else None, stream=stream,
                   include_usage=include_usage)


def _message(text: str, finish: str, tools) -> tuple[dict, str]:
  """The assistant message of a finished choice (tool calls parsed when tools were given).
  Call ids are K2's `functions.NAME:IDX` with IDX counting the reply's calls, whatever index
  the model wrote (two calls must not share an id). A reply cut by max_tokens inside its
  call section keeps finish_reason "length" and lists the complete calls before the cut."""
  if tools:
    try:
      content, calls = chat.parse_tool_calls(text)
    except chat.ToolCallParseError:
      content, calls = text, []      # a malformed section stays visible as text
    if calls:
      return {"role": "assistant", "content": content or None, "tool_calls": [
          {"id": f"functions.{c['name']}:{k}", "type": "function",
           "function": {"name": c["name"], "arguments": json.dumps(c["arguments"],
                                                                   ensure_ascii=False)}}
          for k, c in enumerate(calls)]}, ("length" if finish == "length" and
                                            chat.section_cut(text) else "tool_calls")
    text = content
  return {"role": "assistant", "content": text}, finish


def make_app(engine: Engine, model: str, *, default_max_tokens: int = 512):
  """The Starlette application serving `engine` under the name `model`."""
  from starlette.applications import Starlette
  from starlette.exceptions import HTTPException
  from starlette.responses import JSONResponse, StreamingResponse
  from starlette.routing import Route

  created = int(time.time())

  async def models(request):
    return JSONResponse({"object": "list", "data": [
        {"id": model, "object": "model", "created": created, "owned_by": "k2jax"}]})

  async def health(request):
    return JSONResponse({"status": "ok", **engine.stats})

  async def completions(request):
    try:
      body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise RequestError(f"the request body is not JSON ({e.msg if hasattr(e, 'msg') else e})")
    job, info = parse(body, model=model, cfg=engine.cfg, tokenizer=engine.tok,
                      default_max_tokens=default_max_tokens)
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    job.emit = lambda e: loop.call_soon_threadsafe(events.put_nowait, e)
    rid, now = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
    head = {"id": rid, "created": now, "model": model, "system_fingerprint": "k2jax"}
    engine.submit(job)
    if not info["stream"]:
      done: dict[int, Event] = {}
      try:
        while len(done) < job.n:
          e = await events.get()
          if e.kind == "error":
            raise e.error
          if e.kind == "done":
            done[e.index] = e
      except asyncio.CancelledError:
        job.cancelled = True
        raise
      choices = []
      for i in range(job.n):
        msg, finish = _message(done[i].text, done[i].finish_reason, info["tools"])
        choices.append({"index": i, "message": msg, "finish_reason": finish, "logprobs": None})
      used = sum(e.tokens for e in done.values())
      return JSONResponse({**head, "object": "chat.completion", "choices": choices,
                           "usage": _usage(len(job.prompt), used)})
    return StreamingResponse(_stream(job, events, head, info), media_type="text/event-stream")

  async def _stream(job, events, head, info):
    def chunk(delta, index=0, finish=None):
      return _sse({**head, "object": "chat.completion.chunk", "choices": [
          {"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}]})
    finished, used = 0, 0
    try:
      for i in range(job.n):
        yield chunk({"role": "assistant", "content": ""}, i)
      while finished < job.n:
        e = await events.get()
        if e.kind == "error":
          yield _sse(RequestError(f"decoding failed: {e.error}", status=500,
                                  kind="server_error").body())
          break
        if e.kind == "delta":
          yield chunk({"content": e.text}, e.index)
          continue
        finished, used = finished + 1, used + e.tokens
        msg, finish = _message(e.text, e.finish_reason, info["tools"])
        if msg.get("tool_calls"):
          yield chunk({"tool_calls": [dict(c, index=k) for k, c in enumerate(msg["tool_calls"])]},
                      e.index)
        yield chunk({}, e.index, finish)
      if info["include_usage"]:
        yield _sse({**head, "object": "chat.completion.chunk", "choices": [],
                    "usage": _usage(len(job.prompt), used)})
      yield "data: [DONE]\n\n"
    finally:       # the client went away (or we are done): its rows stop decoding
      job.cancelled = True

  async def refused(request, e: RequestError):
    return JSONResponse(e.body(), status_code=e.status)

  async def http_error(request, e: HTTPException):
    msg = (f"no route {request.method} {request.url.path}; this server has GET /v1/models and "
           "POST /v1/chat/completions") if e.status_code in (404, 405) else str(e.detail)
    return JSONResponse(RequestError(msg, status=e.status_code).body(), status_code=e.status_code)

  async def failed(request, e: Exception):
    log.exception("request failed")
    err = RequestError(f"internal error: {type(e).__name__}: {e}", status=500, kind="server_error")
    return JSONResponse(err.body(), status_code=500)

  return Starlette(routes=[Route("/v1/models", models), Route("/health", health),
                           Route("/v1/chat/completions", completions, methods=["POST"])],
                   exception_handlers={RequestError: refused, HTTPException: http_error,
                                       Exception: failed})


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


def _sse(obj) -> str:
  return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _usage(prompt: int, completion: int) -> dict:
  return {"prompt_tokens": prompt, "completion_tokens": completion,
          "total_tokens": prompt + completion}


# ---------------------------------------------------------------------------------- CLI


def _port_free(host: str, port: int) -> None:
  from k2jax.generate import UserError
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
  p.add_argument("--max_batch", type=int, default=16, help="rows decoded together at most")
  p.add_argument("--batch_window_ms", type=float, default=20.0,
                 help="under concurrent load, how long a batch waits for more requests")
  p.add_argument("--max_tokens", type=int, default=512,
                 help="tokens generated when a request does not say (capped by the context)")
  p.add_argument("--seed", type=int, default=0, help="seeds requests that give no seed")
  p.add_argument("--warmup", type=int, default=0, metavar="PROMPT_TOKENS",
                 help="before listening, compile every batch bucket for prompts of this length "
                 "(0: compile on first use)")
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
  from k2jax.generate import UserError, _check_run_dir, load
  try:
    if not 0 < args.port < 65536:
      raise UserError(f"--port {args.port}: must be in 1..65535")
    for flag in ("max_batch", "max_tokens"):
      if getattr(args, flag) < 1:
        raise UserError(f"--{flag} {getattr(args, flag)}: must be >= 1")
    if not args.batch_window_ms >= 0:
      raise UserError(f"--batch_window_ms {args.batch_window_ms}: must be >= 0")
    if args.workdir:
      _check_run_dir(args.workdir)
    _port_free(args.host, args.port)         # before minutes of loading
    cfg, params, tok = load(args)
  except UserError as e:
    print(f"k2jax.serve: error: {e}", file=sys.stderr)
    raise SystemExit(2)
  import uvicorn
  name = args.model_name or os.path.basename(os.path.normpath(args.workdir or args.hf))
  engine = Engine(cfg, params, tok, max_batch=args.max_batch,
                  window_s=args.batch_window_ms / 1e3, seed=args.seed)
  if args.warmup:
    log.info("compiling batches of 1..%d rows for %d-token prompts", args.max_batch, args.warmup)
    engine.warmup(min(args.warmup, cfg.max_position_embeddings - 1),
                  min(args.max_tokens, max(1, cfg.max_position_embeddings - args.warmup)))
  app = make_app(engine, name, default_max_tokens=args.max_tokens)
  log.info("serving %s at http://%s:%d/v1", name, args.host, args.port)
  uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
  main()
