"""K2's chat format and tool calls (report appendix B; the published chat template).

Every turn is `<|im_{user|assistant|system}|>{name}<|im_middle|>{body}<|im_end|>`:

  * tools, when given, come first: `<|im_system|>tool_declare<|im_middle|>{tools}<|im_end|>`
    with the OpenAI-style tool list as compact JSON;
  * a default system turn ("You are Kimi, an AI assistant created by Moonshot AI.") is added
    when the dialog does not start with one;
  * user / assistant / system turns use their role as the name (or the message's `name`);
  * an assistant turn's tool calls follow its text: `<|tool_calls_section_begin|>` then per
    call `<|tool_call_begin|>functions.{name}:{idx}<|tool_call_argument_begin|>{json}
    <|tool_call_end|>`, then `<|tool_calls_section_end|>` (idx counts calls from 0 over the
    dialog unless the call carries its own id);
  * a tool result is `<|im_system|>{name or tool}<|im_middle|>## Return of {call id}\\n{content}`;
  * the generation prompt is `<|im_assistant|>assistant<|im_middle|>`.

`render` gives the text, `encode` the token ids (markers become K2's special ids with K2's
tiktoken file, or stay text with the byte tokenizer), `encode_with_mask` also marks the
tokens an assistant produced (for SFT), `parse_tool_calls` reads calls back out of generated
text, and `ToolCallConstraint` masks logits so sampled tool calls follow each tool's JSON
schema (llguidance).
"""

import json
import re
from collections.abc import Sequence

import numpy as np

from k2jax.serving import closing

DEFAULT_SYSTEM = "You are Kimi, an AI assistant created by Moonshot AI."
MARKERS = ("<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
           "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
           "<|tool_call_argument_begin|>", "<|tool_call_end|>")
_MARKER_RE = re.compile("|".join(re.escape(m) for m in MARKERS))
GENERATION_PROMPT = "<|im_assistant|>assistant<|im_middle|>"


class ChatFormatError(ValueError):
  """A message list the format cannot render (names the message and the problem)."""


class ToolCallParseError(ValueError):
  """Generated text whose tool-call section is malformed (names the call and the problem)."""


def _turn(marker: str, name: str, body: str) -> str:
  return f"<|im_{marker}|>{name}<|im_middle|>{body}<|im_end|>"


def _arguments(args) -> str:
  return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def _call_fields(call: dict) -> tuple[str | None, str, object]:
  fn = call.get("function", call)
  if "name" not in fn:
    raise ChatFormatError(f"tool call {call!r} has no function name")
  return call.get("id"), fn["name"], fn.get("arguments", {})


def render_chunks(messages: Sequence[dict], tools: Sequence[dict] | None = None,
                  add_generation_prompt: bool = True) -> list[tuple[str, str, bool]]:
  """The rendered dialog as (header, body, produced by the assistant) pieces: the text is the
  concatenation of header + body; SFT trains on assistant bodies only. With
  add_generation_prompt "continue", a final assistant message is left open (no <|im_end|>,
  no new header): the model continues it (a prefilled reply)."""
  chunks: list[tuple[str, str, bool]] = []
  if tools:
    chunks.append(("<|im_system|>tool_declare<|im_middle|>",
                   json.dumps(list(tools), separators=(",", ":"), ensure_ascii=False) +
                   "<|im_end|>", False))
  if not messages or messages[0].get("role") != "system":
    chunks.append(("", _turn("system", "system", DEFAULT_SYSTEM), False))
  call_index = 0
  for i, m in enumerate(messages):
    role = m.get("role")
    content = m.get("content") or ""
    if not isinstance(content, str):
      raise ChatFormatError(f"message {i}: content must be a string, got "
                            f"{type(content).__name__}" + (" (join its text parts into one "
                                                           "string)" if isinstance(content, list)
                                                           else ""))
    if role in ("user", "system"):
      chunks.append(("", _turn(role, m.get("name") or role, content), False))
    elif role == "assistant":
      body = content
      calls = m.get("tool_calls") or []
      if calls:
        body += "<|tool_calls_section_begin|>"
        for call in calls:
          cid, name, args = _call_fields(call)
          cid = cid or f"functions.{name}:{call_index}"
          call_index += 1
          body += (f"<|tool_call_begin|>{cid}<|tool_call_argument_begin|>{_arguments(args)}"
                   "<|tool_call_end|>")
        body += "<|tool_calls_section_end|>"
      chunks.append((f"<|im_assistant|>{m.get('name') or 'assistant'}<|im_middle|>",
                     body + "<|im_end|>", True))
    elif role == "tool":
      if "tool_call_id" not in m:
        raise ChatFormatError(f"message {i}: a tool result needs the tool_call_id it answers")
      chunks.append(("", _turn("system", m.get("name") or "tool",
                               f"## Return of {m['tool_call_id']}\n{content}"), False))
    else:
      raise ChatFormatError(f"message {i}: role {role!r} must be system, user, assistant or tool")
  if add_generation_prompt == "continue" and messages and messages[-1].get("role") == "assistant":
    header, body, mine = chunks[-1]
    if not messages[-1].get("tool_calls"):
      chunks[-1] = (header, body.removesuffix("<|im_end|>"), mine)
      return chunks
  if add_generation_prompt:
    chunks.append((GENERATION_PROMPT, "", False))
  return chunks


