"""Rotary position embeddings with DeepSeek-V3's YaRN extension (used by K2, report 2.5).

Only the decoupled `qk_rope_head_dim` slice of queries and keys is rotated (MLA). Pairs are
interleaved: dims (0, 1), (2, 3), ... rotate together by one frequency each.
"""

import math

import jax.numpy as jnp
import numpy as np


def _yarn_mscale(factor: float, mscale: float) -> float:
  return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def inv_frequencies(cfg) -> np.ndarray:
  """Per-pair inverse frequencies [rope_dim / 2] in float64 (cast at use).

  YaRN (DeepSeek-V3 form): dims whose wavelength fits many times into the original context
  keep their frequency (extrapolate); dims with long wavelengths are divided by `factor`
  (interpolate); a linear ramp between dims `low` and `high` blends the two, where
  find_dim(r) = d ln(L / (2 pi r)) / (2 ln base) is the dim that turns r times over L.
  """
  d, base = cfg.qk_rope_head_dim, float(cfg.rope_theta)
  pos = base ** (np.arange(0, d, 2, dtype=np.float64) / d)
  rs = cfg.rope_scaling
  if rs.type != "yarn":
    return 1.0 / pos
  L = rs.original_max_position_embeddings
  find_dim = lambda r: d * math.log(L / (2 * math.pi * r)) / (2 * math.log(base))
  low = max(math.floor(find_dim(rs.beta_fast)), 0)
  high = min(math.ceil(find_dim(rs.beta_slow)), d - 1)
  if low == high:
    high += 0.001  # avoid 0/0 in the ramp
  ramp = np.clip((np.arange(d // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
  keep = 1.0 - ramp  # weight of the original (extrapolated) frequency
  return (1.0 / (rs.factor * pos)) * (1.0 - keep) + (1.0 / pos) * keep


def softmax_scale(cfg) -> float:
  """1/sqrt(qk_head_dim), times mscale^2 under YaRN (mscale = 0.1 mscale_all_dim ln(factor) + 1)."""
  scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
  rs = cfg.rope_scaling
  if rs.type == "yarn" and rs.mscale_all_dim:
    m = _yarn_mscale(rs.factor, rs.mscale_all_dim)
    scale *= m * m
  return scale


def cos_sin_multiplier(cfg) -> float:
  """YaRN's attention factor applied to cos/sin: mscale(mscale) / mscale(mscale_all_dim)."""
  rs = cfg.rope_scaling
  if rs.type != "yarn":
    return 1.0
  return _yarn_mscale(rs.factor, rs.mscale) / _yarn_mscale(rs.factor, rs.mscale_all_dim)


def cos_sin(cfg, positions):
  """cos, sin [..., rope_dim / 2] in float32 for integer `positions` [...]."""
  inv = jnp.asarray(inv_frequencies(cfg), jnp.float32)
  angles = positions.astype(jnp.float32)[..., None] * inv
  m = cos_sin_multiplier(cfg)
  return jnp.cos(angles) * m, jnp.sin(angles) * m


def apply_rope(x, cos, sin):
  """Rotate interleaved pairs of x [B, T, (H,) D] by angles cos/sin [B, T, D/2].

  The result is returned de-interleaved ([rotated evens | rotated odds]): a fixed
  permutation of the interleaved layout applied identically to queries and keys, so every
  q.k dot product is unchanged and we skip a reshape.
  """
  if x.ndim == 4:  # [B, T, H, D]: broadcast the angles over heads
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
  x1, x2 = x[..., 0::2].astype(jnp.float32), x[..., 1::2].astype(jnp.float32)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)
