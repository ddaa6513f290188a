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
(k2jax.parallel.schedules.build: mesh.pipeline_schedule, 1f1b | gpipe | zbh1 or one
registered): per tick an F phase (forward of one stage on one microbatch) and a B phase
(its backward), and the buffer slots everything is kept in. The loop computes only what
the table says:

  - a phase the table leaves idle is skipped (`lax.cond` on the device's own table entry,
    which every data / expert shard of that pipeline device agrees on, so the MoE's
    collectives inside the branch meet their peers; the ppermutes stay outside). F and the
    head are one cond each; B and W one per layer, with the float32 gradient sums outside
    every cond (XLA:TPU gives a cond's outputs buffers of their own: sums passed through a
    phase's cond were a second copy of them);
  - the embedding and the leading dense layers (a dense layer of 61 for K2) run in the F
    phase of stage 0 only, per microbatch, and B recomputes them from stage 0's input (3
    forward units where the others' ticks take 2; keeping their residuals in the slot a
    padded stage 0 leaves unused would save one dense layer's recomputation, but no time
    at K2's costs);
  - the final norm, head and loss run once per microbatch, in a head phase after the F phase
    of the tick that runs the last stage, on every device: the vocabulary is split over the
    pipeline devices (`stage.head`; the head's columns are stored that way, sharding rule
    `head_vocab`), so each does 1 / P of the head's work instead of the last device all of
    it in one tick (K2: the head is 2.2 layer forwards, more than a stage of 2 layers);
    its gradient is taken right there, and the cotangent waits in a buffer for that stage's B;
  - padding layers of an uneven split are skipped (`lax.cond` per layer);
  - F keeps what the stage's backward needs as `model.remat` decides (each layer's jax.vjp
    residuals under the remat policy: selective recomputation keeps what report 2.4.3
    keeps, "full" only layer inputs), in the table's residual slots; B rebuilds each
    layer's vjp from them. Residuals that are the layer's weights are not copied into the
    buffers. Every phase reads one layer's weights at a time from the device's rows and
    adds that layer's weight gradients to the float32 sums in place (`stage.layer_at`): nothing
    the size of a stage's weights or gradients exists beside them.
    With `model.offload` those slots are in host memory (`executor.Slots`; report 2.4.3): a tick
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

Where each part lives: this module opens the shard_map and sums what it returns;
k2jax.parallel.executor runs the tick loop (`Executor`: forward, head, input-gradient,
weight-gradient and transfer phases, and the `Slots` they keep residuals in);
k2jax.parallel.stage is one stage's work, a layer at a time; k2jax.parallel.schedules
builds the table and k2jax.parallel.layout places stages (`layout.stage_of`).

What a new schedule provides: one `schedules.Schedule` entry, `schedules.register(name,
...)` (its task order per device, how far forwards may run ahead, whether it flushes or
splits the backward); `schedules.build` simulates it into a `Table` (every device's task
per tick and phase, and the buffer slots each tick writes and reads, sized by what is
alive), and this loop runs any table unchanged: per tick the F phase, the head phase where
the table's F runs the last stage, the B phase, the W phase where the table splits, then
the two ring transfers. A schedule that needs a phase of another kind (e.g. DualPipe's two
directions at once) is the one that needs a change here.
"""

import concurrent.futures
import contextlib
import functools
import json
import logging
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from k2jax.configs.sharding_rules import active_mesh_axes, entry_axes, param_spec
from k2jax.kernels import moe as moe_kernels
from k2jax.kernels import platform as kernel_platform
from k2jax.model import context, counting, remat, spec as model_spec, transformer
from k2jax.parallel import executor, schedules, stage
from k2jax.parallel.layout import split
from k2jax.parallel.stage import AXIS

log = logging.getLogger("k2jax.parallel")



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
# come in whole. The head's columns are split over the pipeline only (`stage.head`).
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
  if "lm_head" in out:   # whatever its stored split, padded to divide the pipeline (`stage.head`)
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
  if schedules.SCHEDULES[schedule].split:
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
  if not schedules.SCHEDULES[schedule].split:
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
    cut = stage.split_layer(cfg, sp.stack.ffn, _param_avals(cfg, sp.stack.name, None), x,
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
  writes of idle ticks, in host memory (`executor.Slots`), and on the device the stage F just
  made and the one B reads (a tick moves one to host and one back).

  B reads its slot in the tick it runs. Fetching it a tick ahead (so the copy could run
  behind the tick's phases) kept one more stage on the device and saved no time on a GPU
  (experiments/results/pipeline/gpu_offload_fetch_ahead.csv), so it was taken out."""
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


