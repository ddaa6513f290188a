"""Pipeline parallelism with virtual stages over the `pipeline` mesh axis (report 2.4.2).

The last layer stack (the MoE layers; all layers of an all-dense model) is cut into
S = P x V stages of `per_stage` consecutive layers, P = mesh.pipeline devices and V =
mesh.virtual_stages. Stage s lives on device s % P (round-robin, "interleaved"/circular):
a microbatch visits devices 0, 1, ..., P-1, then device 0 again for stage P, and so on, V
times around the ring. Layer counts that do not divide are padded with identity layers at
the end (e.g. K2's 60 MoE layers over 16 x 1 stages: 4 per stage, 4 identity).

Everything runs in the one jitted step: `shard_map` makes only the `pipeline` axis manual
(data / expert stay automatic, so the MoE's own expert-parallel shard_map nests inside) and
activations move between stages with `ppermute`. With M microbatches (train.grad_accum,
M >= P) the schedule takes M V + P - 1 iterations; at iteration t device p runs its virtual
stage v on microbatch m, where i = t - p, m = i mod M, v = i // M (idle when i is outside
[0, M V)). The bubble is (P - 1) / (M V + P - 1) of the time. Device 0 parks the outputs of
stage P-1 in a buffer until their next lap starts (they arrive M - P iterations early).

The backward pass is JAX's transpose of that loop: the reverse schedule with the ppermutes
reversed. Each stage is rematerialized (`jax.checkpoint` around the stage, the configured
per-layer policy inside), so a device keeps one stage input per iteration, M V + P - 1 of
them; a 1F1B schedule would keep about P. That is GPipe's memory with recomputation, not
1F1B's: the reverse pass is derived by autodiff rather than hand-interleaved.

The embedding and the leading dense layers run before the loop and the final norm, head and
loss after it, on the whole batch; they are not split over the pipeline axis (their
parameters are replicated over it). For K2 that is 1 of 61 layers plus the embedding and
head.
"""

import logging
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from k2jax.kernels import moe as moe_kernels
from k2jax.model import transformer
from k2jax.model.layers import rms_norm
from k2jax.model.remat import remat_policy

log = logging.getLogger("k2jax.parallel")

AXIS = "pipeline"


class Split(NamedTuple):
  """How the pipelined stack is cut: stage s holds its layers [s * per_stage, (s+1) * per_stage)."""
  stack: transformer.Stack   # the pipelined stack (the model's last)
  stages: int                # P: devices on the pipeline axis
  virtual: int               # V: stages per device
  per_stage: int             # layers per stage (identity layers pad the last stages)

  @property
  def padded(self) -> int:
    return self.stages * self.virtual * self.per_stage - self.stack.size

  def describe(self, cfg) -> str:
    pre = [s for s in transformer.stacks(cfg) if s != self.stack]
    before = "embedding" + "".join(f" + {s.size} {s.ffn} layer(s)" for s in pre)
    return (f"pipeline: {self.stack.size} {self.stack.name} over {self.stages} devices x "
            f"{self.virtual} virtual = {self.stages * self.virtual} stages of {self.per_stage} "
            f"layer(s) (stage s on device s % {self.stages}"
            f"{f', {self.padded} identity layer(s) pad the last stages' if self.padded else ''}"
            f"); {before} before the pipeline, norm + head after it")


def split(cfg, stages: int, virtual: int = 1) -> Split:
  stack = transformer.stacks(cfg)[-1]
  return Split(stack, stages, virtual, math.ceil(stack.size / (stages * virtual)))


def routed_impl(impl: str) -> str:
  return moe_kernels.auto_impl() if impl == "auto" else impl


def bubble(stages: int, virtual: int, microbatches: int) -> float:
  """Idle fraction of the schedule: (P - 1) / (M V + P - 1)."""
  return (stages - 1) / (microbatches * virtual + stages - 1)


