"""k2jax.engine's continuous batching on the tiny model: rows join a running batch and leave
it when they end, slots are reused, rows with different sampling settings share steps, and
none of it changes a row's tokens (each compared with the same request decoded alone)."""

import threading

import jax
import pytest

from k2jax import configs, model
from k2jax.serving import chat
from k2jax.data import ByteTokenizer
from k2jax.serving.engine import Engine, Job, row_seed
from k2jax.serving.generate import generate


@pytest.fixture(scope="module")
def tiny():
  cfg = configs.get_config("tiny").model
  return cfg, model.init(cfg, jax.random.key(3)), ByteTokenizer()


def _prompt(tok, i):
  return chat.encode([{"role": "user", "content": f"request {i}: " + "ab" * i}], tokenizer=tok)


class _Waiter:
  """A job's events: its finished choices, and the order jobs finished in (shared list)."""

  def __init__(self, order=None, name=None):
    self.done, self.deltas, self.order, self.name = {}, 0, order, name
    self.finished = threading.Event()

  def job(self, **kw) -> Job:
    self.n = kw.get("n", 1)
    return Job(emit=self.emit, **kw)

  def emit(self, e):
    if e.kind == "delta":
      self.deltas += 1
    elif e.kind == "error":
      self.error = e.error
      self.finished.set()
    elif e.kind == "done":
      self.done[e.index] = e
      if len(self.done) == self.n:
        if self.order is not None:
          self.order.append(self.name)
        self.finished.set()

  def result(self, timeout=300):
    assert self.finished.wait(timeout)
    return [(self.done[i].text, self.done[i].finish_reason, self.done[i].tokens)
            for i in sorted(self.done)]


def _alone(engine, **kw):
  w = _Waiter()
  engine.submit(w.job(**kw))
  return w.result()


def _rows_per_step(engine, before):
  steps = engine.stats["steps"] - before["steps"]
  return (engine.stats["row_steps"] - before["row_steps"]) / max(steps, 1)


def test_a_short_request_joins_a_running_batch_and_leaves_before_it_ends(tiny):
  cfg, params, tok = tiny
  engine = Engine(cfg, params, tok, max_batch=4, window_s=0.0, chunk=4)
  try:
    long_kw = dict(prompt=_prompt(tok, 1), max_tokens=160, temperature=0.0)
    short_kw = dict(prompt=_prompt(tok, 5), max_tokens=6, temperature=0.7, seed=11)
    long_alone, short_alone = _alone(engine, **long_kw), _alone(engine, **short_kw)
    assert long_alone[0][1] == "length"            # runs its full length: the test's premise
    # the greedy row also equals k2jax.generate's (an independent decode loop)
    ids = generate(cfg, params, [long_kw["prompt"]], max_new_tokens=160,
                   stop_ids=engine.stop_ids)[0]
    assert long_alone[0][0] == tok.decode([t for t in ids if t not in engine.stop_ids])
    # ... and so does the seeded sampled row: the same per-row key, the same draws
    ids = generate(cfg, params, [short_kw["prompt"]], max_new_tokens=6, temperature=0.7,
                   seed=[row_seed(11, 0)], stop_ids=engine.stop_ids)[0]
    assert short_alone[0][0] == tok.decode([t for t in ids if t not in engine.stop_ids])

    order, before = [], dict(engine.stats)
    lw, sw = _Waiter(order, "long"), _Waiter(order, "short")
    engine.submit(lw.job(**long_kw))
    while lw.deltas < 20:                          # the long row is decoding ...
      assert not lw.finished.wait(0.01)
    engine.submit(sw.job(**short_kw))              # ... when the short one arrives
    assert sw.result() == short_alone and lw.result() == long_alone
    assert order == ["short", "long"]              # it left first
    assert engine.stats["rows"] - before["rows"] == 2
    assert _rows_per_step(engine, before) > 1      # the two shared decode steps
  finally:
    engine.close()


