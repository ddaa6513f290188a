"""Generation and the RL update, compiled by XLA:TPU for one v5e chip on this machine.

The programs are the ones k2jax runs, not copies: `k2jax.serving.generate._programs(cfg)`'s jitted
prefill and decode functions (what `generate` and the RL rollouts call) and
`k2jax.rl.train.step_program` (the RL loop's update). Each is traced from ShapeDtypeStructs
with the shardings the callers give their arrays, compiled with the kernels `auto` picks on
TPU, and held to: XLA accepted it; its per-device peak lies between the bytes passed in and
a ceiling counted here from the shapes; it fits the chip's HBM; donated buffers are reused.

Generation runs a K2-shaped model: K2's widths (hidden 7168, 64 heads, q / kv LoRA 1536 /
512, rope 64, nope 128, v 128, experts 2048 wide) with 2 MoE layers of 16 experts, top-4,
and a 32K vocabulary, at batch 4 with a 256-token cache. The dense first layer is left out:
its SwiGLU is the shared expert's code at another width, and each large matmul costs XLA:TPU
seconds to compile here. The RL update runs the tiny_rl preset, cut to one MoE layer.
"""

import os

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")   # xdist workers each load libtpu

import pytest

pytest.importorskip("libtpu")   # the [tpu] / [test] extra: XLA:TPU's compiler

import math

import jax
import jax.numpy as jnp

from k2jax.tools import compile as k2compile
from k2jax import configs, kernels, model, optim, parallel
from k2jax.serving import generate
from k2jax.configs import base
from k2jax.kernels import platform
from k2jax.model import decode

MIB = 1 << 20
SMALL = 16 * MIB   # the program's code, scalars and metadata


pytestmark = pytest.mark.usefixtures("no_persistent_cache")   # tests/conftest.py


@pytest.fixture(scope="module")
def chip():
  return k2compile.topology_devices("v5e:1x1")


def nbytes(tree) -> int:
  return sum(math.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(tree))


def abstract(tree, shardings):
  """ShapeDtypeStructs of `tree` placed by `shardings` (one sharding, or a matching tree)."""
  if not isinstance(shardings, jax.sharding.Sharding):
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        tree, shardings)
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=shardings),
                      tree)


def compile_for(fn, *args, **static):
  """fn (a jitted k2jax program) traced with the kernels TPU picks and compiled ->
  (compiled, XLA's device memory dict)."""
  with platform.target("tpu"):
    compiled = fn.trace(*args, **static).lower().compile()
  mem = k2compile.memory(compiled.memory_analysis())[0]
  print(f"{getattr(fn, '__name__', fn)}: "   # pytest -s
        + ", ".join(f"{k} {v / MIB:.1f} MiB" for k, v in mem.items()))
  return compiled, mem


def check_memory(mem, floor: int, ceiling: int, device):
  """XLA's arguments hold at least what we passed; its peak lies between that and the
  ceiling counted from the shapes, and within the chip's HBM (XLA's own figure)."""
  print(f"  floor {floor / MIB:.1f} MiB, peak {mem['peak'] / MIB:.1f} MiB, ceiling "
        f"{ceiling / MIB:.1f} MiB")   # pytest -s
  assert mem["arguments"] >= floor, (mem, floor)
  assert floor <= mem["peak"] <= ceiling, (
      f"peak {mem['peak'] / MIB:.1f} MiB outside [{floor / MIB:.1f}, {ceiling / MIB:.1f}] "
      f"MiB: {mem}")
  assert mem["peak"] <= k2compile.hbm_bytes(device), "does not fit the chip"


# ------------------------------------------------------------------------------- generation

B, T, S = 4, 128, 256   # batch, prompt bucket, cache length (generate's power-of-two buckets)


def k2_shaped():
  cfg = configs.get_config("kimi_k2").model
  cfg.update(dict(num_hidden_layers=2, first_k_dense_replace=0, n_routed_experts=16,
                  num_experts_per_tok=4, vocab_size=32768))
  return cfg


