"""k2jax.closing: every proposed ending of a partial JSON document is judged by two checkers we
did not write (llguidance's grammar for the schema, and the `jsonschema` validator), over
every prefix of documents written compactly and with spaces, escapes and non-ASCII text
included; and the budget it buys: a uniform random sampler under a tool-call / JSON grammar
with a token budget ends valid exactly when the budget holds the shortest ending."""

import json

import jsonschema
import numpy as np
import pytest

from k2jax.serving import chat, closing
from k2jax.data import ByteTokenizer, get_tokenizer
from tests.test_chat import write_bpe

END = "<|im_end|>"

SCHEMAS = [
    ({"type": "object", "properties": {"expression": {"type": "string"}},
      "required": ["expression"]},
     [{"expression": "12 * 7"}, {"expression": 'a"b\\c\u00e9\u20ac\n'}]),
    ({"type": "object", "properties": {
        "city": {"type": "string", "minLength": 2},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14}},
      "required": ["city", "unit"]},
     [{"city": "Paris", "unit": "celsius", "days": 3}, {"city": "N\u00eemes", "unit": "fahrenheit"}]),
    ({"type": "object", "properties": {
        "b": {"type": "string"}, "a": {"type": "integer"},
        "c": {"type": "array", "items": {"type": "number"}, "minItems": 2}},
      "required": ["a", "c"]},
     [{"b": "hi there", "a": -12, "c": [1.5e3, -0.25, 7]},
      {"a": 3, "c": [0, 1], "zz": [1, {"u": True}, None]}]),
    ({"type": "object", "properties": {
        "q": {"type": "object", "properties": {
            "x": {"type": ["number", "null"]},
            "y": {"anyOf": [{"type": "boolean"}, {"type": "array", "items": {"$ref": "#/$defs/p"}}]}},
            "required": ["x", "y"]},
        "tags": {"type": "array", "items": {"type": "string"}}},
      "required": ["q"], "$defs": {"p": {"type": "object", "properties": {"k": {"type": "string"}},
                                         "required": ["k"]}}},
     [{"q": {"x": None, "y": [{"k": "v"}, {"k": "w"}]}, "tags": ["a", "bb"]},
      {"q": {"x": -3.5e-2, "y": True}}]),
    # bounds a partial number has not reached yet ("1" under minimum 5 closes as 10)
    ({"type": "object", "properties": {"n": {"type": "integer", "minimum": 5},
                                       "m": {"type": "integer", "maximum": -3}},
      "required": ["n", "m"]},
     [{"n": 12, "m": -7}, {"n": 5, "m": -30}]),
    # recursive (pydantic's Optional["Node"]): a cycle of $refs must not recurse forever
    ({"$defs": {"Node": {"type": "object", "properties": {
        "value": {"type": "integer"},
        "next": {"anyOf": [{"$ref": "#/$defs/Node"}, {"type": "null"}]}},
        "required": ["value", "next"]}}, "$ref": "#/$defs/Node"},
     [{"value": 1, "next": {"value": 2, "next": None}}]),
]


def _llguidance_accepts(schema, text, tok, ll):
  import llguidance
  m = llguidance.LLMatcher(ll, llguidance.LLMatcher.grammar_from_lark(
      f"start: %json{json.dumps(schema)}\n"))
  return all(m.consume_token(int(t)) for t in tok.encode(text)) and m.is_accepting()


@pytest.mark.parametrize("case", range(len(SCHEMAS)))
def test_every_prefix_closes_into_a_document_both_checkers_accept(case):
  schema, docs = SCHEMAS[case]
  tok = ByteTokenizer()
  ll = chat._lltokenizer(tok)
  shortest = closing.minimal(schema)
  assert _llguidance_accepts(schema, shortest, tok, ll)
  jsonschema.validate(json.loads(shortest), schema)
  checked = 0
  for doc in docs:
    for sep in [(",", ":"), (", ", ": ")]:
      text = json.dumps(doc, separators=sep, ensure_ascii=False)
      jsonschema.validate(doc, schema)                     # the documents are the schema's
      for i in range(len(text) + 1):
        suffix, end = closing.complete(text[:i], schema)
        assert end == i
        whole = text[:i] + suffix
        assert _llguidance_accepts(schema, whole, tok, ll), (text[:i], suffix)
        jsonschema.validate(json.loads(whole), schema)
        # never longer than finishing the document the prefix came from
        assert len(suffix) <= len(text) - i or i == 0, (text[:i], suffix)
        checked += 1
  assert checked > 50


