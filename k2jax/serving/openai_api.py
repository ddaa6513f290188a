"""The OpenAI request formats the server accepts, checked and parsed into engine jobs.

    jobs, info = parse(body, model="tiny", cfg=cfg, tokenizer=tok, default_max_tokens=512)

`parse` reads a `/v1/chat/completions` body, `parse_completion` a `/v1/completions` one.
Every field OpenAI defines is either honoured, accepted at its no-op value, or refused with
a `RequestError` naming the field and the fix (OpenAI's error object, status 400): a client
never gets a silently different behaviour than it asked for.
"""

import json

from k2jax.serving import chat
from k2jax.serving.engine import Job

MAX_N = 16
MAX_STOP = 4


class RequestError(ValueError):
  """A request the server refuses: HTTP status, OpenAI error type, the offending field."""

  def __init__(self, message: str, param: str | None = None, status: int = 400,
               code: str | None = None, kind: str = "invalid_request_error",
               retry_after: int | None = None):
    super().__init__(message)
    self.param, self.status, self.code, self.kind = param, status, code, kind
    self.retry_after = retry_after       # seconds, sent as Retry-After (429)

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


# Fields the server reads, per endpoint. A field of OpenAI's API it does not honour is refused
# (400 naming it) unless it has the value that changes nothing: a client must not believe
# something was applied that was not. Fields outside both lists are refused too; `user`,
# `metadata` and `store` describe the request and are accepted as such.
_SAMPLING = ("model", "temperature", "top_p", "top_k", "n", "seed", "max_tokens", "stop",
             "stream", "stream_options", "logprobs", "user", "metadata", "store")
_SAMPLING = _SAMPLING + ("presence_penalty", "frequency_penalty", "repetition_penalty",
                         "logit_bias", "min_tokens")
_HONOURED = _SAMPLING + ("messages", "max_completion_tokens", "top_logprobs", "tools",
                         "tool_choice", "response_format", "parallel_tool_calls")
_NO_OPS = {"functions": [], "function_call": "none"}
_COMPLETION_HONOURED = _SAMPLING + ("prompt", "echo")
_COMPLETION_NO_OPS = {"best_of": 1, "suffix": ""}
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024


def _same(value, noop) -> bool:
  """value is the no-op value (numbers by value: 0 and 0.0; booleans only as booleans)."""
  if isinstance(value, bool) or isinstance(noop, bool):
    return value is noop
  if isinstance(noop, (int, float)):
    return isinstance(value, (int, float)) and value == noop
  return value == noop


