"""Pipeline parallelism with virtual stages over the `pipeline` mesh axis (report 2.4.2).

The last layer stack is cut into S = P x V stages (k2jax.parallel.layout: stage s = v P + p
on device p, stored in that order so no weight moves) and microbatches flow through them
in the one jitted step: `shard_map` makes every mesh axis manual (`pipeline`, and the
batch's `data` and `expert`: `replica_axes`), and stage outputs and their cotangents move
between devices with `ppermute`. Inside, each device holds its own tokens, its stage's
experts (the MoE's all-to-all runs on the manual `expert` axis) and every other weight of the
stage whole, gathered once as the shard_map opens; it adds its tokens' weight gradients to
its float32 sums through the whole loop, and they are summed over `data` and `expert` once,
after it. So no collective inside the loop is shaped like a weight
(experiments/tick_collectives.py counts them): only activations, their cotangents, routing
and statistics cross devices there.

What each device does at each tick is read from a static table
(k2jax.parallel.schedules.build: mesh.pipeline_schedule = 1f1b | gpipe | zbh1): per tick an F
phase (forward of one stage on one microbatch) and a B phase (its backward), and the buffer
slots everything is kept in. The loop computes only what the table says:

  - a phase the table leaves idle is skipped (`lax.cond` on the device's own table entry,
    which every data / expert shard of that pipeline device agrees on, so the MoE's
    collectives inside the branch meet their peers; the ppermutes stay outside). F and the
    head are one cond each; B and W one per layer, with the float32 gradient sums outside
    every cond (XLA:TPU gives a cond's outputs buffers of their own: sums passed through a
    phase's cond were a second copy of them);
  - the embedding and the leading dense layers (a dense layer of 61 for K2) run in the F
    phase of stage 0 only, per microbatch, and B recomputes them from stage 0's input (3
    forward units where the others' ticks take 2). Keeping their residuals in the slot a
    padded stage 0 leaves unused instead saved one dense layer's recomputation and measured
    no shorter (idle 19.8% -> 20.0% at 16 x 2 on K2's costs), at ~250 lines: removed;
  - the final norm, head and loss run once per microbatch, in a head phase after the F phase
    of the tick that runs the last stage, on every device: the vocabulary is split over the
    pipeline devices (`_head`; the head's columns are stored that way, sharding rule
    `head_vocab`), so each does 1 / P of the head's work instead of the last device all of
    it in one tick (K2: the head is 2.2 layer forwards, more than a stage of 2 layers);
    its gradient is taken right there, and the cotangent waits in a buffer for that stage's B;
  - padding layers of an uneven split are skipped (`lax.cond` per layer);
  - F keeps what the stage's backward needs as `model.remat` decides (each layer's jax.vjp
    residuals under the remat policy: selective recomputation keeps what report 2.4.3
    keeps, "full" only layer inputs), in the table's residual slots; B rebuilds each
    layer's vjp from them. Residuals that are the layer's weights are not copied into the
    buffers. Every phase reads one layer's weights at a time from the device's rows and
    adds that layer's weight gradients to the float32 sums in place (`_layer_at`): nothing
    the size of a stage's weights or gradients exists beside them.
    With `model.offload` those slots are in host memory (`_Slots`; report 2.4.3): a tick
    moves the residuals its F made to the host and those its B needs back.

With a split table (zbh1) each layer's backward is cut by k2jax.parallel.bwsplit: F keeps
every layer's vjp residuals, B runs the input-gradient half and stores what the
weight-gradient half needs (the cut) in the table's cut slots, and a W phase after B runs
the weight gradients the table put in that tick. The head's weight gradient stays in its
head phase: deferring it would keep the f32 gradient of every device's logits slice.

That is `skip="device"`, the default on GPU / TPU. XLA:CPU's collective-permute waits for
every device of the program, so a reshard the partitioner puts inside a branch that only
some pipeline devices take deadlocks there (seen: pipeline 2 x data 2 x expert 2). On CPU
(`skip="tick"`) a branch is skipped when no device of the tick needs it (the table says so
statically: warm-up backwards, cool-down forwards, the embedding outside its
ticks), and a device idle in a tick others work in computes a masked copy; in lockstep
time (what the idle fraction counts) both are the same, since that device would wait at
the tick's ppermute anyway.

`loss_and_grads` returns the loss sums, per-layer statistics in stored order and gradients
in the stored layout; `loss` runs the F phases only (evaluation).

What a new schedule provides: a task order per device for k2jax.parallel.schedules (its
`_orders`: the (v, m) of each F, B and, if it splits the backward, W task, in order);
`schedules.build` simulates it into a `Table` (every device's task per tick and phase, and
the buffer slots each tick writes and reads, sized by what is alive), and this loop runs any
table unchanged: per tick the F phase, the head phase where the table's F runs the last
stage, the B phase, the W phase where the table splits, then the two ring transfers. A
schedule that needs a phase of another kind (e.g. DualPipe's two directions at once) is the
one that needs a change here.
"""

import concurrent.futures
import contextlib
import functools
import json
import logging
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from k2jax.configs.sharding_rules import (active_mesh_axes, constrain, entry_axes,
                                          param_spec)
from k2jax.kernels import moe as moe_kernels
from k2jax.kernels import platform as kernel_platform
from k2jax.model import context, counting, remat, spec as model_spec, transformer
from k2jax.model.embedding import embed
from k2jax.model.layers import rms_norm
from k2jax.model.remat import remat_policy
from k2jax.parallel import bwsplit, schedules
from k2jax.parallel.layout import Split, split

log = logging.getLogger("k2jax.parallel")

AXIS = "pipeline"


def replica_axes(mesh) -> tuple[str, ...]:
  """The mesh axes the pipeline's shard_map holds manual besides `pipeline`: every axis the
  batch is split over (`data`, `expert`) and those each sequence's tokens are split over
  (`context`: k2jax.model.context, which the layers then run on their manual axis). Each
  device holds its stage's weights (the experts
  and the embedding's rows split as stored, every other weight whole: `inner_specs`) and
  its own tokens, so the weight gradients it adds up tick after tick are its tokens' share:
  the float32 sums stay unreduced through the loop and are summed over these axes once,
  after it (one gradient reduction a step, as data parallelism does it: report 2.4.2),
  instead of in every backward phase; and the weights split only to save memory between
  steps (FSDP over `expert`) are gathered once, as the shard_map opens, instead of in every
  phase."""
  return (active_mesh_axes("batch", mesh, manual=True)
          + active_mesh_axes("length", mesh, manual=True))


# The logical axes whose split the computation inside the pipeline's shard_map keeps: a
# stage's layers, the experts (the MoE's all-to-all exchange runs on the manual axis) and
# the embedding's rows (so does its lookup, k2jax.model.embedding). The other splits only
# save memory between steps (`embed`, `heads`: FSDP over the expert group); those weights
# come in whole. The head's columns are split over the pipeline only (`_head`).
_INNER = ("layers", "experts", "vocab")


