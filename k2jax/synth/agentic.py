"""Agentic tool-use data (report 3.1.1, Figure 8): tools, agents, rubric tasks, simulated
multi-turn trajectories, and a judge that keeps only those meeting their rubric.

  1. Tool repository. Specs from JSON files (OpenAI function tools, or MCP `tools/list`
     entries {name, description, inputSchema}), plus tools synthesized by hierarchical domain
     evolution: the model proposes categories, then domains within each, then tools per domain
     with JSON-schema parameters (`evolve_tools`). A spec may carry Python source under
     "x-k2jax-code" (a `run(args) -> result` function): such a tool is executed for real in
     `k2jax.rl.sandbox` instead of being simulated.
  2. Agents: a system prompt over a tool subset sampled from one domain (`make_agent`).
  3. Tasks with rubrics: the model writes a task the agent's tools can serve, and the checks
     a good trajectory passes (`make_task`).
  4. Trajectories (`simulate`): a user simulator (the model playing a sampled persona, who
     knows the task and says DONE when satisfied), the agent (the model with the tools), and a
     tool simulator that keeps a JSON state across calls and is told each call's outcome,
     drawn with controlled stochasticity: success, partial failure, or an edge case.
  5. Judge (`judge`): the model grades the trajectory against the rubric (JSON); failing or
     unparseable verdicts are dropped and counted.

Output: chat records {"messages", "tools", ...provenance} in the shape `k2jax.sft` reads (the
K2 tool-call format is what `k2jax.serving.chat` renders them into). Failures that make an item
unusable (an unknown tool called, arguments outside the tool's JSON schema, malformed JSON
from a simulator or judge) raise `rephrase.Dropped` with the reason, so the CLI counts them.
"""

import dataclasses
import glob
import json
import random
import re
import threading

import jsonschema

from k2jax.synth.client import Client, Request
from k2jax.synth.rephrase import Dropped
from k2jax.synth.store import extract_json, item_seed

PERSONAS = [
    "a busy professional who writes short messages and wants results fast",
    "a careful beginner who asks for each step to be explained",
    "a skeptical user who double-checks numbers and pushes back on vague answers",
    "a non-native English speaker who writes simply and sometimes imprecisely",
    "an expert who uses the field's jargon and expects the same back",
]
OUTCOMES = (("success", 0.7), ("partial failure", 0.15), ("edge case", 0.15))
_NAME_OK = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
# One code tool at a time: run as root, k2jax.rl.sandbox ends each program by killing every
# process of its sandbox uid, so runs from concurrent items killed each other (signal 9).
_SANDBOX_LOCK = threading.Lock()


# ------------------------------------------------------------------------------ tools


def normalize_tool(spec: dict, domain: str | None = None) -> dict:
  """An OpenAI-style function tool from an OpenAI or MCP spec; ValueError if unusable."""
  fn = spec.get("function", spec) if isinstance(spec, dict) else None
  if not isinstance(fn, dict) or not _NAME_OK.fullmatch(str(fn.get("name", ""))):
    raise ValueError(f"tool {str(spec)[:60]!r}: needs a name of letters, digits and _")
  params = fn.get("parameters", fn.get("inputSchema", {"type": "object", "properties": {}}))
  if not isinstance(params, dict) or params.get("type", "object") != "object":
    raise ValueError(f"tool {fn['name']}: parameters must be a JSON schema of type object")
  try:
    _validator(params)
  except jsonschema.SchemaError as e:
    raise ValueError(f"tool {fn['name']}: parameters are not a valid JSON schema: "
                     f"{e.message}") from None
  out = {"type": "function", "function": {"name": fn["name"],
                                          "description": str(fn.get("description", "")),
                                          "parameters": params}}
  extra = {k: v for k, v in {"domain": domain or spec.get("x-k2jax-domain"),
                             "code": spec.get("x-k2jax-code")}.items() if v}
  return {**out, **{f"x-k2jax-{k}": v for k, v in extra.items()}}