def render(messages: Sequence[dict], tools: Sequence[dict] | None = None,
           add_generation_prompt: bool = True) -> str:
  """The dialog as K2 chat text (see the module docstring for the layout)."""
  return "".join(h + b for h, b, _ in render_chunks(messages, tools, add_generation_prompt))


def _encode_text(text: str, tokenizer) -> list[int]:
  """Tokens of text holding chat markers: markers -> the tokenizer's special ids when it has
  them, else their text."""
  specials = getattr(tokenizer, "special_ids", {}) or {}
  ids, pos = [], 0
  for m in _MARKER_RE.finditer(text):
    ids += [int(t) for t in tokenizer.encode(text[pos:m.start()])]
    ids += [specials[m.group()]] if m.group() in specials else [
        int(t) for t in tokenizer.encode(m.group())]
    pos = m.end()
  return ids + [int(t) for t in tokenizer.encode(text[pos:])]


def _tokenizer(tokenizer):
  if tokenizer is None:
    from k2jax.data import ByteTokenizer
    return ByteTokenizer()
  return tokenizer


def encode(messages: Sequence[dict], tools: Sequence[dict] | None = None,
           add_generation_prompt: bool = True, tokenizer=None) -> list[int]:
  """Token ids of `render(...)` (default tokenizer: bytes), BOS first."""
  tok = _tokenizer(tokenizer)
  return [tok.bos_id] + _encode_text(render(messages, tools, add_generation_prompt), tok)


def encode_with_mask(messages: Sequence[dict], tools: Sequence[dict] | None = None,
                     tokenizer=None) -> tuple[list[int], list[bool]]:
  """(ids, mask) of a whole dialog, mask True on the tokens the assistant produced (its text,
  tool calls and closing <|im_end|>), never on system / user / tool-result tokens."""
  tok = _tokenizer(tokenizer)
  ids, mask = [tok.bos_id], [False]
  for header, body, assistant in render_chunks(messages, tools, add_generation_prompt=False):
    h = _encode_text(header, tok)
    b = _encode_text(body, tok)
    ids += h + b
    mask += [False] * len(h) + [assistant] * len(b)
  return ids, mask


def encode_tool_results(results: Sequence[dict], tokenizer=None,
                        add_generation_prompt: bool = True) -> list[int]:
  """Token ids of tool-result messages ({"tool_call_id", "name", "content"}) continuing a
  dialog after the assistant's tool calls, then the next assistant header: what an agent loop
  appends to the ids it has (rendering the whole dialog again could re-tokenize the sampled
  tokens differently)."""
  tok = _tokenizer(tokenizer)
  text = "".join(_turn("system", r.get("name") or "tool",
                       f"## Return of {r['tool_call_id']}\n{r.get('content') or ''}")
                 for r in results)
  return _encode_text(text + (GENERATION_PROMPT if add_generation_prompt else ""), tok)


