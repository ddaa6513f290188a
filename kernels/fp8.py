"""FP8 storage of activations saved for the backward pass (report 2.4.3).

K2 keeps the inputs of the MoE up-projections and of SwiGLU in FP8-E4M3 between the forward
and backward passes, in 1 x 128 tiles with a float32 scale each; the forward pass itself
computes in the working dtype. `fp8_saved(f, n)` wraps a function whose first n arguments are
such activations: the output is f's, exactly; the backward pass gets the cotangents of f at
the arguments rounded through E4M3. For a matmul x @ w that changes only dW (dx = g w^T does
not read x); for SwiGLU both input cotangents see the rounded inputs.

A custom VJP rather than a checkpoint policy: JAX's policies choose which values to save or
recompute, not the format they are saved in.

    q = round_e4m3(x / s),  s = max|x_tile| / 448 (one per 128 values of the last dim)
    x ~ q * s                (relative error <= 2^-4 per value, E4M3's 3 mantissa bits)
"""

import jax
import jax.numpy as jnp

TILE = 128
E4M3_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)   # 448


def quantize(x, tile: int = TILE):
  """x [..., n] -> (q [..., n] float8_e4m3fn, scales [..., ceil(n / tile)] float32)."""
  n = x.shape[-1]
  pad = -n % tile
  x32 = jnp.pad(x.astype(jnp.float32), [(0, 0)] * (x.ndim - 1) + [(0, pad)])
  t = x32.reshape(x.shape[:-1] + (-1, tile))
  s = jnp.max(jnp.abs(t), axis=-1, keepdims=True) / E4M3_MAX
  s = jnp.where(s > 0, s, 1.0)
  q = (t / s).astype(jnp.float8_e4m3fn).reshape(x32.shape)[..., :n]
  return q, s[..., 0]


def dequantize(q, s, dtype, tile: int = TILE):
  n = q.shape[-1]
  pad = -n % tile
  t = jnp.pad(q.astype(jnp.float32), [(0, 0)] * (q.ndim - 1) + [(0, pad)])
  t = t.reshape(q.shape[:-1] + (-1, tile)) * s[..., None]
  return t.reshape(q.shape[:-1] + (-1,))[..., :n].astype(dtype)


def fp8_saved(f, n: int = 1):
  """f(*args) with its first n (floating, activation) arguments stored in FP8 for backward.

  The remaining arguments (weights, integer group sizes) are saved as they are.
  """
  def wrapped(*args):
    dtypes = [a.dtype for a in args[:n]]

    @jax.custom_vjp
    def g(*args):
      return f(*args)

    def fwd(*args):
      return f(*args), (tuple(quantize(a) for a in args[:n]), args[n:])

    def bwd(res, ct):
      saved, rest = res
      xs = [dequantize(q, s, dt) for (q, s), dt in zip(saved, dtypes)]
      _, vjp = jax.vjp(f, *xs, *rest)
      return vjp(ct)

    g.defvjp(fwd, bwd)
    return g(*args)
  return wrapped
