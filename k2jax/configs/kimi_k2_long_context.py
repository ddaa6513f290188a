"""Kimi K2's long-context activation stage (report 2.5), and the published config.json.

After pre-training at 4k the report anneals the learning rate from 2e-5 to 7e-6 over 400B
tokens at 4k, then trains 60B tokens at 32k with YaRN, which extends the context to 128k.
The YaRN settings below are the published Kimi-K2 config.json's, so this preset is also the
architecture of the released checkpoints.

QK-Clip's threshold is kept in pre-training units: YaRN multiplies every scaled logit by
mscale^2 (k2jax.model.rope.softmax_scale), so tau is raised by the same factor and clipping
starts at the same q.k as the report's tau = 100 did at 4k.
"""

import math

from k2jax.configs import base, kimi_k2

YARN_FACTOR = 32.0


def get_config():
  c = kimi_k2.get_config()
  c.model.update(dict(
      rope_scaling=base.yarn(factor=YARN_FACTOR, original_max_position_embeddings=4096,
                             beta_fast=1.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
      max_position_embeddings=131072,
  ))
  mscale = 0.1 * math.log(YARN_FACTOR) + 1.0           # mscale_all_dim = 1
  # 60B tokens at 32k in the same 67M-token batch (2048 x 32768): ~900 steps, no warmup,
  # the tail of the anneal (2e-5 -> 7e-6).
  c.optimizer.update(dict(learning_rate=2e-5, end_learning_rate=7e-6, warmup_steps=0,
                          decay_steps=900, tau=100.0 * mscale * mscale))
  c.train.update(dict(steps=900, batch_size=2048, seq_len=32768, eval_every=100,
                      checkpoint_every=100))
  # Each 32k sequence split over 8 context devices (k2jax.model.context): PP16 x EP16 x CP8
  # on 2,048 devices holds 4k tokens of a sequence per device, as pre-training did, so
  # one sequence per microbatch gives the same 128 microbatches and the same residuals in
  # flight (`python -m k2jax.plan --config kimi_k2_long_context`). Without it each device
  # would hold 32k tokens: 16 microbatches (a large bubble) and far more host residuals.
  c.mesh.context = 8
  return c
