"""What every Pallas kernel here shares: a pallas_call that, in interpret mode, starts each
output as poison (NaN, or the most negative integer), so a kernel that forgets to write part
of an output fails its tests instead of returning zeros or stale memory; and, inside
`shard_map`, the manual-axis types of its outputs and of custom-VJP cotangents."""

import inspect

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


def _poison(s):
  if jnp.issubdtype(s.dtype, jnp.floating):
    return jnp.full(s.shape, jnp.nan, s.dtype)
  return jnp.full(s.shape, jnp.iinfo(s.dtype).min, s.dtype)


# Under shard_map, values carry the manual mesh axes they vary over. Custom VJPs and
# pallas_calls must keep those types where autodiff would: values started from constants
# (loop carries, outputs) are cast to varying, and a cotangent of an operand that does not
# vary over an axis is summed over it (the transpose of using a replicated weight on
# per-device rows). No-ops outside shard_map.
def vma(a) -> frozenset:
  """The manual mesh axes `a` varies over."""
  return type_vma(jax.typeof(a))


def type_vma(t) -> frozenset:
  """The manual mesh axes a value of type `t` (an aval) varies over (its manual_axis_type
  where jax has one; older jax: vma)."""
  mat = getattr(t, "manual_axis_type", None)
  return frozenset(mat.varying) if mat is not None else frozenset(getattr(t, "vma", ()))


def varying_like(x, *refs):
  """`x` cast to vary over every axis one of `refs` varies over."""
  missing = tuple(sorted(frozenset().union(*map(vma, refs)) - vma(x)))
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def cotangent_for(ct, primal):
  """`ct` summed over the axes it varies over and `primal` does not."""
  extra = tuple(sorted(vma(ct) - vma(primal)))
  return jax.lax.psum(ct, extra) if extra else ct


# pallas_call (check_vma on) needs each output's manual axis type, a field of
# ShapeDtypeStruct in the jax versions that have it.
_DECLARES_VMA = "manual_axis_type" in inspect.signature(jax.ShapeDtypeStruct.__init__).parameters


def _varying(args, shapes):
  """(args, shapes) for a pallas_call inside `shard_map`: a kernel's outputs vary over every
  mesh axis its inputs vary over, so the inputs are cast to that common set and the outputs
  declared with it. Outside shard_map (or on an older JAX) both come back unchanged."""
  mat = next((m for m in (getattr(jax.typeof(a), "manual_axis_type", None) for a in args)
              if m is not None), None)
  if mat is None or not _DECLARES_VMA:
    return args, shapes
  mat = mat.update(varying=frozenset().union(*map(vma, args)))
  return ([varying_like(a, *args) for a in args],
          [jax.ShapeDtypeStruct(s.shape, s.dtype, manual_axis_type=mat) for s in shapes])


def foreign_kernel(fn, *args, **kwargs):
  """fn(*args, **kwargs) for a kernel written elsewhere (jax's own Pallas ops), whose
  outputs do not declare how they vary over `shard_map`'s manual axes: traced with that
  check off, the outputs are then cast to vary like the array arguments (one device's
  kernel, one device's result; the cast is free). Without the cast they would be typed as
  equal on every device, and a replicated weight's gradient would skip its psum. A no-op
  outside shard_map. The switch is JAX's internal config (`_check_vma`); where jax has none
  the call is made as is."""
  from jax._src import config as _config
  check = getattr(_config, "_check_vma", None)
  operands = [a for a in (*args, *kwargs.values()) if isinstance(a, jax.Array)]  # tracers too
  if check is None or not any(map(vma, operands)):
    return fn(*args, **kwargs)
  with check(False):
    out = fn(*args, **kwargs)
  return jax.tree.map(lambda o: varying_like(o, *operands), out)


def pallas_call(kernel, *, in_specs, out_specs, out_shape, interpret: bool,
                num_scalar_prefetch: int = 0, **kwargs):
  """`pl.pallas_call` with the same arguments; under interpret=True every output buffer is
  aliased to a poison-filled input (the kernel never sees those extra inputs). Inside
  `shard_map`, outputs vary over the mesh axes the inputs vary over (`_varying`).

  num_scalar_prefetch > 0 (TPU): the first that many operands go to SMEM before the grid
  runs and reach every index map (after the grid indices) and the kernel (as its first
  refs): `grid`, the specs and `scratch_shapes` become a `pltpu.PrefetchScalarGridSpec`."""
  single = not isinstance(out_shape, (list, tuple))
  shapes = [out_shape] if single else list(out_shape)
  specs = [out_specs] if single else list(out_specs)

  def call(kernel, in_specs, **extra):
    if not num_scalar_prefetch:
      return pl.pallas_call(kernel, in_specs=in_specs, out_specs=out_specs, **extra, **kwargs)
    from jax.experimental.pallas import tpu as pltpu
    rest = dict(kwargs)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=num_scalar_prefetch, grid=rest.pop("grid"), in_specs=in_specs,
        out_specs=out_specs, scratch_shapes=rest.pop("scratch_shapes", ()))
    return pl.pallas_call(kernel, grid_spec=grid_spec, **extra, **rest)

  def run(*args):
    n = len(args)
    if not interpret:
      args, out = _varying(args, shapes)
      return call(kernel, in_specs, out_shape=out[0] if single else out, interpret=False)(*args)

    # The poison operands come last, so their refs sit right after the n operands' (scalar
    # prefetch refs first, then the blocked inputs), as do their indices among the operands.
    def poisoned_kernel(*refs):
      return kernel(*refs[:n], *refs[n + len(shapes):])

    args, out = _varying([*args, *(_poison(s) for s in shapes)], shapes)
    return call(poisoned_kernel, [*in_specs, *specs], out_shape=out[0] if single else out,
                interpret=True, input_output_aliases={n + i: i for i in range(len(shapes))})(*args)

  return run