def stop_ids(tokenizer) -> list[int]:
  """Token ids that end an assistant turn (<|im_end|> when the tokenizer has it)."""
  specials = getattr(tokenizer, "special_ids", {}) or {}
  return [specials["<|im_end|>"]] if "<|im_end|>" in specials else []


# ------------------------------------------------------------------------- parsing calls

_SECTION_BEGIN = re.compile(r"<\|tool_calls?_section_begin\|>")
_CALL = ("<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>")
_SECTION_END = re.compile(r"<\|tool_calls?_section_end\|>")


def parse_tool_calls(text: str) -> tuple[str, list[dict]]:
  """(content, calls) of an assistant turn's text, calls as [{"id", "name", "arguments",
  "raw"}] (arguments parsed; raw: the JSON text as the model wrote it).

  Robust to what deployed K2 output holds: several calls in a section, JSON arguments with
  braces, escaped newlines or marker lookalikes inside strings (arguments are read with a
  JSON decoder, not a regex), text before the section, `<think>` blocks (a section opened
  inside one counts), the singular `<|tool_call_section_begin|>` spelling, and a section cut
  off by the token limit (the complete calls are returned, the cut one is dropped).

  Raises ToolCallParseError for a call whose id or arguments are malformed in a section that
  was not cut off.
  """
  text = re.sub(r"<\|im_end\|>\s*$", "", text)
  m = _SECTION_BEGIN.search(text)
  if not m:
    return _strip_think(text).strip(), []
  before = text[:m.start()]
  in_think = before.rfind("<think>") > before.rfind("</think>")
  content = _strip_think(before).strip()
  calls, pos, n, trailing, closed = [], m.end(), 0, "", False
  # strict=False: a model writes code arguments with raw newlines / tabs inside JSON strings;
  # rejecting them would drop every call of the turn.
  decoder = json.JSONDecoder(strict=False)
  begin, arg, end = _CALL
  # Scan call by call: the arguments are read by a JSON decoder, so braces or marker text
  # inside JSON strings cannot end a call early.
  while True:
    rest = text[pos:].lstrip()
    if not rest:
      break
    end_match = _SECTION_END.match(rest)
    if end_match:
      trailing, closed = rest[end_match.end():], True
      break
    if in_think and rest.startswith("</think>"):
      break     # the thinking block ended, and with it the section opened inside it
    if not rest.startswith(begin):
      if begin in rest or _SECTION_END.search(rest):
        raise ToolCallParseError(f"tool call {n}: expected {begin}, found {rest[:40]!r}")
      break                                      # trailing text of a cut section
    head, sep, after = rest[len(begin):].partition(arg)
    if not sep:
      break                                      # cut before the arguments began
    cid = head.strip()
    if not re.fullmatch(r"[\w.\-]+:\d+", cid):
      raise ToolCallParseError(f"tool call {n}: id {cid!r} is not functions.NAME:INDEX")
    body = after.lstrip()
    try:
      args, used = decoder.raw_decode(body)
    except json.JSONDecodeError as e:
      if end not in body and not _SECTION_END.search(body):
        break                                    # cut off inside the arguments
      raise ToolCallParseError(f"tool call {n} ({cid}): arguments are not JSON ({e.msg} at "
                               f"{e.pos})") from None
    tail = body[used:].lstrip()
    if not tail.startswith(end):
      if not tail:
        break                                    # cut right after the arguments
      raise ToolCallParseError(f"tool call {n} ({cid}): text after the JSON arguments: "
                               f"{tail[:40]!r}")
    if not isinstance(args, dict):
      raise ToolCallParseError(f"tool call {n} ({cid}): arguments must be a JSON object")
    # the name is what the id holds between `functions.` and `:IDX`, dots included
    # (namespaced tools: functions.browser.open:0)
    name = cid.rsplit(":", 1)[0]
    calls.append({"id": cid, "name": name.removeprefix("functions."), "arguments": args,
                  "raw": body[:used]})
    pos = len(text) - len(tail) + len(end)
    n += 1
  # Text after the section is content too; if the section opened inside a <think> block,
  # the block goes on until its </think>. A section never closed is what was left after the
  # complete calls: a cut call (dropped), unless the thinking block ends in it - then the
  # text after that </think> is the answer.
  if not closed:
    trailing = text[pos:] if in_think else ""
  if in_think:
    close = trailing.find("</think>")
    trailing = "" if close < 0 else trailing[close + len("</think>"):]
  content = "\n".join(t for t in (content, _strip_think(trailing).strip()) if t)
  return content, calls


