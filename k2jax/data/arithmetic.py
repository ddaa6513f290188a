"""Arithmetic problems "a op b" split once into train and held-out parts, shared by RL's
arithmetic environment (k2jax.rl.envs) and SFT's generated dialogs (k2jax.sft), so neither
trains on a problem the other evaluates on; and the calculator tool both offer.

    draw_problem(random.Random(0), 9, "+-*", "train")    # -> e.g. "3 * 7"
"""

import random
import zlib

# Held-out arithmetic. One-digit problems number only 300, so problems drawn at random for
# evaluation were seen in training. Each problem "a op b" belongs to one part by a stable hash
# of its text (crc32, not Python's per-process salted hash): the same partition in every
# process and at every operand range. Training draws (RL tasks, k2jax.sft's dialogs) take the
# train part, evaluation the held-out one (1 in 4: 78 of the one-digit problems).
HELDOUT_EVERY = 4
SPLITS = ("train", "heldout", "all")
OPS = "+-*"
# The calculator tool Arithmetic(use_tools=True) offers and k2jax.sft's dialogs call.
CALCULATOR = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}]


def check_ops(ops: str) -> str:
  """ops, if it is a non-empty string of distinct operators from OPS."""
  if not ops or set(ops) - set(OPS) or len(set(ops)) != len(ops):
    raise ValueError(f"arithmetic ops {ops!r}: give distinct operators from '{OPS}', e.g. '+'")
  return ops


def arithmetic_split(expr: str) -> str:
  """'train' or 'heldout': the part the problem `expr` ("a op b") belongs to."""
  return "heldout" if zlib.crc32(expr.encode()) % HELDOUT_EVERY == 0 else "train"


def draw_problem(rng: random.Random, max_operand: int, ops: str, split: str) -> str:
  """A problem "a op b" of `split` (operands 0..max_operand, op from ops), drawn with rng:
  one of the other part is drawn again. RL's tasks and k2jax.sft's dialogs both draw here,
  so neither can reach the held-out part."""
  while True:
    a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
    expr = f"{a} {rng.choice(ops)} {b}"
    if split == "all" or arithmetic_split(expr) == split:
      return expr
