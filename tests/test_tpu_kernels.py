"""Every TPU kernel path, compiled by XLA:TPU at K2's shapes on this machine (nothing runs).

libtpu compiles for the chips of a TPU topology (`k2jax.tools.compile.topology_devices`); each
program is traced from ShapeDtypeStructs, compiled, and held to two checks: XLA accepted it,
and its per-device memory (`compiled.memory_analysis()`) lies between a floor and a ceiling
counted here from the shapes alone. The floor is the bytes we pass in; the ceiling names what
the kernel may hold besides its arguments and results, so a kernel that materializes
something it should not (a T x T score matrix, a weight-sized copy) fails here.

  attention          Mosaic flash attention (impl="pallas_tpu"), MLA's 192 / 128 head dims, 64
                     heads, T 4096 with segment ids: forward (output and per-head S_max) and
                     every input gradient; v5e (inference) and v5p (training) chips.
  grouped matmul     what routed experts run on TPU: XLA's ragged_dot (`auto`), jax's megablox
                     and tokamax's Mosaic kernel, at K2's expert shapes (d 7168, f 2048).
  routed experts     the whole dispatch / SwiGLU / combine layer as `auto` runs it on TPU
                     (ragged, over XLA's ragged_dot), with K2's FP8 activation storage,
                     forward and gradients.
The kernels also compile under jax_enable_x64, where our Mosaic attention, jax's megablox and
tokamax's kernels each made 64-bit integers XLA:TPU refuses (kernels/flash_tpu.py, gmm.py).
tokamax's TPU attention is not compiled: it refuses packed documents (last test).
"""

import os

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")   # xdist workers each load libtpu

import pytest

pytest.importorskip("libtpu")   # the [tpu] / [test] extra: XLA:TPU's compiler

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from k2jax.tools import compile as k2compile
from k2jax import kernels
from k2jax.kernels import platform

MIB = 1 << 20
SMALL = 16 * MIB   # the program's code, scalars and metadata: no array of the shapes here

# K2's shapes (kimi_k2 preset): MLA head dims, heads, model and expert widths
H, DQK, DV = 64, 192, 128
D, F = 7168, 2048


pytestmark = pytest.mark.usefixtures("no_persistent_cache")   # tests/conftest.py


@pytest.fixture(scope="module")
def chips():
  """One chip of each generation: v5e (Colab's, inference) and a v5p slice's first."""
  return {"v5e": k2compile.topology_devices("v5e:1x1")[0],
          "v5p": k2compile.topology_devices("v5p:2x2x2")[0]}


def nbytes(tree) -> int:
  return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))


def compile_on(chip, f, *args, x64=False, tokamax=False):
  """f compiled for one TPU chip from abstract args (pytrees of (shape, dtype)) -> (the
  compiled program, XLA's device memory dict, the abstract args as passed).

  tokamax picks its kernels by the default device (tracers have none): on this CPU host it
  would take its XLA fallback, so its tests make the chip the default device, as on a TPU VM."""
  sharding = NamedSharding(Mesh(np.asarray([chip]), ("chip",)), P())
  with jax.enable_x64(x64), platform.target("tpu"):
    args = jax.tree.map(lambda s: jax.ShapeDtypeStruct(*s, sharding=sharding), args,
                        is_leaf=lambda s: isinstance(s, tuple) and len(s) == 2
                        and isinstance(s[0], tuple))
    if tokamax:
      kernels.prepare("auto", "tokamax")
      with jax.default_device(chip):
        compiled = jax.jit(f).trace(*args).lower().compile()
    else:
      compiled = jax.jit(f).trace(*args).lower().compile()
  mem = k2compile.memory(compiled.memory_analysis())[0]
  print(f"{getattr(f, '__name__', f)} on {chip.device_kind}, x64 {x64}: "
        + ", ".join(f"{k} {v / MIB:.1f} MiB" for k, v in mem.items()))   # pytest -s
  return compiled, mem, args