def test_slots_are_reused_and_mixed_settings_share_steps(tiny):
  """Two slots, six requests with six different sampling settings (greedy, temperatures,
  top_k, top_p, n = 2): every row equals its request decoded alone, and no step served more
  rows than there are slots."""
  cfg, params, tok = tiny
  engine = Engine(cfg, params, tok, max_batch=2, window_s=0.0)
  try:
    settings = [dict(temperature=0.0), dict(temperature=1.0, seed=1),
                dict(temperature=0.5, top_k=7, seed=2), dict(temperature=1.3, top_p=0.6, seed=3),
                dict(temperature=0.9, top_k=20, top_p=0.9, seed=4),
                dict(temperature=1.0, seed=5, n=2)]
    kws = [dict(prompt=_prompt(tok, i), max_tokens=5 + 3 * i, **s) for i, s in enumerate(settings)]
    alone = [_alone(engine, **kw) for kw in kws]
    assert alone[-1][0] != alone[-1][1]            # n = 2: the rows draw differently
    before = dict(engine.stats)
    waiters = [_Waiter() for _ in kws]
    for w, kw in zip(waiters, kws):
      engine.submit(w.job(**kw))
    assert [w.result() for w in waiters] == alone
    assert engine.stats["most_rows"] == 2
    assert _rows_per_step(engine, before) > 1.5
  finally:
    engine.close()


def test_requests_that_cannot_fit_are_refused_and_the_engine_goes_on(tiny):
  cfg, params, tok = tiny
  engine = Engine(cfg, params, tok, max_batch=2, max_len=256, window_s=0.0)
  prompt = _prompt(tok, 0)
  try:
    assert engine.max_len == 256 > len(prompt)
    for kw in (dict(n=3, max_tokens=4), dict(n=1, max_tokens=256 - len(prompt) + 1)):
      w = _Waiter()
      engine.submit(w.job(prompt=prompt, temperature=0.0, **kw))
      assert w.finished.wait(60) and "slots" in str(w.error)
    text, reason, n = _alone(engine, prompt=prompt, max_tokens=256 - len(prompt),
                             temperature=0.0)[0]
    assert reason in ("length", "stop") and 1 <= n <= 256 - len(prompt)
  finally:
    engine.close()


def test_a_prompt_that_continues_a_finished_one_runs_only_its_new_tokens(tiny):
  """An agent loop's next turn resends the dialog so far: the engine continues the slot that
  holds it (its prompt and the tokens it generated; decode.extend over the held cache)
  instead of prefilling the whole prompt, and the reply is the one a full prefill gives
  (tokens equal, log probabilities to float rounding)."""
  import numpy as np
  cfg, params, tok = tiny
  reusing = Engine(cfg, params, tok, max_batch=2, window_s=0.0, reuse_min=16)
  fresh = Engine(cfg, params, tok, max_batch=2, window_s=0.0, reuse_min=None)

  def reply(engine, prompt):
    w = _Waiter()
    engine.submit(w.job(prompt=prompt, max_tokens=12, temperature=0.0, logprobs=2))
    w.result()
    return w.done[0]
  try:
    dialog = [{"role": "system", "content": "You are terse. " * 8},
              {"role": "user", "content": "hello"}]
    prompt = chat.encode(dialog, tokenizer=tok)
    first = reply(reusing, prompt)
    assert reusing.stats["reused_tokens"] == 0 and first.tokens == 12
    # another request decodes meanwhile, beside the free slot that holds the first turn
    reply(reusing, [tok.bos_id] + [int(i) for i in tok.encode("meanwhile, elsewhere")])
    said = [i for i, _, _ in first.logprobs]               # the ids the reply generated
    prompt = prompt + said + [int(i) for i in tok.encode("<|im_end|>and then?")]
    second = reply(reusing, prompt)
    # held: the first prompt and every token fed after it (the reply's, and a chunk's
    # overrun past its end, which the new prompt does not repeat)
    assert reusing.stats["reused_tokens"] == len(prompt) - len(tok.encode("<|im_end|>and then?"))
    want = reply(fresh, prompt)
    assert fresh.stats["reused_tokens"] == 0
    assert second.text == want.text
    np.testing.assert_allclose([lp for _, lp, _ in second.logprobs],
                               [lp for _, lp, _ in want.logprobs], atol=1e-4)
    # a prompt that shares fewer than reuse_min tokens with any slot is prefilled whole
    prefills, reused = reusing.stats["prefills"], reusing.stats["reused_tokens"]
    reply(reusing, [tok.bos_id] + [int(i) for i in tok.encode("an unrelated document")])
    assert reusing.stats["prefills"] == prefills + 1 and reusing.stats["reused_tokens"] == reused
    assert len(reusing._held[0]) == reusing._length[0]    # what a slot holds, counted right
  finally:
    reusing.close()
    fresh.close()


