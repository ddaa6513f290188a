"""RL environments (report 3.2.1): a prompt source and a scorer, verifiable where possible.

    env = make("arithmetic")
    tasks = env.tasks(random.Random(0), 8)              # Task: messages, budget, answer data
    rewards = env.score_group(tasks[0], ["... = 42", "41"])

An environment gives tasks (a chat prompt, a maximum token budget, and whatever its scorer
needs) and scores a task's K responses together (`score_group`, so a judge can rank them
against each other); rewards lie in [0, 1]. An environment with `tools` lets the policy call
them: the rollout loop renders the call's result as a tool message and lets the policy go on
(multi-turn tool use), and scores the final answer.

Environments here: arithmetic with a verifiable integer answer; the 24 game, checked by
parsing the expression (ast, numbers and + - * / only, exact rational arithmetic); code
with unit tests run in the sandbox (k2jax.rl.sandbox); and the self-critique rubric reward
(report 3.2.2), where a judge model - the policy itself by default - ranks responses against
rubrics.
"""

import ast
import dataclasses
import fractions
import itertools
import random
import re
from collections.abc import Callable, Sequence
from typing import Any, Protocol

# the arithmetic problems' split, operators and calculator tool live with the data (SFT's
# dialogs draw from them too); envs.OPS, envs.CALCULATOR, ... keep working
from k2jax.data.arithmetic import (CALCULATOR, HELDOUT_EVERY, OPS, SPLITS,  # noqa: F401
                                   arithmetic_split, check_ops, draw_problem)
from k2jax.rl import sandbox


@dataclasses.dataclass
class Task:
  """One prompt: chat messages (k2jax.serving.chat format), a token budget, and the scorer's data."""
  env: str
  messages: list[dict]
  budget: int
  data: dict = dataclasses.field(default_factory=dict)


class Environment(Protocol):
  name: str
  tools: list[dict] | None

  def tasks(self, rng: random.Random, n: int) -> list[Task]:
    """n tasks drawn with rng."""

  def score_group(self, task: Task, responses: Sequence[str]) -> list[float]:
    """Rewards in [0, 1] of the task's responses (the final assistant text of each)."""

  def call_tool(self, name: str, arguments: dict) -> str:
    """The result of a tool call (environments with tools)."""


class _PerResponse:
  """score_group from a per-response score."""
  tools = None

  def score(self, task: Task, response: str) -> float:
    raise NotImplementedError

  def score_group(self, task, responses):
    return [float(self.score(task, r)) for r in responses]

  def call_tool(self, name, arguments):
    raise ValueError(f"{self.name} has no tools (called {name!r})")


_INT = re.compile(r"-?\d+")


def last_integer(text: str) -> int | None:
  found = _INT.findall(text)
  return int(found[-1]) if found else None


class Arithmetic(_PerResponse):
  """'What is a op b?' with the integer answer checked exactly (the last integer in the
  response). With use_tools, a calculator tool is offered (the SFT data teaches its use).
  split: the problems drawn, 'train' (training), 'heldout' (evaluation) or 'all'; ops: the
  operators drawn (a subset of "+-*"; "+" with max_operand 99 is two-digit addition, where
  held-out problems share the digit-and-carry procedure with the training ones instead of
  being separate facts)."""
  name = "arithmetic"

  def __init__(self, max_operand: int = 99, budget: int = 48, use_tools: bool = False,
               split: str = "train", ops: str = OPS):
    if split not in SPLITS:
      raise ValueError(f"arithmetic split {split!r}: choose one of {', '.join(SPLITS)}")
    self.ops = check_ops(ops)
    self.max_operand, self.budget, self.split = max_operand, budget, split
    if use_tools:
      self.tools = CALCULATOR

  def _in_split(self, expr: str) -> bool:
    return self.split == "all" or arithmetic_split(expr) == self.split

  def _task(self, expr: str) -> Task:
    return Task(self.name, [{"role": "user", "content": f"What is {expr}?"}], self.budget,
                {"answer": _eval_int(expr)})

  def tasks(self, rng, n):
    return [self._task(draw_problem(rng, self.max_operand, self.ops, self.split))
            for _ in range(n)]

  def all_tasks(self) -> list[Task]:
    """Every problem of the split once, in a fixed order (an evaluation set without repeats)."""
    r = range(self.max_operand + 1)
    return [self._task(e) for e in (f"{a} {op} {b}" for a in r for op in self.ops for b in r)
            if self._in_split(e)]

  def score(self, task, response):
    return float(last_integer(response) == task.data["answer"])

  def call_tool(self, name, arguments):
    if name != "calculator":
      raise ValueError(f"unknown tool {name!r}")
    try:
      return str(evaluate(str(arguments.get("expression", "")), allowed_numbers=None))
    except ValueError as e:
      return f"error: {e}"


