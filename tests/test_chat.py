"""K2's chat format against the published layout, the tool-call parser on what deployed
parsers meet, and constrained decoding of tool calls against their JSON schemas."""

import base64

import numpy as np
import pytest

from k2jax.serving import chat
from k2jax.data import ByteTokenizer, get_tokenizer

WEATHER = [{"type": "function", "function": {
    "name": "get_weather",
    "description": "Get weather information. Call this tool when the user needs to get weather "
                   "information",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string", "description": "City name"}}}}}]
ASK = [{"role": "user", "content": "What's the weather like in Beijing today? Use the tool to check."}]

# The published layout, written out from the template's rules (k2-facts "Chat and tool-call
# format"; the K2 tool-call guide's example): declarations, the default system turn, turns.
DECLARE = ("<|im_system|>tool_declare<|im_middle|>[{\"type\":\"function\",\"function\":{\"name\":"
           "\"get_weather\",\"description\":\"Get weather information. Call this tool when the "
           "user needs to get weather information\",\"parameters\":{\"type\":\"object\","
           "\"required\":[\"city\"],\"properties\":{\"city\":{\"type\":\"string\",\"description\":"
           "\"City name\"}}}}}]<|im_end|>")
SYSTEM = "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
USER = ("<|im_user|>user<|im_middle|>What's the weather like in Beijing today? Use the tool to "
        "check.<|im_end|>")
CALL = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        "<|tool_call_argument_begin|>{\"city\": \"Beijing\"}<|tool_call_end|>"
        "<|tool_calls_section_end|>")
GEN = "<|im_assistant|>assistant<|im_middle|>"


def test_render_matches_the_published_layout():
  assert chat.render(ASK, WEATHER) == DECLARE + SYSTEM + USER + GEN
  dialog = ASK + [
      {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
          "name": "get_weather", "arguments": "{\"city\": \"Beijing\"}"}}]},
      {"role": "tool", "tool_call_id": "functions.get_weather:0", "name": "get_weather",
       "content": "{\"weather\": \"Sunny\"}"}]
  assert chat.render(dialog, WEATHER) == (
      DECLARE + SYSTEM + USER + GEN + CALL + "<|im_end|>" +
      "<|im_system|>get_weather<|im_middle|>## Return of functions.get_weather:0\n"
      "{\"weather\": \"Sunny\"}<|im_end|>" + GEN)
  # an explicit system turn replaces the default; no tools, no declaration turn
  own = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
  assert chat.render(own, add_generation_prompt=False) == (
      "<|im_system|>system<|im_middle|>Be brief.<|im_end|><|im_user|>user<|im_middle|>hi<|im_end|>")


def test_call_ids_count_over_the_dialog_and_parse_back():
  calls = [{"function": {"name": "add", "arguments": {"a": 1, "b": "}{\n"}}},
           {"function": {"name": "mul", "arguments": {"x": [1, {"y": "<|tool_call_end|>"}]}}}]
  dialog = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "ok",
                                                "tool_calls": calls}]
  text = chat.render(dialog, add_generation_prompt=False)
  turn = text.split(GEN)[-1]
  content, parsed = chat.parse_tool_calls(turn)
  assert content == "ok"
  assert [(c["id"], c["name"], c["arguments"]) for c in parsed] == [
      ("functions.add:0", "add", {"a": 1, "b": "}{\n"}),
      ("functions.mul:1", "mul", {"x": [1, {"y": "<|tool_call_end|>"}]})]


@pytest.mark.parametrize("text,content,names", [
    ("no calls here<|im_end|>", "no calls here", []),
    ("Let me check.\n" + CALL, "Let me check.", ["get_weather"]),
    # the singular spelling some deployments emit
    CALL.replace("tool_calls_section", "tool_call_section").join(["", ""]) and
    (CALL.replace("tool_calls_section", "tool_call_section"), "", ["get_weather"]),
    # a section opened inside a think block still counts; the reasoning is not content
    ("<think>plan " + CALL[:-len("<|tool_calls_section_end|>")], "", ["get_weather"]),
    # ... and the text after the block's </think> is content
    ("<think>plan " + CALL + " still thinking</think>The answer follows.", "The answer follows.",
     ["get_weather"]),
    # a section opened inside a think block and never closed ends with the block: the text
    # after </think> is the answer (it was dropped as part of a cut section)
    ("<think>plan " + CALL[:-len("<|tool_calls_section_end|>")] + "</think>Final answer 42.",
     "Final answer 42.", ["get_weather"]),
    # ... also when the block ends inside a call's arguments (the cut call is dropped)
    ("<think>plan <|tool_calls_section_begin|><|tool_call_begin|>functions.f:0"
     "<|tool_call_argument_begin|>{\"a\": </think>Final answer 42.", "Final answer 42.", []),
    # text after a section outside any think block is content
    ("Checking. " + CALL + " Done.", "Checking.\nDone.", ["get_weather"]),
    # cut off by the token limit inside the second call's arguments: the first call survives
    (CALL[:-len("<|tool_calls_section_end|>")] + "<|tool_call_begin|>functions.f:1"
     "<|tool_call_argument_begin|>{\"a\": [1, ", "", ["get_weather"]),
])
def test_parser_handles_real_output(text, content, names):
  got_content, calls = chat.parse_tool_calls(text)
  assert got_content == content and [c["name"] for c in calls] == names


def test_raw_control_characters_in_json_strings_are_kept():
  """A code argument written with a literal newline and tab (not JSON-escaped): the call is
  read, the characters kept, instead of every call of the turn being dropped."""
  text = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.run:0"
          "<|tool_call_argument_begin|>{\"code\": \"for i in x:\n\tprint(i)\"}<|tool_call_end|>"
          "<|tool_calls_section_end|>")
  assert "\n" in text and "\\n" not in text
  _, calls = chat.parse_tool_calls(text)
  assert calls[0]["arguments"] == {"code": "for i in x:\n\tprint(i)"}