def streamed_calls(section: str) -> list[dict]:
  """The calls of a tool-call section as far as it has been written (streaming):
  [{"name", "arguments": the argument text so far, "done"}]. A finished call's arguments are
  its raw JSON (as parse_tool_calls' "raw"); an unfinished one's stop short of trailing
  whitespace and of anything that may be the start of <|tool_call_end|>, so what is shown
  only ever grows into the finished text."""
  begin, arg, end = _CALL
  decoder = json.JSONDecoder(strict=False)
  m = _SECTION_BEGIN.search(section)
  pos, out = (m.end() if m else 0), []
  while True:
    rest = section[pos:].lstrip()
    if not rest.startswith(begin):
      return out
    head, sep, after = rest[len(begin):].partition(arg)
    if not sep:
      return out
    name = head.strip().rsplit(":", 1)[0].removeprefix("functions.")
    body = after.lstrip()
    try:
      _, used = decoder.raw_decode(body)
      tail = body[used:].lstrip()
      if tail.startswith(end):
        out.append({"name": name, "arguments": body[:used], "done": True})
        pos = len(section) - len(tail) + len(end)
        continue
    except json.JSONDecodeError:
      pass
    shown = body.rstrip()
    for k in range(min(len(end) - 1, len(shown)), 0, -1):
      if shown.endswith(end[:k]):
        shown = shown[:-k].rstrip()
        break
    out.append({"name": name, "arguments": shown, "done": False})
    return out


def split_reasoning(text: str) -> tuple[str | None, str]:
  """(reasoning, the rest) of an assistant turn's text: the first `<think>` block's text, or
  None without one. A block left open (no `</think>`: a cut, or a model that went straight
  to its calls) runs to a tool-call section if one begins inside it, else to the end; a
  section never belongs to the reasoning, so an unclosed block does not swallow the calls.
  The rest is the text around the block (its markers dropped)."""
  start = text.find("<think>")
  if start < 0:
    return None, text
  body = start + len("<think>")
  close = text.find("</think>", body)
  stop = close if close >= 0 else len(text)
  section = _SECTION_BEGIN.search(text, body, stop)
  if section:
    after = text[section.start():]
    if close >= 0:
      after = after.replace("</think>", "", 1)
    return text[body:section.start()], text[:start] + after
  return text[body:stop], text[:start] + (text[close + len("</think>"):] if close >= 0 else "")


def section_cut(text: str) -> bool:
  """Whether a tool-call section opened in `text` and never closed (the reply was cut)."""
  m = _SECTION_BEGIN.search(text)
  return bool(m) and not _SECTION_END.search(text, m.end())


def _strip_think(text: str) -> str:
  return re.sub(r"<think>.*?(</think>|$)", "", text, flags=re.S)


# ---------------------------------------------------------------- constrained decoding


def _lark_string(s: str) -> str:
  return json.dumps(s)