def _fields(body, honoured=_HONOURED, no_ops=_NO_OPS) -> None:
  """Refuse a field the server would otherwise ignore (`_HONOURED`, `_NO_OPS`)."""
  for key, value in body.items():
    if key in honoured or value is None:
      continue
    if key not in no_ops:
      raise RequestError(f"{key} is not a field k2jax.serve reads: remove it", param=key)
    if not _same(value, no_ops[key]):
      raise RequestError(f"{key} {json.dumps(value)[:60]} is not supported by k2jax.serve "
                         f"(only {json.dumps(no_ops[key])}, which changes nothing)",
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


def _per_row(make, param: str, rows: int):
  """A Job processor with one constraint (`make()`) for each of its `rows`, all made now:
  in the request's parse, off the event loop and off the engine's thread, whose dispatches
  would otherwise wait for a grammar's compile. A schema that does not compile is the
  request's fault (400 naming `param`)."""
  try:
    constraints = [make() for _ in range(rows)]
    constraints[0](0, [])      # the first mask: compiles what the constructor left lazy
  except ValueError as e:
    raise RequestError(f"{param}: {e}", param=param) from None
  return lambda row, ids: constraints[row](row, ids)


def _response_format(body) -> dict | None:
  """The JSON schema response_format asks for (json_object: any object), or None (text)."""
  fmt = body.get("response_format")
  if fmt is None:
    return None
  kind = fmt.get("type") if isinstance(fmt, dict) else None
  if kind == "text":
    return None
  if kind == "json_object":
    return {"type": "object"}
  spec = fmt.get("json_schema") if kind == "json_schema" else None
  if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
    raise RequestError("response_format must be {type: text}, {type: json_object} or {type: "
                       "json_schema, json_schema: {name, schema: {...}}}",
                       param="response_format")
  return spec["schema"]


def _model(body, model: str) -> None:
  if not isinstance(body, dict):
    raise RequestError("the request body must be a JSON object")
  if body.get("model") not in (None, model):
    raise RequestError(f"model {body.get('model')!r} is not served here; GET /v1/models lists "
                       f"{model!r}", param="model", status=404, code="model_not_found")


def _room(prompt, cfg, max_len: int | None, param: str) -> int:
  """Tokens the prompt leaves of a request's room (the engine's slots, within the context);
  RequestError when none."""
  limit = min(max_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
  room = limit - len(prompt)
  if room < 1:
    raise RequestError(
        f"the prompt is {len(prompt)} tokens; " + (
            f"the model's context is {limit} tokens" if limit == cfg.max_position_embeddings
            else f"the server holds {limit} tokens a request (--max_len)")
        + f": shorten the {param}", param=param, code="context_length_exceeded")
  return room


def _sampling(body, cfg, max_n: int) -> dict:
  """The settings chat and completions share, checked: Job fields and the response's."""
  temperature = _number(body, "temperature", 0, 2, 1.0)
  top_p = _number(body, "top_p", 0, 1, 1.0, lo_open=True)
  stop = body.get("stop")
  stop = [stop] if isinstance(stop, str) else stop or []
  if (not isinstance(stop, list) or len(stop) > MAX_STOP
      or not all(isinstance(s, str) and s for s in stop)):
    raise RequestError(f"stop must be a non-empty string or a list of at most {MAX_STOP}",
                       param="stop")
  stream = body.get("stream", False)
  if not isinstance(stream, bool):
    raise RequestError("stream must be true or false", param="stream")
  options = body.get("stream_options") or {}
  if not isinstance(options, dict):
    raise RequestError("stream_options must be an object such as {include_usage: true}",
                       param="stream_options")
  return dict(job=dict(
      temperature=float(temperature), top_p=None if top_p >= 1 else float(top_p),
      top_k=_number(body, "top_k", 1, cfg.vocab_size, None, integer=True),
      n=_number(body, "n", 1, min(MAX_N, max_n), 1, integer=True),
      seed=_number(body, "seed", -2**63, 2**63 - 1, None, integer=True), stop=stop,
      **_penalties(body, cfg)),
      stream=stream, include_usage=bool(options.get("include_usage")))


def _at_most(min_tokens: int, max_tokens: int) -> None:
  if min_tokens > max_tokens:       # (vLLM refuses it too)
    raise RequestError(f"min_tokens {min_tokens} is more than the {max_tokens} tokens this "
                       "reply may have (max_tokens, or what the context leaves)",
                       param="min_tokens")


def _penalties(body, cfg) -> dict:
  """OpenAI's presence / frequency penalties and logit_bias, vLLM's repetition_penalty and
  min_tokens, checked (engine.Job's fields; k2jax.serving.generate.penalize applies them)."""
  bias = body.get("logit_bias") or {}
  if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
    raise RequestError(f"logit_bias must be an object of at most {MAX_LOGIT_BIAS} "
                       "{token id: bias}", param="logit_bias")
  ids = {}
  for k, v in bias.items():
    try:
      tid = int(k)
    except ValueError:
      tid = -1
    if not 0 <= tid < cfg.vocab_size or isinstance(v, bool) or not isinstance(v, (int, float)) \
        or not -100 <= v <= 100:
      raise RequestError(f"logit_bias {{{json.dumps(k)}: {json.dumps(v)}}}: keys are token "
                         f"ids in [0, {cfg.vocab_size}), values in [-100, 100]",
                         param="logit_bias")
    ids[tid] = float(v)
  return dict(presence_penalty=float(_number(body, "presence_penalty", -2, 2, 0.0)),
              frequency_penalty=float(_number(body, "frequency_penalty", -2, 2, 0.0)),
              repetition_penalty=float(_number(body, "repetition_penalty", 0, 10, 1.0,
                                               lo_open=True)),
              logit_bias=ids or None,
              min_tokens=_number(body, "min_tokens", 0, 2**31 - 1, 0, integer=True))


def parse(body, *, model: str, cfg, tokenizer, default_max_tokens: int, max_len: int | None = None,
          max_n: int = MAX_N) -> tuple[Job, dict]:
  """A chat-completion request -> (Job without its emit, what the response needs).
  max_len: the tokens a request may hold, prompt and completion (the engine's slots; default
  the model's context); max_n: the most choices (the engine's slots). Raises RequestError
  naming the field."""
  _model(body, model)
  messages = body.get("messages")
  if not isinstance(messages, list) or not messages:
    raise RequestError("messages must be a non-empty list of {role, content}",
                       param="messages")
  messages = [_content(m, i) for i, m in enumerate(messages)]
  _fields(body)
  tools, choice = _tools(body)
  try:
    # A final assistant message is continued, not closed (a prefilled reply); the reply is
    # what comes after it.
    prompt = chat.encode(messages, tools, add_generation_prompt="continue",
                         tokenizer=tokenizer)
  except (chat.ChatFormatError, KeyError, TypeError) as e:
    raise RequestError(f"messages cannot be rendered in K2's chat format: {e}",
                       param="messages") from None
  room = _room(prompt, cfg, max_len, "messages")
  sampling = _sampling(body, cfg, max_n)
  key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
  max_tokens = _number(body, key, 1, 2**31, None, integer=True)
  logprobs = body.get("logprobs") or False
  if not isinstance(logprobs, bool):
    raise RequestError("logprobs must be true or false (top_logprobs: how many alternatives)",
                       param="logprobs")
  top = _number(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, None, integer=True)
  if top and not logprobs:
    raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs")
  # A max_tokens past the context is clamped to what is left (the reply then ends with
  # finish_reason "length") rather than refused: a client that sizes max_tokens for a 128k
  # model (the synth pipelines' defaults) still gets answers from the 1k-context tiny model.
  max_tokens = min(room, max_tokens or default_max_tokens)
  _at_most(sampling["job"]["min_tokens"], max_tokens)
  # Constraints know the budget: a call or JSON reply closes in time whenever the budget
  # holds its shortest ending (chat.GrammarConstraint)
  parallel = body.get("parallel_tool_calls", True)
  if not isinstance(parallel, bool):
    raise RequestError("parallel_tool_calls must be true or false", param="parallel_tool_calls")
  calls = dict(max_calls=2 if parallel else 1, max_tokens=max_tokens)  # false: one call a turn
  processor, n = None, sampling["job"]["n"]
  if tools and choice == "auto":     # free text, but a section it opens follows the schemas
    processor = _per_row(lambda: chat.ToolSectionConstraint(tokenizer, tools, **calls), "tools",
                         n)
  elif tools and choice != "none":
    allowed = tools if choice == "required" else [
        t for t in tools if t["function"]["name"] == choice["function"]["name"]]
    processor = _per_row(lambda: chat.ToolCallConstraint(tokenizer, allowed, **calls), "tools",
                         n)
  schema = _response_format(body)
  if sampling["job"]["min_tokens"] and (schema is not None or (tools and choice != "none")):
    # a grammar may end before it (only stop tokens allowed, all masked)
    raise RequestError("min_tokens with a constrained reply (tools or response_format): drop "
                       "one", param="min_tokens")
  if schema is not None:
    if tools and choice != "none":
      raise RequestError("response_format json_object / json_schema with tools: drop one, or "
                         "pass tool_choice none", param="response_format")
    processor = _per_row(lambda: chat.JSONConstraint(tokenizer, schema, max_tokens=max_tokens),
                         "response_format", n)
  job = Job(prompt=prompt, max_tokens=max_tokens,
            emit=lambda e: None, hold_tool_calls=bool(tools) and choice != "none",
            processor=processor, logprobs=(top or 0) if logprobs else None, **sampling["job"])
  return job, dict(tools=tools if choice != "none" else None, stream=sampling["stream"],
                   include_usage=sampling["include_usage"])


def parse_completion(body, *, model: str, cfg, tokenizer, max_len: int | None = None,
                     max_n: int = MAX_N) -> tuple[list[Job], dict]:
  """A (legacy) completion request -> (one Job per prompt, without emit; the response's
  needs). A prompt is a string (its tokens after BOS, as training documents start), a list
  of token ids (as given), or a list of either (a batch: choice index = prompt i x n + row).
  max_tokens may be 0 with echo: the prompt's log probabilities only (lm-evaluation-harness
  scores a continuation so)."""
  _model(body, model)
  _fields(body, _COMPLETION_HONOURED, _COMPLETION_NO_OPS)
  prompt = body.get("prompt")
  ids = lambda p: isinstance(p, list) and p and all(
      isinstance(t, int) and not isinstance(t, bool) for t in p)
  if isinstance(prompt, str) or ids(prompt):
    prompt = [prompt]
  if (not isinstance(prompt, list) or not prompt
      or not all((isinstance(p, str) and p) or ids(p) for p in prompt)):
    raise RequestError("prompt must be a non-empty string, a list of token ids, or a list of "
                       "either", param="prompt")
  prompts, implicit = [], []
  for p in prompt:
    if isinstance(p, str):
      prompts.append([tokenizer.bos_id] + [int(t) for t in tokenizer.encode(p)])
    else:
      if not all(0 <= t < cfg.vocab_size for t in p):
        raise RequestError(f"prompt token ids must be in [0, {cfg.vocab_size})",
                           param="prompt")
      prompts.append(list(p))
    implicit.append(isinstance(p, str))
  echo = body.get("echo", False)
  if not isinstance(echo, bool):
    raise RequestError("echo must be true or false", param="echo")
  logprobs = _number(body, "logprobs", 0, MAX_TOP_LOGPROBS, None, integer=True)
  max_tokens = _number(body, "max_tokens", 0 if echo else 1, 2**31, 16, integer=True)
  sampling = _sampling(body, cfg, max_n)
  _at_most(sampling["job"]["min_tokens"], max_tokens)
  jobs = []
  for p in prompts:
    room = _room(p, cfg, max_len, "prompt")
    jobs.append(Job(prompt=p, max_tokens=min(room, max_tokens), emit=lambda e: None,
                    logprobs=logprobs, echo=echo and logprobs is not None, **sampling["job"]))
  return jobs, dict(stream=sampling["stream"], include_usage=sampling["include_usage"],
                    echo=echo, implicit=implicit, n=sampling["job"]["n"])
