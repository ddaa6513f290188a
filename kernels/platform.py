"""Which backend `impl="auto"` picks kernels for.

Normally the one JAX runs on. Lowering for another one on this machine
(`jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))`, how CI checks the GPU and TPU
paths without either) must pick that platform's kernels instead, and the lowering platform
is not known while tracing, so the caller names it:

    with kernels.platform.target("tpu"):
      jax.jit(step).trace(state, batch).lower(lowering_platforms=("tpu",))
"""

import contextlib

import jax

_ALIASES = {"cuda": "gpu", "rocm": "gpu"}
_target: list[str] = []


@contextlib.contextmanager
def target(platform: str):
  """Within the block, `backend()` is `platform` ("cpu", "gpu" / "cuda" / "rocm", "tpu")."""
  _target.append(_ALIASES.get(platform, platform))
  try:
    yield
  finally:
    _target.pop()


def backend() -> str:
  """The backend kernels are chosen for: the innermost `target`, else JAX's default."""
  return _target[-1] if _target else jax.default_backend()


def gpu_kind() -> str | None:
  """The GPU's device kind (`NVIDIA H100 80GB HBM3`) where kernels are chosen for a GPU and
  one is here; None otherwise (another backend, or lowering for CUDA without a GPU)."""
  if backend() != "gpu":
    return None
  try:
    return jax.devices("gpu")[0].device_kind
  except RuntimeError:
    return None


def gpu_capability() -> tuple[int, int] | None:
  """The GPU's compute capability ((9, 0) on Hopper) where `gpu_kind` gives a kind."""
  if gpu_kind() is None:
    return None
  cc = getattr(jax.devices("gpu")[0], "compute_capability", None)
  try:
    return tuple(int(v) for v in str(cc).split(".")[:2])
  except ValueError:
    return None


def tokamax():
  """Import the optional tokamax package for a kernel call.

  tokamax reads its settings from absl flags and, when nobody has parsed them, parses
  sys.argv itself, which fails in any program with its own arguments (pytest, Jupyter, our
  CLIs): its flags are left at their defaults. A later absl `app.run` still parses argv."""
  from absl import flags
  import tokamax as tk   # optional extra: pip install k2jax[gpu] / [tpu]
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
  return tk
