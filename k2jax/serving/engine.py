"""Continuous batching for concurrent requests: what `k2jax.serve` runs behind its HTTP layer.

    engine = Engine(cfg, params, tokenizer, max_batch=16, max_len=2048)
    job = Job(prompt=ids, n=1, max_tokens=64, temperature=0.7, top_p=1.0, seed=None,
              stop=["\\n\\n"], emit=print)
    engine.submit(job)        # emit(Event) is called from the engine's thread

One thread owns the device and a slotted latent cache of `max_batch` rows of `max_len`
tokens (k2jax.model.decode's cache, allocated once). Between decode dispatches it admits
queued requests into free slots (one prefill for all of them, written into their rows of the
cache) and frees the slots of rows that ended, so a short request leaves as soon as it is
done and a new one joins the running batch instead of waiting for it to end (continuous
batching, as vLLM / SGLang / JetStream serve). Every decode step serves every occupied slot.

A dispatch runs `chunk` decode steps on the device (one when a row samples under a logits
processor, which needs the host every step); a row that ends inside a chunk leaves at its
end, and what it generated past its end is dropped. A dispatch gathers the occupied slots'
rows into a power-of-two batch over the shortest power-of-two prefix of positions that holds
every row's tokens: a cache sized for many long requests does not make one short request
pay for its size, wherever its slot is. Under a mesh the slots are split over the devices a
batch's rows are (generate.cache_axes: each holds its share of the cache, not all of it)
and a dispatch runs every slot where it is, over that prefix.

A slot that a row leaves keeps its cache, and the engine remembers the tokens it holds. A
new row whose prompt starts with at least `reuse_min` of them takes that slot and runs only
the rest of its prompt (`decode.extend`, the absorbed form, over the held entries): an agent
loop resends its whole dialog every turn, and the turn before is what the slot holds
(prefix reuse; vLLM / SGLang share prefixes across requests through paged / radix caches).
The continued prompt's logits equal a full prefill's to float rounding, not bit for bit, so
a near-tie can flip: `reuse_min=None` keeps a seeded request bit-for-bit repeatable.

Rows sample with their own settings (temperature, top_p, top_k are per-row arrays, so
requests whose settings differ share steps) and their own keys: the key of a row's t-th token
is fold_in(key(row seed), t), as `k2jax.serving.generate.generate` draws it, so a seeded request
gives the same tokens whoever shares its steps and whenever it joined, as long as the
batched forward gives the row the same logits (exact on XLA:CPU; accelerators may differ in
the last bits, which can flip a near-tie). Rows of a request without a seed draw theirs from
the engine's generator.

Rows end at a stop token, a stop string (the text is cut before it, as OpenAI does), their
own `max_tokens`, or when the client goes away (`job.cancelled`). Streamed text is held back
while its tail could still become a stop string or a tool-call section, and while it ends in
an incomplete UTF-8 character.
"""

import codecs
import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from k2jax import kernels
from k2jax.serving import chat
from k2jax.serving.generate import (Penalties, batch_devices, bucket, cache_axes, new_cache, penalize,
                            place_cache, rows_bucket, sample_rows)
from k2jax.model import decode

log = logging.getLogger("k2jax.engine")

SECTION = "<|tool_calls_section_begin|>"
THINK = ["<think>", "</think>"]
CHUNK = 8     # decode steps per dispatch: fewer dispatches vs a row's wait to join / leave


class Unfit(ValueError):
  """A request the engine cannot take as asked (more rows or tokens than its slots hold, a
  min_tokens past max_tokens): the client's to fix, unlike a failure while decoding."""


@dataclasses.dataclass
class Event:
  """What a job's `emit` receives: kind "delta" (text of choice `index`), "section" (with
  Job.hold_tool_calls: the held tool-call section so far, from its marker on), "done"
  (choice `index` finished: its whole text, finish reason, completion tokens) or "error"."""
  kind: str
  index: int = 0
  text: str = ""
  finish_reason: str | None = None
  tokens: int = 0
  error: Exception | None = None
  # With Job.logprobs: "delta" the entries of the tokens since the row's last delta, "done"
  # all of them; an entry is (token id, log p, [(alternative id, log p), ...] best first).
  logprobs: list | None = None
  # With Job.echo, on a row's first delta and on "done": the prompt's entries (None for its
  # first token).
  prompt_logprobs: list | None = None


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
  # Log probabilities under the model (temperature 1, before any filter or constraint) of
  # each generated token and of this many alternatives; None: none.
  logprobs: int | None = None
  echo: bool = False        # ... and of the prompt's tokens (needs logprobs)
  # OpenAI's presence / frequency penalties and logit_bias {id: bias}, vLLM's
  # repetition_penalty and min_tokens (k2jax.serving.generate.penalize); the defaults change nothing.
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  repetition_penalty: float = 1.0
  logit_bias: dict | None = None
  min_tokens: int = 0
  cancelled: bool = False

  @property
  def penalized(self) -> bool:
    return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias
                or self.min_tokens or self.repetition_penalty != 1.0)