def inner_specs(cfg, params: dict, mesh) -> tuple[dict, dict]:
  """How the pipeline's shard_map holds each parameter of `params` (the stored layout, or
  ShapeDtypeStructs of it) on `mesh`: (PartitionSpecs over its manual axes, and per leaf
  the manual batch axes it is not split over: its float32 gradient sum is unreduced over
  them through the loop, a leading axis of the shard_map's output). Both trees are shaped
  like `params`. plan counts the loop's copies of the weights and its sums from these."""
  reps = replica_axes(mesh)
  held = (AXIS, *reps)
  specs = transformer.param_specs(cfg)
  staged = transformer.stacks(cfg)[-1].name     # the stack the stages hold (layout.split)

  def inner(k):
    keep = held if k == staged else reps    # the rest is whole on every pipeline device
    def one(s, a):
      stored = list(param_spec(s.axes, a.shape, mesh)) + [None] * len(s.axes)
      return P(*[tuple(m for m in entry_axes(e) if m in keep) or None if n in _INNER
                 else None for n, e in zip(s.axes, stored)])
    return one

  def lead(pspec):
    used = {m for e in pspec for m in entry_axes(e)}
    return tuple(m for m in held if m != AXIS and m not in used) or None

  out = {k: jax.tree.map(inner(k), specs[k], v, is_leaf=model_spec.is_spec)
         for k, v in params.items()}
  if "lm_head" in out:   # whatever its stored split, padded to divide the pipeline (`_head`)
    out["lm_head"] = P(None, AXIS)
  return out, jax.tree.map(lead, out, is_leaf=lambda x: isinstance(x, P))


def routed_impl(impl: str) -> str:
  return moe_kernels.auto_impl() if impl == "auto" else impl


def table(config) -> schedules.Table:
  """The schedule table a full config trains with (zbh1 places its W tasks by the stages'
  costs, `costs`, and how this backend, or mesh.pipeline_skip, skips idle phases)."""
  m = config.mesh
  return schedule_table(config.model, m.pipeline, m.get("virtual_stages", 1),
                        config.train.grad_accum, m.get("pipeline_schedule", "1f1b"),
                        m.data, m.expert, config.train.seq_len,
                        per_device=skip_of(config) == "device")


def costs(config, seq_len=None, platform=None) -> dict:
  """The stages' F / B / W costs (schedules.stage_costs) of a full config."""
  m = config.mesh
  return schedule_costs(config.model, m.pipeline, m.get("virtual_stages", 1),
                        m.get("pipeline_schedule", "1f1b"), m.data, m.expert,
                        seq_len or config.train.seq_len, platform)


def schedule_costs(mcfg, P: int, V: int, schedule: str, data: int = 1, expert: int = 1,
                   seq_len: int = 4096, platform=None) -> dict:
  """schedules.stage_costs of model config `mcfg` on P pipeline devices x V virtual stages:
  W's share from the split of one layer's backward on the data x expert mesh (`w_share`)
  when the schedule splits, else none."""
  w = None
  if schedule == "zbh1":
    w = w_share(mcfg, data, expert, seq_len, platform)
  sp = split(mcfg, P, V)
  return schedules.stage_costs(mcfg, sp, seq_len, w)


@contextlib.contextmanager
def _abstract(cfg_json: str, data: int, expert: int, platform):
  """The stages' model config (from its JSON: a cache key) under a data x expert abstract
  mesh and the kernels `auto` picks on `platform` (default gpu): where the traced figures
  (`split_cost`) are taken, at abstract shapes, nothing allocated."""
  import ml_collections
  from k2jax.kernels import platform as kernel_platform
  mesh = jax.sharding.AbstractMesh((data, expert), ("data", "expert"))
  with jax.sharding.use_abstract_mesh(mesh), kernel_platform.target(platform or "gpu"):
    yield _pipeline_model_cfg(ml_collections.ConfigDict(json.loads(cfg_json)))


def _param_avals(cfg, name: str, rows=-1):
  """Abstract params of table entry `name` in param_dtype: whole (rows -1), without the
  leading layers axis (None) or with `rows` layers."""
  def aval(s):
    shape = s.shape if rows == -1 else s.shape[1:] if rows is None else (rows,) + s.shape[1:]
    return jax.ShapeDtypeStruct(shape, jnp.dtype(cfg.param_dtype))
  return jax.tree.map(aval, transformer.param_specs(cfg)[name], is_leaf=model_spec.is_spec)


def _sequences(B: int, seq_len: int):
  """Positions and segment ids of B whole sequences."""
  return (jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), (B, seq_len)),
          jnp.ones((B, seq_len), jnp.int32))


def schedule_table(mcfg, P: int, V: int, M: int, schedule: str, data: int = 1,
                   expert: int = 1, seq_len: int = 4096, platform=None,
                   per_device: bool | None = None) -> schedules.Table:
  """The table the trainer runs (what `table` gives for a full config; plan asks here).
  per_device: whether idle phases are skipped per device (None: as on `platform`, default
  gpu: every backend but CPU)."""
  if schedule != "zbh1":
    return schedules.build(schedule, P, V, M)
  if per_device is None:
    per_device = skip_mode(platform or "gpu") == "device"
  c = schedule_costs(mcfg, P, V, schedule, data, expert, seq_len, platform)
  return schedules.build(schedule, P, V, M, schedules.frozen(c), per_device)


@functools.lru_cache(maxsize=16)
def _traced_split(cfg_json: str, data: int, expert: int, seq_len: int, platform):
  batch = data * expert        # one sequence per device, as k2jax.plan counts
  with _abstract(cfg_json, data, expert, platform) as cfg:
    sp = split(cfg, 1, 1)
    x = jax.ShapeDtypeStruct((batch, seq_len, cfg.hidden_size), jnp.dtype(cfg.dtype))
    cut = _split_layer(cfg, sp.stack.ffn, _param_avals(cfg, sp.stack.name, None), x,
                       *_sequences(batch, seq_len), 1.0)[3]
  unit = counting.layer_flops(cfg, sp.stack.ffn, seq_len) * batch * seq_len
  nbytes = lambda avals: sum(math.prod(a.shape) * a.dtype.itemsize for a in avals) / batch
  return cut.flops["W"] / unit, nbytes(cut.cut_avals)


def split_cost(cfg, data: int = 1, expert: int = 1, seq_len: int = 4096, platform=None):
  """(w_share, bytes B hands W per layer and sequence: bwsplit's cut, what waits in the
  zbh1 schedule's cut buffers)."""
  # Traced in a thread of its own: the trainer asks from inside its `jax.set_mesh` (a
  # pipeline x data x expert mesh), and an abstract mesh of another size cannot be entered
  # there; the mesh context is per thread.
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    return pool.submit(_traced_split, cfg.to_json(), data, expert, seq_len,
                       platform).result()


