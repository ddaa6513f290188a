"""Sampling from a trained run or a published checkpoint, over MLA's latent cache.

    from k2jax.serving.generate import generate
    out = generate(cfg, params, [[1, 2, 3], [4, 5]], max_new_tokens=32, temperature=0.8, top_p=0.9)

    python -m k2jax.generate --workdir runs/tiny --prompt "def "        # newest checkpoint of a run
    python -m k2jax.generate --hf /path/to/Kimi-K2-Instruct --chat --prompt "Hi"

Prompts of different lengths share one batch; the cache is sized to a power-of-two bucket of
prompt + new tokens, so one prefill and one decode step are compiled per (batch, bucket) and
reused for every token (k2jax.model.decode). Sampling (greedy, temperature, top-k, top-p) runs
on device; each step's tokens come back to the host only to stop finished rows, stream text
and, when given, apply a logits processor (e.g. k2jax.serving.chat's tool-call constraint).
"""

import argparse
import contextlib
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from k2jax import kernels
from k2jax.model import decode


def bucket(n: int, minimum: int = 16) -> int:
  """The compile bucket of a length: the next power of two (at least `minimum`)."""
  return max(minimum, 1 << (max(n, 1) - 1).bit_length())


def batch_devices(mesh=None) -> int:
  """Devices a batch's rows are split over on `mesh` (default: the one set by
  jax.set_mesh), those of the logical `batch` axis: 1 without a mesh."""
  from k2jax.configs.sharding_rules import active_mesh_axes
  mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
  return math.prod(mesh.shape[a] for a in active_mesh_axes("batch", mesh))