def _reference_tokens(cfg, params, prompt, n, *, presence=0.0, frequency=0.0, repetition=1.0,
                      bias=None, min_tokens=0, stops=()):
  """Greedy decoding by a full forward pass per token (no cache), the request's adjustments
  written out in float64 numpy from their definitions (OpenAI's penalties and logit_bias,
  vLLM's repetition_penalty and min_tokens): what the engine's on-device version must pick."""
  import numpy as np
  width = len(prompt) + n           # one padded length: one compile (causal: the padding
  forward = jax.jit(lambda p, ids: model.forward(cfg, p, ids)[0][0])   # after is not seen)
  out = []
  for t in range(n):
    ids = np.zeros((1, width), np.int32)
    ids[0, :len(prompt) + t] = list(prompt) + out
    logits = np.asarray(forward(params, ids)[len(prompt) + t - 1], np.float64)
    for tid, v in (bias or {}).items():
      logits[tid] += v
    counts = np.bincount(np.asarray(out, int), minlength=logits.size)[:logits.size]
    seen = counts > 0
    seen[list(prompt)] = True
    logits = np.where(seen, np.where(logits > 0, logits / repetition, logits * repetition),
                      logits)
    logits = logits - frequency * counts - presence * (counts > 0)
    if t < min_tokens:
      logits[list(stops)] = -np.inf
    out.append(int(np.argmax(logits)))
    if out[-1] in stops:
      break
  return out


def test_penalties_bias_and_min_tokens_pick_what_their_definitions_pick(tiny):
  """Each adjustment on its own and all together, greedy, against `_reference_tokens`; the
  rows share a batch with a plain row, which gets its tokens as if alone; a row that later
  takes a biased row's slot gets no bias. min_tokens: a bias of +100 on EOS makes the row
  stop right after min_tokens."""
  cfg, params, tok = tiny
  engine = Engine(cfg, params, tok, max_batch=4, window_s=0.2)
  prompt = _prompt(tok, 3)
  n = 12
  cases = [dict(presence=1.5), dict(frequency=0.8), dict(repetition=1.6),
           dict(bias={ord("q"): 4.0, ord(" "): -3.0}),
           dict(presence=0.4, frequency=0.3, repetition=1.2, bias={ord("e"): 2.0})]
  keys = dict(presence="presence_penalty", frequency="frequency_penalty",
              repetition="repetition_penalty", bias="logit_bias")
  try:
    plain = _alone(engine, prompt=prompt, max_tokens=n, temperature=0.0)
    for case in cases:
      ws = [_Waiter(), _Waiter()]
      engine.submit(ws[0].job(prompt=prompt, max_tokens=n, temperature=0.0,
                              **{keys[k]: v for k, v in case.items()}))
      engine.submit(ws[1].job(prompt=prompt, max_tokens=n, temperature=0.0))
      text, _, _ = ws[0].result()[0]
      want = _reference_tokens(cfg, params, prompt, n, **case)
      assert text == tok.decode(want), case
      assert ws[1].result() == plain                       # no leak into the plain row
      assert text != plain[0][0], case                     # (the adjustment did something)
    # the biased row's slot, reused by a plain row
    assert _alone(engine, prompt=prompt, max_tokens=n, temperature=0.0) == plain
    got = _alone(engine, prompt=prompt, max_tokens=n, temperature=0.0, min_tokens=5,
                 logit_bias={tok.eos_id: 100.0})
    want = _reference_tokens(cfg, params, prompt, n, bias={tok.eos_id: 100.0}, min_tokens=5,
                             stops=engine.stop_ids)
    assert len(want) == 6 and want[-1] == tok.eos_id
    assert got == [(tok.decode(want), "stop", 6)]
    # a stop string that occurs before min_tokens does not end the row; one ending after
    # it does, and the text is cut there (vLLM's rule)
    text = _alone(engine, prompt=prompt, max_tokens=2 * n, temperature=0.0)[0][0]
    early = len(tok.decode(_reference_tokens(cfg, params, prompt, 6)))
    stop = next(c for c in text if c.isascii() and text.count(c) >= 2
                and text.index(c) < early)
    got = _alone(engine, prompt=prompt, max_tokens=2 * n, temperature=0.0, min_tokens=6,
                 stop=[stop])
    cut = text.find(stop, early - len(stop) + 1)
    assert cut > 0 and got[0][:2] == (text[:cut], "stop")
    assert cut != text.index(stop)
  finally:
    engine.close()


