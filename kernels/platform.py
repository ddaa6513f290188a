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
