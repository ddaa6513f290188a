"""One model interface for every synthesis pipeline, whatever answers it.

    client = OpenAIClient("http://127.0.0.1:8000/v1", model="tiny")   # k2jax.serve, vLLM, SGLang
    client = LocalClient.from_run("runs/tiny")                         # in process (k2jax.serving.engine)
    client = ScriptedClient(lambda request: "...")                      # tests, dry runs

    replies = client.chat_many([Request(messages=[...], seed=1), ...])  # bounded concurrency
    replies[0].content, replies[0].tool_calls, replies[0].finish_reason

A pipeline builds `Request`s and reads `Reply`s; it never knows which backend it talks to.
Failures a pipeline should count and move past (the endpoint gave up after its retries, a
reply it cannot use) raise `ModelError`; an endpoint that cannot be reached at all is found
by `check()` before any item is processed.
"""

import concurrent.futures
import dataclasses
import threading
from collections.abc import Callable, Sequence


class ModelError(RuntimeError):
  """A request that failed for good (after retries): the item is dropped and counted."""


class Unreachable(RuntimeError):
  """The endpoint cannot be used at all (one line for the CLI)."""


@dataclasses.dataclass
class Request:
  messages: list[dict]
  tools: list[dict] | None = None
  tool_choice: str | dict | None = None
  temperature: float = 0.8
  top_p: float | None = None
  max_tokens: int = 512
  seed: int | None = None
  stop: list[str] | None = None


@dataclasses.dataclass
class Reply:
  content: str
  tool_calls: list[dict] = dataclasses.field(default_factory=list)   # {id, name, arguments}
  finish_reason: str = "stop"
  prompt_tokens: int = 0
  completion_tokens: int = 0


class Client:
  """Backends implement `chat`; `chat_many` runs requests `concurrency` at a time, in order
  of the input, a failed one becoming its ModelError instead of a Reply."""
  concurrency: int = 1

  def chat(self, request: Request) -> Reply:
    raise NotImplementedError

  def check(self) -> None:
    """Raise Unreachable if no request can succeed (called once, before any item)."""

  def chat_many(self, requests: Sequence[Request]) -> list[Reply | ModelError]:
    def one(r):
      try:
        return self.chat(r)
      except ModelError as e:
        return e
    if self.concurrency <= 1 or len(requests) <= 1:
      return [one(r) for r in requests]
    with concurrent.futures.ThreadPoolExecutor(min(self.concurrency, len(requests))) as pool:
      return list(pool.map(one, requests))


class OpenAIClient(Client):
  """Any OpenAI-compatible endpoint through the official `openai` client, whose retries
  (exponential backoff with jitter on connection errors, 408 / 429 / 5xx) and timeouts we use
  as they are.

  Args:
    base_url: e.g. http://127.0.0.1:8000/v1.
    model: the served model's name (None: the first of GET /v1/models).
    api_key: sent as the bearer token (local servers ignore it).
    concurrency: requests in flight at once (chat_many).
    retries: attempts per request (the openai client's max_retries).
    timeout: seconds per request.
  """

  def __init__(self, base_url: str, model: str | None = None, *, api_key: str = "unused",
               concurrency: int = 8, retries: int = 4, timeout: float = 120.0):
    import openai
    self._openai = openai
    self.client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=retries,
                                timeout=timeout)
    self.base_url, self.model, self.concurrency = base_url, model, concurrency

  def check(self) -> None:
    try:
      names = [m.id for m in self.client.with_options(max_retries=1, timeout=10).models.list()]
    except self._openai.APIError as e:
      raise Unreachable(f"{self.base_url}: {type(e).__name__}: {str(e).splitlines()[0]}; is "
                        "the server running (python -m k2jax.serve ...)?") from None
    if self.model is None:
      if not names:
        raise Unreachable(f"{self.base_url} serves no model")
      self.model = names[0]
    elif self.model not in names:
      raise Unreachable(f"{self.base_url} does not serve {self.model!r}; it has {names}")

  def chat(self, request: Request) -> Reply:
    import json
    kw = {k: v for k, v in dataclasses.asdict(request).items() if v is not None}
    try:
      r = self.client.chat.completions.create(model=self.model or "default", **kw)
    except self._openai.APIError as e:
      raise ModelError(f"{type(e).__name__}: {str(e).splitlines()[0]}") from None
    c = r.choices[0]
    calls = []
    for t in c.message.tool_calls or ():
      try:
        args = json.loads(t.function.arguments)
      except json.JSONDecodeError:
        args = t.function.arguments        # kept as text: the pipeline decides (a drop)
      calls.append({"id": t.id, "name": t.function.name, "arguments": args})
    u = r.usage
    return Reply(c.message.content or "", calls, c.finish_reason or "stop",
                 u.prompt_tokens if u else 0, u.completion_tokens if u else 0)