def w_share(cfg, data: int = 1, expert: int = 1, seq_len: int = 4096, platform=None) -> float:
  """The weight-gradient (W) work of one pipelined layer, in units of its forward, as
  k2jax.parallel.bwsplit cuts its backward on a data x expert mesh (traced at abstract
  shapes, with the kernels `auto` picks on `platform`, default gpu; nothing allocated).
  A backward of 2 forwards splits ideally 1 + 1; weight gradients made inside an op the
  input gradient needs stay in B (below 1), and the expert exchange's weight gradients run
  over its padded buffers (1.25x the rows it receives when balanced: above 1 for K2)."""
  return split_cost(cfg, data, expert, seq_len, platform)[0]


def _pipeline_model_cfg(cfg):
  """The model config the stages run. `model.offload` is taken by the schedule's residual
  buffers (`offloads`), not by the layers' remat policy: what a stage keeps stays on the
  device until its F phase hands it to a host-memory slot."""
  if routed_impl(cfg.moe_impl) != "capacity" and not cfg.offload:
    return cfg
  cfg = cfg.copy_and_resolve_references()
  # The capacity path's overflow is a lax.cond on a per-shard predicate. Inside the pipeline
  # loop XLA:CPU places data-axis collectives in its branches, so shards that disagree
  # deadlock (8 simulated devices, pipeline=4 x data=2); sort + grouped matmul has no
  # data-dependent branch.
  if routed_impl(cfg.moe_impl) == "capacity":
    cfg.moe_impl = "ragged"
  cfg.offload = False
  return cfg


def offloads(cfg) -> bool:
  """Whether the pipeline keeps its stage residuals in host memory: `model.offload` on a
  backend with a host memory space (report 2.4.3, activations offloaded to CPU)."""
  if not cfg.offload:
    return False
  if remat.host_memory_kind() is None:
    log.warning("model.offload: %s has no host memory space; the pipeline's stage "
                "residuals stay on the device", jax.default_backend())
    return False
  return True


def residual_stages(tab: schedules.Table, offload: bool) -> dict:
  """Stage residuals (each what one stage keeps for its backward) a pipeline device holds
  at once, by memory: {"device": n, "host": n}. Without offload, the schedule's in-flight
  count on the device. With it, the table's residual slots plus one that only absorbs the
  writes of idle ticks, in host memory (`_Slots`), and on the device the stage F just
  made and the one B reads (a tick moves one to host and one back).

  B reads its slot in the tick it runs. Fetching it a tick ahead (so the copy could run
  behind the tick's phases) kept one more stage on the device and saved nothing on one
  H200 (2026-11-26: 1.99x the device slots' step time vs 1.96x reading in place,
  experiments/results/pipeline/gpu_offload_fetch_ahead.csv), so it was taken out."""
  if not offload:
    return {"device": tab.in_flight, "host": 0}
  return {"device": min(2, tab.in_flight), "host": tab.sizes["res"] + 1}


def skip_mode(platform: str | None = None) -> str:
  """"device" on GPU / TPU, "tick" on CPU (module docstring); `platform` default: the backend
  kernels are chosen for (JAX's here, or the one a compile for another machine targets:
  k2jax.kernels.platform.target)."""
  return "tick" if (platform or kernel_platform.backend()) == "cpu" else "device"


def skip_of(config) -> str:
  """How a full config's pipeline skips idle phases: mesh.pipeline_skip, or `skip_mode()`
  where that is "auto"."""
  skip = config.mesh.get("pipeline_skip", "auto")
  return skip_mode() if skip == "auto" else skip


def _layer_at(params, v, l):
  """Layer l of virtual stage v from a device's rows [V, L, ...]: a dynamic slice of the
  stack, which XLA fuses into its consumers or copies one layer at a time. Slicing the whole
  stage first (and scanning over the slice) made XLA:TPU copy the stage's weights in every
  phase and stack the stage's weight gradients in a bf16 buffer of the stage's size before
  adding them to the float32 sums: 7.9 of the 30.8 GiB live at the K2 step's peak (v5p
  8x16x16, libtpu 0.0.42.1)."""
  return jax.tree.map(lambda a: a[v, l], params)


def _add_at(g, v, l, grads, valid, idx=None):
  """The float32 sums g [V, L, ...] (a list of leaves, or a tree with `idx` None) with
  grads added at [v, l] where `valid` (leaves `idx` of g, in order, when given)."""
  add = lambda a, b: a.at[v, l].add(jnp.where(valid, b.astype(a.dtype), 0.0))
  if idx is None:
    return jax.tree.map(add, g, grads)
  g = list(g)
  for i, b in zip(idx, grads):
    g[i] = add(g[i], b)
  return g


def _stage_forward(layer, saved, res_avals, params, v, on, x, positions, segment_ids, weight,
                   skip_padding: bool, stats):
  """The F phase of virtual stage v: its layers one at a time (`_layer_at`), padding rows
  (on [V, L] False) skipped (`skip_padding`) or computed and discarded. With `saved` (a
  _Saved) each layer's vjp residuals are kept, stacked [L, ...] (one layer's: `res_avals`,
  traced here where None).
  stats: (heads, expert-load width) of the padding rows' statistics.
  -> ((y, weighted aux-loss sum), (max logits [L, H], expert load [L, E]), residuals)."""
  H, n_load = stats
  if saved is not None and res_avals is None:
    res_avals = _layer_residuals(layer, _Saved(), _layer_at(params, 0, 0), x, positions,
                                 segment_ids, weight)

  def body(x, l):
    pl = _layer_at(params, v, l)

    def real(x):
      if saved is None:
        (y, aux), (ml, load) = layer(pl, x, positions, segment_ids, weight)
        return y, aux, ml, load, []
      (y, aux), (ml, load), res = saved.vjp(
          lambda a, b: layer(a, b, positions, segment_ids, weight), pl, x, has_aux=True)
      return y, aux, ml, load, res

    def pad(x):
      return (x, jnp.zeros((), jnp.float32), jnp.full((H,), -jnp.inf, jnp.float32),
              jnp.zeros((n_load,), jnp.float32), _zeros(res_avals) if saved else [])
    y, aux, ml, load, res = _if_real(on[v, l], real, pad, skip_padding, x)
    return y, (aux, ml, load, res)
  y, (aux, ml, load, res) = jax.lax.scan(body, x, jnp.arange(on.shape[1]))
  return (y, jnp.sum(aux)), (ml, load), res