class GrammarConstraint:
  """Token masks that keep each row's tokens inside a Lark grammar (llguidance compiles it and
  tracks each row; we only wire it up): c(row, ids so far) -> bool [vocab], the
  `logits_processor` of k2jax.generate / a Job. After the grammar ends (or if a row left it),
  only the stop tokens are allowed.

  With `max_tokens` (the row's budget) a row ends inside it whenever the budget leaves room
  for the grammar's shortest ending: once `left` tokens are at most the tokens of `closing`
  (the shortest text from here to the end; subclasses know it) plus `margin`, the row is held
  to that closing token by token. The closing is checked against llguidance before it is
  used; a grammar without one (or a closing llguidance refuses) keeps the plain mask.
  """

  margin = 0     # `slack` where it does not depend on the text

  def __init__(self, tokenizer, grammar: str, what: str = "grammar", *,
               max_tokens: int | None = None):
    import llguidance  # pip install llguidance (no other dependencies)
    self.tokenizer, self.grammar, self.max_tokens = tokenizer, grammar, max_tokens
    self._plans: dict[int, tuple] = {}     # row -> (tokens when planned, the closing's tokens)
    self._far: dict[int, tuple] = {}       # row -> (tokens when read, closing's tokens, slack)
    self._ll_tok = _lltokenizer(tokenizer)
    err = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(grammar),
                                                self._ll_tok)
    if err:       # llguidance's first line says why; the rest quotes the grammar
      raise ValueError(f"{what} does not compile: {err.strip().splitlines()[0]}")
    self._matchers: dict[int, tuple] = {}
    self.vocab = tokenizer.vocab_size
    self.stop = [tokenizer.eos_id] + stop_ids(tokenizer)

  @staticmethod
  def marker(tokenizer):
    """How a grammar names one of K2's chat markers: its special id where the tokenizer has
    one, else its text."""
    specials = getattr(tokenizer, "special_ids", {}) or {}
    return (lambda m: f"<[{specials[m]}]>") if specials else _lark_string

  def _matcher(self, row):
    import llguidance
    if row not in self._matchers:
      self._matchers[row] = (llguidance.LLMatcher(
          self._ll_tok, llguidance.LLMatcher.grammar_from_lark(self.grammar)), 0)
    return self._matchers[row]

  def closing(self, text: str) -> str | None:
    """The shortest text that takes the grammar from `text` (this row's so far) to its end;
    None: unknown (no budget guarantee)."""
    return None

  def slack(self, text: str) -> int:
    """Tokens of slack: the row starts its closing once its budget is within this many tokens
    of it, so that no token sampled freely before can grow the closing past the budget."""
    return self.margin

  def most_slack(self) -> int:
    """`slack`'s largest value, whatever the text."""
    return self.margin

  def _plan(self, row: int, matcher, generated: list[int], left: int) -> list[int] | None:
    """The tokens left of this row's closing when its budget calls for it (else None)."""
    if row in self._plans:
      at, plan = self._plans[row]
      done = len(generated) - at
      if plan is not None and generated[at:] == plan[:done]:
        return plan[done:]
      if plan is None and at == len(generated):
        return None
    # each free token lengthens the closing by at most the slack: while even that leaves
    # room, the closing need not be read again (it is the text so far: reading it every
    # step would cost the row's length per token)
    if row in self._far:
      at, need, per = self._far[row]
      if need + (len(generated) - at + 1) * per < left:
        return None
    read = _text(self.tokenizer, generated)
    tail = None if read is None else self.closing(read[0])
    if tail is None:
      return None
    text, fill = read
    plan = self.tokenizer.byte_ids(fill) + _encode_text(tail, self.tokenizer)
    per = self.most_slack()
    if len(plan) + self.slack(text) < left:
      self._far[row] = (len(generated), len(plan), per)
      return None
    check = matcher.deep_copy()
    if not (all(check.consume_token(int(t)) for t in plan) and check.is_accepting()):
      self._plans[row] = (len(generated), None)    # llguidance refused it: the plain mask
      return None
    self._plans[row] = (len(generated), plan)
    return plan

  def __call__(self, row: int, generated: list[int], left: int | None = None) -> np.ndarray:
    """The allowed next tokens of `row` given its tokens so far (bool [vocab]); `left`: the
    tokens it may still write (default: max_tokens less those generated)."""
    matcher, seen = self._matcher(row)
    for t in generated[seen:]:
      matcher.consume_token(int(t))
    self._matchers[row] = (matcher, len(generated))
    if matcher.is_stopped() or matcher.is_error():
      allowed = np.zeros(self.vocab, bool)
      allowed[self.stop] = True
      return allowed
    if left is None and self.max_tokens is not None:
      left = self.max_tokens - len(generated)
    plan = None if left is None else self._plan(row, matcher, list(generated), left)
    if plan:
      allowed = np.zeros(self.vocab, bool)
      allowed[plan[0]] = True
      return allowed
    words = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint32)
    bits = np.unpackbits(words.view(np.uint8), bitorder="little").astype(bool)
    allowed = np.zeros(self.vocab, bool)
    n = min(self.vocab, bits.size)
    allowed[:n] = bits[:n]
    if not allowed.any():
      allowed[self.stop] = True
    return allowed