def check_between(mem, floor: int, ceiling: int):
  """XLA's arguments hold at least what we passed; its peak (arguments + results +
  temporaries + code) lies between that and the ceiling counted from the shapes."""
  print(f"  floor {floor / MIB:.1f} MiB, peak {mem['peak'] / MIB:.1f} MiB, ceiling "
        f"{ceiling / MIB:.1f} MiB")   # pytest -s
  assert mem["arguments"] >= floor, (mem, floor)
  assert floor <= mem["peak"] <= ceiling, (
      f"peak {mem['peak'] / MIB:.1f} MiB outside [{floor / MIB:.1f}, {ceiling / MIB:.1f}] "
      f"MiB: {mem}")


# -------------------------------------------------------------------------------- attention

B, T = 2, 4096


def _attention_args():
  return ((B, T, H, DQK), jnp.bfloat16), ((B, T, H, DQK), jnp.bfloat16), \
      ((B, T, H, DV), jnp.bfloat16), ((B, T), jnp.int32)


def _attention(q, k, v, seg):
  return kernels.attention(q, k, v, scale=DQK ** -0.5, segment_ids=seg, impl="pallas_tpu")


def _attention_loss(q, k, v, seg):
  out, smax = _attention(q, k, v, seg)
  return out.astype(jnp.float32).sum() + smax.sum()


@pytest.mark.parametrize("chip,x64", [("v5e", False), ("v5p", False), ("v5e", True)],
                         ids=["v5e", "v5p", "v5e-x64"])
def test_flash_attention_compiles_for_tpu_at_k2_shapes_in_linear_memory(chips, chip, x64):
  """Forward (output and S_max [H] f32) and the three input gradients, each one Mosaic
  kernel per pass. Ceiling: the arguments, the results, and one more copy of each (the
  kernels' head-major [B, H, T, D] layout), plus per-query f32 rows (log-sum-exp, running
  max, delta) and SMALL: linear in T. The [B, H, T, T] f32 scores a materializing kernel would hold
  are 8 GiB here, far above it."""
  scores = B * H * T * T * 4
  rows = 4 * B * H * T * 4
  fwd, mem, args = compile_on(chips[chip], _attention, *_attention_args(), x64=x64)
  q, k, v, seg = args
  out_shape, smax_shape = fwd.out_info
  assert out_shape.shape == (B, T, H, DV) and out_shape.dtype == jnp.bfloat16
  assert smax_shape.shape == (H,) and smax_shape.dtype == jnp.float32   # QK-Clip's S_max
  assert "tpu_custom_call" in fwd.as_text()                             # the Mosaic kernel
  results = nbytes((out_shape, smax_shape))
  assert mem["outputs"] >= results
  ceiling = 2 * (nbytes(args) + results) + rows + SMALL
  check_between(mem, nbytes(args), ceiling)
  assert ceiling < scores

  grad = jax.grad(_attention_loss, argnums=(0, 1, 2))
  bwd, mem, args = compile_on(chips[chip], grad, *_attention_args(), x64=x64)
  # dq, dk, dv are the inputs' shapes; the backward also recomputes the forward's output
  # and holds its cotangent (two [B, T, H, Dv] arrays, head-major)
  results = nbytes(args[:3])
  assert mem["outputs"] >= results
  ceiling = 2 * (nbytes(args) + results + 2 * nbytes(args[2])) + rows + SMALL
  check_between(mem, nbytes(args), ceiling)
  assert ceiling < scores
  assert bwd.as_text().count("tpu_custom_call") >= 3   # dk / dv, dq and the forward


# ---------------------------------------------------------------------- grouped matmul, experts

M, G = 2048, 4   # rows on one device: its 4 experts' share of K2's top-8 of 384


def _gmm_args():
  return ((M, D), jnp.bfloat16), ((G, D, F), jnp.bfloat16), ((G,), jnp.int32)