def _stage_backward(saved, params, v, on, res, dy, g, valid, skip_padding: bool, active=None):
  """The B phase of virtual stage v (schedules that do not split W): layer by layer from
  the last, each one's vjp from its weights (`_layer_at`) and stored residuals (res [L,
  ...]); its weight gradients go into the float32 sums g [V, L, ...] at [v, l] where
  `valid`, in the loop, so no stage-sized gradient exists. `active`: whether the phase
  runs (`_if_real`): each layer's work is its own cond and the sums stay outside every
  cond (a cond's output is a buffer of its own on XLA:TPU: the sums passed through the
  phase's cond were a second copy of them, 17 GB on the K2 preset). -> (dx, g)."""
  def body(carry, xs):
    dy, g = carry
    l, r = xs
    pl = _layer_at(params, v, l)

    def real(dy):
      gp, dx = saved.vjp_of(pl, r)((dy, jnp.ones((), jnp.float32)))
      return dx.astype(dy.dtype), gp

    def pad(dy):
      return dy, jax.tree.map(jnp.zeros_like, pl)
    dx, gp = _if_real(on[v, l], real, pad, skip_padding, dy, active=active)
    return (dx, _add_at(g, v, l, gp, valid)), None
  (dx, g), _ = jax.lax.scan(body, (dy, g), (jnp.arange(on.shape[1]), res), reverse=True)
  return dx, g


def _layer_residuals(layer, saved, weights, x, positions, segment_ids, weight):
  """The avals of what one layer's F keeps for its backward (`saved`'s stored leaves)."""
  return jax.eval_shape(lambda pl, x: saved.vjp(
      lambda a, b: layer(a, b, positions, segment_ids, weight), pl, x, has_aux=True)[2],
      weights, x)


def _layer_fn(cfg, ffn):
  """One real layer of a stage, the unit every phase works on (its vjp; zbh1 cuts its
  backward with k2jax.parallel.bwsplit): (p, x, positions, segment_ids, aux weight) ->
  ((y, weighted aux loss), (max logits [H], expert load [E])), under the remat policy."""
  def layer(p, x, positions, segment_ids, weight):
    y, (ml, ms) = transformer._block(cfg, ffn, x, p, positions, segment_ids)
    if ffn != "moe":
      return (y, jnp.zeros((), jnp.float32)), (ml, jnp.zeros((0,), jnp.float32))
    return (y, ms.aux_loss * weight), (ml, ms.expert_load)
  policy = remat_policy(cfg.remat, cfg.offload)
  if policy is not None:
    layer = jax.checkpoint(layer, policy=policy, prevent_cse=False)
  return layer


class _Saved:
  """jax.vjp for a schedule that stores the residuals between a stage's F and its B / W.

  A vjp function is a pytree whose leaves are its residuals. Those that are the weights
  being differentiated are not copied into the schedule's buffers: `vjp` returns the others
  and remembers where each leaf came from, `vjp_of` puts the weights back. One instance per
  differentiated function (the tree is the same for every microbatch)."""

  def __init__(self):
    self.tree, self.source = None, None

  def vjp(self, fn, weights, *args, has_aux=False):
    """jax.vjp(fn, weights, *args) -> (out, stored leaves), or (out, aux, stored leaves)."""
    out, fun, *aux = jax.vjp(fn, weights, *args, has_aux=has_aux)
    leaves, self.tree = jax.tree.flatten(fun)
    ids = {id(w): i for i, w in enumerate(jax.tree.leaves(weights))}
    self.source = [ids.get(id(a)) for a in leaves]      # index into the weights, or None
    return (out, *aux, [a for a in leaves if id(a) not in ids])

  def vjp_of(self, weights, stored):
    """The vjp function again, from the weights and what `vjp` returned to store."""
    it, w = iter(stored), jax.tree.leaves(weights)
    return jax.tree.unflatten(self.tree, [next(it) if s is None else w[s] for s in self.source])


def _nbytes(a) -> int:
  return math.prod(a.shape) * jnp.dtype(a.dtype).itemsize


def _split_fn(saved: _Saved, weights, n_res: int, n_ct: int):
  """The backward of a `saved` vjp as bwsplit.split wants it: flat (weights, stored
  residuals, output cotangents) -> weight-gradient leaves + input-gradient leaves."""
  n_w = len(jax.tree.leaves(weights))
  tree = jax.tree.structure(weights)

  def bwd(*ins):
    w, r, ct = ins[:n_w], ins[n_w:n_w + n_res], ins[n_w + n_res:]
    g_w, *g_in = saved.vjp_of(jax.tree.unflatten(tree, w), r)(ct[0] if n_ct == 1 else tuple(ct))
    return jax.tree.leaves(g_w) + jax.tree.leaves(g_in)
  return bwd


def _split_layer(cfg, ffn, weights, x, positions, segment_ids, weight):
  """One pipelined layer (`_layer_fn`) with its backward cut by k2jax.parallel.bwsplit,
  traced at the shapes of `weights` and `x` -> (the layer, the _Saved its forward uses,
  its stored residuals' shapes, the Split). The cotangents are (dy, d aux loss)."""
  layer, saved = _layer_fn(cfg, ffn), _Saved()
  res = _layer_residuals(layer, saved, weights, x, positions, segment_ids, weight)
  w = jax.tree.leaves(weights)
  one = jax.ShapeDtypeStruct((), jnp.float32)
  cut = bwsplit.split(_split_fn(saved, weights, len(res), 2), len(w), len(w) + len(res),
                      *w, *res, x, one)
  return layer, saved, res, cut


