"""What XLA's device heap holds at its fullest, by the k2jax source line that made each buffer.

XLA packs every temporary of a compiled program into one heap (its buffer assignment's
"preallocated-temp" allocation); its out-of-memory check is the parameters plus that heap
(k2jax.compile). When the heap is larger than plan's count, the question is which buffers
are in it, and the dump answers it (`k2jax.compile --explain`):

  - the buffer assignment places each value (an HLO instruction's output) at an offset in
    the heap, values that share memory at the same place;
  - the live-range dump gives each value's span in XLA's schedule;
  - the HLO's stack frames name the Python line that traced each instruction.

At the time t the most bytes are live (values sharing a place counted once),

    live(t) = sum over places (offset, size) with a value alive at t of size,

each place is charged to the innermost k2jax (or kernels) frame of one of its values. A
value with no frame of its own borrows one: a while loop's carried value (the body's
parameter, the loop's output) from the loop's initial operand at that index (or the loop's
line, for a buffer XLA allocated); a copy, bitcast or tuple element from its operand; an
instruction XLA made from its first operand that has one. A copy of an entry parameter is
named by the argument's path ("copy of state.params[...]": XLA's copy of a donated
argument, or a host-resident one brought to the device). heap - live(t) is what packing
lost: values of different lifetimes that could not share the heap's space.

The heap is not all of it: a donated argument's buffer is free once the argument's last
reader has run, and XLA places temporaries there. At K2's step XLA:TPU does so on purpose:
the expert stacks are copied into the heap before the tick loop and the loop's float32
gradient sums live in their donated buffers. A "copy of" row is then a move,
not a cost; what the arguments' buffers hold at the heap's fullest moment, other than the
arguments themselves, is charged the same way (`HeapPeak.in_arguments`).
"""

from __future__ import annotations

import collections
import glob
import importlib.util
import os
import re
from typing import NamedTuple


# our source directories: a frame is charged to the innermost one in them (k2jax's and its
# kernels', wherever they are checked out or installed; not optax or jax). Asked of the
# import system, not of this file's depth: the kernels live at the repository's top in a
# checkout and inside k2jax once installed. (find_spec imports k2jax itself, not kernels.)
ROOTS = tuple(os.path.dirname(importlib.util.find_spec(m).origin)
              for m in ("k2jax", "k2jax.kernels"))


class Row(NamedTuple):
  bytes: int
  source: str        # "k2jax/parallel/stage.py:41 layer_at", "copy of state.params[...]"
  example: str       # the shape of one buffer charged to it


class HeapPeak(NamedTuple):
  heap: int          # the heap XLA allocated (bytes)
  live: int          # bytes live at its fullest moment
  time: int          # that moment, in XLA's schedule (the live-range dump's clock)
  rows: list         # [Row], largest first
  in_arguments: list = []   # [Row]: temporaries in the arguments' own buffers at that moment
  arguments: int = 0        # the arguments' device buffers (bytes)
  arguments_live: int = 0   # ... of which live at that moment (arguments or temporaries)

  @property
  def all_live(self) -> int:
    """Bytes live in device memory at that moment: what the program holds, before packing."""
    return self.live + self.arguments_live


def _one(dump: str, suffix: str) -> str:
  found = glob.glob(os.path.join(dump, f"*jit_*{suffix}"))
  if not found:
    raise FileNotFoundError(f"no *{suffix} in {dump}: compile with --dump {dump}")
  # the train step's module (a dump may hold smaller programs, e.g. the state's init), the
  # newest where several were written
  found.sort(key=lambda p: ("train_step" not in p, -os.path.getmtime(p)))
  with open(found[0]) as f:
    return f.read()


_ALLOC = re.compile(r"allocation \d+: size (\d+)(.*)")
_VALUE = re.compile(r" value: <\d+ (\S+)(?: \(phi\))? @\S+> \(size=(\d+),offset=(\d+)\): (\S+)")


def allocation(line: str) -> tuple[int, int, str | None] | None:
  """(size, color, kind) of a buffer assignment's "allocation N: ..." line, else None. color:
  XLA's memory space (0 the device's, no color named); kind: "arguments" (an entry
  parameter), "heap" (the preallocated temporaries), "thread_local", or None (constants,
  outputs)."""
  m = _ALLOC.match(line)
  if not m:
    return None
  rest = m.group(2)
  c = re.search(r"color (\d+)", rest)
  kind = ("arguments" if "parameter" in rest else "heap" if "preallocated-temp" in rest
          else "thread_local" if "thread-local" in rest else None)
  return int(m.group(1)), int(c.group(1)) if c else 0, kind