def _eval_int(expr: str) -> int:
  return int(evaluate(expr, allowed_numbers=None))


_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
        ast.Mult: lambda a, b: a * b, ast.Div: lambda a, b: a / b}


def evaluate(expr: str, allowed_numbers: Sequence[int] | None) -> fractions.Fraction:
  """The exact value of an arithmetic expression of integers, + - * / and parentheses.

  Parsed with ast (never eval): anything else (names, calls, powers, floats) raises
  ValueError. With allowed_numbers, the expression must use exactly those integers (as a
  multiset), each once - the 24 game's rule.
  """
  try:
    tree = ast.parse(expr.strip(), mode="eval")
  except SyntaxError:
    raise ValueError(f"not an expression: {expr!r}") from None
  used = []

  def walk(node):
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
      a, b = walk(node.left), walk(node.right)
      if isinstance(node.op, ast.Div) and b == 0:
        raise ValueError("division by zero")
      return _OPS[type(node.op)](a, b)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and \
        allowed_numbers is None:
      return -walk(node.operand)
    if isinstance(node, ast.Constant) and type(node.value) is int:
      used.append(node.value)
      return fractions.Fraction(node.value)
    raise ValueError(f"not allowed in the expression: {ast.dump(node)[:40]}")

  value = walk(tree.body)
  if allowed_numbers is not None and sorted(used) != sorted(allowed_numbers):
    raise ValueError(f"uses {sorted(used)}, not each of {sorted(allowed_numbers)} once")
  return value


def solvable_24(numbers: Sequence[int]) -> bool:
  """Brute force over orders, operators and bracketings (exact rationals)."""
  def values(xs):
    if len(xs) == 1:
      return {xs[0]}
    out = set()
    for i in range(1, len(xs)):
      for a in values(xs[:i]):
        for b in values(xs[i:]):
          out |= {a + b, a - b, a * b}
          if b != 0:
            out.add(a / b)
    return out
  return any(24 in values([fractions.Fraction(x) for x in p])
             for p in set(itertools.permutations(numbers)))


class Game24(_PerResponse):
  """Four numbers 1..13; the response's last line (after an optional 'Answer:' or '=') must
  be an expression using each number once that equals 24."""
  name = "game24"

  def __init__(self, budget: int = 64):
    self.budget = budget

  def tasks(self, rng, n):
    out = []
    while len(out) < n:
      nums = [rng.randint(1, 13) for _ in range(4)]
      if solvable_24(nums):
        q = (f"Use the numbers {', '.join(map(str, nums))} each exactly once with + - * / "
             "and parentheses to make 24. Give the expression.")
        out.append(Task(self.name, [{"role": "user", "content": q}], self.budget,
                        {"numbers": nums}))
    return out

  @staticmethod
  def expression(response: str) -> str:
    lines = [x for x in response.strip().splitlines() if x.strip()]
    line = lines[-1] if lines else ""
    line = line.split("Answer:")[-1]
    return line.split("=")[0].strip().strip("`$. ")

  def score(self, task, response):
    try:
      return float(evaluate(self.expression(response), task.data["numbers"]) == 24)
    except (ValueError, ZeroDivisionError, RecursionError):
      return 0.0


CODE_PROBLEMS = (
    ("Read a line and print it reversed.", [("abc\n", "cba"), ("racecar\n", "racecar")]),
    ("Read two integers on one line and print their sum.", [("2 3\n", "5"), ("-4 10\n", "6")]),
    ("Read an integer n and print n factorial.", [("0\n", "1"), ("5\n", "120")]),
    ("Read a line of words and print how many there are.", [("a b c\n", "3"), ("x\n", "1")]),
    ("Read an integer n and print the n-th Fibonacci number (F(0)=0, F(1)=1).",
     [("0\n", "0"), ("10\n", "55")]),
)


