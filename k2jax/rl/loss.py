"""The Kimi K1.5 policy loss used for K2's RL (report 3.2.3), and the pieces around it.

For a prompt x with K sampled responses y_1..y_K, rewards r_i, the current policy pi and the
policy that sampled them pi_old:

    L(x) = 1/K sum_i ( r_i - mean_j r_j - tau * log(pi(y_i|x) / pi_old(y_i|x)) )^2

The mean reward of the group is the baseline; the log-ratio term (a squared-loss form of a
KL regularizer with strength tau) keeps the update near the sampling policy. The total is
the mean over prompts, plus an auxiliary pre-training (PTX) loss on curated data.

pi_old is the trainer's own probability under the weights that sampled (one forward before
the updates). The sampler that drew y computes that policy in another program (decoding
over the latent cache, perhaps in another precision), so y comes from pi_sampler, not
pi_old: `rollout_weights` corrects for it, scaling each token's (or sequence's) share of the
gradient by rho = pi_old / pi_sampler, truncated (TIS) or masked outside a band (IcePop).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax


def k15_loss(logp, logp_old, rewards, tau: float, mask=None):
  """mean over prompts of mean_i (r_i - mean_j r_j - tau log(pi / pi_old))^2.

  The mean over prompts counts only groups with at least one sample: under partial
  rollouts the batch is padded with empty groups, which must not scale the RL term down
  against the fixed-weight PTX loss.

  Args:
    logp: [prompts, samples] sequence log-probabilities under the current policy.
    logp_old: the same under the sampling policy (no gradient flows into it).
    rewards: [prompts, samples].
    tau: the regularization strength.
    mask: optional [prompts, samples] bool: samples that exist (groups of unequal size).
  Returns:
    A scalar.
  """
  logp_old = jax.lax.stop_gradient(logp_old)
  rewards = jax.lax.stop_gradient(rewards).astype(jnp.float32)
  m = jnp.ones_like(rewards) if mask is None else mask.astype(jnp.float32)
  n = jnp.maximum(m.sum(-1, keepdims=True), 1.0)
  baseline = (rewards * m).sum(-1, keepdims=True) / n
  resid = rewards - baseline - tau * (logp - logp_old)
  per_prompt = (m * resid ** 2).sum(-1) / n[:, 0]
  groups = jnp.maximum(jnp.sum(m.sum(-1) > 0), 1)
  return jnp.sum(per_prompt) / groups


def sequence_logprobs(logits, targets, mask, weights=None):
  """sum over the masked (response) positions of log softmax(logits)[target] -> [B].

  weights [B, T] (no gradient): the value is unchanged, its gradient is
  sum_t mask_t w_t grad log pi_t, each token's share scaled by its importance weight
  (`rollout_weights`): sum_t mask_t (w_t log pi_t + (1 - w_t) stop_gradient(log pi_t)).
  """
  logp = -optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
  if weights is not None:
    w = jax.lax.stop_gradient(weights).astype(jnp.float32)
    logp = w * logp + (1.0 - w) * jax.lax.stop_gradient(logp)
  return jnp.sum(logp * mask, axis=-1)


CORRECTIONS = ("none", "tis", "icepop")     # rollout_weights' modes
LEVELS = ("token", "sequence")


def rollout_weights(logp_trainer, logp_sampler, mask, *, mode: str = "none",
                    level: str = "token", cap: float = 2.0, low: float = 0.5,
                    high: float = 2.0):
  """Importance weights for rollouts drawn by a sampler that is not the trainer (another
  precision, layout or kernels; in an MoE a small logit difference flips a token's experts).

  The ratio of a sampled token, or of a whole sequence (level="sequence": the product over
  its tokens), is rho = pi_trainer_old / pi_sampler, with pi_trainer_old the trainer's
  probability under the weights that sampled it (the K1.5 loss's pi_old). Then

      mode "tis":    w = min(rho, cap)                       truncated importance sampling
      mode "icepop": w = rho if low <= rho <= high, else 0   two-sided masking
      mode "none":   w = 1

  Tokens outside `mask`, or whose sampler log-probability is not known (NaN in
  logp_sampler), get w = 1 and are not counted.

  Args:
    logp_trainer: [B, T] per-token log-probabilities under the trainer.
    logp_sampler: [B, T] the same under the sampler.
    mask: [B, T] the policy's (sampled) tokens.
  Returns:
    (w [B, T] float32, stats: ratio_mean, truncated_frac, masked_frac over the counted
    tokens or sequences).
  """
  if mode not in CORRECTIONS or level not in LEVELS:
    raise ValueError(f"rollout correction {mode!r} at level {level!r}: modes "
                     f"{', '.join(CORRECTIONS)}; levels {', '.join(LEVELS)}")
  lt, ls = np.asarray(logp_trainer, np.float64), np.asarray(logp_sampler, np.float64)
  counted = (np.asarray(mask) > 0) & np.isfinite(ls)
  log_rho = np.where(counted, lt - np.where(counted, ls, 0.0), 0.0)
  if level == "sequence":
    rho = np.exp(np.clip(log_rho.sum(-1), -50, 50))
    units = rho[counted.any(-1)]
    rho = np.broadcast_to(rho[:, None], lt.shape)
  else:
    rho = np.exp(np.clip(log_rho, -50, 50))
    units = rho[counted]
  if mode == "tis":
    w, cut = np.minimum(rho, cap), units > cap
  elif mode == "icepop":
    w, cut = np.where((rho >= low) & (rho <= high), rho, 0.0), (units < low) | (units > high)
  else:
    w, cut = np.ones_like(rho), np.zeros(units.shape, bool)
  w = np.where(counted, w, 1.0).astype(np.float32)
  frac = float(cut.mean()) if units.size else 0.0
  stats = dict(ratio_mean=float(units.mean()) if units.size else float("nan"),
               truncated_frac=frac if mode == "tis" else 0.0,
               masked_frac=frac if mode == "icepop" else 0.0)
  return w, stats


def budget_rewards(rewards, truncated, penalty: float = -1.0):
  """Per-task token budgets (report 3.2.3): a response that reached its task's budget without
  ending gets `penalty` instead of its reward; the others keep theirs."""
  return jnp.where(truncated, penalty, rewards)


def with_ptx(rl_loss, ptx_loss, weight: float):
  """RL loss plus the auxiliary pre-training loss on curated data (report 3.2.3)."""
  return rl_loss + weight * ptx_loss


def temperature_at(step: int, total: int, start: float, end: float) -> float:
  """Temperature decay over RL (report 3.2.3): exploration early, exploitation late; linear."""
  frac = min(max(step / max(total, 1), 0.0), 1.0)
  return start + (end - start) * frac