def rows_bucket(n: int, mesh=None) -> int:
  """The compile bucket of a batch of n rows: the next power of two, rounded up to a
  multiple of `batch_devices(mesh)`. Under a mesh the MoE layers split a batch's rows over
  those devices (k2jax.model.moe), which needs every device to get whole rows."""
  k = batch_devices(mesh)
  return -(-bucket(n, minimum=1) // k) * k


def cache_axes(rows: int, mesh=None) -> tuple:
  """The mesh axes a latent cache of `rows` rows is split over on `mesh` (default: the one
  set): the batch's (`batch_devices`) where they divide the rows, so each device holds the
  rows it decodes; () for a cache whole on every device (or no mesh)."""
  from k2jax.configs.sharding_rules import active_mesh_axes
  mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
  if mesh.empty:
    return ()
  axes = active_mesh_axes("batch", mesh)
  return axes if axes and rows % batch_devices(mesh) == 0 else ()


def cache_specs(rows: int, mesh=None) -> tuple:
  """PartitionSpecs of a cache's latents [layers, rows, positions, width] and lengths."""
  P = jax.sharding.PartitionSpec
  return P(None, cache_axes(rows, mesh) or None, None, None), P()


def cache_shardings(cfg, rows: int, S: int, mesh):
  """Where a cache of `rows` x S positions (`decode.init_cache`) lives on `mesh`
  (`cache_specs`); None without a mesh: the default device."""
  if mesh is None:
    return None
  latent, lengths = (jax.sharding.NamedSharding(mesh, s) for s in cache_specs(rows, mesh))
  cache = jax.eval_shape(lambda: decode.init_cache(cfg, rows, S))
  return decode.Cache(jax.tree.map(lambda _: latent, cache.layers), lengths)


_NEW_CACHE: dict = {}


def new_cache(cfg, rows: int, S: int, mesh=None):
  """A zero cache of `rows` x S positions placed by `cache_shardings` (its program compiled
  once per model, shape and mesh: RL's rollouts ask for one every iteration)."""
  key = (cfg.to_json(), rows, S, mesh)
  if key not in _NEW_CACHE:
    _NEW_CACHE[key] = jax.jit(lambda: decode.init_cache(cfg, rows, S),
                              out_shardings=cache_shardings(cfg, rows, S, mesh))
  return _NEW_CACHE[key]()


def place_cache(cache):
  """`cache` (inside a jitted program) held where `cache_specs` puts it on the mesh set, so
  a program returns it where the next one takes it."""
  rows = cache.lengths.shape[0]
  if not cache_axes(rows):
    return cache
  latent, lengths = cache_specs(rows)
  return cache._replace(layers=jax.tree.map(
      lambda a: jax.lax.with_sharding_constraint(a, latent), cache.layers),
      lengths=jax.lax.with_sharding_constraint(cache.lengths, lengths))


def fold(key, i):
  """fold_in for one key or a batch of keys [B] (one per row)."""
  return jax.vmap(jax.random.fold_in, (0, None))(key, i) if key.shape else jax.random.fold_in(key, i)


def sample(logits, key, *, temperature: float, top_k: int | None, top_p: float | None,
           allowed=None):
  """Next tokens [B] from logits [B, V]: greedy at temperature 0, else softmax(logits / T)
  restricted to the top_k tokens and to the smallest set whose probability reaches top_p.
  allowed [B, V] bool (optional) masks tokens out first. `key` is one key for the batch, or
  keys [B], one per row: then a row's draw depends on its key and logits only, not on which
  rows share its batch (what lets a server batch seeded requests)."""
  logits = logits.astype(jnp.float32)
  if allowed is not None:
    logits = jnp.where(allowed, logits, -jnp.inf)
  if isinstance(temperature, (int, float)) and temperature <= 0:   # else: traced, > 0
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits / temperature
  if top_k:
    kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
    logits = jnp.where(logits >= kth, logits, -jnp.inf)
  if top_p is not None and top_p < 1.0:
    order = jnp.argsort(-logits, axis=-1)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs          # mass strictly above each token
    keep_sorted = before < top_p                         # the top token is always kept
    keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(
        keep_sorted)
    logits = jnp.where(keep, logits, -jnp.inf)
  if key.shape:
    return jax.vmap(lambda k, x: jax.random.categorical(k, x))(key, logits).astype(jnp.int32)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def sample_rows(logits, keys, *, temperature, top_k, top_p, allowed=None, filtered: bool = True):
  """`sample` with every setting per row, so rows that sample differently share a batch
  (k2jax.serving.engine): next tokens [B] from logits [B, V], keys [B], temperature [B] (0 =
  greedy), top_k [B] int (0 = every token), top_p [B] (1 = every token), allowed [B, V] bool
  or None. A row's token is the one `sample` draws for it alone with the same key and
  settings. filtered=False skips the top-k / top-p masks (no row uses them): the sort of
  the vocabulary they need is then not in the program.

  Per row: z = logits / T; with k > 0 only tokens with z >= the k-th largest z stay, then
  of those only the smallest prefix (by z, descending) whose probability mass before each
  token is < top_p; the token is drawn from softmax(z) over what stays, or argmax where T = 0.
  """
  logits = logits.astype(jnp.float32)
  if allowed is not None:
    logits = jnp.where(allowed, logits, -jnp.inf)
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  z = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
  if filtered:
    V = z.shape[-1]
    order = jnp.argsort(-z, axis=-1)
    zs = jnp.take_along_axis(z, order, axis=-1)                  # descending
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
    kth = jnp.take_along_axis(zs, (k - 1)[:, None], axis=-1)
    zs = jnp.where(zs >= kth, zs, -jnp.inf)
    probs = jax.nn.softmax(zs, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    keep_sorted = (zs > -jnp.inf) & ((before < top_p[:, None]) | (top_p[:, None] >= 1.0))
    keep = jnp.zeros_like(keep_sorted).at[jnp.arange(z.shape[0])[:, None], order].set(
        keep_sorted)
    z = jnp.where(keep, z, -jnp.inf)
  drawn = jax.vmap(jax.random.categorical)(keys, z).astype(jnp.int32)
  return jnp.where(temperature > 0, drawn, greedy)


class Penalties(NamedTuple):
  """What OpenAI's / vLLM's logit adjustments read, per row: counts [R, V] int32 of each
  token generated so far, prompt [R, V] bool (the token is in the row's prompt), bias [R, V]
  f32 (logit_bias)."""
  counts: jax.Array
  prompt: jax.Array
  bias: jax.Array

  @staticmethod
  def zeros(rows: int, vocab: int) -> "Penalties":
    return Penalties(jnp.zeros((rows, vocab), jnp.int32), jnp.zeros((rows, vocab), bool),
                     jnp.zeros((rows, vocab), jnp.float32))

  @staticmethod
  def fresh(prompts, bias_ids, bias_values, vocab: int) -> "Penalties":
    """Rows starting afresh: no counts, their prompts [R, T] (ids; negative: padding) and
    their logit biases (bias_ids [R, K], negative: none; bias_values [R, K])."""
    R = prompts.shape[0]
    rows = jnp.arange(R)[:, None]
    prompt = jnp.zeros((R, vocab), bool).at[rows, jnp.where(prompts < 0, vocab, prompts)].set(
        True, mode="drop")
    bias = jnp.zeros((R, vocab), jnp.float32).at[
        rows, jnp.where(bias_ids < 0, vocab, bias_ids)].set(bias_values, mode="drop")
    return Penalties(jnp.zeros((R, vocab), jnp.int32), prompt, bias)

  def seen(self, tokens) -> "Penalties":
    """The rows' sampled tokens [R] counted."""
    return self._replace(counts=self.counts.at[jnp.arange(tokens.shape[0]), tokens].add(1))


def penalize(logits, pen: Penalties, *, presence, frequency, repetition, biased, t,
             min_tokens, stop_ids):
  """The logits [R, V] a row samples from after its request's adjustments, each per row
  ([R] arrays; the neutral values change nothing):

      l = l + bias                                        logit_bias (OpenAI; where biased)
      l = l / r where l > 0, l * r where l <= 0,          repetition_penalty r (vLLM / HF;
          for tokens in the prompt or generated           1: none)
      l = l - frequency * count - presence * [count > 0]  OpenAI's penalties, over the
                                                          tokens generated (0: none)
      l[stop_ids] = -inf while t < min_tokens             min_tokens (vLLM: no stop token
                                                          before it)

  t [R]: the index of the token about to be drawn (tokens generated so far)."""
  l = logits.astype(jnp.float32) + jnp.where(biased[:, None], pen.bias, 0.0)
  counts = pen.counts.astype(jnp.float32)
  seen = pen.prompt | (pen.counts > 0)
  r = repetition[:, None]
  l = jnp.where(seen, jnp.where(l > 0, l / r, l * r), l)
  l = l - frequency[:, None] * counts - presence[:, None] * (counts > 0)
  early = (t < min_tokens)[:, None]
  stop = jnp.zeros(l.shape[-1], bool).at[stop_ids].set(True, mode="drop")
  return jnp.where(early & stop[None, :], -jnp.inf, l)


_PROGRAMS: dict[str, tuple] = {}


def _programs(cfg):
  """(prefill, decode step), each fused with sampling and jitted once per model config (and
  then per shape): one dispatch per generated token."""
  key = cfg.to_json()
  if key not in _PROGRAMS:
    kernels.prepare(cfg.attention_impl, cfg.moe_impl)   # before the first trace (its doc)
    # The temperature is traced (RL decays it every iteration: no recompilation); only
    # greedy-or-not, top_k and top_p shape the program.
    opts = ("greedy", "top_k", "top_p")

    def _sample(logits, key, allowed, greedy, temperature, **o):
      return sample(logits, key, allowed=allowed, temperature=0.0 if greedy else temperature, **o)

    def prefill(params, tokens, lengths, cache, key, allowed, **o):
      logits, cache = decode.prefill(cfg, params, tokens, lengths, cache)
      return _sample(logits, key, allowed, **o), logits, place_cache(cache)

    def step(params, cache, tokens, key, allowed, **o):
      logits, cache = decode.decode_step(cfg, params, cache, tokens)
      return _sample(logits, key, allowed, **o), logits, place_cache(cache)

    def steps(params, cache, tokens, key, start, n, logp=False, **o):
      """n decode steps on device (no logits processor): tokens [n, B] (with logp: and
      each one's log probability [n, B])."""
      def body(carry, i):
        cache, tok = carry
        nxt, logits, cache = step(params, cache, tok, fold(key, start + i), None, **o)
        return (cache, nxt), ((nxt, token_logprobs(logits, nxt)) if logp else nxt)
      (cache, _), toks = jax.lax.scan(body, (cache, tokens), jnp.arange(n))
      return toks, place_cache(cache)

    _PROGRAMS[key] = (jax.jit(prefill, static_argnames=opts),
                      jax.jit(step, static_argnames=opts, donate_argnums=1),
                      jax.jit(steps, static_argnames=opts + ("n", "logp"), donate_argnums=1))
  return _PROGRAMS[key]


CHUNK = 16   # decode steps per dispatch when no logits processor needs the host every step


def token_logprobs(logits, tokens):
  """log softmax(logits)[token] per row, at temperature 1 (the policy's own probability,
  what a trainer's forward gives the same token): logits [B, V], tokens [B] -> [B]."""
  logp = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1)
  return jnp.take_along_axis(logp, jnp.asarray(tokens)[:, None], axis=-1)[:, 0]


def check_sampling(temperature: float, top_k: int | None, top_p: float | None,
                   vocab_size: int | None, flag: str = "") -> None:
  """ValueError (one line naming the value and the range) for settings that cannot sample:
  a NaN or negative temperature, top_k outside [1, vocab] (only its lower bound while the
  vocabulary is unknown, vocab_size None), top_p outside (0, 1]. `flag` prefixes the names
  as the caller spells them (the CLI: "--")."""
  if not math.isfinite(temperature) or temperature < 0:
    raise ValueError(f"{flag}temperature {temperature}: must be a finite number >= 0 "
                     "(0 = greedy)")
  if top_k is not None and not 1 <= top_k <= (vocab_size or top_k):
    size = "" if vocab_size is None else f" ({vocab_size})"
    raise ValueError(f"{flag}top_k {top_k}: must be between 1 and the vocabulary size{size}; "
                     "leave it out to sample from all tokens")
  if top_p is not None and not (math.isfinite(top_p) and 0 < top_p <= 1):
    raise ValueError(f"{flag}top_p {top_p}: must be in (0, 1]; 1 keeps every token")


def check_context(cfg, prompts, max_new_tokens: int, flag: str = "") -> None:
  """ValueError when the longest prompt plus the tokens to generate exceed the context."""
  longest = max(len(p) for p in prompts)
  if longest + max_new_tokens > cfg.max_position_embeddings:
    raise ValueError(
        f"a {flag}prompt of {longest} tokens + {flag}max_new_tokens {max_new_tokens} exceeds "
        f"the model's context of {cfg.max_position_embeddings} tokens: shorten the prompt or "
        "generate fewer tokens")


def _padded_batch(prompts, max_new_tokens: int):
  """(tokens [B, T] right-padded, lengths [B], cache length S) of `prompts`. The batch is
  bucketed like the lengths (RL decodes a different number of unfinished trajectories every
  iteration, a server a different number of requests), and filled to the mesh's batch
  devices: extra rows repeat the first prompt, start finished and are never reported."""
  B = rows_bucket(len(prompts))
  prompts = list(prompts) + [prompts[0]] * (B - len(prompts))
  lengths = np.asarray([len(p) for p in prompts], np.int32)
  tokens = np.zeros((B, bucket(int(lengths.max()))), np.int32)
  for b, p in enumerate(prompts):
    tokens[b, :len(p)] = p
  return tokens, lengths, bucket(int(lengths.max()) + max_new_tokens)


def _sampling_key(seed, n: int, B: int):
  """One key for the batch (an int seed) or one per row (a seed per prompt; padding rows 0)."""
  if isinstance(seed, (int, np.integer)):
    return jax.random.key(seed)
  if len(seed) != n:
    raise ValueError(f"generate: {len(seed)} seeds for {n} prompts")
  return jax.vmap(jax.random.key)(jnp.asarray(list(seed) + [0] * (B - n), jnp.uint32))


def generate(cfg, params, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             seed: int | Sequence[int] = 0, stop_ids: Sequence[int] = (),
             logits_processor: Callable[[int, list[int]], np.ndarray | None] | None = None,
             on_token: Callable[[list[int | None]], set[int] | None] | None = None,
             return_logprobs: bool = False):
  """Sample continuations of token-id prompts (lists of different lengths).

  Args:
    cfg: the model config (as `k2jax.interop.hf.load_checkpoint` returns it).
    params: the model's parameters.
    prompts: token-id lists, one per row (at least one token each).
    max_new_tokens: tokens to generate per row at most.
    temperature: sampling temperature (0 = greedy).
    top_k: keep the k most likely tokens (None: all).
    top_p: nucleus sampling's mass (None: all).
    seed: the sampling key: one for the batch, or one per row (a row's tokens then do not
      depend on the other rows; k2jax.serving.engine batches seeded requests this way).
    stop_ids: a row ends after emitting any of these (the stop token is included).
    logits_processor: fn(row, tokens generated so far) -> bool [vocab] of allowed next tokens
      (or None = all), called on the host per row and step (constrained decoding).
    on_token: fn(list of this step's token per row, None for finished rows), for streaming;
      it may return a set of rows to end now (stop strings).
    return_logprobs: also return each generated token's log probability under the model
      (temperature 1, before top-k / top-p: the policy's, whatever sampled it), as the
      sampler computed it; RL compares them with the trainer's.
  Returns:
    The generated token ids per row (the prompt excluded); with return_logprobs, (ids,
    log probabilities) of the same shape.
  """
  if not prompts or any(len(p) == 0 for p in prompts):
    raise ValueError("generate: every prompt needs at least one token")
  check_sampling(temperature, top_k, top_p, cfg.vocab_size)
  check_context(cfg, prompts, max_new_tokens)
  n = len(prompts)
  tokens, lengths, S = _padded_batch(prompts, max_new_tokens)
  B = len(tokens)
  prefill, step, steps = _programs(cfg)
  opts = dict(greedy=temperature <= 0, temperature=jnp.float32(max(float(temperature), 1e-6)),
              top_k=top_k, top_p=top_p)
  key = _sampling_key(seed, n, B)
  stop = set(int(s) for s in stop_ids)
  out: list[list[int]] = [[] for _ in range(B)]
  done = np.arange(B) >= n

  def allowed():
    """The logits processor's masks (host side), or None: the on-device path."""
    if logits_processor is None:
      return None
    mask = np.ones((B, cfg.vocab_size), bool)
    for b in range(n):
      m = None if done[b] else logits_processor(b, out[b])
      if m is not None:
        mask[b, :len(m)] = m
    return jnp.asarray(mask)

  lps: list[list[float]] = [[] for _ in range(B)]
  # its rows split over the mesh's batch devices where one is set (each decodes its own)
  cache = (new_cache(cfg, B, S, jax.sharding.get_mesh()) if cache_axes(B) else
           decode.init_cache(cfg, B, S))
  nxt, logits, cache = prefill(params, jnp.asarray(tokens), jnp.asarray(lengths), cache,
                               fold(key, 0), allowed(), **opts)
  pending = [np.asarray(nxt)]            # sampled, not yet handed out
  pending_lp = [np.asarray(token_logprobs(logits, nxt))] if return_logprobs else [None]
  t = 0
  while True:
    for ids, lp in zip(pending, pending_lp):
      emitted = []
      for b in range(n):
        if done[b]:
          emitted.append(None)
          continue
        out[b].append(int(ids[b]))
        if lp is not None:
          lps[b].append(float(lp[b]))
        emitted.append(int(ids[b]))
        done[b] = int(ids[b]) in stop
      if on_token is not None:
        for b in on_token(emitted) or ():
          done[b] = True
      t += 1
      if done.all() or t == max_new_tokens:
        return (out[:n], lps[:n]) if return_logprobs else out[:n]
    # Rows that finished inside a chunk keep decoding there; their extra tokens are dropped.
    if logits_processor is None:
      chunk = min(CHUNK, max_new_tokens - t)
      toks, cache = steps(params, cache, nxt, key, t, n=chunk, logp=return_logprobs, **opts)
      toks, chunk_lp = toks if return_logprobs else (toks, None)
      nxt = toks[-1]
      pending = list(np.asarray(toks))
      pending_lp = list(np.asarray(chunk_lp)) if return_logprobs else [None] * len(pending)
    else:
      nxt, logits, cache = step(params, cache, nxt, fold(key, t), allowed(), **opts)
      pending = [np.asarray(nxt)]
      pending_lp = [np.asarray(token_logprobs(logits, nxt))] if return_logprobs else [None]


# ---------------------------------------------------------------------------------- CLI


class UserError(ValueError):
  pass


MESH_HELP = ("devices to sample on, as data=D,context=C,expert=E (e.g. context=8: each long "
             "prompt's prefill split over 8 devices, k2jax.model.context; default: one device)")


def inference_mesh(text: str | None, flag: str = "--mesh", devices=None):
  """The mesh a --mesh flag asks generate / serve to run on (data, context, expert; no
  pipeline: a decode step is one token), over the first devices it needs; None for none.
  devices: all of these instead (a slice compiled for: k2jax.compile), data filling what
  the other axes leave of them where the flag does not give it. UserError naming the flag
  and the fix when it cannot be had."""
  if not text:
    return None
  from k2jax import parallel
  from k2jax.parallel.mesh import parse_mesh
  try:
    shape = parse_mesh(text, flag=flag)
  except ValueError as e:
    raise UserError(str(e)) from None
  if shape["pipeline"] > 1:
    raise UserError(f"{flag} {text}: sampling has no pipeline (a decode step is one token); "
                    "leave pipeline out and split over data, context or expert")
  n, have = math.prod(shape.values()), len(jax.devices() if devices is None else devices)
  if devices is not None and "data=" not in text and have % n == 0:
    shape["data"], n = have // n, have
  if n > have or (devices is not None and n != have):
    raise UserError(f"{flag} {text}: needs {n} devices and {have} are here: use a mesh of "
                    f"{'at most ' if devices is None else ''}{have}")
  return parallel.make_mesh(shape, (jax.devices() if devices is None else devices)[:n])


def target_shardings(cfg, mesh, flag: str = "--mesh"):
  """Where the weights go: as the trainer shards them on `mesh` (experts over expert, the
  rest split over the expert group on its model dim, whole over data), or all on the
  first device without a mesh. UserError naming `flag` (the flag and its value) for a mesh
  the model's shapes do not divide."""
  from k2jax import model, parallel
  specs = model.param_specs(cfg)
  if mesh is None:
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda _: one, specs, is_leaf=model.spec.is_spec)
  try:
    return parallel.param_shardings(specs, mesh)
  except ValueError as e:
    raise UserError(f"{flag}: {str(e).splitlines()[0]}") from None