def _head(cfg, hp, y, targets, loss_mask, grads: bool):
  """Final norm, head and summed cross entropy of one microbatch, the vocabulary split over
  the pipeline devices (inside shard_map; Megatron's vocabulary-parallel cross entropy, on
  the pipeline axis). Device p holds columns [p V_p, (p + 1) V_p) of the head (hp["lm_head"]
  [D, V_p]; columns past the vocabulary, padding, are masked) and every device gets the last
  stage's output y. With z = h W_p (f32) and t the target:

      lse = m + log psum_p sum_j exp(z_j - m),   m = pmax_p max_j z_j
      ce  = sum over tokens of mask (lse - psum_p z_t)
      dz  = mask (softmax(z) - onehot(t))        on the device's own columns
      dh  = psum_p dz W_p^T,   dW_p = h^T dz     (the head's weight gradient stays local)

  so a device does 1 / P of the head's matmuls, the lockstep tick that runs the head no
  longer waits on one device doing all of them (idle at K2 16 x 2 x 32: 21.9% -> 19.8% by
  stage FLOPs), and its weights and their gradient are split, not summed over the pipeline.
  The gradient is written out, not taken with jax.grad through the psums (whose transpose
  under shard_map without replication checking is not what this needs). dz is cast to the
  compute dtype for the two backward matmuls (f32 accumulation; dh summed in f32), as a
  bf16 head's backward does.
  -> ce, or (ce, dy, {"final_norm": g, "lm_head": g_p}) with `grads`."""
  dt, f32 = jnp.dtype(cfg.dtype), jnp.float32
  w = hp["lm_head"].astype(dt)
  vp = w.shape[1]
  lo = jax.lax.axis_index(AXIS) * vp
  h, norm_vjp = jax.vjp(lambda y, g: rms_norm(y, g, cfg.rms_norm_eps), y, hp["final_norm"])
  z = jnp.einsum("btd,dv->btv", h, w, preferred_element_type=f32)
  col = lo + jnp.arange(vp)
  z = jnp.where(col < cfg.vocab_size, z, -jnp.inf)
  m = jax.lax.pmax(jnp.max(z, axis=-1), AXIS)
  lse = m + jnp.log(jax.lax.psum(jnp.sum(jnp.exp(z - m[..., None]), axis=-1), AXIS))
  local = targets - lo
  mine = (local >= 0) & (local < vp)
  zt = jnp.take_along_axis(z, jnp.clip(local, 0, vp - 1)[..., None], axis=-1)[..., 0]
  zt = jax.lax.psum(jnp.where(mine, zt, 0.0), AXIS)
  mask = loss_mask.astype(f32)
  ce = jnp.sum((lse - zt) * mask)
  if not grads:
    return ce
  onehot = jax.nn.one_hot(jnp.where(mine, local, -1), vp, dtype=f32)
  dz = ((jnp.exp(z - lse[..., None]) - onehot) * mask[..., None]).astype(dt)
  dh = jax.lax.psum(jnp.einsum("btv,dv->btd", dz, w, preferred_element_type=f32), AXIS)
  g_w = jnp.einsum("btd,btv->dv", h, dz, preferred_element_type=f32)
  dy, g_norm = norm_vjp(dh.astype(h.dtype))
  return ce, dy, {"final_norm": g_norm.astype(f32), "lm_head": g_w}


def _pre(cfg, sp: Split, params, inputs, positions, segment_ids):
  """Embedding and the leading (dense) stacks of one microbatch -> (stage-0 input, their
  max logits [dense layers, H])."""
  # each row read on, and its gradient sent to, the expert shard holding it (embedding.py: XLA
  # gathered the whole table for the forward and the whole microbatch's cotangents for the
  # backward on every device)
  x = embed(params["embed"], inputs, cfg.dtype, vocab=cfg.vocab_size)
  x = constrain(x, ("batch", "length", "embed"))
  pre_max = [jnp.full((0, cfg.num_attention_heads), -jnp.inf, jnp.float32)]
  for st in transformer.stacks(cfg):
    if st == sp.stack:
      break
    x, (ml, _) = transformer._run_stack(cfg, st.ffn, params[st.name], x, positions,
                                        segment_ids)
    pre_max.append(ml)
  return x, jnp.concatenate(pre_max, axis=0)


def _where(c, a, b):
  return jax.tree.map(lambda u, w: jnp.where(c, u, w), a, b)


def _if_real(on, real, pad, skip_padding: bool, *operands, active=None):
  """real(*operands) for a real layer of a phase that runs, pad(*operands) for a padding row
  or an idle phase (`active` False; None: always active): skipped with a lax.cond
  (`skip_padding`, per device: `active` is the device's own) or both computed and one kept
  inside a cond on the tick's `active` (CPU's per-tick mode, module docstring)."""
  if skip_padding:
    return jax.lax.cond(on if active is None else on & active, real, pad, *operands)
  both = lambda *o: _where(on, real(*o), pad(*o))
  return both(*operands) if active is None else jax.lax.cond(active, both, pad, *operands)


def _zeros(avals):
  """Zeros shaped like a tree of arrays / ShapeDtypeStructs."""
  return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), avals)


def _put(buf, slot, value):
  """buf[slot] = value where slot >= 0 (a tree of buffers [slots, ...])."""
  def one(b, x):
    i = jnp.maximum(slot, 0)
    return b.at[i].set(jnp.where(slot >= 0, x.astype(b.dtype), b[i]))
  return jax.tree.map(one, buf, value)


class _Slots(NamedTuple):
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
    return self.host and _nbytes(a) >= self.HOST_MIN

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


