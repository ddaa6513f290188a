"""Pipeline parallelism with virtual stages over the `pipeline` mesh axis (report 2.4.2).

The last layer stack (the MoE layers; all layers of an all-dense model) is cut into
S = P x V stages of `per_stage` consecutive layers, P = mesh.pipeline devices and V =
mesh.virtual_stages. Stage s lives on device s % P (round-robin, "interleaved"/circular):
a microbatch visits devices 0, 1, ..., P-1, then device 0 again for stage P, and so on, V
times around the ring. Layer counts that do not divide are padded with identity layers at
the end (e.g. K2's 60 MoE layers over 16 x 1 stages: 4 per stage, 4 identity).

Everything runs in the one jitted step: `shard_map` makes only the `pipeline` axis manual
(data / expert stay automatic, so the MoE's own expert-parallel shard_map nests inside) and
activations move between stages with `ppermute`. Two schedules (mesh.pipeline_schedule), with
M microbatches (train.grad_accum, M >= P):

  1f1b   (default) Megatron-style interleaved one-forward-one-backward: microbatches enter in
         groups of P, each device runs one stage forward and one stage backward per
         iteration (`loss_and_grads_1f1b`: the gradients are formed inside the loop with
         jax.vjp per stage, cotangents travel the ring backwards). A device keeps at most
         2 P V stage inputs, whatever M. M V + P V + P - 1 iterations.
  gpipe  the forward loop (`loss`) differentiated by JAX: the reverse schedule with the
         ppermutes reversed. A device keeps every stage's activations of every microbatch
         until the backward pass (only the per-layer model.remat policy applies): linear in
         M; the reference schedule. At iteration t device p runs its
         virtual stage v = i // M on microbatch i mod M, i = t - p; device 0 parks the
         outputs of stage P-1 until their next lap (they arrive M - P iterations early).

1f1b recomputes each stage once in the backward pass. Idle slots (`bubble`): gpipe
(P - 1) / (M V + P - 1); 1f1b (P V + P - 1) / (M V + P V + P - 1), since a masked slot costs
as much as a busy one under SPMD: 1f1b trades about twice the bubble for flat memory.

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


def bubble(stages: int, virtual: int, microbatches: int, schedule: str = "gpipe") -> float:
  """Idle fraction of a device's stage slots.

  gpipe: (P - 1) / (M V + P - 1), in the forward loop and again in its transpose.
  1f1b: (P V + P - 1) / (M V + P V + P - 1): every iteration has a forward and a backward
  slot, and under SPMD a masked slot costs as much as a busy one, so the warm-up (forwards
  only) and cool-down (backwards only) iterations are paid in full. The price of keeping
  activations independent of M.
  """
  P, V, M = stages, virtual, microbatches
  if schedule == "1f1b":
    return (P * V + P - 1) / (M * V + P * V + P - 1)
  return (P - 1) / (M * V + P - 1)


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
  return stage


def _pipeline_model_cfg(cfg):
  if routed_impl(cfg.moe_impl) != "capacity":
    return cfg
  # The capacity path's overflow is a lax.cond on a per-shard predicate. Inside the pipeline
  # loop XLA:CPU places data-axis collectives in its branches, so shards that disagree
  # deadlock (8 simulated devices, pipeline=4 x data=2); sort + grouped matmul has no
  # data-dependent branch.
  cfg = cfg.copy_and_resolve_references()
  cfg.moe_impl = "ragged"
  return cfg


def _pre(cfg, sp: Split, params, mb):
  """The embedding and the leading (dense) stacks, per microbatch, outside the pipeline.
  -> (stage-0 inputs [M, mb, T, d], their max logits [dense layers, H])."""
  x = jnp.take(params["embed"], mb["inputs"], axis=0).astype(jnp.dtype(cfg.dtype))
  pre_max = [jnp.full((0, cfg.num_attention_heads), -jnp.inf, jnp.float32)]
  for st in transformer.stacks(cfg):
    if st == sp.stack:
      break
    def dense(x, pos, seg, st=st):
      y, (ml, _) = transformer._run_stack(cfg, st.ffn, params[st.name], x, pos, seg)
      return y, ml
    # Checkpointed per microbatch: the backward pass recomputes one microbatch's dense layers
    # at a time instead of keeping all M of them (which would grow with M).
    dense = jax.checkpoint(dense, prevent_cse=False)
    x, ml = jax.lax.map(lambda a: dense(*a), (x, mb["positions"], mb["segment_ids"]))
    pre_max.append(jnp.max(ml, axis=0))
  return x, jax.lax.stop_gradient(jnp.concatenate(pre_max, axis=0))


def _schedule(cfg, sp: Split, M: int, params, on, x, positions, segment_ids, tokens):
  """Inside shard_map (pipeline manual). params / on: this device's [V, per_stage, ...];
  x [M, mb, T, d] stage-0 inputs; positions / segment_ids [M, mb, T]; tokens [M] weights
  of each microbatch's aux loss. -> (last stage outputs [M, mb, T, d], per-stage stats)."""
  Pn, V, L = sp.stages, sp.virtual, sp.per_stage
  p = jax.lax.axis_index(AXIS)
  # Not checkpointed: a recomputed stage's collectives would be independent of the incoming
  # cotangent's ppermute in the backward pass, an ordering XLA:CPU can deadlock on.
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
  cfg = _pipeline_model_cfg(cfg)
  if M < stages:
    raise ValueError(f"train.grad_accum = {M} microbatches for mesh.pipeline = {stages} "
                     f"stages: need at least {stages} so every stage has work; raise "
                     "train.grad_accum")
  dt = jnp.dtype(cfg.dtype)
  mb = microbatches
  positions, segment_ids = mb["positions"], mb["segment_ids"]
  mask = mb["loss_mask"].astype(jnp.float32)
  tokens = jnp.sum(mask, axis=(1, 2))

  x, pre_max = _pre(cfg, sp, params, mb)

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
  max_logits = jnp.concatenate([pre_max, _from_stages(sp, mx)], axis=0)
  moe = sp.stack.ffn == "moe"
  expert_load = (_from_stages(sp, load) if moe
                 else jnp.zeros((0, cfg.n_routed_experts), jnp.float32))
  stats = transformer.ForwardStats(max_logits=jax.lax.stop_gradient(max_logits),
                                   expert_load=expert_load,
                                   aux_loss=aux / jnp.maximum(n, 1.0))
  return jnp.sum(ce * mask), n, aux, stats


