"""The train step: microbatch accumulation equals one big batch; bf16 compute trains."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from k2jax import configs, optim
from k2jax.step import init_state, train_step


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


def test_grad_accumulation_equals_one_batch():
  """Gradients, loss and max logits of 2 microbatches equal those of the whole batch (the
  loss is a mean over all unmasked tokens, so unequal token counts must be weighted)."""
  from k2jax import model
  from k2jax.step import _grads
  cfg = configs.get_config("tiny")
  cfg.model.num_hidden_layers = 2
  params = model.init(cfg.model, jax.random.key(0))
  batch = _batch(cfg, 4, 16)
  g1, loss1, aux1 = jax.jit(lambda p, b: _grads(cfg.model, p, b, 1))(params, batch)
  g2, loss2, aux2 = jax.jit(lambda p, b: _grads(cfg.model, p, b, 2))(params, batch)
  np.testing.assert_allclose(loss1, loss2, rtol=1e-6)
  np.testing.assert_allclose(aux1.max_logits, aux2.max_logits, rtol=1e-6)
  np.testing.assert_array_equal(aux1.expert_load, aux2.expert_load)
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)


def test_bfloat16_step_is_finite_and_keeps_float32_params():
  cfg = configs.get_config("tiny")
  cfg.model.update(dict(num_hidden_layers=2, dtype="bfloat16"))
  state, m = _one_step(cfg, _batch(cfg, 2, 16))
  assert bool(m["finite"]) and np.isfinite(float(m["loss"]))
  assert all(x.dtype in (jnp.float32,) for x in jax.tree.leaves(state.params))
