"""Scripted models that play every role of the pipelines the way a cooperative model would:
dry runs of the plumbing, cost estimates (experiments/synth_cost.py), tests, samples.

    ScriptedClient(faithful)                 # rephrase / math: rewrites keep their source
    ScriptedClient(agent_model())            # agentic: evolver, task writer, user, agent,
                                             # tool simulator and judge

They recognise a request by the pipelines' own prompt wording, which is why they live beside
the pipelines: a prompt reworded here without them fails the tests that use them.
"""

import json
import re

from k2jax.synth.client import Request


def faithful(request: Request, prefix: str = "") -> str:
  """Rewrites return the passage they were given (after `prefix`); the fidelity judge
  scores 9."""
  text = request.messages[-1]["content"]
  if "Does the rewrite state every fact" in text:
    return '{"score": 9, "missing": [], "invented": []}'
  return prefix + re.findall(r"<<<\n(.*?)\n>>>", text, re.S)[-1]


def example_value(schema: dict):
  """A small value that fits a JSON schema of the kinds tool specs use (type, enum, const,
  properties / required, items / minItems, minimum / maximum)."""
  if "const" in schema:
    return schema["const"]
  if schema.get("enum"):
    return schema["enum"][0]
  kind = schema.get("type", "string")
  if isinstance(kind, list):
    kind = next((k for k in kind if k != "null"), "null")
  if kind in ("integer", "number"):
    lo, hi = schema.get("minimum", 1), schema.get("maximum")
    v = lo if hi is None else min(lo, hi)
    return int(v) if kind == "integer" else float(v)
  if kind == "boolean":
    return True
  if kind == "null":
    return None
  if kind == "array":
    return [example_value(schema.get("items", {}))] * schema.get("minItems", 1)
  if kind == "object":
    return {k: example_value(v) for k, v in schema.get("properties", {}).items()}
  return "example"


def _call(name: str, args: dict, index: int = 0) -> str:
  """K2's tool-call section for one call (what the agent model emits)."""
  return ("<|tool_calls_section_begin|><|tool_call_begin|>functions." + name + f":{index}"
          "<|tool_call_argument_begin|>" + json.dumps(args) +
          "<|tool_call_end|><|tool_calls_section_end|>")


def agent_model(*, call: str | None = None, arguments: dict | None = None,
                verdict: bool = True, sim_json: bool = True):
  """fn(Request) -> str playing every part of the agentic pipeline:

    evolver          categories ["finance", "travel"], domain ["budgeting"], and the tools
                     convert_currency({amount: number}) and an unusable "bad name!"
    task writer      a task and the rubric ["calls a tool", "reports the result"]
    user simulator   asks once, then says DONE once the assistant reported a result
    agent            calls `call` (default: its first tool) with `arguments` (default: a
                     value that fits the tool's schema), then reports the tool's result
    tool simulator   {"result": {"ok": true}, "state": calls counted} (not JSON: sim_json=False)
    judge            pass = `verdict`
  """
  def fn(r: Request) -> str:
    text = r.messages[-1]["content"] or ""
    if "Name broad categories" in text:
      return '["finance", "travel"]'
    if "Name specific application domains" in text:
      return '["budgeting"]'
    if "Design" in text and "tools" in text:
      return json.dumps([{"name": "convert_currency", "description": "convert",
                          "parameters": {"type": "object", "properties": {
                              "amount": {"type": "number"}}}}, {"name": "bad name!"}])
    if "Write one realistic request" in text:
      return ('{"task": "run the tool for me and tell me what it returns", '
              '"rubric": ["calls a tool", "reports the result"]}')
    if "You play a user" in text:
      return "DONE" if "assistant: The result is" in text else "Please run it for me."
    if "You simulate the tool" in text:
      if not sim_json:
        return "sure!"
      state = json.loads(re.search(r"Its state so far: (.*)", text)[1])
      return json.dumps({"result": {"ok": True},
                         "state": {"calls": state.get("calls", 0) + 1}})
    if "meet every rubric item" in text:
      return json.dumps({"pass": verdict, "failed": [] if verdict else ["reports the result"],
                         "reason": "checked against the rubric"})
    if r.tools:                                   # the agent
      results = [m for m in r.messages if m["role"] == "tool"]
      if results:
        return "The result is " + results[-1]["content"]
      tool = next((t for t in r.tools if t["function"]["name"] == call), r.tools[0])
      args = example_value(tool["function"]["parameters"]) if arguments is None else arguments
      return _call(call or tool["function"]["name"], args)
    raise ValueError(f"agent_model: a request it does not script: {text[:80]!r}")
  return fn