def _validator(schema: dict):
  """A validator of call arguments (jsonschema.SchemaError if the schema is not one).
  The call's top-level names must be declared properties unless the schema says otherwise:
  JSON Schema allows undeclared names by default, but a function called with a parameter it
  does not have (convert_currency({"text": ...}) for {amount}) is a wrong call, and OpenAI's
  strict tool mode makes the same rule."""
  if "properties" in schema and "additionalProperties" not in schema:
    schema = {**schema, "additionalProperties": False}
  cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
  cls.check_schema(schema)
  return cls(schema)


def argument_errors(tool: dict, args) -> list[str]:
  """What is wrong with a call's arguments under the tool's schema ([] when they fit)."""
  v = _validator(tool["function"]["parameters"])
  return [f"{'/'.join(map(str, e.absolute_path)) or 'arguments'}: {e.message}"
          for e in sorted(v.iter_errors(args), key=lambda e: list(map(str, e.absolute_path)))]


def load_tools(pattern: str) -> list[dict]:
  """Tool specs from JSON files (a list, {"tools": [...]}, or one spec per file)."""
  tools = []
  for path in sorted(glob.glob(pattern)):
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
    items = data.get("tools", [data]) if isinstance(data, dict) else data
    domain = data.get("domain") if isinstance(data, dict) else None
    tools += [normalize_tool(t, domain) for t in items]
  return tools


def public(tool: dict) -> dict:
  """The spec as the agent sees it (no domain / code)."""
  return {"type": "function", "function": tool["function"]}


def _ask_json(client: Client, prompt: str, seed: int, what: str, max_tokens: int = 1024):
  reply = client.chat(Request(messages=[{"role": "user", "content": prompt}], temperature=0.9,
                              max_tokens=max_tokens, seed=seed))
  try:
    return extract_json(reply.content)
  except ValueError as e:
    raise Dropped(f"malformed JSON from the {what}: {e}") from None


def evolve_tools(client: Client, *, categories: int, domains: int, tools: int, seed: int,
                 log=None) -> list[dict]:
  """Tools by hierarchical domain evolution: categories -> domains -> tools (JSON schemas).
  A level whose reply is malformed loses that branch (logged), not the run."""
  out: list[dict] = []

  def names(prompt, key, n):
    got = _ask_json(client, f"{prompt} Reply with a JSON list of {n} short names.", key, "evolver")
    return [str(g) for g in got][:n] if isinstance(got, list) else []

  for cat in _safe(lambda: names("Name broad categories of real-world tasks that software "
                                 "tools help people with.", item_seed(seed, "cat"), categories),
                   log):
    for dom in _safe(lambda: names(f"Name specific application domains within {cat!r}.",
                                   item_seed(seed, cat), domains), log):
      specs = _safe(lambda: _ask_json(
          client, f"Design {tools} tools (API functions) an assistant for the domain {dom!r} "
          "would call. Reply with a JSON list of {\"name\": snake_case, \"description\": ..., "
          "\"parameters\": JSON schema of type object}.", item_seed(seed, cat, dom), "evolver",
          2048), log)
      for spec in specs if isinstance(specs, list) else []:
        try:
          out.append(normalize_tool(spec, f"{cat} / {dom}"))
        except ValueError as e:
          if log:
            log(f"evolved tool dropped: {e}")
  return out


def _safe(fn, log):
  try:
    return fn()
  except Dropped as e:
    if log:
      log(str(e))
    return []


# ------------------------------------------------------------------------- agents, tasks


@dataclasses.dataclass
class Agent:
  domain: str
  tools: list[dict]
  system: str


def make_agent(tools: list[dict], rng: random.Random, max_tools: int = 4) -> Agent:
  """A system prompt over up to max_tools tools of one domain (drawn by rng)."""
  domains = sorted({t.get("x-k2jax-domain", "general") for t in tools})
  domain = rng.choice(domains)
  pool = [t for t in tools if t.get("x-k2jax-domain", "general") == domain]
  chosen = rng.sample(pool, min(max_tools, len(pool)))
  names = ", ".join(t["function"]["name"] for t in chosen)
  return Agent(domain, chosen, f"You are an assistant for {domain}. You can call these tools: "
               f"{names}. Call a tool when it helps, read its result, and tell the user plainly "
               "what happened, including failures.")


