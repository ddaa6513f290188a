"""Batched decoding for concurrent requests: what `k2jax.serve` runs behind its HTTP layer.

    engine = Engine(cfg, params, tokenizer, max_batch=16)
    job = Job(prompt=ids, n=1, max_tokens=64, temperature=0.7, top_p=1.0, seed=None,
              stop=["\\n\\n"], emit=print)
    engine.submit(job)        # emit(Event) is called from the engine's thread

One thread owns the device. It takes a request, waits up to `window_s` for others when the
last batch was shared (clients answered together come back within milliseconds; a lone
client is not made to wait), takes whatever else is queued up to `max_batch` rows,
groups the rows by the settings a `generate` call shares (temperature, top_p, top_k, seed)
and decodes each group as one batch: every decode step serves every request of the group.
Requests that arrive while a batch decodes wait for the next one (static batching: simple,
and on the accelerator the step time barely grows with rows, so 16 clients get ~16x the
throughput of one; continuous batching would also let a short request leave early).

Every row samples with its own key (`generate` with one seed per row): a request's seed
gives the same tokens whoever shares its batch, as long as the batched forward gives the
row the same logits (exact on XLA:CPU; accelerators may differ in the last bits, which can
flip a near-tie). Rows of a request without a seed draw theirs from the engine's generator.

Rows end at a stop token, a stop string (the text is cut before it, as OpenAI does), their
own `max_tokens`, or when the client goes away (`job.cancelled`). Streamed text is held back
while its tail could still become a stop string or a tool-call section, and while it ends in
an incomplete UTF-8 character.
"""

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from k2jax import chat
from k2jax.generate import generate

log = logging.getLogger("k2jax.engine")

SECTION = "<|tool_calls_section_begin|>"


@dataclasses.dataclass
class Event:
  """What a job's `emit` receives: kind "delta" (text of choice `index`), "done" (choice
  `index` finished: its whole text, finish reason, completion tokens) or "error"."""
  kind: str
  index: int = 0
  text: str = ""
  finish_reason: str | None = None
  tokens: int = 0
  error: Exception | None = None


@dataclasses.dataclass(eq=False)
class Job:
  """One request: n rows sampled from one prompt."""
  prompt: list[int]
  max_tokens: int
  emit: Callable[[Event], None]
  n: int = 1
  temperature: float = 1.0
  top_p: float | None = None
  top_k: int | None = None
  seed: int | None = None
  stop: Sequence[str] = ()
  # Streamed text stops at a tool-call section (it is returned parsed, not as text).
  hold_tool_calls: bool = False
  # fn(row_of_this_job, ids so far) -> allowed bool [vocab] or None (constrained decoding).
  processor: Callable[[int, list[int]], np.ndarray | None] | None = None
  cancelled: bool = False


def _held(text: str, watch: Sequence[str]) -> int:
  """How many trailing characters of `text` to hold back: the longest tail that is a proper
  prefix of a watched string, or an undecoded (replacement) character."""
  hold = 0
  for w in watch:
    for k in range(min(len(w) - 1, len(text)), hold, -1):
      if text.endswith(w[:k]):
        hold = k
        break
  while hold < len(text) and text[len(text) - hold - 1] == "\ufffd":
    hold += 1
  return hold


class _Row:
  """One sampled continuation of a job being decoded."""

  def __init__(self, job: Job, index: int, stops: Sequence[str]):
    self.job, self.index, self.ids, self.sent = job, index, [], 0
    self.stops = list(job.stop) + list(stops)
    self.watch = self.stops + ([SECTION] if job.hold_tool_calls else [])
    self.finish: str | None = None
    self.text = ""