class ToolCallConstraint(GrammarConstraint):
  """Token masks that force an assistant turn to be well-formed tool calls whose arguments
  match each tool's JSON schema.

      c = ToolCallConstraint(tokenizer, tools)
      generate(cfg, params, [prompt], ..., logits_processor=c)   # c(row, ids) -> bool [vocab]

  The grammar: a tool-call section of `max_calls` calls at most (each
  `functions.NAME:IDX` with arguments from NAME's schema), then <|im_end|>. Markers are the
  tokenizer's special ids when it has them, else text.
  """

  def __init__(self, tokenizer, tools: Sequence[dict], *, max_calls: int = 2,
               first_index: int = 0, max_tokens: int | None = None):
    mark = self.marker(tokenizer)
    calls = []
    self.schemas = {}
    for t in tools:
      fn = t.get("function", t)
      self.schemas[fn["name"]] = fn.get("parameters") or {"type": "object"}
      schema = json.dumps(self.schemas[fn["name"]])
      calls.append(f'{mark("<|tool_call_begin|>")} {_lark_string("functions." + fn["name"] + ":")} '
                   f'/[0-9]/ {mark("<|tool_call_argument_begin|>")} %json{schema} '
                   f'{mark("<|tool_call_end|>")}')
    one = " | ".join(f"({c})" for c in calls)
    repeat = " ".join(["call"] + ["call?"] * (max_calls - 1))
    self.max_calls = max_calls
    super().__init__(tokenizer, f"start: {mark('<|tool_calls_section_begin|>')} {repeat} "
                     f"{mark('<|tool_calls_section_end|>')} {mark('<|im_end|>')}\n"
                     f"call: {one}\n", "tool-call grammar", max_tokens=max_tokens)
    # each tool's shortest arguments, once (every closing is built from them)
    self._shortest_args = {n: closing.minimal(sc) for n, sc in self.schemas.items()}
    shortest = self._call(0)
    # inside a call a free token can open one key or item (closing.slack) or pick a longer
    # name than the closing's; between calls it can open another call
    calls = [c for c in (self._call(0, n) for n in self.schemas) if c is not None]
    self.margin = max(closing.slack(s) for s in self.schemas.values()) + (
        max(len(_encode_text(c, tokenizer)) for c in calls) -
        min(len(_encode_text(c, tokenizer)) for c in calls) if calls else 0)
    self._another = 0 if shortest is None else len(_encode_text(shortest, tokenizer))
    self.shortest = None if shortest is None else len(_encode_text(
        "<|tool_calls_section_begin|>" + shortest + _END, tokenizer))

  def slack(self, text: str) -> int:
    between = text.rfind("<|tool_call_end|>") > text.rfind("<|tool_call_begin|>")
    return self.margin + (self._another if between else 0)

  def most_slack(self) -> int:
    return self.margin + self._another

  def _call(self, index: int, name: str | None = None) -> str | None:
    """The shortest whole call (of `name`, else of any tool) numbered `index`."""
    found = []
    for n, args in self._shortest_args.items():
      if args is not None and name in (None, n):
        found.append(f"<|tool_call_begin|>functions.{n}:{index % 10}"
                     f"<|tool_call_argument_begin|>{args}<|tool_call_end|>")
    return min(found, key=len, default=None)

  def closing(self, text: str) -> str | None:
    """The shortest way from `text` (the section so far, from its first marker) to the end of
    the turn: finish the open marker, name or arguments, close the call, close the section."""
    pos, calls = _expect(text, 0, "<|tool_calls_section_begin|>")
    if pos is None:
      return None
    if calls is not None:                          # the section's marker is still open
      call = self._call(0)
      return None if call is None else calls + call + _END
    n = 0
    while True:
      rest = text[pos:]
      if rest.startswith("<|tool_call_begin|>"):
        tail, pos = self._close_call(text, pos + len("<|tool_call_begin|>"), n)
        if tail is not None or pos is None:
          return tail
        n += 1
        continue
      options = []                                 # end the section, or open a call
      if n and _END.startswith(rest):
        options.append(_END[len(rest):])
      if n < self.max_calls and "<|tool_call_begin|>".startswith(rest):
        call = self._call(n)
        if call is not None:
          options.append(call[len(rest):] + _END)
      return min(options, key=len, default=None)

  def _close_call(self, text: str, pos: int, n: int) -> tuple[str | None, int | None]:
    """Read call n from pos (after its begin marker): (the rest of the turn's closing, None)
    when the text ends inside it, or (None, where it ends) when it is whole."""
    rest = text[pos:]
    heads = {name: f"functions.{name}:" for name in self.schemas}
    name = next((k for k, h in heads.items() if rest.startswith(h)), None)
    if name is None:                               # inside the name
      options = [c[len("<|tool_call_begin|>") + len(rest):] for k, h in heads.items()
                 if h.startswith(rest) for c in [self._call(n, k)] if c is not None]
      return (min(options, key=len) + _END if options else None), None
    pos += len(heads[name])
    args = self._shortest_args[name]
    if pos == len(text):
      return (None if args is None else
              f"{n % 10}<|tool_call_argument_begin|>{args}<|tool_call_end|>{_END}"), None
    pos += 1                                        # the call's index digit
    pos, missing = _expect(text, pos, "<|tool_call_argument_begin|>")
    if pos is None:
      return None, None
    if missing is not None:
      return (None if args is None else f"{missing}{args}<|tool_call_end|>{_END}"), None
    done = closing.complete(text[pos:], self.schemas[name])
    if done is None:
      return None, None
    suffix, end = done
    pos += end
    if pos == len(text):
      return suffix + "<|tool_call_end|>" + _END, None
    pos, missing = _expect(text, pos, "<|tool_call_end|>")
    if pos is None:
      return None, None
    return (missing + _END, None) if missing is not None else (None, pos)