def make_task(client: Client, agent: Agent, seed: int, max_tokens: int = 1024) -> dict:
  """{"task": what the user wants, "rubric": [checks]} (Dropped when malformed)."""
  specs = json.dumps([public(t) for t in agent.tools], ensure_ascii=False)
  got = _ask_json(client, f"Tools: {specs}\nWrite one realistic request a user of {agent.domain!r}"
                  " would make that needs these tools, and a rubric: 2-5 checks a good assistant"
                  ' conversation passes. Reply with JSON {"task": ..., "rubric": [...]}.', seed,
                  "task writer", max_tokens)
  if (not isinstance(got, dict) or not isinstance(got.get("task"), str)
      or not isinstance(got.get("rubric"), list) or not got["rubric"]):
    raise Dropped("malformed JSON from the task writer: needs task and a non-empty rubric")
  return {"task": got["task"], "rubric": [str(r) for r in got["rubric"]]}


# --------------------------------------------------------------------------- simulation


def _outcome(rng: random.Random) -> str:
  x, acc = rng.random(), 0.0
  for name, p in OUTCOMES:
    acc += p
    if x < acc:
      return name
  return OUTCOMES[-1][0]


def run_tool(client: Client, tool: dict, args: dict, state: dict, rng: random.Random,
             seed: int, sandbox_run=None, max_tokens: int = 1024) -> tuple[str, dict]:
  """(result text, new state) of one call: executed in the sandbox when the tool has code,
  else simulated by the model under a drawn outcome with the state it keeps."""
  name = tool["function"]["name"]
  if tool.get("x-k2jax-code"):
    if sandbox_run is None:
      from k2jax.rl.sandbox import run as sandbox_run
    program = (tool["x-k2jax-code"] + "\nimport json, sys\n"
               "print(json.dumps(run(json.loads(sys.stdin.read())), default=str))\n")
    with _SANDBOX_LOCK:
      r = sandbox_run(program, stdin=json.dumps(args), timeout_s=5.0)
    return (r.stdout.strip() if r.ok else json.dumps(
        {"error": f"{name} failed ({r.reason}): {r.stderr.strip()[-200:]}"})), state
  outcome = _outcome(rng)
  got = _ask_json(client, f"You simulate the tool {name}: {json.dumps(public(tool))}\n"
                  f"Its state so far: {json.dumps(state)}\nCall arguments: {json.dumps(args)}\n"
                  f"Simulate a {outcome} of this call, consistent with the state. Reply with JSON "
                  '{"result": what the tool returns, "state": the updated state}.', seed,
                  "tool simulator", max_tokens)
  if not isinstance(got, dict) or "result" not in got:
    raise Dropped("malformed JSON from the tool simulator: no result")
  new_state = got.get("state") if isinstance(got.get("state"), dict) else state
  result = got["result"]
  return (result if isinstance(result, str) else json.dumps(result, ensure_ascii=False)), new_state


def _user_turn(client: Client, persona: str, task: str, messages: list[dict], seed: int,
               max_tokens: int = 256) -> str:
  seen = "\n".join(f"{m['role']}: {m.get('content') or ''}" for m in messages[1:]
                   if m["role"] in ("user", "assistant"))
  reply = client.chat(Request(messages=[{"role": "user", "content":
      f"You play a user: {persona}. You want: {task}\nConversation so far:\n{seen or '(none)'}\n"
      "Write your next message to the assistant only. If your request is fully handled, reply "
      "with DONE."}], temperature=0.9, max_tokens=min(256, max_tokens), seed=seed))
  return reply.content.strip()