class Code(_PerResponse):
  """Write a program; reward = the fraction of its unit tests (stdin -> expected stdout)
  that pass in the sandbox. The program is the response's last ```python block, or the
  whole response without one."""
  name = "code"

  def __init__(self, problems=CODE_PROBLEMS, budget: int = 256, timeout_s: float = 2.0,
               memory_mb: int = 256, isolation: str = "namespaces"):
    """isolation: the sandbox's ("namespaces", or the opt-in "limits" where namespaces cannot
    start: k2jax.rl.sandbox); SandboxUnavailable here, before training, if it cannot start."""
    self.problems, self.budget = list(problems), budget
    self.timeout_s, self.memory_mb = timeout_s, memory_mb
    self.isolation = sandbox.check(isolation)

  def tasks(self, rng, n):
    out = []
    for _ in range(n):
      text, tests = rng.choice(self.problems)
      q = f"{text} Answer with a Python program in a ```python block."
      out.append(Task(self.name, [{"role": "user", "content": q}], self.budget,
                      {"tests": [list(t) for t in tests]}))
    return out

  @staticmethod
  def program(response: str) -> str:
    blocks = re.findall(r"```(?:python|py)?\n(.*?)```", response, re.S)
    return blocks[-1] if blocks else response

  def score(self, task, response):
    code = self.program(response)
    tests = task.data["tests"]
    passed = 0
    for stdin, expected in tests:
      r = sandbox.run(code, stdin=stdin, timeout_s=self.timeout_s, memory_mb=self.memory_mb,
                      isolation=self.isolation)
      passed += int(r.ok and r.stdout.strip() == expected.strip())
    return passed / len(tests)


# A judge: fn(question, responses, rubrics) -> one score per response (higher is better).
Judge = Callable[[str, Sequence[str], Sequence[str]], Sequence[float]]

RUBRICS = ("The response answers the question that was asked.",
           "The response is concise and does not repeat itself.",
           "The response states facts only when it is confident of them.")

OPEN_PROMPTS = ("Explain what a prime number is.", "Give one tip for writing clear code.",
                "Why is the sky blue?", "Describe a cat in one sentence.",
                "What does a compiler do?", "Name a good habit for learning.")


class SelfCritique:
  """The self-critique rubric reward (report 3.2.2): for prompts without a verifiable answer,
  a judge compares the K responses against rubrics; the rewards are their ranks scaled to
  [0, 1] (best 1, worst 0, ties shared). The judge is pluggable; k2jax.rl.train installs the
  policy itself (PolicyJudge) by default, the report's setup."""
  name = "self_critique"
  tools = None

  def __init__(self, prompts: Sequence[str] = OPEN_PROMPTS, rubrics: Sequence[str] = RUBRICS,
               judge: Judge | None = None, budget: int = 64):
    self.prompts, self.rubrics, self.judge, self.budget = list(prompts), list(rubrics), judge, \
        budget

  def tasks(self, rng, n):
    return [Task(self.name, [{"role": "user", "content": rng.choice(self.prompts)}],
                 self.budget, {}) for _ in range(n)]

  def score_group(self, task, responses):
    if self.judge is None:
      raise ValueError("self_critique needs a judge (k2jax.rl.train sets the policy as judge)")
    scores = list(self.judge(task.messages[-1]["content"], responses, self.rubrics))
    return rank_rewards(scores)

  def call_tool(self, name, arguments):
    raise ValueError(f"self_critique has no tools (called {name!r})")


def rank_rewards(scores: Sequence[float]) -> list[float]:
  """Scores -> ranks in [0, 1]: best 1, worst 0, tied scores share their mean rank."""
  n = len(scores)
  if n == 1:
    return [0.5]
  order = sorted(range(n), key=lambda i: scores[i])
  ranks = [0.0] * n
  i = 0
  while i < n:
    j = i
    while j + 1 < n and scores[order[j + 1]] == scores[order[i]]:
      j += 1
    for t in range(i, j + 1):
      ranks[order[t]] = (i + j) / 2 / (n - 1)
    i = j + 1
  return ranks


ENVIRONMENTS: dict[str, Callable[..., Any]] = {
    "arithmetic": Arithmetic, "game24": Game24, "code": Code, "self_critique": SelfCritique}


def make(name: str, **kwargs):
  if name not in ENVIRONMENTS:
    raise ValueError(f"unknown environment {name!r}; choose from {', '.join(ENVIRONMENTS)}")
  return ENVIRONMENTS[name](**kwargs)