class LocalClient(Client):
  """In-process decoding on this machine's devices through `k2jax.serving.engine` (concurrent
  requests from chat_many share decode steps, as on the server)."""

  def __init__(self, cfg, params, tokenizer, *, concurrency: int = 16, mesh=None):
    from k2jax.serving.engine import Engine
    self.engine = Engine(cfg, params, tokenizer, max_batch=concurrency, window_s=0.01,
                         mesh=mesh)
    self.cfg, self.tok, self.concurrency = cfg, tokenizer, concurrency

  @classmethod
  def from_run(cls, workdir: str | None = None, hf: str | None = None, mesh: str | None = None,
               **kw):
    """From a k2jax run or a Hugging Face directory, its weights loaded straight into the
    shardings of `mesh` (a --mesh string: k2jax.serving.generate.inference_mesh), else one device."""
    import argparse

    from k2jax.serving.generate import inference_mesh, load
    devices = inference_mesh(mesh)
    cfg, params, tok = load(argparse.Namespace(workdir=workdir, hf=hf), devices,
                            flag=f"--mesh {mesh}")
    return cls(cfg, params, tok, mesh=devices, **kw)

  def chat(self, request: Request) -> Reply:
    import queue

    from k2jax.serving import chat
    from k2jax.serving.serve import RequestError, parse
    body = {k: v for k, v in dataclasses.asdict(request).items() if v is not None}
    try:      # the server's own checks and rendering: one behaviour for both backends
      job, info = parse(body, model="local", cfg=self.cfg, tokenizer=self.tok,
                        default_max_tokens=request.max_tokens, max_len=self.engine.max_len,
                        max_n=self.engine.max_batch)
    except RequestError as e:
      raise ModelError(str(e)) from None
    events: queue.Queue = queue.Queue()
    job.emit = events.put
    self.engine.submit(job)
    while (e := events.get()).kind in ("delta", "section"):
      pass
    if e.kind == "error":
      raise ModelError(f"decoding failed: {e.error}")
    content, calls = e.text, []
    if info["tools"]:
      try:
        content, calls = chat.parse_tool_calls(e.text)
      except chat.ToolCallParseError as err:
        raise ModelError(f"malformed tool call: {err}") from None
    finish = "tool_calls" if calls else e.finish_reason
    return Reply(content, calls, finish, len(job.prompt), e.tokens)


class ScriptedClient(Client):
  """Replies from a function of the request (tests, dry runs): fn(Request) -> str | Reply.
  A str is parsed for K2 tool calls like generated text."""

  def __init__(self, fn: Callable[[Request], "str | Reply"], concurrency: int = 1):
    self.fn, self.concurrency = fn, concurrency
    self.requests: list[Request] = []
    self._lock = threading.Lock()

  def chat(self, request: Request) -> Reply:
    import copy

    from k2jax.serving import chat
    with self._lock:       # as sent: a caller may go on changing its lists
      self.requests.append(copy.deepcopy(request))
    out = self.fn(request)
    if isinstance(out, Reply):
      return out
    try:
      content, calls = chat.parse_tool_calls(out)
    except chat.ToolCallParseError as e:
      raise ModelError(f"malformed tool call: {e}") from None
    return Reply(content, calls, "tool_calls" if calls else "stop", 0, len(out))