def _held(text: str, watch: Sequence[str]) -> int:
  """How many trailing characters of `text` to hold back: the longest tail that is a proper
  prefix of a watched string. (A character whose bytes are still arriving is not in the
  text yet: the row's UTF-8 decoder holds them.)"""
  hold = 0
  for w in watch:
    for k in range(min(len(w) - 1, len(text)), hold, -1):
      if text.endswith(w[:k]):
        hold = k
        break
  return hold


def row_seed(seed: int, i: int) -> int:
  """The sampling seed of row i of a request seeded `seed` (`generate`'s per-row seed)."""
  return ((seed % 2**31) * 1_000_003 + i) % 2**32


class _Row:
  """One sampled continuation of a job, in its slot of the cache."""

  def __init__(self, job: Job, index: int, stops: Sequence[str], seed: int):
    self.job, self.index, self.ids, self.sent, self.seed = job, index, [], 0, seed
    self.stops = list(job.stop) + list(stops)
    # held back while they could still be completing: stops, the tool-call section, and
    # the reasoning markers (a stream splits a <think> block off: k2jax.serve)
    self.watch = self.stops + ([SECTION] if job.hold_tool_calls else []) + THINK
    self.finish: str | None = None
    # The reply's text, grown by each token's characters (`Engine._on_token`); the decoder
    # keeps the first bytes of a character until its last one arrives.
    self.text = ""
    self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    self.section_at = -1        # where the tool-call section starts in the text (-1: not yet)
    self.lps: list = []
    self.lp_sent = 0
    self.section_sent = 0
    self.prompt_lps: list | None = None
    self.stop_from = 0          # where a stop string may start ending (min_tokens)


