"""One training step and one eval step, as pure functions to jit.

The train step: forward + backward (optionally over microbatches), skip the update if the
loss or a gradient is not finite, otherwise apply the optimizer (MuonClip reads this step's
max logits) and then the router-bias balancing rule with this step's expert load.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from k2jax import model
from k2jax.model import balance


class TrainState(NamedTuple):
  step: jax.Array          # int32: optimizer steps taken (skipped steps included)
  params: dict
  opt_state: optax.OptState
  nan_streak: jax.Array    # int32: consecutive non-finite steps so far
  skipped: jax.Array       # int32: non-finite steps skipped in total


def init_state(cfg, tx, rng) -> TrainState:
  params = model.init(cfg.model, rng)
  zero = jnp.zeros((), jnp.int32)
  return TrainState(zero, params, tx.init(params), zero, zero)


def lm_loss(mcfg, params, batch):
  """Summed next-token cross entropy over unmasked targets, its token count, and aux."""
  logits, aux = model.forward(mcfg, params, batch["inputs"], positions=batch["positions"],
                              segment_ids=batch["segment_ids"])
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
  mask = batch["loss_mask"].astype(jnp.float32)
  return jnp.sum(ce * mask), jnp.sum(mask), aux


def _grads(mcfg, params, batch, grad_accum):
  """Gradients of mean token loss (+ aux loss), accumulated over microbatches in float32."""

  def micro(mb):
    def f(p):
      ce_sum, n, aux = lm_loss(mcfg, p, mb)
      return ce_sum + aux.aux_loss * n, (ce_sum, n, aux)
    return jax.grad(f, has_aux=True)(params)

  if grad_accum == 1:
    g, (ce_sum, n, aux) = micro(batch)
  else:
    split = jax.tree.map(lambda x: x.reshape((grad_accum, -1) + x.shape[1:]), batch)

    def body(carry, mb):
      g, (ce_sum, n, aux) = micro(mb)
      acc_g, acc_ce, acc_n, acc_max, acc_load = carry
      return (jax.tree.map(lambda a, b: a + b.astype(jnp.float32), acc_g, g), acc_ce + ce_sum,
              acc_n + n, jnp.maximum(acc_max, aux.max_logits),
              acc_load + aux.expert_load), None

    shapes = jax.eval_shape(lambda: model.forward(mcfg, params, batch["inputs"][:1])[1])
    init = (jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params),
            jnp.zeros(()), jnp.zeros(()), jnp.full(shapes.max_logits.shape, -jnp.inf),
            jnp.zeros(shapes.expert_load.shape))
    (g, ce_sum, n, max_logits, load), _ = jax.lax.scan(body, init, split)
    aux = model.ForwardStats(max_logits, load, jnp.zeros(()))
  n = jnp.maximum(n, 1.0)
  return jax.tree.map(lambda x: x / n, g), ce_sum / n, aux


def train_step(config, tx, schedule, state: TrainState, batch):
  """-> (new state, metrics). `config` is the full config (model, optimizer, train)."""
  mcfg, ocfg = config.model, config.optimizer
  grads, loss, aux = _grads(mcfg, state.params, batch, config.train.grad_accum)
  grad_norm = optax.global_norm(grads)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  updates, opt_state = tx.update(grads, state.opt_state, state.params,
                                 max_logits=aux.max_logits)
  params = optax.apply_updates(state.params, updates)
  params = balance.update_router_bias(params, aux.expert_load, mcfg.bias_update_speed)
  keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
  clips = ocfg.name in ("muonclip", "adamw_qk_clip")
  new_state = TrainState(
      step=state.step + 1,
      params=keep(params, state.params),
      opt_state=keep(opt_state, state.opt_state),
      nan_streak=jnp.where(finite, 0, state.nan_streak + 1),
      skipped=state.skipped + (~finite).astype(jnp.int32))
  max_logits = aux.max_logits
  metrics = {
      "loss": loss,
      "grad_norm": grad_norm,
      "learning_rate": schedule(state.step),
      "max_logit": jnp.max(max_logits),
      "max_logits_per_layer": jnp.max(max_logits, axis=-1),
      "clipped_heads": jnp.sum(max_logits > ocfg.tau) if clips else jnp.zeros((), jnp.int32),
      "clipped_heads_ever_frac": _ever_clipped_fraction(opt_state) if clips else jnp.zeros(()),
      "expert_load_imbalance": (jnp.mean(balance.load_imbalance(aux.expert_load))
                                if aux.expert_load.size else jnp.ones(())),
      "finite": finite,
  }
  return new_state, metrics


def _ever_clipped_fraction(opt_state):
  ever = optax.tree_utils.tree_get(opt_state, "ever_clipped")
  return jnp.mean(ever.astype(jnp.float32))


def eval_step(config, params, batch):
  """-> (summed cross entropy, token count) of one batch."""
  ce_sum, n, _ = lm_loss(config.model, params, batch)
  return ce_sum, n