def heap_values(text: str, kind: str = "heap") -> tuple[int, dict]:
  """The device heap of a buffer assignment: (its size, {value: (size, offset, shape)}).
  Should XLA make several heaps, they are laid end to end (offsets past the ones before).
  kind="arguments": the same of the entry parameters' device buffers, one after another."""
  size, values, inside, base = 0, {}, False, 0
  for line in text.splitlines():
    a = allocation(line)
    if a:
      inside = a[1:] == (0, kind)
      if inside:
        base, size = size, size + a[0]
      continue
    v = _VALUE.match(line) if inside else None
    if v:
      name = v.group(1) if "{" in v.group(1) else v.group(1) + "{}"
      values[name] = (int(v.group(2)), base + int(v.group(3)),
                      v.group(4).lstrip("(").split("{")[0])
  return size, values


def live_ranges(text: str) -> dict:
  """{value: (first, last)} of the live-range dump's schedule."""
  body = text.split("BufferLiveRange:")[1].split("Live ranges at")[0]
  return {m.group(1): (int(m.group(2)), int(m.group(3)))
          for m in re.finditer(r"^\s+(\S+):(\d+)-(\d+)$", body, re.M)}


def fullest(values: dict, ranges: dict) -> tuple[int, int, dict]:
  """(t, bytes, {place: [values]}) at the moment the most heap bytes are live: the union of
  the live values' [offset, offset + size), values sharing memory counted once. A sweep over
  the values' starts and ends keeps the union's length in a segment tree over the places'
  boundaries (each node: how many values cover all of it, how much of it is covered), the
  way the area of a union of rectangles is swept."""
  live = [(n, v) for n, v in values.items() if n in ranges]
  edges = sorted({b for _, (size, offset, _) in live for b in (offset, offset + size)})
  at = {b: i for i, b in enumerate(edges)}
  m = max(len(edges) - 1, 1)
  cover, length = [0] * (4 * m), [0] * (4 * m)

  def add(node, lo, hi, a, b, step):     # segments [lo, hi) of the tree; [a, b) changes
    if b <= lo or hi <= a:
      return
    if a <= lo and hi <= b:
      cover[node] += step
    else:
      mid = (lo + hi) // 2
      add(2 * node, lo, mid, a, b, step)
      add(2 * node + 1, mid, hi, a, b, step)
    if cover[node]:
      length[node] = edges[hi] - edges[lo]
    else:
      length[node] = 0 if hi - lo == 1 else length[2 * node] + length[2 * node + 1]

  events = sorted((t, step, name) for name, _ in live
                  for t, step in ((ranges[name][0], 1), (ranges[name][1] + 1, -1)))
  best, best_t = -1, 0
  for i, (t, step, name) in enumerate(events):
    size, offset, _ = values[name]
    if size:
      add(1, 0, m, at[offset], at[offset + size], step)
    if (i + 1 == len(events) or events[i + 1][0] != t) and length[1] > best:
      best, best_t = length[1], t
  places = collections.defaultdict(list)
  for name, (size, offset, _) in live:
    if ranges[name][0] <= best_t <= ranges[name][1]:
      places[(offset, size)].append(name)
  return best_t, max(best, 0), places