def _check_run_dir(workdir: str) -> None:
  """UserError unless `workdir` looks like a k2jax.train run (before loading anything)."""
  if not os.path.isdir(workdir):
    raise UserError(f"--workdir {workdir}: no such directory; pass the --workdir of a "
                    "k2jax.train run")
  names = os.listdir(workdir)
  if any(n.endswith(".safetensors") for n in names) and "checkpoints" not in names:
    raise UserError(f"--workdir {workdir} holds a Hugging Face checkpoint (safetensors), not "
                    f"a k2jax.train run: pass it as --hf {workdir}")


def load(args, mesh=None, flag: str = "--mesh"):
  """-> (model config, params, tokenizer) of --hf / --workdir, the params loaded straight
  into `mesh`'s shardings (target_shardings): each process reads only its shards."""
  from k2jax import data as data_lib
  from k2jax.training import weights
  path = args.hf or args.workdir
  if args.hf and weights.is_run(path):
    raise UserError(f"--hf {path} holds a k2jax run, not a Hugging Face checkpoint: pass "
                    f"it as --workdir {path}")
  try:
    source = weights.open_source(path, "hf" if args.hf else "run")
    cfg = source.model
    params = source.load(cfg, target_shardings(cfg, mesh, flag))
  except (OSError, ValueError) as e:
    raise UserError(str(e).splitlines()[0]) from None
  return cfg, params, data_lib.get_tokenizer(source.tokenizer())