@pytest.mark.parametrize("text,fragment", [
    ("<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>"
     "{\"a\": 1,}<|tool_call_end|><|tool_calls_section_end|>", "tool call 0 (functions.f:0): "
     "arguments are not JSON"),
    ("<|tool_calls_section_begin|><|tool_call_begin|>get weather<|tool_call_argument_begin|>{}"
     "<|tool_call_end|><|tool_calls_section_end|>", "is not functions.NAME:INDEX"),
    ("<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>"
     "[1, 2]<|tool_call_end|><|tool_calls_section_end|>", "must be a JSON object"),
])
def test_malformed_calls_are_named_errors(text, fragment):
  with pytest.raises(chat.ToolCallParseError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
    chat.parse_tool_calls(text)


def write_bpe(tmp_path):
  ranks = [bytes([b]) for b in range(256)] + [b"th", b"the", b" the"]
  path = tmp_path / "tiny.tiktoken"
  path.write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % r for r, t in enumerate(ranks)))
  return str(path)


def test_encode_places_k2_special_ids_and_masks_assistant_tokens(tmp_path):
  tok = get_tokenizer(write_bpe(tmp_path))
  dialog = ASK + [{"role": "assistant", "content": "Sunny."}]
  ids = chat.encode(dialog, WEATHER, add_generation_prompt=False, tokenizer=tok)
  sp = tok.special_ids
  assert ids[0] == tok.bos_id and ids.count(sp["<|im_end|>"]) == 4
  assert tok.decode(ids[1:], specials=True) == chat.render(dialog, WEATHER, add_generation_prompt=False)
  ids2, mask = chat.encode_with_mask(dialog, WEATHER, tokenizer=tok)
  assert ids2 == ids
  trained = [i for i, m in zip(ids2, mask) if m]
  assert tok.decode(trained, specials=True) == "Sunny.<|im_end|>"
  # the byte tokenizer keeps markers as text
  ids_b, mask_b = chat.encode_with_mask(dialog, WEATHER, tokenizer=ByteTokenizer())
  assert ByteTokenizer().decode([i for i, m in zip(ids_b, mask_b) if m]) == "Sunny.<|im_end|>"


def _valid(args, schema):
  """A small JSON-schema check for the schemas used here (type, enum, bounds, required)."""
  if set(schema.get("required", [])) - set(args) or (
      schema.get("additionalProperties") is False and set(args) - set(schema["properties"])):
    return False
  for k, v in args.items():
    s = schema["properties"][k]
    if s["type"] == "integer" and not (isinstance(v, int) and s.get("minimum", -1e18) <= v <=
                                       s.get("maximum", 1e18)):
      return False
    if s["type"] == "string" and not (isinstance(v, str) and v in s.get("enum", [v])
                                      and len(v) <= s.get("maxLength", 1e9)):
      return False
  return True


TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                              "b": {"type": "integer", "minimum": 0, "maximum": 99}},
             "required": ["a", "b"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "convert", "parameters": {
             "type": "object", "properties": {"unit": {"type": "string", "enum": ["km", "mi"]},
                                              "value": {"type": "integer", "minimum": 0}},
             "required": ["unit", "value"], "additionalProperties": False}}}]


@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_constraint_makes_a_random_sampler_emit_valid_calls(tmp_path, tokenizer):
  tok = ByteTokenizer() if tokenizer == "byte" else get_tokenizer(write_bpe(tmp_path))
  schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
  for seed in range(4):
    c = chat.ToolCallConstraint(tok, TOOLS, max_calls=2)
    rng = np.random.default_rng(seed)
    ids = []
    while len(ids) < 400:
      nxt = int(rng.choice(np.flatnonzero(c(0, ids))))   # uniform over the allowed tokens
      if nxt == tok.eos_id:
        break
      ids.append(nxt)
    text = tok.decode(ids, specials=True) if tokenizer == "bpe" else tok.decode(ids)
    assert text.endswith("<|im_end|>"), text
    _, calls = chat.parse_tool_calls(text)
    assert 1 <= len(calls) <= 2
    assert all(_valid(c_["arguments"], schemas[c_["name"]]) for c_ in calls), calls


def test_streamed_calls_only_grow_into_the_parsed_calls():
  """Every prefix of a section (as a stream sees it) shows each call's arguments as a prefix
  of the finished raw JSON, marker lookalikes and whitespace inside strings included; the
  whole section shows exactly what parse_tool_calls returns."""
  text = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.web.search:0"
          "<|tool_call_argument_begin|> {\"q\": \"a <|tool_call_end|> b\",\n \"n\": 3}  "
          "<|tool_call_end|><|tool_call_begin|>functions.add:1<|tool_call_argument_begin|>"
          "{\"a\": 1, \"b\": [2, {\"c\": \"}\"}]}<|tool_call_end|><|tool_calls_section_end|>")
  _, calls = chat.parse_tool_calls(text)
  final = [(c["name"], c["raw"]) for c in calls]
  assert [n for n, _ in final] == ["web.search", "add"]
  shown_before = []
  for cut in range(len(text) + 1):
    shown = chat.streamed_calls(text[:cut])
    assert len(shown) >= len(shown_before)
    for k, c in enumerate(shown):
      assert c["name"] == final[k][0] and final[k][1].startswith(c["arguments"])
      if k < len(shown_before):
        assert c["arguments"].startswith(shown_before[k]["arguments"])
    shown_before = shown
  assert [(c["name"], c["arguments"]) for c in shown_before] == final
  assert all(c["done"] for c in shown_before)