def _run(cfg, sp: Split, tab: schedules.Table, grads: bool, skip: str, offload: bool,
         reps: tuple, stage_params, on, pre_params, head, mb, aux_weight):
  """Inside shard_map (pipeline and `reps` manual: `replica_axes`). offload: residual slots
  in host memory (`_Slots`).
  stage_params: this device's [V L, ...] stored rows;
  on [V L] bool (real layers); pre_params {"embed", dense stacks}; head {"final_norm",
  "lm_head": this device's [D, vocab / P] columns}; mb: microbatches [M, mb, T]; aux_weight:
  every microbatch's aux loss weight (the batch's loss tokens / M, as in k2jax.step's
  accumulation). Sums over `reps` (losses, statistics, gradients) are taken once, at the end:
  each device's aux loss weighs 1 / their size, its mean over their shards."""
  Pn, V, L = sp.stages, sp.virtual, sp.per_stage
  p = jax.lax.axis_index(AXIS)
  aux_weight = aux_weight / math.prod(jax.lax.axis_size(a) for a in reps)
  H, E = cfg.num_attention_heads, cfg.n_routed_experts
  moe = sp.stack.ffn == "moe"
  dt = jnp.dtype(cfg.dtype)
  per_device = skip == "device"
  layer = _layer_fn(cfg, sp.stack.ffn)
  stats = (H, E if moe else 0)
  params = jax.tree.map(lambda a: a.reshape((V, L) + a.shape[1:]), stage_params)
  on = on.reshape(V, L)
  fwd_ring = [(j, (j + 1) % Pn) for j in range(Pn)]
  bwd_ring = [(j, (j - 1) % Pn) for j in range(Pn)]
  act_shape = mb["inputs"].shape[1:] + (cfg.hidden_size,)
  n_pre = sum(s.size for s in transformer.stacks(cfg) if s != sp.stack)

  def pre(pp, m, mbs=mb):
    return _pre(cfg, sp, pp, mbs["inputs"][m], mbs["positions"][m], mbs["segment_ids"][m])

  # Every phase works one layer at a time (`_layer_at`): F keeps each layer's vjp residuals
  # minus its weights (`saved`), B / W take the weights again and add each layer's weight
  # gradients to the sums in place. zbh1 cuts a layer's backward into B (input gradient)
  # and W (weight gradients) with k2jax.parallel.bwsplit: B hands W the cut ([L, ...]).
  pl0 = _layer_at(params, 0, 0)
  x_aval = jax.ShapeDtypeStruct(act_shape, dt)
  if grads and tab.split:
    layer, saved, layer_res, cut_fn = _split_layer(
        cfg, sp.stack.ffn, pl0, x_aval, mb["positions"][0], mb["segment_ids"][0], aux_weight)
    w_avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in jax.tree.leaves(pl0)]
    early = [i for i in range(len(w_avals)) if i not in cut_fn.late]
    log.info("pipeline (zbh1): W takes %.0f%% of a layer's backward matmul FLOPs (B %.3g, "
             "W %.3g); %d of %d weight gradients in W; B hands W %.3g MB per layer",
             100 * cut_fn.flops["W"] / max(cut_fn.flops["B"] + cut_fn.flops["W"], 1),
             cut_fn.flops["B"], cut_fn.flops["W"], len(cut_fn.late), len(w_avals),
             sum(math.prod(a.shape) * a.dtype.itemsize for a in cut_fn.cut_avals) / 1e6)
  elif grads:
    saved = _Saved()
    layer_res = _layer_residuals(layer, saved, pl0, x_aval, mb["positions"][0],
                                 mb["segment_ids"][0], aux_weight)
  else:
    saved, layer_res = None, []

  def forward(x, v, m):
    """-> ((y, aux), (max logits, load), stored residual leaves [L, ...])."""
    return _stage_forward(layer, saved, layer_res, params, v, on, x, mb["positions"][m],
                          mb["segment_ids"][m], aux_weight, per_device, stats)

  def backward(res, dy, v, valid, g, active):
    """zbh1's B -> (dx, cut [L, ...], g with the early weight gradients added)."""
    def body(carry, xs):
      dy, g = carry
      l, r = xs
      pl = _layer_at(params, v, l)

      def real(dy):
        dx, e, cut = cut_fn.b(*jax.tree.leaves(pl), *r, dy, jnp.ones((), jnp.float32))
        return dx[0].astype(dt), [e[i] for i in early], cut

      def pad(dy):
        return dy, _zeros([w_avals[i] for i in early]), _zeros(cut_fn.cut_avals)
      dx, e, cut = _if_real(on[v, l], real, pad, per_device, dy, active=active)
      return (dx, _add_at(g, v, l, e, valid, early)), cut
    leaves, tree = jax.tree.flatten(g)
    (dx, leaves), cut = jax.lax.scan(body, (dy, leaves), (jnp.arange(L), res), reverse=True)
    return dx, cut, jax.tree.unflatten(tree, leaves)

  def weights_grad(res, cut, v, valid, g, active):
    """zbh1's W: g with the late weight gradients (cut_fn.late) of stage v added."""
    def body(leaves, xs):
      l, r, c = xs
      pl = _layer_at(params, v, l)

      def real():
        gw = cut_fn.w(list(jax.tree.leaves(pl)) + list(r), c)
        return [gw[i] for i in cut_fn.late]

      def pad():
        return _zeros([w_avals[i] for i in cut_fn.late])
      return _add_at(leaves, v, l, _if_real(on[v, l], real, pad, per_device, active=active),
                     valid, cut_fn.late), None
    leaves, tree = jax.tree.flatten(g)
    leaves = jax.lax.scan(body, leaves, (jnp.arange(L), res, cut))[0]
    return jax.tree.unflatten(tree, leaves)

  # Shapes of one F phase's outputs, for the buffers and the idle branch.
  x0 = jnp.zeros(act_shape, dt)
  f_shapes = jax.eval_shape(lambda x: forward(x, 0, 0), x0)
  res_shapes = f_shapes[2]
  slots = tab.sizes
  if grads and tab.split:
    cut_shapes = [jax.ShapeDtypeStruct((L,) + a.shape, a.dtype) for a in cut_fn.cut_avals]
  if grads:
    nbytes = lambda t: sum(_nbytes(a) for a in jax.tree.leaves(t))
    log.info("pipeline: a stage keeps %.3g MB for its backward (model.remat=%s; its %.3g MB "
             "of weights are not copied), %d slots per device in %s memory",
             nbytes(res_shapes) / 1e6, cfg.remat, nbytes(params) / V / 1e6, slots["res"],
             "host" if offload else "device")
    if tab.split:
      log.info("pipeline (zbh1): what B hands W waits in %d slots of %.3g MB per device",
               slots["cut"], nbytes(cut_shapes) / 1e6)

  def branch(pred, tick_pred, yes, no, *operands):
    """lax.cond on this device's own predicate ("device") or on the tick's ("tick")."""
    return jax.lax.cond(pred if per_device else tick_pred, yes, no, *operands)

  # The phases. F and the head run under a cond (skipped where idle) on the statistics
  # `st` and the head's sums; B and W skip each layer's work in a cond of its own and add
  # to the float32 sums `g` outside every cond (`_stage_backward`).
  def f_phase(args):
    v, m, valid, flags, act, st = args
    first = (p == 0) & (v == 0)
    no_pre = lambda: (act, jnp.full((n_pre, H), -jnp.inf, jnp.float32))
    x, pre_max = branch(first, flags["pre"], lambda: pre(pre_params, m), no_pre)
    x = jnp.where(first, x, act)
    pre_max = jnp.where(first & valid, pre_max, -jnp.inf)
    (y, aux), (ml, load), res = forward(x, v, m)
    new = dict(aux=st["aux"] + aux, mx=st["mx"].at[v].max(ml),
               pre_max=jnp.maximum(st["pre_max"], pre_max), load=st["load"].at[v].add(load))
    if not per_device:   # this device may be idle in a tick others work in: keep its sums
      new = _where(valid, new, {k: st[k] for k in new})
    return y, res, dict(st, **new)

  def f_idle(args):
    return x0, _zeros(res_shapes), args[-1]

  last_device = p == Pn - 1

  def head_phase(args):
    """Every device, in the ticks the last stage runs its F: the loss of that microbatch
    over the vocabulary slices (`_head`) and the cotangent of the stage's output, which
    the last device keeps for its B. A tick predicate: every device agrees, so the psums
    inside meet their peers."""
    y, m, st = args
    y = jax.lax.psum(jnp.where(last_device, y, jnp.zeros_like(y)), AXIS)
    out = _head(cfg, head, y, mb["targets"][m], mb["loss_mask"][m], grads)
    ce, dy, g = (out, jnp.zeros_like(y), None) if not grads else out
    st = dict(st, ce=st["ce"] + jnp.where(last_device, ce, 0.0))
    if grads:    # the norm's gradient once (the last device's), each device its columns'
      st["g_norm"] = st["g_norm"] + jnp.where(last_device, g["final_norm"], 0.0)
      st["g_lm"] = st["g_lm"] + g["lm_head"]
    return dy.astype(dt), st

  def head_idle(args):
    return jnp.zeros_like(args[0]), args[-1]

  def b_phase(v, m, valid, flags, dy, res, g, active):
    """-> (dx, cut or None, g): the stage's backward, and stage 0's through the embedding
    and dense layers (recomputed from its input: `pre`)."""
    cut = None
    if tab.split:
      dx, cut, g_stage = backward(res, dy, v, valid, g["stage"], active)
    else:
      dx, g_stage = _stage_backward(saved, params, v, on, res, dy, g["stage"], valid,
                                    per_device, active)
    first = (p == 0) & (v == 0) & valid

    def pre_grads():   # in the params' dtype; added to the float32 sums below
      _, vjp = jax.vjp(lambda pp: pre(pp, m)[0], pre_params)
      return vjp(dx.astype(dt))[0]
    g_pre = branch(first, flags["pre"], pre_grads,
                   lambda: jax.tree.map(jnp.zeros_like, pre_params))
    g_pre = jax.tree.map(lambda a, b: a + jnp.where(first, b.astype(a.dtype), 0.0),
                         g["pre"], g_pre)
    return dx.astype(dt), cut, dict(stage=g_stage, pre=g_pre)

  task = {k: jnp.asarray(a) for k, a in tab.task.items()}
  slot = {k: jnp.asarray(a) for k, a in tab.slots.items()}
  # What some device of the tick needs (static, from the table): the "tick" predicates.
  busy = {k: jnp.asarray(tab.busy(k).any(axis=1)) for k in tab.task}
  flags = {"F": dict(pre=(tab.task["F"][:, 0, 0] == 0)),
           "B": dict(pre=(tab.task["B"][:, 0, 0] == 0))}
  flags = jax.tree.map(jnp.asarray, flags)
  head_tick = jnp.asarray(schedules.head_ticks(tab))

  # The tick's phases in program order on XLA:CPU only, whose thunk executor may run
  # independent collectives in a different order on each device (a deadlock); GPU and TPU
  # run one schedule on every device, and without the barriers their schedulers may overlap
  # the ring transfers and host copies with the phases' compute.
  order = jax.lax.optimization_barrier if kernel_platform.backend() == "cpu" else lambda x: x

  def tick(carry, t):
    st_f, st_b, act_buf, grad_buf, res_buf, cut_buf, st, g = carry
    sl = {k: a[t, p] for k, a in slot.items()}
    act_buf = _put(act_buf, sl["act_in"], st_f)
    fv, fm = task["F"][t, p, 0], task["F"][t, p, 1]
    act = act_buf[jnp.maximum(sl["act_read"], 0)]
    y, res, st = branch(
        fv >= 0, busy["F"][t], f_phase, f_idle,
        (jnp.maximum(fv, 0), jnp.maximum(fm, 0), fv >= 0,
         {k: a[t] for k, a in flags["F"].items()}, act, st))
    # Every collective of a tick in one order on every device (F phase, head, B phase,
    # then the two ring transfers): XLA:CPU may otherwise issue independent collectives in
    # different orders on different devices and deadlock (`order`).
    y, st = order((y, st))
    dh, st = jax.lax.cond(head_tick[t], head_phase, head_idle,
                          (y, jnp.maximum(task["F"][t, Pn - 1, 1], 0), st))
    if not grads:
      return (jax.lax.ppermute(y, AXIS, fwd_ring), st_b, act_buf, grad_buf, res_buf,
              cut_buf, st, g), None
    res_buf = store.put(res_buf, sl["res_write"], res)
    grad_buf = _put(grad_buf, sl["grad_in"], st_b)
    grad_buf = _put(grad_buf, sl["head_write"], dh)
    if offload:   # host buffers stay out of the barrier: it orders collectives, not copies
      y, grad_buf, st, g = order((y, grad_buf, st, g))
    else:
      y, grad_buf, res_buf, st, g = order((y, grad_buf, res_buf, st, g))
    bv, bm = task["B"][t, p, 0], task["B"][t, p, 1]
    dy = grad_buf[jnp.maximum(sl["grad_read"], 0)]
    # Read after this tick's put. Read before F instead (so that its host -> device copy
    # could overlap F, and the last stage's B took F's residuals without the round trip),
    # the offloaded step took 6.6x the device-slot step on an H200, against 1.72x here
    # (experiments/results/pipeline/gpu_offload_read_before_f.csv).
    res = store.get(res_buf, sl["res_read"], res_shapes)
    dx, cut, g = b_phase(jnp.maximum(bv, 0), jnp.maximum(bm, 0), bv >= 0,
                         {k: a[t] for k, a in flags["B"].items()}, dy, res, g,
                         bv >= 0 if per_device else busy["B"][t])
    if tab.split:
      cut_buf = store.put(cut_buf, sl["cut_write"], cut)
      if offload:
        y, dx, g = order((y, dx, g))
      else:
        y, dx, cut_buf, g = order((y, dx, cut_buf, g))
      wv = task["W"][t, p, 0]
      w_res = store.get(res_buf, sl["res_wread"], res_shapes)
      w_cut = store.get(cut_buf, sl["cut_read"], cut_shapes)
      g = dict(g, stage=weights_grad(w_res, w_cut, jnp.maximum(wv, 0), wv >= 0, g["stage"],
                                     wv >= 0 if per_device else busy["W"][t]))
    y, dx, g = order((y, dx, g))
    st_f = jax.lax.ppermute(y, AXIS, fwd_ring)
    st_f, dx = order((st_f, dx))
    st_b = jax.lax.ppermute(dx, AXIS, bwd_ring)
    return (st_f, st_b, act_buf, grad_buf, res_buf, cut_buf, st, g), None

  f32 = lambda a: jnp.zeros(a.shape, jnp.float32)
  # statistics and the head's sums (through the F / head conds: small) ...
  st = dict(ce=jnp.zeros((), jnp.float32), aux=jnp.zeros((), jnp.float32),
            mx=jnp.full((V, L, H), -jnp.inf, jnp.float32),
            pre_max=jnp.full((n_pre, H), -jnp.inf, jnp.float32),
            load=jnp.zeros((V, L, E if moe else 0), jnp.float32),
            g_norm=f32(head["final_norm"]) if grads else {},
            g_lm=f32(head["lm_head"]) if grads else {})
  # ... and the float32 weight-gradient sums, outside every cond
  g = dict(pre=jax.tree.map(f32, pre_params), stage=jax.tree.map(f32, params)) if grads else {}
  bufs = lambda n, shape: jnp.zeros((n,) + shape, dt)
  store = _Slots(offload and grads)
  res_buf = store.zeros(slots["res"], res_shapes)
  ticks = tab.ticks if grads else int(max(i for i in range(tab.ticks)
                                          if (tab.task["F"][i, :, 0] >= 0).any())) + 1
  cut_buf = []
  if grads and tab.split:
    cut_buf = store.zeros(slots["cut"], cut_shapes)
  init = (x0, x0, bufs(slots["act"], act_shape), bufs(slots["grad"], act_shape), res_buf,
          cut_buf, st, g)
  (_, _, _, _, _, _, st, g), _ = jax.lax.scan(tick, init, jnp.arange(ticks))
  head_grads, g_pre, g_stage = {}, {}, {}
  if grads:
    g_pre, g_stage = g["pre"], g["stage"]
    head_grads = {"final_norm": st["g_norm"], "lm_head": st["g_lm"]}
  psum = lambda a: jax.lax.psum(a, (AXIS, *reps))
  flat = lambda a: a.reshape((V * L,) + a.shape[2:])
  # the statistics over the replicas here; the gradients leave with a leading axis each and
  # are summed outside, once (`_pipelined`)
  over = lambda f, a: f(a, reps) if reps else a
  one = lambda a: a[None]
  return (psum(st["ce"]), psum(st["aux"]), flat(over(jax.lax.pmax, st["mx"])),
          flat(over(jax.lax.psum, st["load"])), jax.lax.pmax(st["pre_max"], (AXIS, *reps)),
          jax.tree.map(one, head_grads), jax.tree.map(one, g_pre),
          jax.tree.map(lambda a: flat(a)[None], g_stage))