def test_one_request_decodes_on_a_mesh_of_more_batch_devices_than_rows():
  """On --mesh data=2,expert=2 (4 simulated devices) a batch splits its rows over 4 devices:
  generate pads one prompt to 4 rows, and the engine keeps 4 slots for max_batch 3
  (engine.slot_count), split one a device, decoding every slot each dispatch. A request
  alone, then two together, give one device's greedy tokens (log probabilities within 1e-4).
  (A batch of fewer rows than those devices failed in the MoE layers' shard_map.)"""
  from tests.multidevice import worker
  got = worker(4, "engine_mesh")
  assert not got["errors"] and got["slots"] == 4, got
  want = got["want"]
  runs = got["runs"]       # generate's one prompt, the engine's alone, then both
  assert len(runs) == 4
  for (tokens, lps), (w_tokens, w_lps) in zip(runs, [want[0], want[0], want[0], want[1]]):
    assert tokens == w_tokens, (tokens, w_tokens)
    assert max(abs(a - b) for a, b in zip(lps, w_lps)) < 1e-4


def _reply_by_decoding_it_all(tok, ids, stops, stop_ids):
  """Brute force: after each token decode every id so far and search the whole text for the
  stops (the engine's former rule, which cost the host a reply's length a token): the text a
  reply ends with and the token it ends at."""
  for k in range(1, len(ids) + 1):
    text = tok.decode([t for t in ids[:k] if t not in stop_ids])
    while text.endswith("\ufffd") and k < len(ids):   # a character still arriving
      text = text[:-1]
    found = [f for f in (text.find(s) for s in stops) if f >= 0]
    if found:
      return text[:min(found)], k
    if ids[k - 1] in stop_ids:
      return tok.decode([t for t in ids[:k] if t not in stop_ids]), k
  return tok.decode([t for t in ids if t not in stop_ids]), len(ids)


def test_a_reply_decoded_a_token_at_a_time_reads_as_decoding_it_whole(tiny):
  """Sampled replies of a random byte-level model (bytes of every kind: ASCII, the leading
  and continuation bytes of multi-byte characters, invalid ones): each row's streamed deltas
  add up to its final text, and that text and the token it stops at are what decoding every
  id again and searching all of it find (the stop strings are common letters, so most rows
  stop at one). And the engine decodes no reply whole: the ids it hands the tokenizer's
  decode() stay within the replies' length (they were that length again every token)."""
  cfg, params, tok = tiny
  decoded = []

  class Counting(ByteTokenizer):
    def decode(self, ids):
      ids = list(ids)
      decoded.append(len(ids))
      return super().decode(ids)
  engine = Engine(cfg, params, Counting(), max_batch=8, window_s=0.2)
  stops = [["e"], ["ab", "x"], [" t", "\u00e9"], []]
  streamed, waiters, replies = {}, [], []
  try:
    for i, stop in enumerate(stops):
      w = _Waiter()
      w.n = 1

      def emit(e, w=w, i=i):
        if e.kind == "delta":
          streamed[i] = streamed.get(i, "") + e.text
        w.emit(e)
      engine.submit(Job(prompt=_prompt(tok, i), max_tokens=120, temperature=1.0, seed=i,
                        stop=stop, logprobs=0, emit=emit))
      waiters.append(w)
    for i, (stop, w) in enumerate(zip(stops, waiters)):
      w.result()
      done = w.done[0]
      ids = [entry[0] for entry in done.logprobs]
      want, at = _reply_by_decoding_it_all(tok, ids, stop, engine.stop_ids)
      assert done.text == want and len(ids) == at, (i, done.text, want, len(ids), at)
      assert streamed.get(i, "") == done.text, (i, streamed.get(i), done.text)
      replies.append(len(ids))
    assert sum(decoded) <= sum(replies), (sum(decoded), replies)
  finally:
    engine.close()


