"""The train step: microbatch accumulation equals one big batch; bf16 compute trains."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k2jax import configs, optim
from k2jax.training.step import init_state, train_step


def _batch(cfg, B, T, seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, 256, (B, T + 1)).astype(np.int32)
  mask = np.ones((B, T), np.float32)
  mask[0, : T // 2] = 0  # uneven token counts per microbatch: the mean must weight by tokens
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": mask,
          "positions": np.tile(np.arange(T, dtype=np.int32), (B, 1)),
          "segment_ids": np.ones((B, T), np.int32)}


def _one_step(cfg, batch):
  """One jitted train step from a fresh state."""
  tx, schedule = optim.optimizer(cfg), optim.learning_rate_schedule(cfg)
  state = init_state(cfg, tx, jax.random.key(0))
  return jax.jit(functools.partial(train_step, cfg, tx, schedule))(state, batch)


@pytest.mark.parametrize("aux_loss_alpha", [0.0, 0.01])
def test_grad_accumulation_equals_one_batch(aux_loss_alpha):
  """Gradients, loss, aux loss and max logits of 2 microbatches equal those of the whole
  batch: the loss is a mean over all unmasked tokens, so unequal token counts must be
  weighted, and the sequence-wise balance loss a mean over sequences, so they must not
  (weighting it by each microbatch's tokens moved the router's gradient 3.4% here, the
  MoE layers' others 0.03-0.16%)."""
  from k2jax import model
  from k2jax.training.step import _grads
  cfg = configs.get_config("tiny")
  cfg.model.num_hidden_layers = 2
  cfg.model.aux_loss_alpha = aux_loss_alpha
  params = model.init(cfg.model, jax.random.key(0))
  batch = _batch(cfg, 4, 16)
  g1, loss1, aux1 = jax.jit(lambda p, b: _grads(cfg.model, p, b, 1))(params, batch)
  g2, loss2, aux2 = jax.jit(lambda p, b: _grads(cfg.model, p, b, 2))(params, batch)
  np.testing.assert_allclose(loss1, loss2, rtol=1e-6)
  np.testing.assert_allclose(aux1.aux_loss, aux2.aux_loss, rtol=1e-6)
  assert (aux1.aux_loss > 0) == (aux_loss_alpha > 0)
  np.testing.assert_allclose(aux1.max_logits, aux2.max_logits, rtol=1e-6)
  np.testing.assert_array_equal(aux1.expert_load, aux2.expert_load)
  for path, a in jax.tree_util.tree_flatten_with_path(g1)[0]:
    b = functools.reduce(lambda t, k: t[k.key], path, g2)
    rel = (np.linalg.norm(np.asarray(a - b, np.float64))
           / max(np.linalg.norm(np.asarray(a, np.float64)), 1e-30))
    assert rel < 1e-5, (jax.tree_util.keystr(path), rel)


@pytest.mark.parametrize("impl", ["blocked", "ragged", "dense", "capacity", "gather"])
def test_weights_cast_once_per_step_give_the_same_gradients(monkeypatch, impl):
  """train.cast_once: with float32 parameters, bf16 compute and 2 microbatches, the weights
  cast once per step give the gradients, loss, max logits and expert load of casting them
  inside each microbatch, to the bit, under every MoE impl that runs on CPU. The leaves the
  forward reads otherwise than as one cast of the whole leaf (router: float32; embedding:
  a gather; the experts under kernels.moe.SUM_BEFORE_CAST) must stay out of it: cast too,
  they change the gradients (checked, so the equality can fail). With blocked, the
  microbatch loop reads no float32 copy of a cast leaf."""
  from k2jax import model
  from k2jax.kernels import moe as moe_kernels
  from k2jax.model import spec
  from k2jax.training.step import _grads, differentiated
  cfg = configs.get_config("tiny")
  cfg.model.update(dict(num_hidden_layers=3, dtype="bfloat16", moe_impl=impl))
  params = model.init(cfg.model, jax.random.key(0))
  batch = _batch(cfg, 4, 16)
  batch["inputs"] = batch["inputs"] % 5   # repeated tokens: the embedding's rows sum
  cfg.train.grad_accum = 2
  fn = lambda co: (lambda p, b: _grads(cfg.model, differentiated(cfg, p) if co else p, b, 2))
  ref, got = jax.jit(fn(False))(params, batch), jax.jit(fn(True))(params, batch)
  for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(got)):
    np.testing.assert_array_equal(a, b)
  specs = model.param_specs
  wrong = (["experts"] if impl in moe_kernels.SUM_BEFORE_CAST
           else ["router", "embed"] if impl == "blocked" else [])
  for name in wrong:
    monkeypatch.setattr(model, "param_specs", lambda c, name=name: jax.tree_util.
                        tree_map_with_path(lambda path, s: s._replace(cast=True)
                                           if name in jax.tree_util.keystr(path) else s,
                                           specs(c), is_leaf=spec.is_spec))
    bad = jax.jit(fn(True))(params, batch)
    assert any(bool(jnp.any(a != b)) for a, b in
               zip(jax.tree.leaves(ref[0]), jax.tree.leaves(bad[0]))), name
  monkeypatch.setattr(model, "param_specs", specs)
  if impl != "blocked":
    return
  # what the microbatch loop (the one top-level scan) reads: the cast leaves in bf16 only
  flags = jax.tree.leaves(jax.tree.map(lambda s: s.cast, specs(cfg.model),
                                       is_leaf=spec.is_spec))
  cast = {x.shape for x, c in zip(jax.tree.leaves(params), flags) if c}
  kept = {x.shape for x, c in zip(jax.tree.leaves(params), flags) if not c}
  wide = {}
  for co in (False, True):
    loop = [e for e in jax.make_jaxpr(fn(co))(params, batch).eqns
            if e.primitive.name == "scan"]
    assert len(loop) == 1
    consts = loop[0].invars[:loop[0].params["num_consts"]]   # (the carry is the f32 sum)
    wide[co] = {v.aval.shape for v in consts if v.aval.dtype == jnp.float32}
  assert cast - kept <= wide[False] and not (cast - kept) & wide[True], wide
  # bf16 params under float32 compute: nothing is widened
  c = cfg.copy_and_resolve_references()
  c.model.update(dict(dtype="float32", param_dtype="bfloat16"))
  narrow = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
  assert all(a is b for a, b in zip(jax.tree.leaves(differentiated(c, narrow)),
                                    jax.tree.leaves(narrow)))