def main(argv=None):
  p = argparse.ArgumentParser(prog="python -m k2jax.generate", description=__doc__.splitlines()[0])
  src = p.add_mutually_exclusive_group(required=True)
  src.add_argument("--workdir", help="a k2jax.train run: samples from its newest checkpoint")
  src.add_argument("--hf", help="a Hugging Face checkpoint directory (config.json + safetensors)")
  p.add_argument("--prompt", action="append", required=True,
                 help="prompt text (repeat for a batch)")
  p.add_argument("--chat", action="store_true", help="render each prompt as a user turn of K2's "
                 "chat format and stop at the end of the assistant turn")
  p.add_argument("--max_new_tokens", type=int, default=200)
  p.add_argument("--temperature", type=float, default=0.8)
  p.add_argument("--top_k", type=int, default=None)
  p.add_argument("--top_p", type=float, default=0.95)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
  p.add_argument("--mesh", default=None, help=MESH_HELP)
  args = p.parse_args(argv)
  from k2jax.training import interrupt
  generated: list[list[int]] = []   # per row, filled as it decodes: the stop line's count
  try:
    with interrupt.raising():       # loading too: a Ctrl-C there was a traceback
      _main(args, generated)
  except interrupt.Interrupted as e:
    where = f"after {sum(map(len, generated))} tokens" if generated else "while loading"
    print(f"\nk2jax.generate: stopped by {e.name} {where}", file=sys.stderr, flush=True)
    raise SystemExit(e.exit_code)