def test_what_it_cannot_close_it_says_so_and_text_after_a_document_is_not_read():
  assert closing.minimal({"type": "string", "pattern": "^[a-z]+$"}) is None
  assert closing.complete('{"s": "ab', {"type": "object", "properties": {
      "s": {"type": "string", "format": "date"}}}) is None
  assert closing.complete('{"a": 1} <|tool', {"type": "object"}) == ("", 9)
  assert closing.complete('{"a": 1]', {"type": "object"}) is None     # not JSON at all


@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_a_budget_that_holds_the_shortest_call_always_gets_a_valid_call(tmp_path, tokenizer):
  """Uniform sampling over the grammar's allowed tokens is the adversary: it opens keys,
  nested items and second calls whenever it may. Every budget from two below the shortest
  call up: a call that validates (jsonschema) and ends the turn inside the budget exactly
  when the budget holds the shortest whole section."""
  tok = ByteTokenizer() if tokenizer == "byte" else get_tokenizer(write_bpe(tmp_path))
  tools = [{"type": "function", "function": {"name": "plan.trip", "parameters": {
      "type": "object", "properties": {
          "city": {"type": "string", "minLength": 1},
          "stops": {"type": "array", "minItems": 1, "items": {
              "type": "object", "properties": {"at": {"type": "string"}, "n": {"type": "number"}},
              "required": ["at"]}},
          "opts": {"type": "object"}},
      "required": ["city", "stops"]}}},
      {"type": "function", "function": {"name": "calc", "parameters": SCHEMAS[0][0]}},
      # a long name (the closing assumes the shortest call) and a non-ASCII key (its bytes
      # are tokens with the byte tokenizer)
      {"type": "function", "function": {"name": "lookup_customer_record_by_identifier",
                                        "parameters": {"type": "object", "properties": {
                                            "説明文字説明文字": {"type": "integer"}}}}}]
  schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
  stops = set(chat.stop_ids(tok)) | {tok.eos_id}
  shortest = chat.ToolCallConstraint(tok, tools).shortest
  for budget in list(range(shortest - 2, shortest + 30, 4)) + [shortest + 120]:
    for seed in range(3):
      c = chat.ToolCallConstraint(tok, tools, max_calls=2, max_tokens=budget)
      rng = np.random.default_rng(seed)
      ids, text = [], ""
      # a turn ends at a stop id or (byte tokenizer: markers are text) at <|im_end|>'s text
      while len(ids) < budget and not (ids and ids[-1] in stops) and not text.endswith(END):
        ids.append(int(rng.choice(np.flatnonzero(c(0, ids)))))
        text = chat._text(tok, [t for t in ids if t != tok.eos_id])[0]
      if budget < shortest:
        assert not text.endswith(END), text                 # no room: cut, never repaired
        continue
      assert text.endswith(END), (budget, text)
      _, calls = chat.parse_tool_calls(text)
      assert calls, text
      for call in calls:
        jsonschema.validate(call["arguments"], schemas[call["name"]])


def test_a_json_reply_closes_inside_its_budget_and_auto_does_not_open_a_section_it_cannot_end(
    tmp_path):
  tok = ByteTokenizer()
  schema = SCHEMAS[3][0]
  shortest = len(closing.minimal(schema)) + len(END)
  for budget in (shortest, shortest + 5, shortest + 40):
    c = chat.JSONConstraint(tok, schema, max_tokens=budget)
    rng = np.random.default_rng(budget)
    ids, text = [], ""
    while len(ids) < budget and not text.endswith(END):
      ids.append(int(rng.choice(np.flatnonzero(c(0, ids)))))
      text = tok.decode(ids)
    assert text.endswith(END), text
    jsonschema.validate(json.loads(text.removesuffix(END)), schema)
  # K2's tokenizer: the section marker is one special id, masked while a section opened now
  # could not end in the budget; allowed as soon as it could
  bpe = get_tokenizer(write_bpe(tmp_path))
  tools = [{"type": "function", "function": {"name": "calc", "parameters": SCHEMAS[0][0]}}]
  auto = chat.ToolSectionConstraint(bpe, tools, max_tokens=100)
  need = auto.inner.shortest
  marker = bpe.special_ids["<|tool_calls_section_begin|>"]
  free = [int(t) for t in bpe.encode("hello")][:1]
  assert auto(0, free * (100 - need)) is None                      # room: nothing masked
  assert not auto(0, free * (100 - need + 1))[marker]              # one short: not opened