def _schedule_1f1b(cfg, sp: Split, M: int, params, on, head, x, positions, segment_ids,
                   targets, mask, tokens):
  """Inside shard_map (pipeline manual): forward AND backward of every stage, interleaved.

  Microbatches go in groups of P (Megatron's interleaved schedule): forward item i = t - p
  of device p is microbatch g P + r mod P of group g = i // (P V) on its virtual stage
  v = (i mod P V) // P. The backward of an item starts at the last stage one iteration after
  its forward there and walks the stages in reverse, one per iteration: backward item
  j = t - P V - (P - 1 - p), virtual stage V - 1 - (j mod P V) // P. An item's stage input
  waits at most 2 P V - 1 iterations for its backward, so a ring of 2 P V stage inputs per
  device holds everything, whatever M: the 1F1B property. The backward recomputes the stage
  (jax.vjp at the saved input), as the checkpointed GPipe schedule does.

  head: {"final_norm", "lm_head"}; targets / mask [M, mb, T]. -> (cross-entropy sum, aux
  sum, max logits and expert load per stage, stage-parameter grads, head grads, d(stage-0
  inputs) [M, mb, T, d]).
  """
  Pn, V, L = sp.stages, sp.virtual, sp.per_stage
  PV, K, T0 = Pn * V, 2 * Pn * V, Pn * V
  p = jax.lax.axis_index(AXIS)
  stage = _stage_fn(cfg, sp.stack.ffn)
  H, E = cfg.num_attention_heads, cfg.n_routed_experts
  moe = sp.stack.ffn == "moe"
  dt = x.dtype
  fwd_ring = [(j, (j + 1) % Pn) for j in range(Pn)]
  bwd_ring = [(j, (j - 1) % Pn) for j in range(Pn)]

  def run_stage(pv, onv, xin, m):
    y, (ml, ms) = stage(pv, onv, xin, positions[m], segment_ids[m])
    aux = jnp.sum(ms.aux_loss * onv) * tokens[m] if moe else jnp.zeros((), jnp.float32)
    return (y, aux), (ml, ms)

  def head_loss(hp, h, m):
    h = rms_norm(h, hp["final_norm"], cfg.rms_norm_eps)
    logits = jnp.einsum("btd,dv->btv", h, hp["lm_head"].astype(dt),
                        preferred_element_type=jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets[m])
    return jnp.sum(ce * mask[m])

  def item(i):
    g, r = i // PV, i % PV
    return g * Pn + r % Pn, r // Pn

  def where_tree(c, a, b):
    return jax.tree.map(lambda u, w: jnp.where(c, u, w), a, b)

  def it(carry, t):
    (xf, db, dh_prev, buf, mx, load, ce_acc, aux_acc, g_stage, g_head, dx0) = carry
    # Forward item.
    i = t - p
    fvalid = (i >= 0) & (i < M * V)
    ic = jnp.clip(i, 0, M * V - 1)
    m, v = item(ic)
    inp = jnp.where((p == 0) & (v == 0), x[m], xf)
    pv = jax.tree.map(lambda a: a[v], params)
    (y, aux), (ml, ms) = run_stage(pv, on[v], inp, m)
    slot = ic % K
    buf = buf.at[slot].set(jnp.where(fvalid, inp, buf[slot]))
    mx = mx.at[v].max(jnp.where(fvalid, ml, -jnp.inf))
    if moe:
      load = load.at[v].add(jnp.where(fvalid, ms.expert_load, 0.0))
    aux_acc = aux_acc + jnp.where(fvalid, aux, 0.0)
    last = fvalid & (p == Pn - 1) & (v == V - 1)
    ce, (gh, dh) = jax.value_and_grad(head_loss, argnums=(0, 1))(head, y, m)
    # Every collective of this iteration in one order on every device (forward stage, head,
    # backward stage, then the two ring transfers): XLA:CPU may otherwise issue independent
    # collectives in different orders on different devices and deadlock.
    ce, gh, dh, db, buf = jax.lax.optimization_barrier((ce, gh, dh, db, buf))
    ce_acc = ce_acc + jnp.where(last, ce, 0.0)
    g_head = jax.tree.map(lambda a, b: a + jnp.where(last, b, 0.0), g_head, gh)
    # Backward item: the forward item (m_b, v_b) of this device, recomputed from its input.
    j = t - T0 - (Pn - 1 - p)
    bvalid = (j >= 0) & (j < M * V)
    jc = jnp.clip(j, 0, M * V - 1)
    g, r = jc // PV, jc % PV
    v_b = V - 1 - r // Pn
    m_b = g * Pn + r % Pn
    i_b = g * PV + v_b * Pn + r % Pn
    dy = jnp.where((p == Pn - 1) & (v_b == V - 1), dh_prev, db)
    pvb = jax.tree.map(lambda a: a[v_b], params)
    _, vjp = jax.vjp(lambda pp, xx: run_stage(pp, on[v_b], xx, m_b)[0], pvb, buf[i_b % K])
    gp, dx = vjp((dy.astype(dt), jnp.ones((), jnp.float32)))
    g_stage = jax.tree.map(
        lambda acc, gg: acc.at[v_b].add(jnp.where(bvalid, gg.astype(jnp.float32), 0.0)),
        g_stage, gp)
    first = bvalid & (p == 0) & (v_b == 0)
    dx0 = dx0.at[m_b].set(jnp.where(first, dx, dx0[m_b]))
    y, dx, g_stage, dx0 = jax.lax.optimization_barrier((y, dx, g_stage, dx0))
    xf = jax.lax.ppermute(y, AXIS, fwd_ring)
    xf, dx = jax.lax.optimization_barrier((xf, dx))
    db = jax.lax.ppermute(dx, AXIS, bwd_ring)
    return (xf, db, dh.astype(jnp.float32), buf, mx, load, ce_acc, aux_acc, g_stage, g_head,
            dx0), None

  zero = jnp.zeros_like(x[0])
  f32 = lambda a: jnp.zeros(a.shape, jnp.float32)
  init = (zero, zero, f32(x[0]), jnp.zeros((K,) + x.shape[1:], dt),
          jnp.full((V, L, H), -jnp.inf, jnp.float32),
          jnp.zeros((V, L, E if moe else 0), jnp.float32), jnp.zeros((), jnp.float32),
          jnp.zeros((), jnp.float32), jax.tree.map(f32, params), jax.tree.map(f32, head),
          jnp.zeros_like(x))
  n_it = T0 + M * V + Pn - 1
  (_, _, _, _, mx, load, ce, aux, g_stage, g_head, dx0), _ = jax.lax.scan(
      it, init, jnp.arange(n_it))
  sum_ = lambda a: jax.lax.psum(a, AXIS)
  return (sum_(ce), sum_(aux), mx[None], load[None], jax.tree.map(lambda a: a[None], g_stage),
          jax.tree.map(sum_, g_head), sum_(dx0))