def _reduce(g, lead: tuple, target):
  """g [R, ...]: one leaf of the shard_map's gradient sums, unreduced over the manual axes
  `lead` (its leading axis) -> their sum, sharded as `target` says (a NamedSharding or its
  PartitionSpec; parallel.grad_shardings: ZeRO-1's slices). A lead axis that `target` splits
  the gradient over is reduce-scattered onto that dimension, the others summed; or None
  where `target` lays a dimension out in an order this cannot produce (the lead axes must
  come last in its entry). Written out because XLA:TPU compiles a plain sum followed by
  ZeRO-1's slice as an all-reduce (twice a reduce-scatter's bytes, and the whole sum on
  every device). A reduce-scatter goes onto the slice's largest dimension the group
  divides and an all-to-all of the slice moves it where the target wants it: scattered
  onto a small dimension (K2's 24 local experts, split 8 ways) XLA:TPU lowered it as an
  all-reduce again, whose whole result lived until the update."""
  spec = tuple(getattr(target, "spec", target))
  spec += (None,) * (g.ndim - 1 - len(spec))
  inner = []
  for e in spec:
    axes = entry_axes(e)
    mine = tuple(a for a in axes if a not in lead)
    if axes[len(mine):] != tuple(a for a in axes if a in lead):
      return None
    inner.append(mine[0] if len(mine) == 1 else (mine or None))
  rest = tuple(a for a in lead if not any(a in entry_axes(e) for e in spec))

  mesh = jax.sharding.get_abstract_mesh()

  def body(x):
    x = x[0]
    for d, e in enumerate(spec):
      scatter = tuple(a for a in entry_axes(e) if a in lead)
      if not scatter:
        continue
      n = math.prod(mesh.shape[a] for a in scatter)
      # onto the largest dimension the group divides, then to d (docstring)
      big = max((i for i in range(x.ndim) if x.shape[i] % n == 0 and i != d
                 and not any(a in lead for a in entry_axes(spec[i]))),
                key=lambda i: x.shape[i], default=d)
      if x.shape[big] <= x.shape[d]:
        big = d
      x = jax.lax.psum_scatter(x, scatter, scatter_dimension=big, tiled=True)
      if big != d:
        x = jax.lax.all_to_all(x, scatter, split_axis=d, concat_axis=big, tiled=True)
    return jax.lax.psum(x, rest) if rest else x
  return jax.shard_map(body, in_specs=P(lead or None, *inner), out_specs=P(*spec),
                       check_vma=False)(g)


def _pipelined(cfg, params, microbatches, tab: schedules.Table, grads: bool, skip=None,
               reduce_to=None):
  """params in the stored layout (k2jax.parallel.layout); -> (cross-entropy sum, token count,
  aux-loss sum, ForwardStats in stored row order, gradients in the stored layout or None).
  reduce_to: the gradients' shardings after the step's one reduction (`_reduce`), or None
  (summed, laid out as XLA picks)."""
  sp = split(cfg, tab.P, tab.V)
  mb = microbatches
  M = mb["inputs"].shape[0]
  if M != tab.M:
    raise ValueError(f"{M} microbatches for a schedule table of {tab.M}")
  offload = offloads(cfg) and grads
  cfg = _pipeline_model_cfg(cfg)
  mask = mb["loss_mask"].astype(jnp.float32)
  # each microbatch's aux loss (a mean over its sequences) weighs N / M, N the batch's loss
  # tokens: the objective of the whole batch at once, whatever the split (k2jax.training.step._grads)
  aux_weight = jnp.sum(mask) / M
  stack = params[sp.stack.name]
  pre_names = ["embed"] + [s.name for s in transformer.stacks(cfg) if s != sp.stack]
  pre_params = {k: params[k] for k in pre_names}
  vocab = cfg.vocab_size
  head, _ = _padded_head(params, vocab, tab.P)
  on = jnp.asarray(sp.real().reshape(-1))
  # every batch axis manual too (replica_axes): each device's microbatches are its batch
  # rows, and its gradients its rows' share until the sums below
  mesh = jax.sharding.get_abstract_mesh()
  reps = replica_axes(mesh)
  both = (AXIS, *reps)
  # each sequence's tokens in the order the context devices hold them (k2jax.model.context):
  # every per-token array moves with them, and the losses are sums over tokens
  mb = _in_context_order(cfg, mb, mesh)
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
      lambda *a: executor.Executor(cfg, sp, tab, grads, skip or skip_mode(), offload, reps,
                           *a).run(),
      in_specs=(spec, P(AXIS), inner, head_spec, rows, P()),
      out_specs=(P(), P(), P(AXIS), P(AXIS), P(), head_out, pre_out if grads else P(both),
                 grad_spec if grads else P(reps or None)),
      axis_names=set(both),
      check_vma=False)
  ce, aux, mx, load, pre_max, g_head, g_pre, g_stage = run(stack, on, pre_params, head, mb,
                                                           aux_weight)
  if grads:
    g_pre, g_head, g_stage = _summed_grads(g_pre, g_head, g_stage, pre_out, grad_spec,
                                           reduce_to, sp.stack.name, vocab)
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


