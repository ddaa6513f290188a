"""The pipeline's tick loop on one device: the schedule table's phases, in order, over the
buffer slots the table assigns (k2jax.parallel.pipeline has the whole design).

  Slots      where the residuals between a stage's F and its B wait: device or host memory
  Executor   one device's program: forward, head, input-gradient, weight-gradient and
             transfer phases per tick, run by `tick` under lax.scan

Everything here reads the table (k2jax.parallel.schedules) and calls the stage's work
(k2jax.parallel.stage); no schedule is written into the loop.
"""

import logging
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from k2jax.kernels import platform as kernel_platform
from k2jax.model import transformer
from k2jax.parallel import schedules, stage
from k2jax.parallel.layout import Split, placed, stage_of
from k2jax.parallel.stage import AXIS

log = logging.getLogger("k2jax.parallel")


def _put(buf, slot, value):
  """buf[slot] = value where slot >= 0 (a tree of buffers [slots, ...])."""
  def one(b, x):
    i = jnp.maximum(slot, 0)
    return b.at[i].set(jnp.where(slot >= 0, x.astype(b.dtype), b[i]))
  return jax.tree.map(one, buf, value)


class Slots(NamedTuple):
  """The memory the schedule's residual slots (and zbh1's cut slots) live in: the device's,
  or host memory (`host`: model.offload, report 2.4.3). Each F phase writes one stage's
  residuals into a slot and each B (W) phase reads one back, so with host slots the device
  holds what the tick is working on and the microbatches in flight wait on the host.

  Host writes are unconditional: a tick with nothing to keep writes to one extra slot that
  nothing reads, instead of selecting between the new value and the slot's old one (which
  would bring the old one to the device). A dynamic-update-slice of a value moved to host
  into a loop-carried host buffer, and a dynamic slice of it moved back, is the form XLA's
  host offloading takes for a scan's offloaded residuals.

  Leaves under HOST_MIN bytes a slot (routing counts, scalars: a few hundred KB a stage)
  stay in device slots. XLA:TPU refuses or fails to compile host offloading's async copies
  of such leaves (libtpu 0.0.42.1: a [slots] buffer of scalars is written one lane at a
  time, "Lane slice updating is not supported in async dynamic update slice", and so is
  [slots, 1, 1]; K2's step aborted in the host DMA emitter with them in host memory), and
  moving them saves nothing. In host memory every slot is a major-most row: a leaf of
  rank < 2 is stored with leading unit axes, so a write never updates part of a buffer's
  two minor (TPU-tiled) dimensions; a leaf narrower than a TPU tile's 128 lanes in its last
  dimension is stored with its two minor dimensions as rows of 128 (XLA:TPU padded K2's
  [tokens, 16] and [tokens, 56] float32 residuals to 128 lanes, 3.3 + 1.1 GiB of host
  memory a device; swapping the two axes did not help: XLA chose the layout back)."""
  host: bool

  HOST_MIN = 1 << 20
  LANES = 128

  def on_host(self, a) -> bool:
    return self.host and stage.nbytes(a) >= self.HOST_MIN

  @staticmethod
  def _row(shape):
    return (1,) * max(0, 2 - len(shape)) + tuple(shape)

  @classmethod
  def _stored(cls, shape):
    """A slot's shape in host memory: `_row`, its two minor dimensions as rows of LANES
    where the last is narrower and their product a multiple of LANES."""
    shape = cls._row(shape)
    n = shape[-1] * shape[-2]
    return shape[:-2] + (n // cls.LANES, cls.LANES) if (shape[-1] < cls.LANES and
                                                         n % cls.LANES == 0) else shape

  def zeros(self, n: int, avals):
    # A host buffer is a host scalar broadcast there: zeros made on the device and moved
    # would first hold every slot in device memory (XLA:TPU: the whole buffer as a device
    # temporary; at K2 the slots are 54.6 GB a device).
    host0 = lambda a: jnp.broadcast_to(jax.device_put(jnp.zeros((), a.dtype),
                                                      jax.memory.Space.Host),
                                       (n + 1,) + self._stored(a.shape))
    return [host0(a) if self.on_host(a)
            else jnp.zeros((n + 1 if self.host else n,) + a.shape, a.dtype) for a in avals]

  def put(self, buf, slot, value):
    """buf[slot] = value where slot >= 0."""
    if not self.host:
      return _put(buf, slot, value)

    # lax.dynamic_update_slice, not `.at[i].set`: jnp's scatter drops out-of-range rows,
    # which XLA turns into a select over the whole buffer, and a select of host buffers is
    # computed on the host (the H100 run of bench_pipeline.offload warned of exactly that).
    # Device leaves take the same unconditional write (their spare slot absorbs idle ticks).
    def one(b, x):
      i = jnp.where(slot >= 0, slot, b.shape[0] - 1)
      if self.on_host(x):
        x = x.astype(b.dtype).reshape((1,) + self._stored(x.shape))
        x = jax.device_put(x, jax.memory.Space.Host)
      else:
        x = x.astype(b.dtype).reshape((1,) + b.shape[1:])
      return jax.lax.dynamic_update_slice_in_dim(b, x, i, 0)
    return [one(b, x) for b, x in zip(buf, value)]

  def get(self, buf, slot, avals):
    """buf[slot] on the device, shaped like `avals` (slot < 0: any slot; the phase reading it
    is idle)."""
    i = jnp.maximum(slot, 0)
    if not self.host:
      return jax.tree.map(lambda b: b[i], buf)
    # the slice moves to the device as it is ([1, ...]) and drops its axis there: XLA's
    # host offloading takes a dynamic slice followed directly by the move to the device
    def one(b, a):
      x = jax.lax.dynamic_slice_in_dim(b, i, 1, 0)
      if not self.on_host(a):
        return x.reshape(a.shape)
      return jax.device_put(x, jax.memory.Space.Device).reshape(a.shape)
    return [one(b, a) for b, a in zip(buf, avals)]