@pytest.fixture(scope="module")
def generation(chip):
  """(cfg, mesh, params, cache, the jitted programs): params sharded as the RL loop shards
  its inference copy (parallel.param_shardings on the inference mesh, here one chip)."""
  cfg = k2_shaped()
  mesh = parallel.make_mesh(base.mesh_config(), chip)
  params = abstract(jax.eval_shape(lambda: model.init(cfg, jax.random.key(0))),
                    parallel.param_shardings(model.param_specs(cfg), mesh))
  cache = abstract(jax.eval_shape(lambda: decode.init_cache(cfg, B, S)),
                   parallel.replicated(mesh))
  with platform.target("tpu"):
    programs = generate._programs(cfg)   # kernels.prepare for TPU's picks, then jit
  return cfg, mesh, params, cache, programs


def sampling(mesh):
  """What the RL rollouts sample with: a traced temperature, no top-k / top-p. (top_p sorts
  the vocabulary, which alone costs XLA:TPU 45 s to compile here at 32K.)"""
  return dict(greedy=False, top_k=None, top_p=None,
              temperature=jax.ShapeDtypeStruct((), jnp.float32,
                                               sharding=parallel.replicated(mesh)))


def one_layer_bytes(params) -> int:
  """One layer's parameters: what a layer scan may copy out of the stacked weights."""
  return max(sum(math.prod(a.shape[1:]) * a.dtype.itemsize for a in jax.tree.leaves(params[st]))
             for st in ("dense_layers", "moe_layers") if st in params)


def test_prefill_compiles_for_a_v5e_chip(chip, generation):
  """generate's prefill (the training-form forward over the prompts, filling the cache,
  sampling each row's next token). Ceiling: arguments and results, one layer's parameters
  (the scan's slice), the [B, T, vocab] f32 logits of every position, and 8 f32 activations
  per token at the widest per-token width (q or k heads x 192, or k experts' d + 2 f rows),
  and SMALL."""
  cfg, mesh, params, cache, (prefill, _, _) = generation
  rep = parallel.replicated(mesh)
  tokens = jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=rep)
  lengths = jax.ShapeDtypeStruct((B,), jnp.int32, sharding=rep)
  key = abstract(jax.eval_shape(lambda: jax.random.key(0)), rep)
  args = (params, tokens, lengths, cache, key, None)
  with jax.set_mesh(mesh):
    compiled, mem = compile_for(prefill, *args, **sampling(mesh))
  assert "tpu_custom_call" in compiled.as_text()   # the Mosaic flash attention
  next_tokens, logits, new_cache = compiled.out_info
  assert next_tokens.shape == (B,) and logits.shape == (B, cfg.vocab_size)
  assert jax.tree.map(lambda a: a.shape, new_cache) == jax.tree.map(lambda a: a.shape, cache)
  H, E = cfg.num_attention_heads, cfg.num_experts_per_tok
  width = max(H * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim),
              E * (cfg.hidden_size + 2 * cfg.moe_intermediate_size))
  results = nbytes(compiled.out_info)
  ceiling = (nbytes(args) + results + one_layer_bytes(params) + B * T * cfg.vocab_size * 4
             + 8 * B * T * width * 4 + SMALL)
  check_memory(mem, nbytes(args), ceiling, chip[0])


def test_decode_steps_compile_for_a_v5e_chip_and_reuse_the_cache(chip, generation):
  """generate's `steps`: CHUNK decode steps in one program (lax.scan of the decode step, the
  cache donated), what generate runs whenever no logits processor needs the host each token
  (the RL rollouts, the CLI). At batch 4 x top-4 <= 16 experts it takes the gather path, as
  K2 does at any small batch (k2jax.model.decode). Ceiling: arguments and results, per layer
  the B k experts' gate, up and down matrices the gather reads, twice (gathered, and one
  relayout for the matmul), one layer's parameters (the scan's slice), and SMALL."""
  cfg, mesh, params, cache, (_, _, steps) = generation
  rep = parallel.replicated(mesh)
  tokens = jax.ShapeDtypeStruct((B,), jnp.int32, sharding=rep)
  key = abstract(jax.eval_shape(lambda: jax.random.key(0)), rep)
  start = jax.ShapeDtypeStruct((), jnp.int32, sharding=rep)
  args = (params, cache, tokens, key, start)
  assert B * cfg.num_experts_per_tok <= cfg.n_routed_experts   # the gather path
  with jax.set_mesh(mesh):
    compiled, mem = compile_for(steps, *args, n=generate.CHUNK, **sampling(mesh))
  toks, new_cache = compiled.out_info
  assert toks.shape == (generate.CHUNK, B)
  assert mem["aliased"] >= nbytes(cache)   # the donated cache is updated in place
  gathered = 3 * B * cfg.num_experts_per_tok * cfg.hidden_size * cfg.moe_intermediate_size * 2
  ceiling = (nbytes(args) + nbytes(compiled.out_info) + 2 * gathered + one_layer_bytes(params)
             + SMALL)
  check_memory(mem, nbytes(args), ceiling, chip[0])


