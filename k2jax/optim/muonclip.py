"""MuonClip (report 2.1, Algorithm 1): Muon with weight decay and RMS matching, then QK-Clip.

    tx = muonclip(cfg, learning_rate=wsd(...), tau=100.0)
    updates, state = tx.update(grads, state, params, max_logits=aux.max_logits)
    params = optax.apply_updates(params, updates)

`optimizer(config)` builds any of the trainer's choices from a full k2jax config.
"""

import optax

from k2jax.optim.muon import adamw, muon
from k2jax.optim.qk_clip import qk_clip
from k2jax.optim.schedules import wsd


def muonclip(cfg, learning_rate, *, tau: float = 100.0, weight_decay: float = 0.1,
             momentum: float = 0.95, nesterov: bool = False, rms_scale: float = 0.2,
             ns_steps: int = 5, adam_b1: float = 0.9, adam_b2: float = 0.95,
             adam_eps: float = 1e-8, adam_learning_rate=None,
             mu_dtype=None) -> optax.GradientTransformationExtraArgs:
  """Muon (matrices) + AdamW (embedding, head, router, norms) followed by per-head QK-Clip."""
  return optax.chain(
      muon(cfg, learning_rate, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
           rms_scale=rms_scale, ns_steps=ns_steps, adam_b1=adam_b1, adam_b2=adam_b2,
           adam_eps=adam_eps, adam_learning_rate=adam_learning_rate, mu_dtype=mu_dtype),
      qk_clip(cfg, tau))


def learning_rate_schedule(config) -> optax.Schedule:
  o = config.optimizer
  return wsd(o.learning_rate, config.train.steps, o.warmup_steps, o.decay_steps,
             o.end_learning_rate)


def optimizer(config) -> optax.GradientTransformationExtraArgs:
  """The trainer's optimizer from a full config: optimizer.name in
  muonclip | muon | adamw | adamw_qk_clip, with the WSD schedule and optional grad clipping."""
  o, m = config.optimizer, config.model
  lr = learning_rate_schedule(config)
  muon_kw = dict(weight_decay=o.weight_decay, momentum=o.momentum, nesterov=o.nesterov,
                 rms_scale=o.rms_scale, ns_steps=o.ns_steps, adam_b1=o.adam_b1,
                 adam_b2=o.adam_b2, adam_eps=o.adam_eps)
  if o.name in ("muonclip", "muon"):
    tx = muon(m, lr, **muon_kw)
  elif o.name in ("adamw", "adamw_qk_clip"):
    tx = adamw(m, lr, weight_decay=o.weight_decay, b1=o.adam_b1, b2=o.adam_b2, eps=o.adam_eps)
  else:
    raise ValueError(f"optimizer.name = {o.name!r}: must be muonclip, muon, adamw or adamw_qk_clip")
  links = [optax.clip_by_global_norm(o.grad_clip_norm)] if o.grad_clip_norm else []
  links.append(tx)
  if o.name in ("muonclip", "adamw_qk_clip"):
    links.append(qk_clip(m, o.tau))
  return optax.chain(*links)