def _main(args, generated):
  try:
    if args.max_new_tokens < 1:
      raise UserError(f"--max_new_tokens {args.max_new_tokens}: must be >= 1")
    try:  # before loading; top_k's vocabulary bound once the model is known
      check_sampling(args.temperature, args.top_k, args.top_p, None, flag="--")
    except ValueError as e:
      raise UserError(str(e)) from None
    if any(s == "" for s in args.stop):
      raise UserError("--stop '': an empty stop string would end every row at once")
    if args.workdir:
      _check_run_dir(args.workdir)
    mesh = inference_mesh(args.mesh)         # before minutes of loading
    cfg, params, tok = load(args, mesh, flag=f"--mesh {args.mesh}")
    stop_ids = [tok.eos_id]
    texts = args.prompt
    if args.chat:
      from k2jax.serving import chat
      prompts = [chat.encode([{"role": "user", "content": t}], tokenizer=tok) for t in texts]
      stop_ids += chat.stop_ids(tok)
    else:
      prompts = [[tok.bos_id] + list(tok.encode(t)) for t in texts]
    try:
      check_sampling(args.temperature, args.top_k, args.top_p, cfg.vocab_size, flag="--")
      check_context(cfg, prompts, args.max_new_tokens, flag="--")
    except ValueError as e:
      raise UserError(str(e)) from None
  except UserError as e:
    print(f"k2jax.generate: error: {e}", file=sys.stderr)
    raise SystemExit(2)
  generated.extend([] for _ in prompts)
  with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
    _sample(args, cfg, params, tok, texts, prompts, stop_ids, generated)