def simulate(client: Client, agent: Agent, task: dict, *, seed: int, max_turns: int = 6,
             sandbox_run=None, max_tokens: int = 1024) -> dict:
  """One trajectory: {"messages", "turns", "tool_calls", "ended"}."""
  rng = random.Random(seed)
  persona = rng.choice(PERSONAS)
  by_name = {t["function"]["name"]: t for t in agent.tools}
  states = {name: {} for name in by_name}
  messages = [{"role": "system", "content": agent.system}]
  first = _user_turn(client, persona, task["task"], messages, item_seed(seed, "user", 0),
                     max_tokens)
  if not first or first.upper() == "DONE":
    raise Dropped("empty: the user simulator opened with nothing")
  messages.append({"role": "user", "content": first})
  calls_made, ended = 0, "max_turns"
  for turn in range(max_turns):
    # a copy: the dialog grows after this turn, a request must stay what was sent
    reply = client.chat(Request(messages=list(messages), tools=[public(t) for t in agent.tools],
                                temperature=0.7, max_tokens=max_tokens,
                                seed=item_seed(seed, "agent", turn)))
    msg = {"role": "assistant", "content": reply.content}
    if reply.tool_calls:
      msg["tool_calls"] = [{"id": c["id"], "type": "function", "function": {
          "name": c["name"], "arguments": c["arguments"]}} for c in reply.tool_calls]
    messages.append(msg)
    if reply.tool_calls:
      for k, c in enumerate(reply.tool_calls):
        tool = by_name.get(c["name"])
        if tool is None:
          raise Dropped(f"unknown tool: the agent called {c['name']!r}")
        if not isinstance(c["arguments"], dict):
          raise Dropped(f"malformed tool call: arguments of {c['name']} are not a JSON object")
        # A call outside the schema would teach SFT wrong calls (and a simulator would play
        # along): the trajectory is dropped and counted, as an unknown tool is.
        if errors := argument_errors(tool, c["arguments"]):
          raise Dropped(f"bad arguments: {c['name']}: {'; '.join(errors)[:160]}")
        result, states[c["name"]] = run_tool(client, tool, c["arguments"], states[c["name"]],
                                             rng, item_seed(seed, "tool", turn, k), sandbox_run,
                                             max_tokens)
        messages.append({"role": "tool", "tool_call_id": c["id"], "name": c["name"],
                         "content": result})
        calls_made += 1
      continue
    nxt = _user_turn(client, persona, task["task"], messages, item_seed(seed, "user", turn + 1),
                     max_tokens)
    if not nxt or nxt.upper().startswith("DONE"):
      ended = "user_done"
      break
    messages.append({"role": "user", "content": nxt})
  if messages[-1]["role"] != "assistant":
    raise Dropped("unfinished: the trajectory does not end with the assistant")
  return {"messages": messages, "persona": persona, "tool_calls": calls_made, "ended": ended}


def judge(client: Client, task: dict, messages: list[dict], seed: int,
          max_tokens: int = 512) -> dict:
  """{"pass": bool, "failed": [rubric items], "reason": str} from the model (Dropped when
  malformed)."""
  shown = json.dumps(messages[1:], ensure_ascii=False)
  got = _ask_json(client, f"Task: {task['task']}\nRubric:\n" + "\n".join(
      f"- {r}" for r in task["rubric"]) + f"\nConversation (JSON): {shown}\nDoes the assistant "
      'meet every rubric item? Reply with JSON {"pass": true|false, "failed": [items], '
      '"reason": "..."}.', seed, "judge", min(512, max_tokens))
  if not isinstance(got, dict) or not isinstance(got.get("pass"), bool):
    raise Dropped("malformed JSON from the judge: no boolean pass")
  return {"pass": got["pass"], "failed": got.get("failed") or [],
          "reason": str(got.get("reason", ""))}


def trajectory(client: Client, tools: list[dict], index: int, *, seed: int, max_tools: int = 4,
               max_turns: int = 6, max_tokens: int = 1024, sandbox_run=None) -> dict:
  """Item `index` of the pipeline: agent, task, simulation, judge -> one kept record.
  max_tokens bounds every reply (a small model's context holds prompt + reply)."""
  s = item_seed(seed, "trajectory", index)
  agent = make_agent(tools, random.Random(s), max_tools)
  task = make_task(client, agent, item_seed(s, "task"), max_tokens)
  sim = simulate(client, agent, task, seed=item_seed(s, "sim"), max_turns=max_turns,
                 sandbox_run=sandbox_run, max_tokens=max_tokens)
  verdict = judge(client, task, sim["messages"], item_seed(s, "judge"), max_tokens)
  if not verdict["pass"]:
    raise Dropped(f"rubric: {'; '.join(map(str, verdict['failed']))[:120] or verdict['reason']}")
  return {"messages": sim["messages"], "tools": [public(t) for t in agent.tools],
          "domain": agent.domain, "task": task["task"], "rubric": task["rubric"],
          "persona": sim["persona"], "tool_calls": sim["tool_calls"], "ended": sim["ended"],
          "judge": verdict}