class Sources:
  """The k2jax line behind an HLO value (module docstring), from the optimized HLO text."""

  _INST = re.compile(r"^\s+(ROOT )?%(\S+) = (.*)$")

  def __init__(self, hlo: str, roots=None):
    self.roots = [os.path.abspath(r).rstrip(os.sep) + os.sep for r in (roots or ROOTS)]
    def section(name, nxt):
      part = hlo.split("\n" + name + "\n", 1)
      if len(part) < 2:
        return ""
      return part[1].split("\n" + nxt + "\n", 1)[0] if nxt else part[1]
    self.files = dict(re.findall(r'^(\d+) "(.*)"$', section("FileNames", "FunctionNames"), re.M))
    self.funcs = dict(re.findall(r'^(\d+) "(.*)"$', section("FunctionNames", "FileLocations"),
                                 re.M))
    self.locs = {i: (f, fn, int(ln)) for i, f, fn, ln in re.findall(
        r"^(\d+) \{file_name_id=(\d+) function_name_id=(\d+) line=(\d+)",
        section("FileLocations", "StackFrames"), re.M)}
    self.frames = dict((i, (loc, parent)) for i, loc, parent in re.findall(
        r"^(\d+) \{file_location_id=(\d+) parent_frame_id=(\d+)\}", section("StackFrames", None),
        re.M))
    self.inst = {}       # name -> (opcode, operands, frame, op_name, computation, index)
    self.caller = {}     # computation -> the value its parameter 0 is (a loop's init, a branch's)
    self.root = {}       # computation -> its ROOT instruction
    computation = None
    for line in hlo.splitlines():
      c = re.match(r"^(?:ENTRY )?%(\S+) .*\{$", line)
      if c:
        computation = c.group(1)
        continue
      m = self._INST.match(line)
      if not m:
        continue
      is_root, name, rest = m.groups()
      if is_root:
        self.root[computation] = name
      op = re.search(r"\s([a-z][\w-]*)\((.*?)\)(?:,|$)", rest)
      opcode, args = (op.group(1), op.group(2)) if op else ("", "")
      operands = re.findall(r"%([\w.\-]+)", args)
      frame = re.search(r"stack_frame_id=(\d+)", rest)
      op_name = re.search(r'op_name="([^"]*)"', rest)
      at = re.search(r"\bindex=(\d+)", rest[op.end():]) if op else None   # not the types
      self.inst[name] = (opcode, operands, frame.group(1) if frame else None,
                         op_name.group(1) if op_name else "", computation,
                         at.group(1) if at else "")
      if opcode == "while" and operands:
        for key in ("body", "condition"):
          called = re.search(key + r"=%([\w.\-]+)", rest)
          if called:
            self.caller[called.group(1)] = (operands[0], name)
      elif opcode == "conditional":
        branches = re.search(r"branch_computations=\{([^}]*)\}", rest)
        names = (re.findall(r"%([\w.\-]+)", branches.group(1)) if branches else
                 [re.search(k + r"=%([\w.\-]+)", rest).group(1)
                  for k in ("true_computation", "false_computation") if k + "=" in rest])
        for k, b in enumerate(names):
          if k + 1 < len(operands):
            self.caller[b] = (operands[k + 1], name)
      elif opcode == "fusion":
        called = re.search(r"calls=%([\w.\-]+)", rest)
        if called:
          self.caller["fusion " + name] = (called.group(1), name)

  def _frame(self, fid: str | None) -> str | None:
    seen = set()
    while fid in self.frames and fid not in seen:
      seen.add(fid)
      loc, parent = self.frames[fid]
      f, fn, line = self.locs[loc]
      path = self.files.get(f, "")
      for root in self.roots:
        if path.startswith(root):
          name = os.path.relpath(path, os.path.dirname(root.rstrip(os.sep)))
          return f"{name}:{line} {self.funcs.get(fn, '')}"
      fid = parent
    return None

  def of(self, value: str) -> str | None:
    """The source of `value` ("name{i,j}", as the dumps name values), or None."""
    name, index = value.rstrip("}").split("{", 1) if "{" in value else (value, "")
    return self._of(name, tuple(int(i) for i in index.split(",") if i), 0)

  def _of(self, name: str, index: tuple, depth: int) -> str | None:
    if depth > 40 or name not in self.inst:
      return None
    opcode, operands, frame, op_name, computation, at = self.inst[name]
    # what passes a value on (a loop, a tuple, a copy) has the line of what it passes, even
    # where it has a line of its own (a loop's output is its carry, not the loop's line)
    if opcode == "parameter":
      if computation in self.caller:      # a loop's carry, a branch's operand: where it began,
        init, user = self.caller[computation]   # else (a buffer XLA allocated) the loop's line
        return (self._of(init, index, depth + 1)
                or self._frame(self.inst.get(user, (None,) * 3)[2]))
      return f"argument {op_name}".replace("\\'", "'") if op_name else None
    if opcode == "get-tuple-element" and operands and at:
      return self._of(operands[0], (int(at),) + index, depth + 1)
    if opcode == "tuple" and index and index[0] < len(operands):
      return self._of(operands[index[0]], index[1:], depth + 1)
    if opcode in ("while", "copy", "bitcast", "copy-start", "copy-done") and operands:
      inner = self._of(operands[0], index, depth + 1)
      if inner and inner.startswith("argument ") and opcode in ("copy", "copy-start"):
        return "copy of " + inner.removeprefix("argument ")
      if inner:
        return inner
    found = self._frame(frame)
    if found:
      return found
    if opcode == "fusion" and ("fusion " + name) in self.caller:
      called, _ = self.caller["fusion " + name]
      inner = self._of(self.root.get(called, ""), index, depth + 1)
      if inner:
        return inner
    # an instruction XLA made (a fusion of the update's math, a host call's result): the line
    # of the first operand that has one
    return next((s for s in (self._of(o, (), depth + 1) for o in operands) if s), None)