def visible(text: str, stops) -> str:
  """What of a streamed text may be shown: up to its first stop string, and short of a tail
  that could still grow into one (printed text cannot be taken back)."""
  cut = min((text.index(s) for s in stops if s in text), default=None)
  if cut is not None:
    return text[:cut]
  hold = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
  return text[:len(text) - hold]


def _sample(args, cfg, params, tok, texts, prompts, stop_ids, generated):
  """main's decoding: streams one prompt as it decodes, prints a batch at the end."""
  stream = len(prompts) == 1
  shown = [""]

  def on_token(ids):
    ended = set()
    for b, i in enumerate(ids):
      if i is None:
        continue
      generated[b].append(i)
      if args.stop and any(s in tok.decode(generated[b]) for s in args.stop):
        ended.add(b)
    if stream and ids[0] is not None:
      text = visible(tok.decode([i for i in generated[0] if i not in stop_ids]), args.stop)
      print(text[len(shown[0]):], end="", flush=True)
      shown[0] = text
    return ended

  if stream:
    print(texts[0], end="", flush=True)
  t0 = time.perf_counter()
  out = generate(cfg, params, prompts, max_new_tokens=args.max_new_tokens,
                 temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                 seed=args.seed, stop_ids=stop_ids, on_token=on_token)
  dt = time.perf_counter() - t0
  if stream:    # a held-back tail that never became a stop string
    text = tok.decode([i for i in out[0] if i not in stop_ids])
    for s in args.stop:
      text = text.split(s)[0]
    print(text[len(shown[0]):], end="", flush=True)
  else:
    for b, ids in enumerate(out):
      text = tok.decode([i for i in ids if i not in stop_ids])
      for s in args.stop:
        text = text.split(s)[0]
      print(f"--- [{b}]\n{texts[b]}{text}")
  n = sum(len(o) for o in out)
  print(f"\n[{n} tokens in {dt:.2f}s (compile included): {n / dt:.1f} tokens/s, batch "
        f"{len(out)}]", file=sys.stderr)

if __name__ == "__main__":
  main()