class ToolSectionConstraint:
  """tool_choice "auto": the turn is free text until the model opens a tool-call section;
  from there the section is held to the tools' grammar (`ToolCallConstraint`) to its end.
  Without it a section the model opens on its own is unconstrained, and its arguments may
  not match their schemas (what K2 Vendor Verifier counts against a server).

  c(row, ids) -> None (no mask) before the section, else the grammar's mask for the tokens
  from the section's first marker on. The marker is the tokenizer's special id, or its
  text's bytes (byte tokenizer)."""

  def __init__(self, tokenizer, tools: Sequence[dict], *, max_calls: int = 2,
               max_tokens: int | None = None):
    self.inner = ToolCallConstraint(tokenizer, tools, max_calls=max_calls)
    self.max_tokens, self.vocab = max_tokens, tokenizer.vocab_size
    specials = getattr(tokenizer, "special_ids", {}) or {}
    name = "<|tool_calls_section_begin|>"
    self.marker = [specials[name]] if name in specials else list(name.encode())
    self._start: dict[int, int] = {}
    self._seen: dict[int, int] = {}        # tokens of a row already searched

  def _find(self, row: int, ids) -> int | None:
    """Where the marker starts in ids, searching only what the last call had not seen (a
    decode step adds a token: the search stays constant per step)."""
    m, n = self.marker, len(self.marker)
    for i in range(max(self._seen.get(row, 0) - n + 1, 0), len(ids) - n + 1):
      if ids[i] == m[0] and list(ids[i:i + n]) == m:
        return i
    self._seen[row] = len(ids)
    return None

  def __call__(self, row: int, generated: list[int]) -> np.ndarray | None:
    left = None if self.max_tokens is None else self.max_tokens - len(generated)
    start = self._start.get(row)
    if start is None:
      start = self._find(row, generated)
      if start is None:
        # a section opened now could not end inside the budget: do not open one (a marker
        # that is one special token can be masked; text markers cannot)
        if (left is not None and len(self.marker) == 1 and self.inner.shortest is not None
                and left < self.inner.shortest):
          allowed = np.ones(self.vocab, bool)
          allowed[self.marker[0]] = False
          return allowed
        return None
      self._start[row] = start
    return self.inner(row, generated[start:], left=left)