class TickCarry(NamedTuple):
  """What the tick loop carries from one tick to the next on one device."""
  act_in: object     # the stage output the previous device sent this tick
  grad_in: object    # the input cotangent the next device sent this tick
  act_buf: object    # slots of arrived activations waiting for their F
  grad_buf: object   # slots of arrived cotangents waiting for their B
  res_buf: object    # slots of what F saved for its B (host memory with offload)
  cut_buf: object    # slots of what B hands W (split schedules)
  stats: dict        # loss sums, max logits, expert load, the head's gradient sums
  sums: dict         # float32 weight-gradient sums: {"pre", "stage"}


class Executor:
  """One pipeline device's program over the schedule table, inside the pipeline's shard_map
  (pipeline and `reps` manual: `pipeline.replica_axes`), as named phases that `tick` runs
  in order:

    forward_phase         F: the stage's layers on one microbatch (stage 0 embeds first)
    head_phase            the final norm, head and loss of the microbatch the last stage
                          finished this tick, on every device (`stage.head`); its cotangent
                          waits in a gradient slot for that stage's B
    input_grad_phase      B: the stage's backward (zbh1: its input-gradient half only)
    weight_grad_phase     W (zbh1): the weight-gradient half the table put in this tick
    transfer              the stage outputs one way round the ring, cotangents the other

  The table says which stage and microbatch each phase runs at each tick on each device
  and which buffer slots it writes and reads (k2jax.parallel.schedules); this class holds
  no schedule of its own.

  Args (the shard_map's operands, this device's shares): stage_params, this device's
  [V L, ...] stored rows; real_layers [V L] bool (rows that are layers, not padding);
  pre_params {"embed", dense stacks};
  head {"final_norm", "lm_head": this device's [D, vocab / P] columns}; mb, microbatches
  [M, mb, T]; aux_weight, every microbatch's aux loss weight (the batch's loss tokens / M,
  as in k2jax.training.step's accumulation). offload: residual slots in host memory (`Slots`).
  Sums over `reps` (losses, statistics, gradients) are taken once, at the end (`results`):
  each device's aux loss weighs 1 / their size, its mean over their shards.
  """

  def __init__(self, cfg, sp: Split, tab: schedules.Table, grads: bool, skip: str,
               offload: bool, reps: tuple, stage_params, real_layers, pre_params, head, mb,
               aux_weight):
    self.cfg, self.sp, self.tab, self.grads, self.reps = cfg, sp, tab, grads, reps
    self.pre_params, self.head, self.mb = pre_params, head, mb
    P, V, L = self.P, self.V, self.L = sp.stages, sp.virtual, sp.per_stage
    self.p = jax.lax.axis_index(AXIS)
    self.aux_weight = aux_weight / math.prod(jax.lax.axis_size(a) for a in reps)
    self.H, self.E = cfg.num_attention_heads, cfg.n_routed_experts
    self.moe = sp.stack.ffn == "moe"
    self.dt = jnp.dtype(cfg.dtype)
    self.per_device = skip == "device"
    self.stats = (self.H, self.E if self.moe else 0)
    self.params = jax.tree.map(lambda a: a.reshape((V, L) + a.shape[1:]), stage_params)
    self.real = real_layers.reshape(V, L)
    self.fwd_ring = [(j, (j + 1) % P) for j in range(P)]
    self.bwd_ring = [(j, (j - 1) % P) for j in range(P)]
    self.act_shape = mb["inputs"].shape[1:] + (cfg.hidden_size,)
    self.n_pre = sum(s.size for s in transformer.stacks(cfg) if s != sp.stack)
    # the device running the last stage (the head's input and its cotangent live there)
    self.last = placed(P * V - 1, P)[1]
    self.last_device = self.p == self.last
    self._layer_functions()
    # Shapes of one F phase's outputs, for the buffers and the idle branch.
    self.x0 = jnp.zeros(self.act_shape, self.dt)
    self.res_shapes = jax.eval_shape(lambda x: self.stage_forward(x, 0, 0), self.x0)[2]
    if grads and tab.split:
      self.cut_shapes = [jax.ShapeDtypeStruct((L,) + a.shape, a.dtype)
                         for a in self.cut_fn.cut_avals]
    self.store = Slots(offload and grads)
    self._log_buffers()
    # The table as arrays: each device's task and slots per tick, and what some device of
    # the tick needs (static: the "tick" predicates of skip="tick").
    self.task = {k: jnp.asarray(a) for k, a in tab.task.items()}
    self.slot = {k: jnp.asarray(a) for k, a in tab.slots.items()}
    self.busy = {k: jnp.asarray(tab.busy(k).any(axis=1)) for k in tab.task}
    self.embeds = {k: jnp.asarray(tab.task[k][:, 0, 0] == 0) for k in ("F", "B")}
    self.head_tick = jnp.asarray(schedules.head_ticks(tab))
    # The tick's phases in program order on XLA:CPU only, whose thunk executor may run
    # independent collectives in a different order on each device (a deadlock); GPU and
    # TPU run one schedule on every device, and without the barriers their schedulers may
    # overlap the ring transfers and host copies with the phases' compute.
    self.order = (jax.lax.optimization_barrier if kernel_platform.backend() == "cpu"
                  else lambda x: x)

  # ------------------------------------------------------------------ one stage, layer by layer

  def _layer_functions(self):
    """Every phase works one layer at a time (`stage.layer_at`): F keeps each layer's vjp
    residuals minus its weights (`saved`), B / W take the weights again and add each
    layer's weight gradients to the sums in place. zbh1 cuts a layer's backward into B
    (input gradient) and W (weight gradients) with k2jax.parallel.bwsplit: B hands W the
    cut ([L, ...])."""
    cfg, sp, mb = self.cfg, self.sp, self.mb
    self.layer = stage.layer_fn(cfg, sp.stack.ffn)
    pl0 = stage.layer_at(self.params, 0, 0)
    x_aval = jax.ShapeDtypeStruct(self.act_shape, self.dt)
    if self.grads and self.tab.split:
      self.layer, self.saved, self.layer_res, cut_fn = stage.split_layer(
          cfg, sp.stack.ffn, pl0, x_aval, mb["positions"][0], mb["segment_ids"][0],
          self.aux_weight)
      self.cut_fn = cut_fn
      self.w_avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in jax.tree.leaves(pl0)]
      self.early = [i for i in range(len(self.w_avals)) if i not in cut_fn.late]
      log.info("pipeline (zbh1): W takes %.0f%% of a layer's backward matmul FLOPs (B %.3g, "
               "W %.3g); %d of %d weight gradients in W; B hands W %.3g MB per layer",
               100 * cut_fn.flops["W"] / max(cut_fn.flops["B"] + cut_fn.flops["W"], 1),
               cut_fn.flops["B"], cut_fn.flops["W"], len(cut_fn.late), len(self.w_avals),
               sum(math.prod(a.shape) * a.dtype.itemsize for a in cut_fn.cut_avals) / 1e6)
    elif self.grads:
      self.saved = stage.Saved()
      self.layer_res = stage.layer_residuals(self.layer, self.saved, pl0, x_aval,
                                        mb["positions"][0], mb["segment_ids"][0],
                                        self.aux_weight)
    else:
      self.saved, self.layer_res = None, []

  def _log_buffers(self):
    if not self.grads:
      return
    nbytes = lambda t: sum(stage.nbytes(a) for a in jax.tree.leaves(t))
    log.info("pipeline: a stage keeps %.3g MB for its backward (model.remat=%s; its %.3g MB "
             "of weights are not copied), %d slots per device in %s memory",
             nbytes(self.res_shapes) / 1e6, self.cfg.remat, nbytes(self.params) / self.V / 1e6,
             self.tab.sizes["res"], "host" if self.store.host else "device")
    if self.tab.split:
      log.info("pipeline (zbh1): what B hands W waits in %d slots of %.3g MB per device",
               self.tab.sizes["cut"], nbytes(self.cut_shapes) / 1e6)

  def embed(self, pre_params, m):
    """Embedding and the leading (dense) stacks of microbatch m (`stage.pre`)."""
    mb = self.mb
    return stage.pre(self.cfg, self.sp, pre_params, mb["inputs"][m], mb["positions"][m],
                mb["segment_ids"][m])

  def stage_forward(self, x, v, m):
    """-> ((y, aux), (max logits, load), stored residual leaves [L, ...])."""
    mb = self.mb
    return stage.forward(self.layer, self.saved, self.layer_res, self.params, v, self.real, x,
                          mb["positions"][m], mb["segment_ids"][m], self.aux_weight,
                          self.per_device, self.stats)

  def stage_input_grad(self, res, dy, v, valid, sums, active):
    """zbh1's B -> (dx, cut [L, ...], sums with the early weight gradients added)."""
    cut_fn, early, w_avals, dt = self.cut_fn, self.early, self.w_avals, self.dt

    def body(carry, xs):
      dy, sums = carry
      l, r = xs
      pl = stage.layer_at(self.params, v, l)

      def real(dy):
        dx, e, cut = cut_fn.b(*jax.tree.leaves(pl), *r, dy, jnp.ones((), jnp.float32))
        return dx[0].astype(dt), [e[i] for i in early], cut

      def pad(dy):
        return dy, stage.zeros([w_avals[i] for i in early]), stage.zeros(cut_fn.cut_avals)
      dx, e, cut = stage.if_real(self.real[v, l], real, pad, self.per_device, dy, active=active)
      return (dx, stage.add_at(sums, v, l, e, valid, early)), cut
    leaves, tree = jax.tree.flatten(sums)
    (dx, leaves), cut = jax.lax.scan(body, (dy, leaves), (jnp.arange(self.L), res),
                                     reverse=True)
    return dx, cut, jax.tree.unflatten(tree, leaves)

  def stage_weight_grad(self, res, cut, v, valid, sums, active):
    """zbh1's W: sums with the late weight gradients (cut_fn.late) of stage v added."""
    cut_fn, w_avals = self.cut_fn, self.w_avals

    def body(leaves, xs):
      l, r, c = xs
      pl = stage.layer_at(self.params, v, l)

      def real():
        gw = cut_fn.w(list(jax.tree.leaves(pl)) + list(r), c)
        return [gw[i] for i in cut_fn.late]

      def pad():
        return stage.zeros([w_avals[i] for i in cut_fn.late])
      return stage.add_at(leaves, v, l, stage.if_real(self.real[v, l], real, pad, self.per_device,
                                            active=active), valid, cut_fn.late), None
    leaves, tree = jax.tree.flatten(sums)
    leaves = jax.lax.scan(body, leaves, (jnp.arange(self.L), res, cut))[0]
    return jax.tree.unflatten(tree, leaves)

  # ------------------------------------------------------------------------------ the phases
  # F and the head run under a cond (skipped where idle) on the statistics `stats` (the
  # head's gradient sums among them); B and W skip each layer's work in a cond of its own
  # and add to the float32 weight-gradient `sums` outside every cond (`stage.backward`).

  def branch(self, pred, tick_pred, yes, no, *operands):
    """lax.cond on this device's own predicate ("device") or on the tick's ("tick")."""
    return jax.lax.cond(pred if self.per_device else tick_pred, yes, no, *operands)

  def forward_phase(self, args):
    v, m, valid, embeds, act, stats = args
    H = self.H
    first = stage_of(v, self.p, self.P) == 0
    no_pre = lambda: (act, jnp.full((self.n_pre, H), -jnp.inf, jnp.float32))
    x, pre_max = self.branch(first, embeds, lambda: self.embed(self.pre_params, m), no_pre)
    x = jnp.where(first, x, act)
    pre_max = jnp.where(first & valid, pre_max, -jnp.inf)
    (y, aux), (ml, load), res = self.stage_forward(x, v, m)
    new = dict(aux=stats["aux"] + aux, mx=stats["mx"].at[v].max(ml),
               pre_max=jnp.maximum(stats["pre_max"], pre_max), load=stats["load"].at[v].add(load))
    if not self.per_device:   # this device may be idle in a tick others work in: keep its sums
      new = stage.where(valid, new, {k: stats[k] for k in new})
    return y, res, dict(stats, **new)

  def forward_idle(self, args):
    return self.x0, stage.zeros(self.res_shapes), args[-1]

  def head_phase(self, args):
    """Every device, in the ticks the last stage runs its F: the loss of that microbatch
    over the vocabulary slices (`stage.head`) and the cotangent of the stage's output, which
    the last device keeps for its B. A tick predicate: every device agrees, so the psums
    inside meet their peers."""
    y, m, stats = args
    last = self.last_device
    y = jax.lax.psum(jnp.where(last, y, jnp.zeros_like(y)), AXIS)
    out = stage.head(self.cfg, self.head, y, self.mb["targets"][m], self.mb["loss_mask"][m],
                self.grads)
    ce, dy, g = (out, jnp.zeros_like(y), None) if not self.grads else out
    stats = dict(stats, ce=stats["ce"] + jnp.where(last, ce, 0.0))
    if self.grads:    # each device its columns' and its tokens' share of the norm's
      # (or, where dh was all-reduced, the norm's once: the last device's)
      g_norm = g["final_norm"]
      if not stage.scatters_dh(y.shape[0] * y.shape[1], jax.lax.axis_size(AXIS)):
        g_norm = jnp.where(last, g_norm, 0.0)
      stats["g_norm"] = stats["g_norm"] + g_norm
      stats["g_lm"] = stats["g_lm"] + g["lm_head"]
    return dy.astype(self.dt), stats

  def head_idle(self, args):
    return jnp.zeros_like(args[0]), args[-1]

  def input_grad_phase(self, v, m, valid, embeds, dy, res, sums, active):
    """B -> (dx, cut or None, sums): the stage's backward, and stage 0's through the embedding
    and dense layers (recomputed from its input: `embed`)."""
    cut = None
    if self.tab.split:
      dx, cut, g_stage = self.stage_input_grad(res, dy, v, valid, sums["stage"], active)
    else:
      dx, g_stage = stage.backward(self.saved, self.params, v, self.real, res, dy, sums["stage"],
                                    valid, self.per_device, active)
    first = (stage_of(v, self.p, self.P) == 0) & valid
    pre_params = self.pre_params

    # Added to the float32 sums inside the branch: returned from it, the embedding's gradient
    # (a whole vocabulary slice, in the params' dtype) and the sums plus it were two more
    # vocabulary-sized buffers beside the sums at the step's peak (`k2jax.compile --explain`
    # shows them). The mask: in the tick's mode the branch runs on every device.
    def pre_grads(pre):
      _, vjp = jax.vjp(lambda pp: self.embed(pp, m)[0], pre_params)
      return jax.tree.map(lambda a, b: a + jnp.where(first, b.astype(a.dtype), 0.0), pre,
                          vjp(dx.astype(self.dt))[0])
    g_pre = self.branch(first, embeds, pre_grads, lambda pre: pre, sums["pre"])
    return dx.astype(self.dt), cut, dict(stage=g_stage, pre=g_pre)

  def weight_grad_phase(self, t, res_buf, cut_buf, sums):
    """W (zbh1): the weight gradients of the stage the table put in tick t."""
    sl = {k: a[t, self.p] for k, a in self.slot.items()}
    wv = self.task["W"][t, self.p, 0]
    res = self.store.get(res_buf, sl["res_wread"], self.res_shapes)
    cut = self.store.get(cut_buf, sl["cut_read"], self.cut_shapes)
    active = wv >= 0 if self.per_device else self.busy["W"][t]
    return dict(sums, stage=self.stage_weight_grad(res, cut, jnp.maximum(wv, 0), wv >= 0,
                                                   sums["stage"], active))

  def transfer(self, y, dx):
    """The stage's output to the next device, its input cotangent to the previous one."""
    sent = jax.lax.ppermute(y, AXIS, self.fwd_ring)
    sent, dx = self.order((sent, dx))
    return sent, jax.lax.ppermute(dx, AXIS, self.bwd_ring)

  # -------------------------------------------------------------------------------- the loop

  def tick(self, carry, t):
    """One tick: F, head, B, W and the two ring transfers, reading and writing the table's
    slots. Every collective of a tick runs in one order on every device (`order`)."""
    act_buf, grad_buf, res_buf, cut_buf = (carry.act_buf, carry.grad_buf, carry.res_buf,
                                           carry.cut_buf)
    stats, sums = carry.stats, carry.sums
    p, task, order, store = self.p, self.task, self.order, self.store
    sl = {k: a[t, p] for k, a in self.slot.items()}
    act_buf = _put(act_buf, sl["act_in"], carry.act_in)
    fv, fm = task["F"][t, p, 0], task["F"][t, p, 1]
    act = act_buf[jnp.maximum(sl["act_read"], 0)]
    y, res, stats = self.branch(
        fv >= 0, self.busy["F"][t], self.forward_phase, self.forward_idle,
        (jnp.maximum(fv, 0), jnp.maximum(fm, 0), fv >= 0, self.embeds["F"][t], act, stats))
    y, stats = order((y, stats))
    dh, stats = jax.lax.cond(self.head_tick[t], self.head_phase, self.head_idle,
                          (y, jnp.maximum(task["F"][t, self.last, 1], 0), stats))
    if not self.grads:
      return carry._replace(act_in=jax.lax.ppermute(y, AXIS, self.fwd_ring), act_buf=act_buf,
                            stats=stats), None
    res_buf = store.put(res_buf, sl["res_write"], res)
    grad_buf = _put(grad_buf, sl["grad_in"], carry.grad_in)
    grad_buf = _put(grad_buf, sl["head_write"], dh)
    if store.host:   # host buffers stay out of the barrier: it orders collectives, not copies
      y, grad_buf, stats, sums = order((y, grad_buf, stats, sums))
    else:
      y, grad_buf, res_buf, stats, sums = order((y, grad_buf, res_buf, stats, sums))
    bv, bm = task["B"][t, p, 0], task["B"][t, p, 1]
    dy = grad_buf[jnp.maximum(sl["grad_read"], 0)]
    # Read after this tick's put. Read before F instead (so that its host -> device copy
    # could overlap F, and the last stage's B took F's residuals without the round trip),
    # the offloaded step took 6.6x the device-slot step on an H200, against 1.72x here
    # (experiments/results/pipeline/gpu_offload_read_before_f.csv).
    res = store.get(res_buf, sl["res_read"], self.res_shapes)
    dx, cut, sums = self.input_grad_phase(
        jnp.maximum(bv, 0), jnp.maximum(bm, 0), bv >= 0, self.embeds["B"][t], dy, res, sums,
        bv >= 0 if self.per_device else self.busy["B"][t])
    if self.tab.split:
      cut_buf = store.put(cut_buf, sl["cut_write"], cut)
      if store.host:
        y, dx, sums = order((y, dx, sums))
      else:
        y, dx, cut_buf, sums = order((y, dx, cut_buf, sums))
      sums = self.weight_grad_phase(t, res_buf, cut_buf, sums)
    y, dx, sums = order((y, dx, sums))
    act_in, grad_in = self.transfer(y, dx)
    return TickCarry(act_in, grad_in, act_buf, grad_buf, res_buf, cut_buf, stats, sums), None

  def run(self):
    """The tick loop over the table, then the statistics reduced over the replicas and the
    gradients with a leading axis each (summed outside, once: `pipeline._pipelined`)."""
    V, L, H, dt, grads, tab = self.V, self.L, self.H, self.dt, self.grads, self.tab
    zeros32 = lambda a: jnp.zeros(a.shape, jnp.float32)
    # statistics and the head's sums (through the F / head conds: small) ...
    stats = dict(ce=jnp.zeros((), jnp.float32), aux=jnp.zeros((), jnp.float32),
              mx=jnp.full((V, L, H), -jnp.inf, jnp.float32),
              pre_max=jnp.full((self.n_pre, H), -jnp.inf, jnp.float32),
              load=jnp.zeros((V, L, self.E if self.moe else 0), jnp.float32),
              g_norm=zeros32(self.head["final_norm"]) if grads else {},
              g_lm=zeros32(self.head["lm_head"]) if grads else {})
    # ... and the float32 weight-gradient sums, outside every cond
    sums = (dict(pre=jax.tree.map(zeros32, self.pre_params),
              stage=jax.tree.map(zeros32, self.params)) if grads else {})
    bufs = lambda n: jnp.zeros((n,) + self.act_shape, dt)
    slots = tab.sizes
    res_buf = self.store.zeros(slots["res"], self.res_shapes)
    ticks = tab.ticks if grads else int(max(i for i in range(tab.ticks)
                                            if (tab.task["F"][i, :, 0] >= 0).any())) + 1
    cut_buf = self.store.zeros(slots["cut"], self.cut_shapes) if grads and tab.split else []
    init = TickCarry(self.x0, self.x0, bufs(slots["act"]), bufs(slots["grad"]), res_buf,
                     cut_buf, stats, sums)
    last, _ = jax.lax.scan(self.tick, init, jnp.arange(ticks))
    return self.results(last.stats, last.sums)

  def results(self, stats, sums):
    reps = self.reps
    head_grads, g_pre, g_stage = {}, {}, {}
    if self.grads:
      g_pre, g_stage = sums["pre"], sums["stage"]
      head_grads = {"final_norm": stats["g_norm"], "lm_head": stats["g_lm"]}
    psum = lambda a: jax.lax.psum(a, (AXIS, *reps))
    flat = lambda a: a.reshape((self.V * self.L,) + a.shape[2:])
    # the statistics over the replicas here; the gradients leave with a leading axis each
    # and are summed outside, once (`pipeline._pipelined`)
    over = lambda f, a: f(a, reps) if reps else a
    one = lambda a: a[None]
    return (psum(stats["ce"]), psum(stats["aux"]), flat(over(jax.lax.pmax, stats["mx"])),
            flat(over(jax.lax.psum, stats["load"])), jax.lax.pmax(stats["pre_max"], (AXIS, *reps)),
            jax.tree.map(one, head_grads), jax.tree.map(one, g_pre),
            jax.tree.map(lambda a: flat(a)[None], g_stage))