class Engine:
  """The device-owning decode thread and its queue (see the module docstring).

  Args:
    cfg, params, tokenizer: the model (as `k2jax.generate.load` returns them).
    max_batch: rows decoded together at most (a request's n rows count n).
    window_s: how long the first request of a batch waits for others.
    seed: draws the sampling key of requests that give none (reproducible server runs).
  """

  def __init__(self, cfg, params, tokenizer, *, max_batch: int = 16, window_s: float = 0.02,
               seed: int = 0):
    self.cfg, self.params, self.tok = cfg, params, tokenizer
    self.max_batch, self.window_s = max_batch, window_s
    self.stop_ids = [tokenizer.eos_id] + chat.stop_ids(tokenizer)
    # With a byte tokenizer the chat markers are text: <|im_end|> ends a turn as a string.
    self.stop_text = ["<|im_end|>"]
    self._rng = np.random.default_rng(seed)
    self._queue: queue.Queue = queue.Queue()
    self._last_rows = 0
    self.stats = dict(batches=0, rows=0, tokens=0)
    self._thread = threading.Thread(target=self._loop, name="k2jax-engine", daemon=True)
    self._thread.start()

  def submit(self, job: Job) -> None:
    self._queue.put(job)

  def warmup(self, prompt_tokens: int, max_tokens: int, sampled: bool = True) -> None:
    """Compile the decode programs for every batch-size bucket up to max_batch at one prompt
    length (a server's first requests otherwise wait for XLA; each bucket is a program).
    Runs on the caller's thread: call it before serving."""
    from k2jax.generate import bucket
    sizes = sorted({bucket(b, minimum=1) for b in range(1, self.max_batch + 1)})
    for b in sizes:
      for temperature in (0.0, 1.0) if sampled else (0.0,):
        generate(self.cfg, self.params, [[self.tok.bos_id] * prompt_tokens] * b,
                 max_new_tokens=max_tokens, temperature=temperature)

  def close(self) -> None:
    self._queue.put(None)
    self._thread.join(timeout=60)

  # --------------------------------------------------------------------------- the thread

  def _take(self) -> list[Job] | None:
    first = self._queue.get()
    if first is None:
      return None
    jobs, rows = [first], first.n
    # Wait for company only under concurrent load (the last batch had several rows): a lone
    # client would pay the window on every request for nothing.
    deadline = time.monotonic() + (self.window_s if self._last_rows > 1 else 0.0)
    while rows < self.max_batch:
      try:
        wait = deadline - time.monotonic()
        job = self._queue.get(timeout=wait) if wait > 0 else self._queue.get_nowait()
      except queue.Empty:
        break
      if job is None:
        self._queue.put(None)
        break
      jobs.append(job)
      rows += job.n
    self._last_rows = rows
    return jobs

  def _loop(self) -> None:
    while (jobs := self._take()) is not None:
      groups: dict[tuple, list[Job]] = {}
      for job in jobs:
        if job.cancelled:
          continue
        key = (job.temperature if job.temperature > 0 else 0.0,
               job.top_p if job.temperature > 0 else None,
               job.top_k if job.temperature > 0 else None)
        groups.setdefault(key, []).append(job)
      for group in groups.values():
        try:
          self._decode(group)
        except Exception as e:    # the server keeps serving; these requests get a 500
          log.exception("decoding a batch of %d requests failed", len(group))
          for job in group:
            job.emit(Event("error", error=e))

  def _decode(self, jobs: list[Job]) -> None:
    rows = [_Row(job, i, self.stop_text) for job in jobs for i in range(job.n)]
    first = jobs[0]
    seeds = []
    for job in jobs:      # row i of a seeded request: a key from (seed, i)
      base = job.seed % 2**31 if job.seed is not None else int(self._rng.integers(2**31))
      seeds += [(base * 1_000_003 + i) % 2**32 for i in range(job.n)]
    tok, stop_ids = self.tok, set(self.stop_ids)

    def finish(row: _Row, reason: str) -> None:
      row.finish = reason
      row.job.emit(Event("done", row.index, row.text, reason, len(row.ids)))

    def on_token(ids):
      ended = set()
      for b, i in enumerate(ids):
        row = rows[b]
        if i is None or row.finish:
          continue
        if row.job.cancelled:
          row.finish = "cancelled"
          ended.add(b)
          continue
        row.ids.append(i)
        text = tok.decode([t for t in row.ids if t not in stop_ids])
        cut = min((text.find(s) for s in row.stops if s in text), default=-1)
        reason = None
        if cut >= 0:
          text, reason = text[:cut], "stop"
        elif i in stop_ids:
          reason = "stop"
        elif len(row.ids) >= row.job.max_tokens:
          reason = "length"
        row.text = text
        visible = text if reason else text[:len(text) - _held(text, row.watch)]
        if row.job.hold_tool_calls and SECTION in visible:
          visible = visible[:visible.index(SECTION)]
        if len(visible) > row.sent:
          row.job.emit(Event("delta", row.index, visible[row.sent:]))
          row.sent = len(visible)
        if reason:
          finish(row, reason)
          ended.add(b)
      return ended

    processor = None
    if any(job.processor for job in jobs):
      def processor(b, generated):
        fn = rows[b].job.processor
        return None if fn is None else fn(rows[b].index, generated)

    generate(self.cfg, self.params, [job.prompt for job in jobs for _ in range(job.n)],
             max_new_tokens=max(job.max_tokens for job in jobs),
             temperature=first.temperature, top_p=first.top_p, top_k=first.top_k, seed=seeds,
             stop_ids=self.stop_ids, logits_processor=processor, on_token=on_token)
    for row in rows:     # a row that hit the batch's last step without ending on its own
      if row.finish is None:
        finish(row, "length")
    self.stats["batches"] += 1
    self.stats["rows"] += len(rows)
    self.stats["tokens"] += sum(len(r.ids) for r in rows)