@pytest.mark.parametrize("max_len", [256, 1000, 1024])
def test_a_slot_holds_its_rows_tokens_and_a_dispatch_not_twice_them(tiny, max_len):
  """A slot of the cache holds max_len tokens and the chunk a dispatch may run past a row's
  end, to TPU's 128 lanes: a power-of-two max_len (the default, and K2's 4,096) once took
  the next power of two, twice the memory a row can use. The decode program's cache has
  that many positions."""
  cfg, params, tok = tiny
  engine = Engine(cfg, params, tok, max_batch=2, max_len=max_len)
  try:
    need = max_len + engine.chunk
    assert need <= engine._S < need + 128 and engine._S % 128 == 0, (max_len, engine._S)
    _alone(engine, prompt=_prompt(tok, 1), max_tokens=3, temperature=0.0)
    assert {a.shape[2] for lat in engine._cache.layers.values() for a in lat} == {engine._S}
  finally:
    engine.close()


def test_a_constrained_row_does_not_slow_the_others_dispatches(tiny):
  """One row under a logits processor (its mask from the host before each token, as a tool
  call or response_format has) beside two free rows: the free rows keep dispatches of
  `chunk` steps (they ran one step a dispatch while any row was constrained), the
  constrained row one, and every row's tokens are those of its request decoded alone."""
  import numpy as np
  cfg, params, tok = tiny
  letters = np.zeros(cfg.vocab_size, bool)
  letters[ord("a"):ord("z") + 1] = True

  def only_letters(row, ids):
    return letters
  engine = Engine(cfg, params, tok, max_batch=4, window_s=0.3)
  try:
    kws = [dict(prompt=_prompt(tok, 1), max_tokens=12, temperature=1.0, seed=3,
                processor=only_letters),
           dict(prompt=_prompt(tok, 2), max_tokens=40, temperature=0.0),
           dict(prompt=_prompt(tok, 3), max_tokens=40, temperature=1.0, seed=4)]
    alone = [_alone(engine, **kw) for kw in kws]
    assert set(alone[0][0][0]) <= set("abcdefghijklmnopqrstuvwxyz") and alone[0][0][2] == 12
    dispatches, dispatch = [], engine._dispatch

    def record(rows, n, every):
      dispatches.append((n, [r.job.processor is not None for r in rows]))
      return dispatch(rows, n, every)
    engine._dispatch = record
    waiters = [_Waiter() for _ in kws]
    for w, kw in zip(waiters, kws):
      engine.submit(w.job(**kw))
    assert [w.result() for w in waiters] == alone
    together = [n for n, held in dispatches if any(held)]
    free = [n for n, held in dispatches if not any(held)]
    assert together and set(together) == {1}, dispatches
    assert free and set(free) == {engine.chunk}, dispatches
    assert all(all(held) or not any(held) for _, held in dispatches), dispatches
  finally:
    engine.close()


def test_warmup_ends_when_the_slots_are_not_a_power_of_two(tiny):
  """warmup runs a request for each batch bucket: with 3 slots the bucket of 4 is reached
  by 3 rows (it asked for 4 rows, which the engine refused once while warmup waited for 4
  answers: it never returned)."""
  cfg, params, tok = tiny
  engine = Engine(cfg, params, tok, max_batch=3, window_s=0.0)
  try:
    t = threading.Thread(target=engine.warmup, args=(8, 2, False), daemon=True)
    t.start()
    t.join(timeout=120)
    assert not t.is_alive() and engine.stats["prefills"] == 3
  finally:
    engine.close()