def _padded_head(params, vocab: int, P: int):
  """-> ({final_norm, lm_head}, columns of padding). The head's columns, one slice per
  pipeline device (`stage.head`), padded to a multiple of P where the vocabulary is not
  (then the head is stored whole: param_spec, and each device cuts its slice locally)."""
  pad = -vocab % P
  lm = params["lm_head"]
  return {"final_norm": params["final_norm"],
          "lm_head": jnp.pad(lm, ((0, 0), (0, pad))) if pad else lm}, pad


def _in_context_order(cfg, mb, mesh):
  """Each sequence's tokens in the order the context devices hold them
  (k2jax.model.context): every per-token array moves with them, and the losses are sums
  over tokens, so nothing needs moving back."""
  C = context.size(mesh)
  if C == 1:
    return mb
  chunk = context.chunk_size(cfg, mb["inputs"].shape[2], C)
  return {k: context.to_placement(v, C, chunk, axis=2) for k, v in mb.items()}


def _summed_grads(g_pre, g_head, g_stage, pre_out, grad_spec, reduce_to, stack: str,
                  vocab: int):
  """The executor's unreduced gradients (a leading axis over the manual axes) summed.

  Summed outside the shard_map, once a step: over the replicas every gradient, over the
  pipeline axis those of stage 0 (embedding, dense layers) and the last device's final
  norm, the only non-zero ones. Outside, XLA reduces each straight into its stored
  sharding (a reduce-scatter for a weight stored split over `expert`), where a psum inside
  would leave every device the whole sum. The head's columns come out where they are
  stored, its padding cut. Given reduce_to (the trainer's: ZeRO-1's slices), each leaf is
  reduce-scattered into its slice instead (`_reduce`)."""
  def reduced(g, out_spec, target):
    r = _reduce(g, entry_axes(out_spec[0]), target)
    return g.sum(0) if r is None else r
  if reduce_to is not None:
    g_pre = {k: jax.tree.map(reduced, g_pre[k], pre_out[k], reduce_to[k]) for k in g_pre}
    g_stage = jax.tree.map(reduced, g_stage, grad_spec, reduce_to[stack])
  else:
    g_pre = jax.tree.map(lambda a: a.sum(0), g_pre)
    g_stage = jax.tree.map(lambda a: a.sum(0), g_stage)
  g_lm = g_head["lm_head"].sum(0)
  g_head = {"final_norm": g_head["final_norm"].sum(0), "lm_head": g_lm[:, :vocab]}
  return g_pre, g_head, g_stage


def loss_and_grads(cfg, params, microbatches, tab: schedules.Table, skip=None, reduce_to=None):
  """Loss sums, statistics and gradients of cross entropy + aux loss summed over the
  microbatches (not divided by the token count), params / grads / statistics in the stored
  layout: what jax.grad of the unpipelined model gives, with rows permuted and padded.
  skip: "device" | "tick" (module docstring; default `skip_mode()`). reduce_to: a tree of
  the params' structure, the shardings the gradients are reduced into (`_reduce`; ZeRO-1's
  from parallel.grad_shardings), or None."""
  return _pipelined(cfg, params, microbatches, tab, True, skip, reduce_to)


def loss(cfg, params, microbatches, tab: schedules.Table, skip=None):
  """Forward only (the table's F phases): (cross-entropy sum, token count, aux sum, stats)."""
  return _pipelined(cfg, params, microbatches, tab, False, skip)[:4]