class JSONConstraint(GrammarConstraint):
  """Token masks that force an assistant turn to be one JSON value matching `schema` (JSON
  Schema; {"type": "object"} for any object), then <|im_end|>: OpenAI's `response_format`
  json_schema and json_object."""

  def __init__(self, tokenizer, schema: dict, *, max_tokens: int | None = None):
    mark = self.marker(tokenizer)
    self.schema = schema
    super().__init__(tokenizer, f"start: %json{json.dumps(schema)} {mark('<|im_end|>')}\n",
                     "response_format's JSON schema", max_tokens=max_tokens)
    self.margin = closing.slack(schema)

  def closing(self, text: str) -> str | None:
    done = closing.complete(text, self.schema)
    if done is None:
      return None
    suffix, end = done
    if end < len(text):                 # the value is whole: what follows is <|im_end|>'s start
      pos, missing = _expect(text, end, "<|im_end|>")
      return missing if pos is not None and missing is not None else None
    return suffix + "<|im_end|>"


_END = "<|tool_calls_section_end|><|im_end|>"


def _expect(text: str, pos: int, marker: str) -> tuple[int | None, str | None]:
  """Read `marker` at pos: (after it, None) when whole, (end of text, what is missing of it)
  when the text ends inside it, (None, None) when the text says something else."""
  rest = text[pos:]
  if rest.startswith(marker):
    return pos + len(marker), None
  if marker.startswith(rest):
    return len(text), marker[len(rest):]
  return None, None


def _text(tokenizer, ids) -> tuple[str, bytes] | None:
  """The text of ids with chat markers written out (what `closing` reads), and the bytes that
  finish a character the last token left open (the smallest such character: a closing
  cannot start inside one); None: no character starts that way."""
  raw = b"".join(tokenizer.token_bytes(int(i)) for i in ids)
  fill = b""
  for back in range(1, min(4, len(raw)) + 1):
    lead = raw[-back]
    if lead & 0xC0 == 0x80:                 # a continuation byte: look further back
      continue
    need = 2 if 0xC0 <= lead < 0xE0 else 3 if 0xE0 <= lead < 0xF0 else 4 if lead >= 0xF0 else 1
    if back < need:
      second = {0xE0: 0xA0, 0xF0: 0x90}.get(lead, 0x80)
      fill = bytes([second] if back == 1 else []) + b"\x80" * (need - back - (back == 1))
    break
  try:
    return (raw + fill).decode("utf-8"), fill
  except UnicodeDecodeError:
    return None


def _lltokenizer(tokenizer):
  """llguidance's view of one of our tokenizers (bytes per id, specials, EOS)."""
  import llguidance
  specials = getattr(tokenizer, "special_ids", {}) or {}
  if hasattr(tokenizer, "ranks"):                       # tiktoken BPE: ranks + K2 specials
    import tiktoken
    from k2jax.data.tokenizer import SPLIT_PATTERN
    enc = tiktoken.Encoding(name="k2", pat_str=SPLIT_PATTERN, mergeable_ranks=tokenizer.ranks,
                            special_tokens=specials)
    from llguidance.tiktoken import lltokenizer_from_encoding
    return lltokenizer_from_encoding(enc, n_vocab=tokenizer.vocab_size, eos_token=tokenizer.eos_id)

  class _Bytes:                                         # the byte tokenizer
    eos_token_id = tokenizer.eos_id
    bos_token_id = tokenizer.bos_id
    tokens = [bytes([i]) for i in range(256)] + [b""] * (tokenizer.vocab_size - 256)
    special_token_ids = list(range(256, tokenizer.vocab_size))

    def __call__(self, s):
      return [int(t) for t in tokenizer.encode(s)]
  return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()))