def _pipelined(cfg, params, microbatches, tab: schedules.Table, grads: bool, skip=None):
  """params in the stored layout (k2jax.parallel.layout); -> (cross-entropy sum, token count,
  aux-loss sum, ForwardStats in stored row order, gradients in the stored layout or None)."""
  sp = split(cfg, tab.P, tab.V)
  mb = microbatches
  M = mb["inputs"].shape[0]
  if M != tab.M:
    raise ValueError(f"{M} microbatches for a schedule table of {tab.M}")
  offload = offloads(cfg) and grads
  cfg = _pipeline_model_cfg(cfg)
  mask = mb["loss_mask"].astype(jnp.float32)
  # each microbatch's aux loss (a mean over its sequences) weighs N / M, N the batch's loss
  # tokens: the objective of the whole batch at once, whatever the split (k2jax.step._grads)
  aux_weight = jnp.sum(mask) / M
  stack = params[sp.stack.name]
  pre_names = ["embed"] + [s.name for s in transformer.stacks(cfg) if s != sp.stack]
  pre_params = {k: params[k] for k in pre_names}
  # The head's columns, one slice per pipeline device (`_head`); padded to a multiple of P
  # where the vocabulary is not (then the head is stored whole: param_spec, and each device
  # cuts its slice locally).
  vocab = cfg.vocab_size
  pad = -vocab % tab.P
  head = {"final_norm": params["final_norm"],
          "lm_head": jnp.pad(params["lm_head"], ((0, 0), (0, pad))) if pad else params["lm_head"]}
  on = jnp.asarray(sp.real().reshape(-1))
  # every batch axis manual too (replica_axes): each device's microbatches are its batch
  # rows, and its gradients its rows' share until the sums below
  mesh = jax.sharding.get_abstract_mesh()
  reps = replica_axes(mesh)
  both = (AXIS, *reps)
  # each sequence's tokens in the order the context devices hold them (k2jax.model.context):
  # every per-token array moves with them, and the losses are sums over tokens
  C = context.size(mesh)
  if C > 1:
    chunk = context.chunk_size(cfg, mb["inputs"].shape[2], C)
    mb = {k: context.to_placement(v, C, chunk, axis=2) for k, v in mb.items()}
  rows = P(None, active_mesh_axes("batch", mesh, manual=True) or None,
           active_mesh_axes("length", mesh, manual=True) or None)
  inner, lead = inner_specs(cfg, {sp.stack.name: stack, **pre_params, **head}, mesh)
  is_p = lambda x: isinstance(x, P)
  spec, lead_stack = inner.pop(sp.stack.name), lead.pop(sp.stack.name)
  # the head's columns split over the pipeline only: each device's [D, V / P] slice whole
  # over the rest, gathered once as the shard_map opens (K2: 147 MB of bf16)
  head_spec = {k: inner.pop(k) for k in head}
  lead = {k: lead[k] for k in inner}
  # each gradient leaves with a leading axis over the manual axes it is unreduced over
  # (stage 0's prefix over the pipeline too: only stage 0's are non-zero)
  grad_spec = jax.tree.map(lambda s, r: P(r, *s), spec, lead_stack, is_leaf=is_p)
  pre_out = jax.tree.map(lambda s, r: P((AXIS, *(r or ())), *s), inner, lead, is_leaf=is_p)
  head_out = ({"final_norm": P(both), "lm_head": P(reps or None, None, AXIS)} if grads
              else P(reps or None))
  run = jax.shard_map(
      lambda *a: _run(cfg, sp, tab, grads, skip or skip_mode(), offload, reps, *a),
      in_specs=(spec, P(AXIS), inner, head_spec, rows, P()),
      out_specs=(P(), P(), P(AXIS), P(AXIS), P(), head_out, pre_out if grads else P(both),
                 grad_spec if grads else P(reps or None)),
      axis_names=set(both),
      check_vma=False)
  ce, aux, mx, load, pre_max, g_head, g_pre, g_stage = run(stack, on, pre_params, head, mb,
                                                           aux_weight)
  # Summed outside the shard_map, once a step: over the replicas every gradient, over the
  # pipeline axis those of stage 0 (embedding, dense layers) and the last device's final
  # norm, the only non-zero ones. Outside, XLA reduces each straight into its stored
  # sharding (a reduce-scatter for a weight stored split over `expert`), where a psum
  # inside would leave every device the whole sum. The head's columns come out where they
  # are stored.
  g_pre = jax.tree.map(lambda a: a.sum(0), g_pre)
  if grads:
    g_stage = jax.tree.map(lambda a: a.sum(0), g_stage)
    g_lm = g_head["lm_head"].sum(0)
    g_head = {"final_norm": g_head["final_norm"].sum(0),
              "lm_head": g_lm[:, :vocab] if pad else g_lm}
  n = jnp.sum(mask)
  moe = sp.stack.ffn == "moe"
  stats = transformer.ForwardStats(
      max_logits=jnp.concatenate([pre_max, mx], axis=0),
      expert_load=load if moe else jnp.zeros((0, cfg.n_routed_experts), jnp.float32),
      aux_loss=aux / jnp.maximum(n, 1.0))
  if not grads:
    return ce, n, aux, stats, None
  g = {**g_pre, **g_head, sp.stack.name: g_stage}
  return ce, n, aux, stats, {k: g[k] for k in params}


def loss_and_grads(cfg, params, microbatches, tab: schedules.Table, skip=None):
  """Loss sums, statistics and gradients of cross entropy + aux loss summed over the
  microbatches (not divided by the token count), params / grads / statistics in the stored
  layout: what jax.grad of the unpipelined model gives, with rows permuted and padded.
  skip: "device" | "tick" (module docstring; default `skip_mode()`)."""
  return _pipelined(cfg, params, microbatches, tab, True, skip)


def loss(cfg, params, microbatches, tab: schedules.Table, skip=None):
  """Forward only (the table's F phases): (cross-entropy sum, token count, aux sum, stats)."""
  return _pipelined(cfg, params, microbatches, tab, False, skip)[:4]