def _to_stages(sp: Split, x):
  """[layers, ...] -> [P, V, per_stage, ...] (zero-padded): [p, v] is stage v P + p."""
  x = jnp.pad(x, [(0, sp.padded)] + [(0, 0)] * (x.ndim - 1))
  x = x.reshape((sp.virtual, sp.stages, sp.per_stage) + x.shape[1:])
  return jnp.swapaxes(x, 0, 1)


def _from_stages(sp: Split, x):
  """[P, V, per_stage, ...] -> [layers, ...], dropping the padding."""
  x = jnp.swapaxes(x, 0, 1)
  return x.reshape((-1,) + x.shape[3:])[:sp.stack.size]


def _stage_fn(cfg, ffn):
  """One stage: its layers in a scan; identity where a layer is padding."""
  def layer(x, p_on, positions, segment_ids):
    p, on = p_on
    y, (ml, ms) = transformer._block(cfg, ffn, x, p, positions, segment_ids)
    return jnp.where(on, y, x), (ml, ms)

  policy = remat_policy(cfg.remat, cfg.offload)
  if policy is not None:
    layer = jax.checkpoint(layer, policy=policy, prevent_cse=False)

  def stage(p, on, x, positions, segment_ids):
    return jax.lax.scan(lambda x, po: layer(x, po, positions, segment_ids), x, (p, on))
  # Keep only the stage input per iteration; the stage is recomputed in the backward pass.
  return jax.checkpoint(stage, prevent_cse=False)


def _schedule(cfg, sp: Split, M: int, params, on, x, positions, segment_ids, tokens):
  """Inside shard_map (pipeline manual). params / on: this device's [V, per_stage, ...];
  x [M, mb, T, d] stage-0 inputs; positions / segment_ids [M, mb, T]; tokens [M] weights
  of each microbatch's aux loss. -> (last stage outputs [M, mb, T, d], per-stage stats)."""
  Pn, V, L = sp.stages, sp.virtual, sp.per_stage
  p = jax.lax.axis_index(AXIS)
  stage = _stage_fn(cfg, sp.stack.ffn)
  H, E = cfg.num_attention_heads, cfg.n_routed_experts
  moe = sp.stack.ffn == "moe"
  ring = [(j, (j + 1) % Pn) for j in range(Pn)]

  def it(carry, t):
    state, parked, outs, mx, load, aux = carry
    i = t - p
    valid = (i >= 0) & (i < M * V)
    ic = jnp.clip(i, 0, M * V - 1)
    m, v = ic % M, ic // M
    # Device 0: park what stage P-1 sent (microbatch (t - P) mod M), then take this
    # iteration's input: the embedding on the first lap, a parked activation after it.
    j = t - Pn
    arrived = (p == 0) & (j >= 0) & (j < M * V)
    parked = jnp.where(arrived, parked.at[jnp.clip(j, 0, M * V - 1) % M].set(state), parked)
    first = jnp.where(v == 0, x[m], parked[m])
    inp = jnp.where(p == 0, first, state)
    pv = jax.tree.map(lambda a: a[v], params)
    y, (ml, ms) = stage(pv, on[v], inp, positions[m], segment_ids[m])
    mx = mx.at[v].max(jnp.where(valid, ml, -jnp.inf))
    if moe:
      load = load.at[v].add(jnp.where(valid, ms.expert_load, 0.0))
      aux = aux + jnp.where(valid, jnp.sum(ms.aux_loss * on[v]) * tokens[m], 0.0)
    last = valid & (p == Pn - 1) & (v == V - 1)
    outs = jnp.where(last, outs.at[m].set(y), outs)
    state = jax.lax.ppermute(y, AXIS, ring)
    return (state, parked, outs, mx, load, aux), None

  zeros = jnp.zeros_like(x[0])
  init = (zeros, jnp.zeros_like(x), jnp.zeros_like(x),
          jnp.full((V, L, H), -jnp.inf, jnp.float32),
          jnp.zeros((V, L, E if moe else 0), jnp.float32), jnp.zeros((), jnp.float32))
  (_, _, outs, mx, load, aux), _ = jax.lax.scan(it, init, jnp.arange(M * V + Pn - 1))
  outs = jax.lax.psum(jnp.where(p == Pn - 1, outs, 0.0), AXIS)   # the last stage's, everywhere
  return outs, mx[None], load[None], jax.lax.psum(aux, AXIS)