def loss_and_grads_1f1b(cfg, params, microbatches, *, stages: int, virtual: int = 1):
  """The interleaved 1F1B schedule (_schedule_1f1b): loss and gradients in one pass.

  -> (summed cross entropy, token count, summed token-weighted aux loss, ForwardStats,
      gradients of cross entropy + aux loss summed over microbatches (not divided by
      the token count)), the same quantities `jax.grad` of `loss` gives.
  """
  sp = split(cfg, stages, virtual)
  mb = microbatches
  M = mb["inputs"].shape[0]
  if M < stages or M % stages:
    raise ValueError(f"train.grad_accum = {M} microbatches for mesh.pipeline = {stages} "
                     "with the 1f1b schedule: must be a multiple of the pipeline size; "
                     f"set train.grad_accum to {stages * max(1, M // stages)}")
  cfg = _pipeline_model_cfg(cfg)
  mask = mb["loss_mask"].astype(jnp.float32)
  tokens = jnp.sum(mask, axis=(1, 2))
  pre_names = ["embed"] + [s.name for s in transformer.stacks(cfg) if s != sp.stack]
  (x, pre_max), pre_vjp = jax.vjp(
      lambda pp: _pre(cfg, sp, pp, mb), {k: params[k] for k in pre_names})
  head = {k: params[k] for k in ("final_norm", "lm_head")}
  stage_params = jax.tree.map(lambda a: _to_stages(sp, a), params[sp.stack.name])
  on = _to_stages(sp, jnp.ones((sp.stack.size,), bool))
  specs = jax.tree.map(lambda _: P(AXIS), stage_params)
  run = jax.shard_map(
      lambda prm, on, *a: _schedule_1f1b(cfg, sp, M, jax.tree.map(lambda b: b[0], prm), on[0],
                                         *a),
      in_specs=(specs, P(AXIS), P(), P(), P(), P(), P(), P(), P()),
      out_specs=(P(), P(), P(AXIS), P(AXIS), specs, P(), P()), axis_names={AXIS},
      check_vma=False)
  ce, aux, mx, load, g_stage, g_head, dx0 = run(
      stage_params, on, head, x, mb["positions"], mb["segment_ids"], mb["targets"], mask,
      tokens)
  (g_pre,) = pre_vjp((dx0, jnp.zeros_like(pre_max)))
  grads = {**g_pre, **g_head,
           sp.stack.name: jax.tree.map(lambda a: _from_stages(sp, a), g_stage)}
  grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
  n = jnp.sum(mask)
  moe = sp.stack.ffn == "moe"
  stats = transformer.ForwardStats(
      max_logits=jnp.concatenate([pre_max, _from_stages(sp, mx)], axis=0),
      expert_load=(_from_stages(sp, load) if moe
                   else jnp.zeros((0, cfg.n_routed_experts), jnp.float32)),
      aux_loss=aux / jnp.maximum(n, 1.0))
  return ce, n, aux, stats, grads