def cache_length(max_len: int, chunk: int) -> int:
  """Positions a slot of the cache holds for rows of up to `max_len` tokens: a dispatch of
  `chunk` steps may run past a row's last token (its writes past the cache are dropped, but
  the row's own must land), rounded up to 128 (TPU's lanes). Spans of a dispatch are
  power-of-two buckets up to it."""
  return -(-(max_len + chunk) // 128) * 128


def slot_count(max_batch: int, mesh) -> int:
  """The slots an engine asked for `max_batch` keeps on `mesh`: a multiple of the mesh's
  batch devices (generate.batch_devices). A dispatch runs that many rows whatever it holds
  (the MoE layers give each device whole rows), and with as many slots the cache splits over
  those devices (generate.cache_axes) instead of each device holding every slot and a
  gathered copy of the rows a dispatch runs."""
  k = 1 if mesh is None else batch_devices(mesh)
  return -(-max_batch // k) * k


def dispatch_rows(n: int, slots: int, mesh) -> tuple[int, bool]:
  """(rows, every) of a decode dispatch of n occupied slots of a cache of `slots`: with the
  slots split over the mesh (generate.cache_axes) every slot in slot order (each device
  decodes the slots it holds; a gather of some would cross devices), else the occupied ones
  gathered into rows_bucket(n) rows."""
  if mesh is not None and cache_axes(slots, mesh):
    return slots, True
  return rows_bucket(n, mesh), False


def _scores(logits, tokens, top: int) -> dict:
  """log p(tokens) [...] under logits [..., V] (temperature 1), and the `top` most likely
  tokens' ids and log p [..., top] when top > 0."""
  lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  out = {"lp": jnp.take_along_axis(lp, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]}
  if top > 0:
    out["top_lp"], out["top_ids"] = jax.lax.top_k(lp, top)
  return out


# The engine programs' pieces: sampling with per-row keys, and moving rows between the
# engine's cache and a step's own (module level so `_programs` reads as its three programs).

def _draw(logits, seeds, t, temperature, top_k, top_p, allowed, filtered, pen=None, ps=None):
  """Each row's token t, sampled with its own key fold_in(key(seed), t)."""
  keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(seeds, t)
  if pen is not None:       # the request's penalties, bias and min_tokens (generate.penalize)
    logits = penalize(logits, pen, t=t, **ps)
  return sample_rows(logits, keys, temperature=temperature, top_k=top_k, top_p=top_p,
                     allowed=allowed, filtered=filtered)


def _first(logits, seeds, temperature, top_k, top_p, allowed, filtered, top, pen=None,
           ps=None):
  """A new row's first token (its key's index 0) and its scores."""
  tok = _draw(logits, seeds, jnp.zeros_like(seeds, jnp.int32), temperature, top_k, top_p,
              allowed, filtered, pen, ps)
  return tok, ({"first": _scores(logits, tok, top)} if top >= 0 else {})


def _take(pen, slots):
  """The penalty rows of `slots`."""
  return jax.tree.map(lambda a: jnp.take(a, slots, axis=0, mode="clip"), pen)


def _give(pen, sub, slots):
  """`sub` written back into the penalty rows of `slots` (padding slots dropped)."""
  return jax.tree.map(lambda a, b: a.at[slots].set(b, mode="drop"), pen, sub)


def _gather(cache, slots, span, lengths, every=False):
  """Rows `slots` of the cache over its first `span` positions, at `lengths` (a padding
  index past the cache reads a clipped row and is dropped by `_put`); every: slots are all
  of them in order, the cache's own rows where they are."""
  pick = (lambda a: a[:, :, :span]) if every else (
      lambda a: jnp.take(a[:, :, :span], slots, axis=1, mode="clip"))
  return decode.Cache({name: decode.Latents(*map(pick, lat))
                       for name, lat in cache.layers.items()}, lengths)


def _put(cache, sub, slots, every=False):
  """`sub` (rows `slots`, its own positions from 0) written back into the cache, which
  stays where generate.cache_specs places it."""
  def write(big, small):
    if every:
      return jax.lax.dynamic_update_slice_in_dim(big, small.astype(big.dtype), 0, axis=2)
    return big.at[:, slots, :small.shape[2]].set(small.astype(big.dtype), mode="drop")
  layers = {name: decode.Latents(*map(write, cache.layers[name], sub.layers[name]))
            for name in cache.layers}
  return place_cache(decode.Cache(layers,
                                  cache.lengths.at[slots].set(sub.lengths, mode="drop")))


def _programs(cfg, rows: int, S: int):
  """(admit, steps): the engine's two jitted programs over a cache of `rows` x `S` tokens.

  admit(params, cache, tokens [b, T], lengths [b], slots [b], settings of the b rows,
    allowed [b, V] | None, filtered, top, echo) -> (first tokens [b], scores, cache): prefill
    of new rows (right-padded prompts) in a cache of their own, written into rows `slots` of
    the engine's (a slot index of `rows` or more is dropped: the batch's padding rows).
  steps(params, cache, slots [r], tokens [r], settings of those slots, active [r] (False:
    padding), allowed | None, n, span, filtered, top) -> (tokens [n, r], scores, cache): n
    decode steps of the rows in `slots` over the first `span` positions of the cache.
  Settings: seeds [.] uint32 and the index t [.] of the row's next token (its key is
  fold_in(key(seed), t)), temperature [.] (0 greedy), top_k [.] (0 all), top_p [.] (1 all).
  filtered: some row uses top_k / top_p. top: -1, or the sampled tokens' `_scores` with that
  many alternatives (admit: "first"; with echo also "prompt", of tokens[:, 1:]).
  """
  def admit(params, cache, tokens, lengths, slots, seeds, temperature, top_k, top_p, allowed,
            filtered, top, echo, pen=None, ps=None, bias_ids=None, bias_values=None):
    b, T = tokens.shape
    logits, *every, new = decode.prefill(cfg, params, tokens, lengths,
                                         decode.init_cache(cfg, b, T), every=echo)
    sub = None
    if pen is not None:       # the new rows' penalty rows start afresh
      prompts = jnp.where(jnp.arange(T)[None, :] < lengths[:, None], tokens, -1)
      sub = Penalties.fresh(prompts, bias_ids, bias_values, cfg.vocab_size)
    tok, scores = _first(logits, seeds, temperature, top_k, top_p, allowed, filtered, top, sub,
                        ps)
    if echo:
      scores["prompt"] = _scores(every[0][:, :-1], tokens[:, 1:], top)
    if pen is not None:
      pen = _give(pen, sub.seen(tok), slots)
    return tok, scores, _put(cache, new, slots), pen

  def steps(params, cache, slots, tokens, seeds, t, temperature, top_k, top_p, active, allowed,
            n, span, filtered, top, every=False, pen=None, ps=None):
    # The occupied slots' rows over the first `span` positions: the work of a step follows
    # the rows and lengths in use, not the cache's size or where the rows sit in it (but
    # for `every`, whose slots are split over the mesh's devices).
    sub = _gather(cache, slots, span,
                 jnp.where(active, jnp.take(cache.lengths, slots, mode="clip"), span), every)
    got = None if pen is None else _take(pen, slots)

    def body(carry, i):
      sub, tok, rows = carry
      logits, sub = decode.decode_step(cfg, params, sub, tok)
      # a padding row sits past the sub-cache's end: its writes are dropped
      sub = sub._replace(lengths=jnp.where(active, sub.lengths, span))
      nxt = _draw(logits, seeds, t + i, temperature, top_k, top_p, allowed, filtered, rows, ps)
      rows = None if rows is None else rows.seen(nxt)
      return (sub, nxt, rows), (nxt, _scores(logits, nxt, top) if top >= 0 else {})
    (sub, _, got), (toks, scores) = jax.lax.scan(body, (sub, tokens, got), jnp.arange(n))
    # (a padding row's length is the span: its slot keeps the length it had)
    sub = sub._replace(lengths=jnp.where(active, sub.lengths,
                                         jnp.take(cache.lengths, slots, mode="clip")))
    return (toks, scores, _put(cache, sub, slots, every),
            None if pen is None else _give(pen, got, slots))

  def reuse(params, cache, tokens, counts, starts, slots, seeds, temperature, top_k, top_p,
            allowed, filtered, top, span):
    # Rows whose slot holds their prompt's first starts[b] tokens: only the rest is run
    # (decode.extend) over the slot's first `span` positions.
    logits, sub = decode.extend(cfg, params, _gather(cache, slots, span, starts), tokens,
                                counts)
    tok, scores = _first(logits, seeds, temperature, top_k, top_p, allowed, filtered, top)
    return tok, scores, _put(cache, sub, slots)     # (rows with penalties are never reused)

  return (jax.jit(admit, static_argnames=("filtered", "top", "echo"),
                  donate_argnames=("cache", "pen")),
          jax.jit(steps, static_argnames=("n", "span", "filtered", "top", "every"),
                  donate_argnames=("cache", "pen")),
          jax.jit(reuse, static_argnames=("filtered", "top", "span"), donate_argnums=1))


def _entry(scores, *index) -> tuple:
  """One token's logprob entry (Event.logprobs) from host `scores` at `index`."""
  alts = []
  if "top_ids" in scores:
    alts = [(int(i), float(v)) for i, v in zip(scores["top_ids"][index], scores["top_lp"][index])]
  return float(scores["lp"][index]), alts


class Engine:
  """The device-owning decode thread, its slots and its queue (see the module docstring).

  Args:
    cfg: the model's config (as `k2jax.serving.generate.load` returns it).
    params: its parameters.
    tokenizer: its tokenizer.
    max_batch: slots: rows decoded together at most (a request's n rows take n); under a
      mesh rounded up to a multiple of its batch devices (`slot_count`).
    max_len: tokens a slot holds, prompt and completion (default and at most the model's
      context). The cache is max_batch x max_len latents (k2jax.model.decode).
    window_s: how long a request arriving at an idle engine waits for others when the last
      admission took several rows (clients answered together come back within milliseconds;
      a lone client is not made to wait). A request arriving while rows decode joins at the
      next dispatch without waiting.
    seed: draws the sampling key of requests that give none (reproducible server runs).
    chunk: decode steps per dispatch (module docstring).
    mesh: the devices to decode on (k2jax.serving.generate.inference_mesh; params placed on it by
      k2jax.serving.generate.target_shardings); under context > 1 a prompt's prefill is split over the
      context devices (k2jax.model.context). None: the default device.
    reuse_min: a new row continues the tokens a free slot's cache holds when they start its
      prompt for at least this many tokens (module docstring); None (default): every prompt
      is prefilled whole. Off by default: each (rows, new tokens, positions) bucket of a
      continued prompt is a program of its own, and under concurrent load on this CPU
      their first compiles cost more than the reuse saved (experiments/bench_serve.py).
  """

  def __init__(self, cfg, params, tokenizer, *, max_batch: int = 16, max_len: int | None = None,
               window_s: float = 0.02, seed: int = 0, chunk: int = CHUNK,
               reuse_min: int | None = None, mesh=None):
    self.cfg, self.params, self.tok, self.mesh = cfg, params, tokenizer, mesh
    self.max_batch = slot_count(max_batch, mesh)
    self.window_s, self.chunk = window_s, chunk
    self.reuse_min = reuse_min
    self.max_len = min(max_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    self.stop_ids = [tokenizer.eos_id] + chat.stop_ids(tokenizer)
    # With a byte tokenizer the chat markers are text: <|im_end|> ends a turn as a string.
    self.stop_text = ["<|im_end|>"]
    self._rng = np.random.default_rng(seed)
    self._queue: queue.Queue = queue.Queue()
    self._waiting: list[Job] = []          # taken from the queue, not yet given slots
    self._last_rows = 0
    self._S = cache_length(self.max_len, chunk)
    B = self.max_batch
    self._rows: list[_Row | None] = [None] * B
    self._host = dict(tokens=np.zeros(B, np.int32), seeds=np.zeros(B, np.uint32),
                      t=np.zeros(B, np.int32), temperature=np.zeros(B, np.float32),
                      top_k=np.zeros(B, np.int32), top_p=np.ones(B, np.float32),
                      presence=np.zeros(B, np.float32), frequency=np.zeros(B, np.float32),
                      repetition=np.ones(B, np.float32), biased=np.zeros(B, bool),
                      min_tokens=np.zeros(B, np.int32))
    self._pen = None       # generate.Penalties of every slot, once a row has asked for them
    self._stops = np.asarray([i for i in self.stop_ids if i >= 0], np.int32)
    self._length = np.zeros(B, np.int64)   # tokens in each slot's cache
    self._held: list[list[int]] = [[] for _ in range(B)]   # ... and which (`reuse`)
    self._freed = [-1] * B                 # when each slot was left (a count of ends)
    self._cache = None
    self.stats = dict(prefills=0, steps=0, row_steps=0, most_rows=0, rows=0, tokens=0,
                      reused_tokens=0)
    self._thread = threading.Thread(target=self._loop, name="k2jax-engine", daemon=True)
    self._thread.start()

  def submit(self, job: Job) -> None:
    self._queue.put(job)

  def running_rows(self) -> int:
    """Rows decoding in slots now."""
    return sum(r is not None for r in self._rows)

  def waiting_rows(self) -> int:
    """Rows submitted that have no slot yet (a server's queue bound reads this)."""
    queued = list(self._queue.queue)       # a snapshot; the engine's thread takes from it
    return sum(j.n for j in queued + list(self._waiting) if j is not None and not j.cancelled)

  def warmup(self, prompt_tokens: int, max_tokens: int, sampled: bool = True) -> None:
    """Compile the programs a server's first requests would otherwise wait for: the prefill
    of 1..max_batch new rows (each power-of-two bucket a program) at one prompt length,
    and the decode dispatches up to prompt_tokens + max_tokens, by running such requests
    through the engine. Blocks until they are done."""
    sizes: dict[int, int] = {}
    for b in range(1, self.max_batch + 1):    # the fewest rows that take each batch bucket
      sizes.setdefault(rows_bucket(b, self.mesh), b)
    for b in sorted(sizes.values()):
      for temperature in (0.0, 1.0) if sampled else (0.0,):
        done = threading.Semaphore(0)

        def emit(e, b=b, done=done):      # a row's "done", or one "error" for the job
          if e.kind in ("done", "error"):
            done.release(1 if e.kind == "done" else b)
        self.submit(Job(prompt=[self.tok.bos_id] * prompt_tokens, n=b, max_tokens=max_tokens,
                        temperature=temperature, seed=0, emit=emit))
        for _ in range(b):
          done.acquire()

  def close(self) -> None:
    self._queue.put(None)
    self._thread.join(timeout=60)

  # --------------------------------------------------------------------------- the thread

  def _free(self) -> int:
    return sum(r is None for r in self._rows)

  def _take(self) -> bool:
    """Move queued jobs to `_waiting`: blocks while nothing decodes or waits. False once
    the engine is closed."""
    busy = any(self._rows) or self._waiting
    try:
      first = self._queue.get_nowait() if busy else self._queue.get()
    except queue.Empty:
      return True
    if first is None:
      return False
    self._waiting.append(first)
    rows = sum(j.n for j in self._waiting)
    # Wait for company only when idle under concurrent load (the last admission had several
    # rows): a lone client would pay the window on every request for nothing.
    wait = self.window_s if not busy and self._last_rows > 1 else 0.0
    deadline = time.monotonic() + wait
    while rows < self._free():
      try:
        left = deadline - time.monotonic()
        job = self._queue.get(timeout=left) if left > 0 else self._queue.get_nowait()
      except queue.Empty:
        break
      if job is None:
        self._queue.put(None)
        break
      self._waiting.append(job)
      rows += job.n
    return True

  def _loop(self) -> None:
    # the mesh is a per-thread setting: the engine's thread traces and runs every program
    with jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext():
      self._serve()

  def _serve(self) -> None:
    while self._take():
      try:
        self._admit()
        if any(self._rows):
          self._advance()
      except Exception as e:    # the server keeps serving; these requests get a 500
        jobs = {id(r.job): r.job for r in self._rows if r is not None}
        log.exception("decoding %d requests failed", len(jobs))
        for job in jobs.values():
          job.emit(Event("error", error=e))
        self._rows = [None] * self.max_batch
        self._held = [[] for _ in range(self.max_batch)]
        self._cache = self._pen = None      # donated into the failed call: start over

  def _slot_for(self, job: Job, free: list[int]) -> tuple[int, int]:
    """(free slot, prompt tokens it already holds) for a row of `job`: the free slot whose
    cache starts with the longest part of the prompt (at least `reuse_min` tokens, and one
    token short of the prompt: its last one must run to give the first logits), else the
    free slot that was left longest ago (never used first, then the lowest) and 0. An echo
    needs the whole prompt's scores, a row with penalties its prompt's tokens: no reuse."""
    oldest = min(free, key=lambda slot: (self._freed[slot], slot))
    best, held = oldest, 0
    if self.reuse_min and not job.echo and not job.penalized:
      prompt = np.asarray(job.prompt)
      for slot in free:
        have = self._held[slot]
        m = min(len(have), len(prompt) - 1)
        if m <= held:
          continue
        same = np.asarray(have[:m]) == prompt[:m]
        k = m if same.all() else int(np.argmin(same))
        if k > held:
          best, held = slot, k
    return (best, held) if held >= (self.reuse_min or 1) else (oldest, 0)

  def _admit(self) -> None:
    """Give waiting jobs free slots (in arrival order), then run their prompts: one prefill
    for the rows whose slot holds nothing of theirs, one `decode.extend` of the rest of the
    prompt for those whose slot holds its start."""
    new: list[_Row] = []
    free = [s for s, r in enumerate(self._rows) if r is None]
    while self._waiting and (self._waiting[0].cancelled or self._waiting[0].n <= len(free)):
      job = self._waiting.pop(0)
      if job.cancelled:
        continue
      if job.n > self.max_batch or len(job.prompt) + job.max_tokens > self.max_len:
        job.emit(Event("error", error=Unfit(
            f"a request of {job.n} rows x {len(job.prompt)} + {job.max_tokens} tokens does "
            f"not fit the engine's slots ({self.max_batch} of {self.max_len} tokens)")))
        continue
      if not 0 <= job.min_tokens <= job.max_tokens:
        job.emit(Event("error", error=Unfit(
            f"min_tokens {job.min_tokens}: must be in [0, max_tokens {job.max_tokens}]")))
        continue
      seed = job.seed if job.seed is not None else int(self._rng.integers(2**31))
      for i in range(job.n):
        row = _Row(job, i, self.stop_text, row_seed(seed, i))
        row.slot, row.held = self._slot_for(job, free)
        free.remove(row.slot)
        self._rows[row.slot] = row
        new.append(row)
    if self._waiting and self._waiting[0].n > self.max_batch:
      job = self._waiting.pop(0)
      job.emit(Event("error", error=Unfit(
          f"n {job.n} is more than the engine's {self.max_batch} slots")))
    if not new:
      return
    if self._cache is None:
      self._cache = new_cache(self.cfg, self.max_batch, self._S, self.mesh)
    self._last_rows = len(new)
    for row in new:
      for k, v in self._settings(row).items():
        self._host[k][row.slot] = v
      self._host["t"][row.slot] = 1
      self._length[row.slot] = len(row.job.prompt)
      self._held[row.slot] = list(row.job.prompt)
    fresh = [r for r in new if not r.held]
    if fresh:
      self._prefill(fresh)
    if len(fresh) < len(new):
      self._continue([r for r in new if r.held])
    self.stats["rows"] += len(new)

  def _group(self, rows: list[_Row], slots, at=None) -> dict:
    """The host settings of `rows` at their slots (padded: `slots` past the cache read the
    last slot's, which nothing reports), and what shapes their program. at: each row's
    index in the batch (default: the first len(rows))."""
    h = {k: v[np.minimum(slots, self.max_batch - 1)] for k, v in self._host.items()}
    placed: list[_Row | None] = [None] * len(slots)
    for i, row in zip(range(len(rows)) if at is None else at, rows):
      placed[i] = row
    return dict(seeds=h["seeds"], temperature=h["temperature"], top_k=h["top_k"],
                top_p=h["top_p"], allowed=self._allowed(placed, len(slots)),
                filtered=self._filtered(rows), top=self._top(rows)), h

  def _penalties(self, rows: list[_Row], h: dict) -> dict:
    """The programs' penalty arguments when a row of `rows` asked for any (else none: the
    program without them), the slots' state allocated on first use."""
    if not any(r.job.penalized for r in rows):
      return {}
    if self._pen is None:
      self._pen = Penalties.zeros(self.max_batch, self.cfg.vocab_size)
    return dict(pen=self._pen, ps=dict(
        presence=h["presence"], frequency=h["frequency"], repetition=h["repetition"],
        biased=h["biased"], min_tokens=h["min_tokens"], stop_ids=self._stops))

  def _slots(self, rows: list[_Row]) -> np.ndarray:
    """The rows' slots, padded with an index past the cache to a power of two that the
    mesh's batch devices divide (generate.rows_bucket)."""
    slots = np.full(rows_bucket(len(rows), self.mesh), self.max_batch, np.int32)
    slots[:len(rows)] = [r.slot for r in rows]
    return slots

  def _prefill(self, rows: list[_Row]) -> None:
    slots = self._slots(rows)
    T = min(bucket(max(len(r.job.prompt) for r in rows)), self._S)
    tokens = np.zeros((len(slots), T), np.int32)
    lengths = np.ones(len(slots), np.int32)
    for i, row in enumerate(rows):
      tokens[i, :len(row.job.prompt)] = row.job.prompt
      lengths[i] = len(row.job.prompt)
    admit = self._compiled()[0]
    g, h = self._group(rows, slots)
    p = self._penalties(rows, h)
    if p:
      k = bucket(max(len(r.job.logit_bias or ()) for r in rows), minimum=1)
      p["bias_ids"] = np.full((len(slots), k), -1, np.int32)
      p["bias_values"] = np.zeros((len(slots), k), np.float32)
      for i, row in enumerate(rows):
        for j, (tid, v) in enumerate((row.job.logit_bias or {}).items()):
          p["bias_ids"][i, j], p["bias_values"][i, j] = tid, v
      self._pen = None                                 # donated into the call
    first, scores, self._cache, pen = admit(self.params, self._cache, tokens, lengths, slots,
                                            echo=any(r.job.echo for r in rows), **g, **p)
    if p:
      self._pen = pen
    self.stats["prefills"] += 1
    self._started(rows, np.asarray(first), jax.tree.map(np.asarray, scores), g["top"])

  def _continue(self, rows: list[_Row]) -> None:
    slots = self._slots(rows)
    # (at least 16 new tokens a row: fewer shapes, so fewer programs to compile)
    t = bucket(max(len(r.job.prompt) - r.held for r in rows), minimum=16)
    span = min(bucket(max(len(r.job.prompt) for r in rows) + t), self._S)
    tokens = np.zeros((len(slots), t), np.int32)
    counts, starts = np.ones(len(slots), np.int32), np.zeros(len(slots), np.int32)
    for i, row in enumerate(rows):
      rest = row.job.prompt[row.held:]
      tokens[i, :len(rest)] = rest
      counts[i], starts[i] = len(rest), row.held
    reuse = self._compiled()[2]
    g, _ = self._group(rows, slots)
    first, scores, self._cache = reuse(self.params, self._cache, tokens, counts, starts, slots,
                                       span=span, **g)
    self.stats["reused_tokens"] += sum(r.held for r in rows)
    self._started(rows, np.asarray(first), jax.tree.map(np.asarray, scores), g["top"])

  def _started(self, rows, first, scores, top: int) -> None:
    """Hand new rows their first tokens (and an echo its prompt's scores)."""
    for i, row in enumerate(rows):
      self._host["tokens"][row.slot] = first[i]
      if row.job.echo:
        prompt = scores["prompt"]
        row.prompt_lps = [None] + [(t, *_entry(prompt, i, j))
                                   for j, t in enumerate(row.job.prompt[1:])]
      if row.job.max_tokens == 0:      # scoring only (echo): nothing to generate
        self._end(row, "length")
        continue
      self._on_token(row, int(first[i]), _entry(scores["first"], i) if top >= 0 else None)

  def _advance(self) -> None:
    """Decode steps for the occupied slots; rows that end free their slots.

    A row under a logits processor (a tool call, a response_format) needs the host's mask
    before each of its tokens, so it runs one step a dispatch. The other rows keep their
    dispatches of `chunk` steps, in a dispatch of their own issued first; the constrained
    rows then take up to `chunk` one-step dispatches (the first one's masks computed while
    the device runs the free rows' steps; each later one waits for the step before it):
    every row moves `chunk` tokens. (Where the cache is split
    over a mesh a dispatch runs every slot, `dispatch_rows`: one dispatch, one step while
    a row is constrained.)"""
    rows = [r for r in self._rows if r is not None]
    held = [r for r in rows if r.job.processor]
    free = [r for r in rows if not r.job.processor]
    _, every = dispatch_rows(len(rows), self.max_batch, self.mesh)
    if every or not held or not free:
      return self._hand_out(*self._dispatch(rows, 1 if held else self.chunk, every))
    launched = self._dispatch(free, self.chunk, every)
    for _ in range(self.chunk):
      held = [r for r in held if r.finish is None]
      if not held:
        break
      self._hand_out(*self._dispatch(held, 1, every))
    self._hand_out(*launched)

  def _dispatch(self, rows: list[_Row], n: int, every: bool):
    """Launch n decode steps of `rows` (gathered into a power-of-two batch, or every slot
    in place: `dispatch_rows`); returns what `_hand_out` needs, the tokens not yet fetched."""
    span = min(bucket(int(max(self._length[r.slot] for r in rows)) + n), self._S)
    at = [r.slot for r in rows] if every else list(range(len(rows)))   # rows in the batch
    slots = np.arange(self.max_batch, dtype=np.int32) if every else self._slots(rows)
    active = np.zeros(len(slots), bool)
    active[at] = True
    g, h = self._group(rows, slots, at)
    steps = self._compiled()[1]
    p = self._penalties(rows, h)
    if p:
      self._pen = None                                 # donated into the call
    toks, scores, self._cache, pen = steps(self.params, self._cache, slots, h["tokens"],
                                           t=h["t"], active=active, n=n, span=span,
                                           every=every, **g, **p)
    if p:
      self._pen = pen
    return rows, at, n, g["top"], h["tokens"], toks, scores

  def _hand_out(self, rows, at, n, top, fed, toks, scores) -> None:
    """Give each row of a dispatch its n tokens (`_on_token`)."""
    toks, scores = np.asarray(toks), jax.tree.map(np.asarray, scores)
    self.stats["steps"] += n
    self.stats["row_steps"] += n * len(rows)
    self.stats["most_rows"] = max(self.stats["most_rows"], len(rows))
    for j, row in zip(at, rows):   # what the dispatch fed each row (its cache holds them)
      self._held[row.slot] += [int(fed[j])] + toks[:-1, j].tolist()
      self._host["tokens"][row.slot] = toks[-1, j]
      self._host["t"][row.slot] += n
      self._length[row.slot] += n
    for i in range(n):
      for j, row in zip(at, rows):
        if row.finish is None:
          self._on_token(row, int(toks[i, j]), _entry(scores, i, j) if top >= 0 else None)

  def _compiled(self):
    return _compiled(self.cfg, self.max_batch, self._S)

  @staticmethod
  def _settings(row: _Row) -> dict:
    job = row.job
    greedy = job.temperature <= 0
    return dict(seeds=row.seed, temperature=max(job.temperature, 0.0),
                top_k=0 if greedy or not job.top_k else job.top_k,
                top_p=1.0 if greedy or job.top_p is None else job.top_p,
                presence=job.presence_penalty, frequency=job.frequency_penalty,
                repetition=job.repetition_penalty, biased=bool(job.logit_bias),
                min_tokens=job.min_tokens)

  @staticmethod
  def _top(rows) -> int:
    """-1 when no row wants log probabilities, else the most alternatives one wants."""
    return max((r.job.logprobs for r in rows if r is not None and r.job.logprobs is not None),
               default=-1)

  @staticmethod
  def _filtered(rows) -> bool:
    """Whether any row samples under top_k / top_p (the program that sorts the vocabulary)."""
    return any(r is not None and r.job.temperature > 0 and (r.job.top_k or r.job.top_p)
               for r in rows)

  def _allowed(self, rows, b: int):
    """The logits processors' masks [b, vocab] for these rows (None: no row has one)."""
    if not any(r is not None and r.job.processor for r in rows):
      return None
    mask = np.ones((b, self.cfg.vocab_size), bool)
    for i, r in enumerate(rows):
      m = None if r is None or r.job.processor is None else r.job.processor(r.index, r.ids)
      if m is not None:
        mask[i, :len(m)] = m
    return mask

  def _on_token(self, row: _Row, i: int, scored: tuple | None = None) -> None:
    """Hand a row its next token (and its log probabilities, `_entry`): stream its visible
    text, end it (freeing its slot) at a stop token, a stop string, max_tokens, or a client
    that went away."""
    if row.job.cancelled:
      return self._end(row, "cancelled")
    row.ids.append(i)
    if row.job.logprobs is not None:
      lp, alts = scored
      row.lps.append((i, lp, alts[:row.job.logprobs]))
    self.stats["tokens"] += 1
    # Host work per token is this token's: its bytes through the row's incremental decoder
    # (equal to decoding every id again, the tokenizer's decode(), which took 1 ms a token at
    # 16k tokens), the stop strings and the section marker searched where they could end in
    # its characters.
    before = len(row.text)
    if i not in self.stop_ids:
      row.text += row.utf8.decode(self.tok.text_bytes(i))
    text = row.text
    cut = -1
    if len(row.ids) < row.job.min_tokens:     # vLLM: nothing stops a row before min_tokens,
      row.stop_from = len(text)               # and a stop string must end after it
    else:
      start = max(row.stop_from, before)      # what ends before was searched already
      found = [text.find(s, max(0, start - len(s) + 1)) for s in row.stops]
      cut = min((f for f in found if f >= 0), default=-1)
    if row.job.hold_tool_calls and row.section_at < 0:
      row.section_at = text.find(SECTION, max(0, before - len(SECTION) + 1))
    reason = None
    if cut >= 0 or i in self.stop_ids:
      reason = "stop"
    elif len(row.ids) >= row.job.max_tokens:
      reason = "length"
    if reason:
      if cut >= 0:
        text = text[:cut]
      else:        # the bytes of a character the reply left unfinished (as decode() shows)
        text += row.utf8.decode(b"", final=True)
      row.text = text
    end = len(text) if reason else len(text) - _held(text, row.watch)
    sec = row.section_at
    if sec >= 0 and sec + len(SECTION) <= len(text):     # the section is held, not streamed
      if sec + len(SECTION) <= end:
        end = sec
      if not reason:
        section = text[sec:]      # the held section as it grows (streaming)
        if len(section) > row.section_sent:
          row.job.emit(Event("section", row.index, section))
          row.section_sent = len(section)
    if end > row.sent:
      lps = row.lps[row.lp_sent:] if row.job.logprobs is not None else None
      row.lp_sent = len(row.lps)
      row.job.emit(Event("delta", row.index, text[row.sent:end], logprobs=lps,
                         prompt_logprobs=None if row.sent else row.prompt_lps))
      row.sent = end
    if reason:
      self._end(row, reason)

  def _end(self, row: _Row, reason: str) -> None:
    row.finish = reason
    self._rows[row.slot] = None
    self._freed[row.slot] = max(self._freed) + 1
    if reason != "cancelled":
      row.job.emit(Event("done", row.index, row.text, reason, len(row.ids),
                         logprobs=row.lps if row.job.logprobs is not None else None,
                         prompt_logprobs=row.prompt_lps))


_PROGRAMS: dict[tuple, tuple] = {}


def _compiled(cfg, rows: int, S: int):
  """`_programs` once per (model config, slots, cache length)."""
  key = (cfg.to_json(), rows, S)
  if key not in _PROGRAMS:
    kernels.prepare(cfg.attention_impl, cfg.moe_impl)   # before the first trace (its doc)
    _PROGRAMS[key] = _programs(cfg, rows, S)
  return _PROGRAMS[key]