# ------------------------------------------------------------------------------------ RL


def tpu_tiled_bytes(a) -> int:
  """Bytes of `a` in TPU's tiled layout at most: its last two dims rounded up to (8, 128),
  at 4 bytes an element (narrower types pack more rows per tile, never fewer bytes)."""
  s = list(a.shape) or [1]
  s[-1] = -(-s[-1] // 128) * 128
  if len(s) > 1:
    s[-2] = -(-s[-2] // 8) * 8
  return math.prod(s) * max(a.dtype.itemsize, 4)


def test_rl_update_compiles_for_a_v5e_chip(chip):
  """The RL loop's update (k2jax.rl.train.step_program: K1.5 loss, gradients, MuonClip),
  the state donated. tiny_rl cut to one MoE layer, without the PTX loss (rl.ptx_weight 0):
  PTX adds a second forward and backward of the same layers at another shape, which doubles
  the compile (over two minutes here). Ceiling: arguments and results, the gradient and the
  update (each the params' size), every residual the loss's VJP keeps for the backward in
  TPU tiles (`tpu_tiled_bytes`: the tiny widths, 16-48, pad to 128 lanes), and SMALL."""
  from k2jax.rl import train as rl
  from k2jax.training.step import init_state
  config = configs.get_config("tiny_rl")
  config.model.update(dict(num_hidden_layers=1, first_k_dense_replace=0))
  config.rl.ptx_weight = 0.0
  mesh = parallel.make_mesh(config.mesh, chip)
  tx = optim.optimizer(config)
  state_shapes = jax.eval_shape(lambda: init_state(config, tx, jax.random.key(0)))
  state = abstract(state_shapes, parallel.state_shardings(
      model.param_specs(config.model), mesh, state_shapes, tx,
      host_state=config.optimizer.host_state))
  P, K, L = config.rl.prompts, config.rl.samples, 128   # rl.train.batch_of's arrays
  rep = parallel.replicated(mesh)
  rows = lambda dt: jax.ShapeDtypeStruct((P * K, L), dt, sharding=rep)
  groups = lambda dt: jax.ShapeDtypeStruct((P, K), dt, sharding=rep)
  batch = dict(inputs=rows(jnp.int32), targets=rows(jnp.int32), mask=rows(jnp.float32),
               weights=rows(jnp.float32), segment_ids=rows(jnp.int32), positions=rows(jnp.int32),
               rewards=groups(jnp.float32), sample_mask=groups(jnp.bool_),
               logp_old=groups(jnp.float32))
  with platform.target("tpu"):
    kernels.prepare(config.model.attention_impl, config.model.moe_impl)
    step = rl.step_program(config, tx)
    residuals = jax.eval_shape(
        lambda p, b: jax.vjp(lambda q: rl.rl_loss(config, q, b, None)[0], p)[1],
        state_shapes.params, batch)
  with jax.set_mesh(mesh):
    compiled, mem = compile_for(step, state, batch, None)
  assert "tpu_custom_call" in compiled.as_text()
  assert mem["aliased"] >= nbytes(state)   # the donated state becomes the new one in place
  args = (state, batch)
  ceiling = (nbytes(args) + nbytes(compiled.out_info) + 2 * nbytes(state.params)
             + sum(map(tpu_tiled_bytes, jax.tree.leaves(residuals))) + SMALL)
  check_memory(mem, nbytes(args), ceiling, chip[0])
