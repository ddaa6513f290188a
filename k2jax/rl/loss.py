"""The Kimi K1.5 policy loss used for K2's RL (report 3.2.3), and the pieces around it.

For a prompt x with K sampled responses y_1..y_K, rewards r_i, the current policy pi and the
policy that sampled them pi_old:

    L(x) = 1/K sum_i ( r_i - mean_j r_j - tau * log(pi(y_i|x) / pi_old(y_i|x)) )^2

The mean reward of the group is the baseline; the log-ratio term (a squared-loss form of a
KL regularizer with strength tau) keeps the update near the sampling policy. The total is
the mean over prompts, plus an auxiliary pre-training (PTX) loss on curated data.
"""

import jax
import jax.numpy as jnp
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


def sequence_logprobs(logits, targets, mask):
  """sum over the masked (response) positions of log softmax(logits)[target] -> [B]."""
  logp = -optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
  return jnp.sum(logp * mask, axis=-1)


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