def explain(dump: str, top: int = 25, roots=None) -> HeapPeak:
  """The device heap of the train step compiled into `dump` (XLA's dump directory: the buffer
  assignment, live ranges and optimized HLO) at its fullest moment, charged to the innermost
  frame in one of the directories `roots` (default: ours, ROOTS) of the Python that traced
  each buffer."""
  assignment = _one(dump, "after_optimizations-buffer-assignment.txt")
  heap, values = heap_values(assignment)
  ranges = live_ranges(_one(dump, "after_optimizations-live-range.txt"))
  t, live, places = fullest(values, ranges)
  src = Sources(_one(dump, "after_optimizations.txt"), roots)

  def charge(places, values):
    charged, example = collections.Counter(), {}
    for place, names in places.items():
      found = next((s for s in map(src.of, names) if s), None) or "unnamed (XLA's own)"
      charged[found] += place[1]
      big = max(names, key=lambda n: values[n][0])
      if found not in example or place[1] > example[found][0]:
        example[found] = (place[1], values[big][2])
    rows = [Row(b, s, example[s][1]) for s, b in charged.most_common()]
    return rows[:top] + ([Row(sum(r.bytes for r in rows[top:]), f"{len(rows) - top} more sources",
                              "")] if len(rows) > top else [])

  # the arguments' buffers at the same moment: what lives there that is not the argument
  args, held = heap_values(assignment, "arguments")
  own = {n for n in held if src.inst.get(n.split("{")[0], ("",))[0] == "parameter"
         and (src.of(n) or "").startswith("argument ")}
  there, used = collections.defaultdict(list), set()
  for n, (size, offset, _) in held.items():
    if n in ranges and ranges[n][0] <= t <= ranges[n][1]:
      used.add((offset, size))
      if n not in own:
        there[(offset, size)].append(n)
  covered, end = 0, 0               # the union of the live places
  for offset, size in sorted(used):
    covered += max(0, offset + size - max(offset, end))
    end = max(end, offset + size)
  return HeapPeak(heap, live, t, charge(places, values), charge(there, held), args, covered)


def table(peak: HeapPeak) -> str:
  """The rows as text, the packing loss last."""
  GB = 1e9
  line = lambda r: f"  {r.bytes / GB:8.2f}  {r.source}" + (f"   ({r.example})" if r.example
                                                           else "")
  lines = [f"XLA's device heap {peak.heap / GB:.2f} GB; at its fullest (schedule step "
           f"{peak.time}) {peak.live / GB:.2f} GB live, by the line that made it:"]
  lines += map(line, peak.rows)
  lines.append(f"  {(peak.heap - peak.live) / GB:8.2f}  packing: heap space no value of that "
               f"moment could use")
  if peak.arguments:
    lines.append(f"live in all device memory then: {peak.all_live / GB:.2f} GB (the heap's "
                 f"{peak.live / GB:.2f} and {peak.arguments_live / GB:.2f} of the arguments' "
                 f"{peak.arguments / GB:.2f}); packing lost "
                 f"{(peak.heap + peak.arguments - peak.all_live) / GB:.2f} GB of XLA's check")
  if peak.in_arguments:
    moved = sum(r.bytes for r in peak.in_arguments)
    lines.append(f"and {moved / GB:.2f} GB of temporaries in the donated arguments' own buffers "
                 f"at that moment (where a \"copy of\" row moved an argument out):")
    lines += map(line, peak.in_arguments)
  return "\n".join(lines)
