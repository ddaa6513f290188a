"""What every Pallas kernel here shares: a pallas_call that, in interpret mode, starts each
output as poison (NaN, or the most negative integer), so a kernel that forgets to write part
of an output fails its tests instead of returning zeros or stale memory."""

import inspect

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


def _poison(s):
  if jnp.issubdtype(s.dtype, jnp.floating):
    return jnp.full(s.shape, jnp.nan, s.dtype)
  return jnp.full(s.shape, jnp.iinfo(s.dtype).min, s.dtype)


def _manual_axis_type(t):
  return getattr(t, "manual_axis_type", None)


def _varying(args, shapes):
  """(args, shapes) for a call inside `shard_map`: pallas_call (check_vma on) needs each
  output's manual axis type; a kernel's outputs vary over every mesh axis its inputs vary
  over, so the inputs are cast to that common set and the outputs declared with it. Outside
  shard_map (or on a JAX without manual axis types) both come back unchanged."""
  mats = [m for m in (_manual_axis_type(jax.typeof(a)) for a in args) if m is not None]
  if not mats or "manual_axis_type" not in inspect.signature(
      jax.ShapeDtypeStruct.__init__).parameters:
    return args, shapes
  varying = frozenset().union(*(m.varying for m in mats))
  mat = mats[0].update(varying=varying)

  def cast(a):
    missing = tuple(sorted(varying - _manual_axis_type(jax.typeof(a)).varying))
    return jax.lax.pcast(a, missing, to="varying") if missing else a
  return ([cast(a) for a in args],
          [jax.ShapeDtypeStruct(s.shape, s.dtype, manual_axis_type=mat) for s in shapes])


def pallas_call(kernel, *, in_specs, out_specs, out_shape, interpret: bool, **kwargs):
  """`pl.pallas_call` with the same arguments; under interpret=True every output buffer is
  aliased to a poison-filled input (the kernel never sees those extra inputs). Inside
  `shard_map`, outputs vary over the mesh axes the inputs vary over (`_varying`)."""
  single = not isinstance(out_shape, (list, tuple))
  shapes = [out_shape] if single else list(out_shape)
  specs = [out_specs] if single else list(out_specs)

  def run(*args):
    n = len(args)
    if not interpret:
      args, out = _varying(args, shapes)
      return pl.pallas_call(kernel, in_specs=in_specs, out_specs=out_specs,
                            out_shape=out[0] if single else out, interpret=False,
                            **kwargs)(*args)

    def poisoned_kernel(*refs):
      return kernel(*refs[:n], *refs[n + len(shapes):])

    args, out = _varying([*args, *(_poison(s) for s in shapes)], shapes)
    call = pl.pallas_call(poisoned_kernel, in_specs=[*in_specs, *specs], out_specs=out_specs,
                          out_shape=out[0] if single else out, interpret=True,
                          input_output_aliases={n + i: i for i in range(len(shapes))}, **kwargs)
    return call(*args)

  return run
