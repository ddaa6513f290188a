"""MuonClip (report 2.1, Algorithm 1) and the trainer's optimizer registry.

    tx = muonclip(cfg, learning_rate=wsd(...), tau=100.0)
    updates, state = tx.update(grads, state, params, max_logits=aux.max_logits)
    params = optax.apply_updates(params, updates)

`optimizer(config)` builds the trainer's chain from a full k2jax config: the registry entry
`OPTIMIZERS[config.optimizer.name]`, optional global-norm clipping before it and router-bias
balancing after it.
"""

from collections.abc import Callable

import optax

from k2jax.optim.balancing import router_bias_balancing
from k2jax.optim.master import master_weights
from k2jax.optim.muon import adamw, muon, sgd
from k2jax.optim.qk_clip import qk_clip
from k2jax.optim.schedules import wsd


def muonclip(cfg, learning_rate, *, tau: float = 100.0, weight_decay: float = 0.1,
             momentum: float = 0.95, nesterov: bool = False, rms_scale: float = 0.2,
             ns_steps: int = 5, adam_b1: float = 0.9, adam_b2: float = 0.95,
             adam_eps: float = 1e-8, adam_learning_rate=None,
             mu_dtype=None, ns_dtype=None) -> optax.GradientTransformationExtraArgs:
  """Muon (matrices) + AdamW (embedding, head, router, norms), then per-head QK-Clip.

  For every Muon matrix W with gradient G (Algorithm 1):

      M = mu M + G;  O = NewtonSchulz5(M) sqrt(max(n, m)) rms_scale;  W -= lr (O + wd W)

  then, per layer l and head h with this step's max scaled logit S[l, h] > tau, the head's
  query / key weights are rescaled so its logits shrink by gamma = tau / S[l, h]
  (k2jax.optim.qk_clip).

  Args:
    cfg: the model config (parameter table, heads, layer stacks).
    learning_rate: a float or an optax schedule, shared by Muon and AdamW unless
      `adam_learning_rate` is given.
    tau: QK-Clip threshold (K2: 100).
    weight_decay: decoupled, scaled by the learning rate (K2: 0.1); norms are not decayed.
    momentum: Muon's mu (0.95).
    nesterov: Nesterov momentum for Muon (Algorithm 1 uses plain momentum).
    rms_scale: Muon update RMS after matching (Moonlight's 0.2, AdamW-like).
    ns_steps: Newton-Schulz iterations (5).
    ns_dtype: the dtype Newton-Schulz iterates in (None: float32; Moonlight's bfloat16).
    adam_b1: AdamW's first-moment decay for the non-matrix parameters.
    adam_b2: its second-moment decay.
    adam_eps: its epsilon.
    adam_learning_rate: a separate learning rate for the AdamW group.
    mu_dtype: dtype of the momenta (None: the parameters').
  Returns:
    An optax.GradientTransformationExtraArgs; `update` needs `params` and `max_logits=`
    f32 [num_hidden_layers, num_attention_heads].
  """
  return optax.chain(
      muon(cfg, learning_rate, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
           rms_scale=rms_scale, ns_steps=ns_steps, adam_b1=adam_b1, adam_b2=adam_b2,
           adam_eps=adam_eps, adam_learning_rate=adam_learning_rate, mu_dtype=mu_dtype,
           ns_dtype=ns_dtype),
      qk_clip(cfg, tau))


def learning_rate_schedule(config) -> optax.Schedule:
  """The WSD schedule of a full config (optimizer.learning_rate, warmup, decay; train.steps)."""
  o = config.optimizer
  return wsd(o.learning_rate, config.train.steps, o.warmup_steps, o.decay_steps,
             o.end_learning_rate)


def _muon_kwargs(o) -> dict:
  return dict(weight_decay=o.weight_decay, momentum=o.momentum, nesterov=o.nesterov,
              rms_scale=o.rms_scale, ns_steps=o.ns_steps, adam_b1=o.adam_b1,
              adam_b2=o.adam_b2, adam_eps=o.adam_eps, ns_dtype=o.get("ns_dtype", "float32"))


def _adamw_kwargs(o) -> dict:
  return dict(weight_decay=o.weight_decay, b1=o.adam_b1, b2=o.adam_b2, eps=o.adam_eps)


# optimizer.name -> builder(full config, learning rate or schedule). The trainer, validation
# and `optimizer()` all read this one table; add an entry to add an optimizer.
OPTIMIZERS: dict[str, Callable[..., optax.GradientTransformation]] = {
    "muonclip": lambda c, lr: muonclip(c.model, lr, tau=c.optimizer.tau,
                                       **_muon_kwargs(c.optimizer)),
    "muon": lambda c, lr: muon(c.model, lr, **_muon_kwargs(c.optimizer)),
    "adamw": lambda c, lr: adamw(c.model, lr, **_adamw_kwargs(c.optimizer)),
    "sgd": lambda c, lr: sgd(c.model, lr),
    "adamw_qk_clip": lambda c, lr: optax.chain(adamw(c.model, lr, **_adamw_kwargs(c.optimizer)),
                                               qk_clip(c.model, c.optimizer.tau)),
}


def validate(config) -> None:
  """Raise ValueError naming optimizer.name if the registry has no such optimizer."""
  name = config.optimizer.name
  if name not in OPTIMIZERS:
    raise ValueError(f"optimizer.name = {name!r}: must be one of {', '.join(OPTIMIZERS)}")


def optimizer(config) -> optax.GradientTransformationExtraArgs:
  """The trainer's optimizer for a full k2jax config.

      clip_by_global_norm (if optimizer.grad_clip_norm > 0)
        -> OPTIMIZERS[optimizer.name] with the WSD schedule
        -> router_bias_balancing (model.bias_update_speed)
      all on float32 master weights (master_weights) when model.param_dtype is lower

  Args:
    config: a full config (groups model, optimizer, train).
  Returns:
    An optax.GradientTransformationExtraArgs; `update` takes `params`, `max_logits=` (used by
    the QK-Clip optimizers) and `expert_load=` (balancing).
  """
  validate(config)
  o = config.optimizer
  links = [optax.clip_by_global_norm(o.grad_clip_norm)] if o.grad_clip_norm else []
  links.append(OPTIMIZERS[o.name](config, learning_rate_schedule(config)))
  links.append(router_bias_balancing(config.model))
  tx = optax.chain(*links)
  if config.model.param_dtype != "float32":   # bf16 params: the chain runs on fp32 masters
    tx = master_weights(tx)
  return tx