@pytest.mark.parametrize("x64", [False, True], ids=["x32", "x64"])
@pytest.mark.parametrize("impl", ["ragged_dot", "megablox", "tokamax"])
def test_grouped_matmul_compiles_for_tpu_at_k2_expert_shapes(chips, impl, x64):
  """x [M, d] @ w_g [d, f] over groups, forward and (dx, dw). Ceiling: arguments and results
  plus one more copy of the rows (x and y, or dy: megablox pads them to whole row tiles and
  masks the rows past the groups) and SMALL: nothing weight-sized (an f32 copy of w), nor
  every group applied to every row as XLA:CPU's ragged_dot does ([G, M, f] f32), fits.
  Under x64, jax's megablox sized its grid with an int64 tile count and tokamax's Mosaic
  kernels mixed int64 and int32 indices; both are traced with x64 off (kernels/gmm.py)."""
  if impl == "tokamax":
    pytest.importorskip("tokamax")
  fwd = lambda x, w, gs: kernels.grouped_matmul(x, w, gs, impl=impl)
  loss = lambda x, w, gs: fwd(x, w, gs).astype(jnp.float32).sum()
  rows = M * D * 2 + M * F * 2
  grads = jax.grad(loss, argnums=(0, 1))
  for f, results in ((fwd, M * F * 2), (grads, M * D * 2 + G * D * F * 2)):
    compiled, mem, args = compile_on(chips["v5e"], f, *_gmm_args(), x64=x64,
                                     tokamax=impl == "tokamax")
    assert mem["outputs"] >= results
    check_between(mem, nbytes(args), nbytes(args) + results + rows + SMALL)
    if impl != "ragged_dot":   # XLA's own ragged_dot lowers without a custom call
      assert "tpu_custom_call" in compiled.as_text()


N, E, TOPK = 256, 8, 2   # tokens on one device, its experts, choices per token


def _experts_args():
  return (((N, D), jnp.bfloat16), ((N, TOPK), jnp.int32), ((N, TOPK), jnp.float32),
          ((E, D, F), jnp.bfloat16), ((E, D, F), jnp.bfloat16), ((E, F, D), jnp.bfloat16))


def test_routed_experts_compile_for_tpu_with_fp8_storage(chips):
  """The routed-expert layer as a TPU step runs it (`auto` on TPU: ragged, over XLA's
  ragged_dot), with K2's FP8-E4M3 storage of the saved up-projection and SwiGLU inputs,
  forward and the gradients of x and the three weights. One compile of both costs about a
  minute here (K2-wide matmuls, nine of them), so the other grouped matmuls are compiled on
  their own above, not as this layer.
  Ceiling: arguments and results plus 12 f32 arrays of the N k assignment rows at the
  widest width (d): the sorted token rows, gate / up / SwiGLU activations and their FP8
  copies, the down projection and the cotangents of each. No per-token weight gathers
  ([N k, d, f] each) fit under it."""
  def layer(x, ids, comb, gate, up, down):
    return kernels.routed_experts(x, ids, comb, gate, up, down, impl="auto", fp8_storage=True)

  def loss(*a):
    return layer(*a).astype(jnp.float32).sum()

  rows = 12 * N * TOPK * D * 4
  for f, n_results in ((layer, 1), (jax.grad(loss, argnums=(0, 3, 4, 5)), 4)):
    compiled, mem, args = compile_on(chips["v5e"], f, *_experts_args())
    results = nbytes([args[i] for i in (0, 3, 4, 5)][:n_results])
    assert mem["outputs"] >= results
    check_between(mem, nbytes(args), nbytes(args) + results + rows + SMALL)


def test_tokamax_tpu_attention_still_refuses_packed_documents(chips):
  """Why attention impl=tokamax is not compiled for TPU (kernels/flash_tokamax.REFUSED):
  tokamax's Mosaic TPU attention raises NotImplementedError for a per-row key start
  (Mask.k_start), the only way packed documents reach it. When a tokamax release takes it,
  this fails: then drop REFUSED's entry and compile it above."""
  pytest.importorskip("tokamax")
  platform.tokamax()
  from tokamax._src.ops.attention import api, base   # what flash_tokamax calls
  op = api.IMPLEMENTATIONS["mosaic_tpu"]

  def attend(q, k, v, start):
    return op(q, k, v, logits_scale=DQK ** -0.5, return_residuals=True,
              mask=base.Mask(k_start=start, is_causal=True))
  with pytest.raises(NotImplementedError, match="k_start"):
    compile_on(chips["v5e"], attend, ((1, 256, H, DQK), jnp.bfloat16),
               ((1, 256, H, DQK), jnp.bfloat16), ((1, 256, H, DV), jnp.bfloat16),
               ((1, 1, 256), jnp.int32), tokamax=True)
