"""Static buffer sizes for data-dependent loads: dropless dispatch with static shapes.

Routing decides at run time how many rows each expert (or each expert-parallel shard)
gets. Shapes must be static, so a buffer takes the smallest of a few static capacities that
fits the largest load, chosen at run time (`choose`, then `lax.switch` over one compiled
branch per capacity); the largest capacity is the worst case, so nothing is dropped.
"""

import math

import jax.numpy as jnp

FACTORS = (1.25, 1.5, 2.0, 3.0, 4.0)   # x the balanced share: the static sizes below the worst


def capacities(total: int, parts: int, factors=FACTORS,
               multiple: int = 8) -> tuple[int, ...]:
  """Sizes for `parts` slices of `total` rows: the balanced share total / parts times each
  factor (rounded up to `multiple`, capped at total), then the worst case `total`."""
  base = total / parts
  caps = {min(total, -(-math.ceil(base * f) // multiple) * multiple) for f in factors}
  return tuple(sorted(caps | {total}))


def choose(need, caps):
  """Index of the smallest capacity >= need (need <= caps[-1] always)."""
  return jnp.sum(jnp.asarray(caps, jnp.int32) < need).astype(jnp.int32)