def test_bfloat16_step_is_finite_and_keeps_float32_params():
  cfg = configs.get_config("tiny")
  cfg.model.update(dict(num_hidden_layers=2, dtype="bfloat16"))
  state, m = _one_step(cfg, _batch(cfg, 2, 16))
  assert bool(m["finite"]) and np.isfinite(float(m["loss"]))
  assert all(x.dtype in (jnp.float32,) for x in jax.tree.leaves(state.params))


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_a_skipped_step_keeps_one_clock(monkeypatch, param_dtype):
  """A non-finite step is skipped (params and moments kept) but every optax step counter
  still advances with the trainer's step, so the logged learning rate is the one optax
  applies (schedule(count)) and a WSD decay still completes on time. bf16 params: the kept
  params are the kept master's rounding (step.train_step), equal to the old ones."""
  from k2jax.training import step as step_lib
  cfg = configs.get_config("tiny")
  cfg.model.num_hidden_layers = 2
  cfg.model.param_dtype = param_dtype
  cfg.optimizer.update(dict(warmup_steps=2, decay_steps=3))
  cfg.train.steps = 5
  original = step_lib.lm_loss
  monkeypatch.setattr(step_lib, "lm_loss", lambda m, p, b: (lambda ce, n, aux: (
      ce * b["poison"], n, aux))(*original(m, p, b)))
  tx, schedule = optim.optimizer(cfg), optim.learning_rate_schedule(cfg)
  state = init_state(cfg, tx, jax.random.key(0))
  step = jax.jit(functools.partial(train_step, cfg, tx, schedule))
  for k in range(cfg.train.steps):
    batch = dict(_batch(cfg, 2, 16, seed=k), poison=np.float32(np.nan if k == 1 else 1.0))
    counts = [c for p, c in jax.tree_util.tree_flatten_with_path(state.opt_state)[0]
              if getattr(p[-1], "name", None) == "count"]
    assert counts and all(int(c) == int(state.step) == k for c in counts)
    old = state.params
    state, m = step(state, batch)
    assert float(m["learning_rate"]) == float(schedule(counts[0]))  # logged == applied
    assert bool(m["finite"]) == (k != 1)
    if k == 1:  # skipped: nothing moved
      for a, b in zip(jax.tree.leaves(old), jax.tree.leaves(state.params)):
        np.testing.assert_array_equal(a, b)
  assert int(state.skipped) == 1
  counts = [c for p, c in jax.tree_util.tree_flatten_with_path(state.opt_state)[0]
            if getattr(p[-1], "name", None) == "count"]
  assert all(int(c) == cfg.train.steps for c in counts)  # the decay ran its full length
  assert float(schedule(counts[0])) == pytest.approx(cfg.optimizer.end_learning_rate)