def loss(cfg, params, microbatches, *, stages: int, virtual: int = 1):
  """Pipelined forward and loss over microbatches (the leaves of `microbatches`: [M, mb, T]).

  -> (summed cross entropy, token count, summed token-weighted aux loss,
      ForwardStats with max_logits maxed and expert_load summed over microbatches; its
      aux_loss is the token-weighted mean).
  The token-weighted aux loss matches k2jax.step's gradient accumulation: microbatch m adds
  aux_m x tokens_m, so gradients equal those of the unpipelined step.
  """
  sp = split(cfg, stages, virtual)
  M = microbatches["inputs"].shape[0]
  if routed_impl(cfg.moe_impl) == "capacity":
    # The capacity path's overflow is a lax.cond on a per-shard predicate. Inside the
    # pipeline loop XLA:CPU places data-axis collectives in its branches, so shards that
    # disagree deadlock (8 simulated devices, pipeline=4 x data=2); sort + grouped matmul
    # has no data-dependent branch.
    cfg = cfg.copy_and_resolve_references()
    cfg.moe_impl = "ragged"
  if M < stages:
    raise ValueError(f"train.grad_accum = {M} microbatches for mesh.pipeline = {stages} "
                     f"stages: need at least {stages} so every stage has work; raise "
                     "train.grad_accum")
  dt = jnp.dtype(cfg.dtype)
  mb = microbatches
  positions, segment_ids = mb["positions"], mb["segment_ids"]
  mask = mb["loss_mask"].astype(jnp.float32)
  tokens = jnp.sum(mask, axis=(1, 2))

  # Embedding and the leading (dense) stacks, per microbatch, outside the pipeline.
  x = jnp.take(params["embed"], mb["inputs"], axis=0).astype(dt)
  pre_max = []
  for st in transformer.stacks(cfg):
    if st == sp.stack:
      break
    def dense(x, pos, seg, st=st):
      y, (ml, _) = transformer._run_stack(cfg, st.ffn, params[st.name], x, pos, seg)
      return y, ml
    x, ml = jax.lax.map(lambda a: dense(*a), (x, positions, segment_ids))
    pre_max.append(jnp.max(ml, axis=0))

  stage_params = jax.tree.map(lambda a: _to_stages(sp, a), params[sp.stack.name])
  on = _to_stages(sp, jnp.ones((sp.stack.size,), bool))
  specs = jax.tree.map(lambda _: P(AXIS), stage_params)
  run = jax.shard_map(
      lambda prm, on, *a: _schedule(cfg, sp, M, jax.tree.map(lambda b: b[0], prm), on[0], *a),
      in_specs=(specs, P(AXIS), P(), P(), P(), P()),
      out_specs=(P(), P(AXIS), P(AXIS), P()), axis_names={AXIS}, check_vma=False)
  outs, mx, load, aux = run(stage_params, on, x, positions, segment_ids, tokens)

  h = rms_norm(outs, params["final_norm"], cfg.rms_norm_eps)
  logits = jnp.einsum("mbtd,dv->mbtv", h, params["lm_head"].astype(dt),
                      preferred_element_type=jnp.float32)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, mb["targets"])
  n = jnp.sum(mask)
  max_logits = jnp.concatenate(pre_max + [_from_stages(sp, mx)], axis=0)
  moe = sp.stack.ffn == "moe"
  expert_load = (_from_stages(sp, load) if moe
                 else jnp.zeros((0, cfg.n_routed_experts), jnp.float32))
  stats = transformer.ForwardStats(max_logits=jax.lax.stop_gradient(max_logits),
                                   expert_load=expert_load,
                                   aux_loss=aux / jnp.maximum(n, 1.0))
  return jnp.sum(ce * mask), n, aux, stats
