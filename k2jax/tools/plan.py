"""Per-device memory of a config on a mesh, asked of the code that shards and schedules.

    python -m k2jax.plan --config kimi_k2
    python -m k2jax.plan --config kimi_k2 --mesh pipeline=16,expert=16 --devices 2048

Nothing is allocated. States come from the trainer's own shardings: the abstract train
state of the stored layout (k2jax.parallel.layout: the pipelined stack padded and in
schedule order, as `k2jax.train` holds it) and `k2jax.parallel.state_shardings` on an
abstract mesh; a device's bytes are its shard of every leaf (the fullest device: shards are
even). Per device:
  params        in model.param_dtype (K2: bf16)
  grads         the float32 gradient buffer of that parameter shard (--grad_bytes)
  optimizer     ZeRO-1 (split over `data` too): Muon momentum / Adam moments, the float32
                master weights when params are lower precision, QK-Clip's record
  activations   what each layer keeps for its backward pass, measured by tracing it with the
                configured remat policy, kernels (those `auto` picks on --platform) and
                activation storage, times what the pipeline schedule's table keeps in
                flight, see `activation_bytes`
"""

import argparse
import copy
import functools
import math
import sys
from typing import NamedTuple

import jax
import numpy as np
from jax.sharding import AbstractMesh, NamedSharding

from k2jax import configs, model, optim
from k2jax.kernels import platform as kernel_platform
from k2jax.model import expert_parallel, spec as model_spec, transformer
from k2jax.configs.sharding_rules import mesh_axes, muon_work_spec, param_spec
from k2jax.parallel import MESH_AXES, grad_shardings, layout, pipeline, state_shardings
from k2jax.parallel import param_shardings as parallel_param_shardings
from k2jax.parallel.mesh import parse_mesh
from k2jax.parallel.mesh import entry_axes
from k2jax.training.step import differentiated, init_state
from k2jax.tools import xla_target

GB = 1e9


def _with_mesh(config, mesh_shape, virtual_stages=None, microbatches=None, param_dtype=None):
  # The mesh goes in before references resolve: a preset deriving its microbatches from
  # the mesh (kimi_k2: one sequence per device) keeps that geometry on the planned mesh.
  config = copy.deepcopy(config)
  config.mesh.update({a: mesh_shape.get(a, 1) for a in MESH_AXES})
  config = config.copy_and_resolve_references()
  if virtual_stages:
    config.mesh.virtual_stages = virtual_stages
  if microbatches:
    config.train.grad_accum = microbatches
  if param_dtype:
    config.model.param_dtype = param_dtype
  return config


def _per_device(tree, shardings, itemsize=None, memory_kind=None) -> int:
  """Bytes of `tree`'s leaves on the fullest device under `shardings` (at `itemsize` bytes a
  value if given; only the leaves in host memory, or only those on the device, if
  memory_kind is "pinned_host" / "device")."""
  return sum(int(np.prod(s.shard_shape(a.shape))) * (itemsize or a.dtype.itemsize)
             for a, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings))
             if memory_kind is None or (s.memory_kind == "pinned_host") == (
                 memory_kind == "pinned_host"))


def state_bytes(config, mesh_shape, grad_bytes=4):
  """Bytes of params, gradient buffer and optimizer state on the fullest device, and totals,
  from `state_shardings` of the train state `k2jax.train` builds for `config` (a full
  config) on a mesh of `mesh_shape` {pipeline, data, expert}."""
  config = _with_mesh(config, mesh_shape)
  stored = layout.stored_config(config)
  tx = optim.optimizer(stored)
  abstract = jax.eval_shape(functools.partial(init_state, stored, tx), jax.random.key(0))
  mesh = AbstractMesh(tuple(mesh_shape.get(a, 1) for a in MESH_AXES), MESH_AXES)
  specs = model.param_specs(stored.model)
  sh = state_shardings(specs, mesh, abstract, tx, host_state=config.optimizer.host_state)
  # the gradients as the update takes them: ZeRO-1's slices (k2jax.training.step.program),
  # and so the accumulator of a step without a pipeline, which XLA keeps in that sharding
  to = grad_shardings(specs, mesh, abstract.params)
  unsplit, names = _unsplit_states(abstract, sh, mesh_shape)
  n = model.count_params(config.model)["total"]
  param_size = np.dtype(config.model.param_dtype).itemsize
  # the weights' model.dtype copy a step without a pipeline differentiates (train.cast_once)
  cast_tree = jax.eval_shape(functools.partial(differentiated, stored), abstract.params)
  cast = [(c, s) for c, a, s in zip(jax.tree.leaves(cast_tree), jax.tree.leaves(abstract.params),
                                    jax.tree.leaves(sh.params)) if c.dtype != a.dtype]
  grads = sums = _per_device(abstract.params, to, grad_bytes)
  loop_copy = loop_grad = 0
  if mesh_shape["pipeline"] == 1:
    # The transpose of the layers' scan hands back a stack's whole gradient (model.dtype,
    # split as its weights) for each microbatch; only then is it reduced into the float32
    # accumulator's slices (step._grads). XLA:TPU holds the largest stack's beside the
    # accumulator (`k2jax.compile --explain` of a step without a pipeline shows it).
    size = np.dtype(config.model.dtype).itemsize
    loop_grad = max(_per_device(abstract.params[s.name], sh.params[s.name], size)
                    for s in model.stacks(stored.model))
  else:
    sums, loop_copy = _pipeline_loop_bytes(stored, abstract, sh, mesh, grad_bytes)
  return dict(params=_per_device(abstract.params, sh.params),
              cast_copy=_per_device([c for c, _ in cast], [s for _, s in cast]),
              loop_copy=loop_copy, loop_sums=sums, loop_grad=loop_grad,
              grads=grads, muon_gather=_muon_gather(specs, abstract, to, mesh),
              grads_whole=_per_device(abstract.params, sh.params, grad_bytes),
              optimizer=_per_device(abstract.opt_state, sh.opt_state, memory_kind="device"),
              optimizer_host=_per_device(abstract.opt_state, sh.opt_state,
                                         memory_kind="pinned_host"),
              optimizer_unsplit=unsplit,
              optimizer_unsplit_leaves=sorted(names, key=names.get, reverse=True),
              total_params=n * param_size, total_grads=n * grad_bytes)


def _unsplit_states(abstract, sh, mesh_shape) -> tuple[float, dict]:
  """-> (bytes, {state path: bytes}) the optimizer states hold beyond ZeRO-1's slices.

  ZeRO-1 splits each state over the `opt_state` mesh axes on a dimension they divide
  (parallel.state.zero1); where none does, the state stays whole over them. Reported so the
  figure does not jump unexplained."""
  group = [a for a in mesh_axes("opt_state") if mesh_shape.get(a, 1) > 1]
  unsplit, names = 0, {}
  for (path, a), s in zip(jax.tree_util.tree_flatten_with_path(abstract.opt_state)[0],
                          jax.tree.leaves(sh.opt_state)):
    held = int(np.prod(s.shard_shape(a.shape))) * a.dtype.itemsize
    used = {x for entry in s.spec for x in entry_axes(entry)}
    extra = held - held / math.prod(mesh_shape[x] for x in group if x not in used)
    if a.ndim and extra > 0:
      unsplit += extra
      name = "/".join(str(getattr(k, "key", "")) for k in path if hasattr(k, "key"))
      names[name] = names.get(name, 0) + extra
  return unsplit, names


def _pipeline_loop_bytes(stored, abstract, sh, mesh, grad_bytes) -> tuple[int, int]:
  """-> (the loop's float32 gradient sums, the weights it gathers), bytes a device.

  The pipeline's shard_map holds the weights stored split only to save memory whole,
  gathered once as it opens, and its float32 sums of every weight's gradient shaped as it
  holds the weight (k2jax.parallel.pipeline.inner_specs); the head padded to a multiple of
  the pipeline's devices, as the pipeline pads it."""
  P = mesh.shape["pipeline"]
  d, vocab = abstract.params["lm_head"].shape
  padded = dict(abstract.params, lm_head=jax.ShapeDtypeStruct(
      (d, -(-vocab // P) * P), abstract.params["lm_head"].dtype))
  inner, _ = pipeline.inner_specs(stored.model, padded, mesh)
  held = [jax.sharding.NamedSharding(mesh, s) for s in jax.tree.leaves(
      inner, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))]
  sums = _per_device(padded, held, grad_bytes)
  copy = sum(_per_device([a], [h]) for a, h, s, b in zip(
      jax.tree.leaves(padded), held, jax.tree.leaves(sh.params),
      jax.tree.leaves(abstract.params)) if h.shard_shape(a.shape) != s.shard_shape(b.shape))
  return sums, copy


def _muon_gather(specs, abstract, to, mesh) -> int:
  """Bytes of the momenta Muon's update gathers beyond ZeRO-1's slices.

  Muon orthogonalizes whole matrices where the momentum ZeRO-1 split over data is not split
  so by the work (sharding_rules.muon_work_spec: a stack's batch dimensions data does not
  divide, e.g. a stage's one dense layer): the update gathers those momenta (float32) and
  holds them and their orthogonalized updates as the work splits them, beyond the slices
  (`k2jax.compile --explain` shows them at optim/muon.py's on_local_matrices)."""
  return sum(
      _per_device([a], [NamedSharding(mesh, muon_work_spec(s.axes, s.shape, mesh,
                                                           model_spec.muon_batch(s)))], 4)
      - _per_device([a], [z], 4)
      for s, a, z in zip(jax.tree.leaves(specs, is_leaf=model_spec.is_spec),
                         jax.tree.leaves(abstract.params), jax.tree.leaves(to))
      if s.group == "muon")


class Activations(NamedTuple):
  """What `activation_bytes` counts for the device holding the most."""
  device: float       # bytes in device memory
  host: float         # bytes in its host memory (model.offload on a pipeline)
  settings: dict      # remat, attention_impl, storage, offload, platform used
  moved: float = 0.0  # bytes a tick writes to host memory, with offload


def activation_bytes(mcfg, mesh_shape, seq_len, micro_batch=1, *, remat=None,
                     attention_impl=None, storage=None, virtual_stages=1, microbatches=None,
                     schedule="1f1b", platform="gpu", offload=None) -> Activations:
  """Activation memory of the device holding the most.

  Per layer, what it keeps for its backward pass, measured by tracing the layer at abstract
  shapes on the mesh's data x expert devices (k2jax.model.transformer.layer_residual_bytes:
  the remat policy, the attention and MoE implementations `auto` picks on `platform`, the
  expert-parallel exchange, the activation storage); plus the working
  set of the layer being differentiated (what it keeps with no recomputation) and of the
  head (f32 logits and their gradient). Per device, micro_batch sequences of seq_len tokens
  (tokens are split over data x expert). With pipeline > 1, the schedule's table
  (k2jax.parallel.schedules) says how many stage activations a device keeps at once
  (`in_flight`: each what a stage's layers save) and how many stage inputs / cotangents wait
  in its buffers; with model.offload the pipeline keeps its stage residuals (and zbh1's cut)
  in host memory and the device only those of the tick at hand
  (k2jax.parallel.pipeline.residual_stages). On one pipeline stage model.offload is the
  layers' offloading remat policy: the trace says which residuals it places in host memory.
  Settings default to the config's.
  """
  m = mcfg.copy_and_resolve_references()
  settings = dict(remat=remat or m.remat, attention_impl=attention_impl or m.attention_impl,
                  storage=storage or m.get("activation_storage", "model"), platform=platform,
                  offload=bool(m.offload if offload is None else offload))
  m.update(dict(remat=settings["remat"], attention_impl=settings["attention_impl"],
                activation_storage=settings["storage"]))
  stages = mesh_shape["pipeline"]
  context = mesh_shape.get("context", 1)   # a sequence's tokens split over this many devices

  @functools.cache
  def layer(ffn, remat, memory="all"):     # bytes per token
    c = m.copy_and_resolve_references()
    c.remat, c.offload = remat, settings["offload"]
    with kernel_platform.target(platform):
      return transformer.layer_residual_bytes(c, ffn, seq_len, 1, mesh_shape["data"],
                                              mesh_shape["expert"], memory=memory,
                                              context=context) / seq_len
  kinds = {st.ffn: st.size for st in model.stacks(m)}
  # the f32 logits and their gradient of one sequence: each pipeline device has its own
  # slice of the vocabulary (k2jax.parallel.stage.head), each context device its tokens
  working = (max(layer(ffn, "none") for ffn in kinds)
             + 8 * -(-m.vocab_size // stages) / context)
  if stages == 1:
    # Each layer's forward writes its offloaded residuals to host memory (and its backward
    # reads them back): `moved` is the largest layer's share.
    per = seq_len * micro_batch
    saved = lambda memory: sum(layer(ffn, m.remat, memory) * n for ffn, n in kinds.items())
    if not settings["offload"]:
      return Activations((saved("all") + working) * per, 0.0, settings)
    return Activations((saved("device") + working) * per, saved("host") * per, settings,
                       max(layer(ffn, m.remat, "host") for ffn in kinds) * per)
  M = microbatches or stages
  a = 4 if m.dtype == "float32" else 2
  sp = layout.split(m, stages, virtual_stages)
  # The phase at work on one layer also holds that layer's weights as the loop reads them
  # (in model.dtype, whole over the axes only memory is split over: they are gathered) and
  # their gradients before they join the float32 sums (k2jax.parallel.stage.add_at):
  # twice the layer. Where the expert exchange's worst case runs in rounds, the backward's
  # scan over the rounds sums the routed experts' gradient in its carry beside the round's
  # own: once more (`k2jax.compile --explain` shows the three at K2: the layer's experts,
  # the carry and the round's).
  layer_bytes = 2 * stack_layer_bytes(m, sp.stack.name, mesh_shape)
  if expert_parallel.runs_in_rounds(mesh_shape["expert"], m.get("ep_round_load", 2.0),
                                    m.get("ep_transport", "auto"), platform):
    layer_bytes += stack_layer_bytes(m, sp.stack.name, mesh_shape, only="experts")
  tab = pipeline.schedule_table(m, stages, virtual_stages, M, schedule, mesh_shape["data"],
                                mesh_shape["expert"], seq_len, platform)
  cut = 0.0
  if tab.split:
    _, cut = pipeline.split_cost(m, mesh_shape["data"], mesh_shape["expert"], seq_len,
                                 platform)
  stage = layer(sp.stack.ffn, m.remat) * sp.per_stage
  # stage inputs / cotangents waiting in the loop's buffers: this device's tokens
  buffers = (tab.sizes["act"] + tab.sizes["grad"]) * a * m.hidden_size / context
  # zbh1: what B hands W (bwsplit's cut) waits in `cut` slots of a stage's layers each; the
  # loop's buffers have the same shape on every pipeline device, so every device holds them.
  cut_stage = sp.per_stage * cut / seq_len / context   # 0 unless the schedule splits
  cut_slots = tab.sizes.get("cut", 0)
  m.offload = settings["offload"]
  where = pipeline.residual_stages(tab, pipeline.offloads(m))
  per = seq_len * micro_batch
  if where["host"]:     # the cut slots are in host memory too, plus their write-only slot
    return Activations((where["device"] * stage + buffers + working) * per + layer_bytes,
                       (where["host"] * stage + (cut_slots + 1) * cut_stage) * per, settings,
                       (stage + cut_stage) * per)
  return Activations((where["device"] * stage + buffers + cut_slots * cut_stage + working) * per
                     + layer_bytes, 0.0, settings)


def stack_layer_bytes(mcfg, name: str, mesh_shape, only: str | None = None) -> int:
  """Bytes of one layer of stack `name` on one device, in model.dtype, as computation needs
  it: split over the axes `param_spec` splits for work (the experts over `expert`), whole
  over those it splits only to save memory (whole=True). `only`: the leaves under that key
  (e.g. "experts")."""
  mesh = AbstractMesh(tuple(mesh_shape.get(a, 1) for a in MESH_AXES), MESH_AXES)
  size = np.dtype(mcfg.dtype).itemsize
  total = 0
  for path, sp in jax.tree_util.tree_leaves_with_path(model.param_specs(mcfg)[name],
                                                      is_leaf=model_spec.is_spec):
    if only and only not in (getattr(k, "key", None) for k in path):
      continue
    shape, axes = sp.shape[1:], sp.axes[1:]
    spec = param_spec(axes, shape, mesh, whole=True)
    total += int(np.prod(jax.sharding.NamedSharding(mesh, spec).shard_shape(shape))) * size
  return total


def check(cfg) -> None:
  """ValueError (one line) for a model or layout the trainer would refuse (its own checks;
  the batch geometry is checked by `micro_batch_of` unless --micro_batch sets it)."""
  configs.validate_model(cfg.model)
  layout.validate(cfg)


def _batch_devices(mesh) -> int:
  """Devices the logical `batch` axis splits over on `mesh` ({axis: size})."""
  return math.prod(mesh[a] for a in mesh_axes("batch") if a in mesh)


def micro_batch_of(cfg, mesh) -> int:
  """Sequences each device runs per microbatch under `cfg` (a full config on `mesh`): the
  trainer splits each of train.grad_accum microbatches of train.batch_size / grad_accum
  rows over the mesh axes of the logical `batch` axis (k2jax.parallel.batch_sharding).
  ValueError (one line) where that is not a whole number."""
  n = _batch_devices(mesh)
  t = cfg.train
  rows = t.batch_size / (t.grad_accum * n)
  if rows < 1 or rows != int(rows):
    raise ValueError(
        f"train.batch_size {t.batch_size} / (train.grad_accum {t.grad_accum} x {n} devices "
        f"the batch splits over) is {rows:g} sequences per device per microbatch: pass "
        "--micro_batch N, or --microbatches M (or --config.train.grad_accum) that divides it")
  return int(rows)


class Estimate(NamedTuple):
  """plan's figures for a config on a mesh (`estimate`), per device on the fullest."""
  cfg: object             # the full config on this mesh (microbatches as planned)
  seq_len: int
  micro_batch: int
  geometry: str           # how micro_batch was decided
  rounded: str            # why train.grad_accum changed, or ""
  states: dict            # state_bytes
  acts: Activations

  @property
  def loop(self) -> float:
    """Device bytes while the step computes its gradients: states, the cast copy of the
    weights, activations."""
    st = self.states
    return (st["params"] + st["loop_sums"] + st["optimizer"] + st["cast_copy"]
            + st["loop_copy"] + st["loop_grad"] + self.acts.device)

  @property
  def update(self) -> float:
    """Device bytes during the optimizer update: params, the gradients (ZeRO-1's slices),
    the states and Muon's gathered momenta (`muon_gather`). The update is elementwise per
    leaf but for Muon's matrices, so each leaf's new states take its old ones' place (in
    place, donated); with optimizer.host_state the states come to the device for it
    (step.on_device) and XLA streams them, each leaf's old ones in and new ones out, which
    counts them once (XLA:TPU's buffer assignment, the 8-chip K2 step: within 1% of what it
    holds live)."""
    st = self.states
    return (st["params"] + st["optimizer"] + st["optimizer_host"] + st["grads"]
            + st["muon_gather"])

  @property
  def device(self) -> float:
    """Bytes in device memory at the step's peak: the gradient loop or the update."""
    return max(self.loop, self.update)

  @property
  def host(self) -> float:
    """Bytes in host memory: host optimizer states and offloaded activations."""
    return self.states["optimizer_host"] + self.acts.host


def estimate(config, mesh, seq_len=None, micro_batch=None, grad_bytes=4, *,
             virtual_stages=None, microbatches=None, remat=None, storage=None,
             param_dtype=None, platform="gpu") -> Estimate:
  """plan's figures of a preset name or a full config on `mesh` ({axis: size})."""
  config = configs.get_config(config) if isinstance(config, str) else config
  cfg = _with_mesh(config, mesh, virtual_stages, microbatches, param_dtype)
  check(cfg)
  V = cfg.mesh.get("virtual_stages", 1)
  seq_len = seq_len or cfg.train.seq_len
  M = cfg.train.grad_accum
  schedule = cfg.mesh.get("pipeline_schedule", "1f1b")
  P = mesh["pipeline"]
  rounded = ""
  if P > 1 and microbatches is None and (M < P or (schedule == "1f1b" and M % P)):
    # the config was written for another mesh: plan the fewest microbatches this one takes
    rounded = f" (the config's train.grad_accum {M} rounded up for this pipeline)"
    M = P * -(-M // P)
    cfg.train.grad_accum = M
  geometry = "--micro_batch"
  if micro_batch is None:
    geometry = f"train.batch_size {cfg.train.batch_size} in {M} microbatches"
    try:
      micro_batch = micro_batch_of(cfg, mesh)
    except ValueError:
      if not rounded:
        raise
      # plan chose M for this mesh: the nearest whole number, and say the batch must change
      n = _batch_devices(mesh)
      micro_batch = max(1, cfg.train.batch_size // (M * n))
      geometry += f", which does not split evenly: train.batch_size must be a multiple of {M * n}"
  st = state_bytes(cfg, mesh, grad_bytes)
  acts = activation_bytes(cfg.model, mesh, seq_len, micro_batch, remat=remat,
                          storage=storage, virtual_stages=V, microbatches=M,
                          schedule=schedule, platform=platform)
  return Estimate(cfg, seq_len, micro_batch, geometry, rounded, st, acts)


def _pipeline_line(cfg, mesh, seq_len, platform, acts, rounded: str) -> str:
  """plan's line on the pipeline: the schedule's ticks, idle time by stage FLOPs, stage
  activations in flight (what every device allocates: one SPMD program), padding rows, the
  zero-bubble split, the work the table runs against the model's own."""
  V = cfg.mesh.get("virtual_stages", 1)
  M = cfg.train.grad_accum
  schedule = cfg.mesh.get("pipeline_schedule", "1f1b")
  P = mesh["pipeline"]
  args = (schedule, mesh["data"], mesh["expert"], seq_len, platform)
  tab = pipeline.schedule_table(cfg.model, P, V, M, *args)
  costs = pipeline.schedule_costs(cfg.model, P, V, *args)
  sp = layout.split(cfg.model, P, V)
  layout_note = ("one task per device and tick" if tab.grid
                 else "1F1B's ticks with the W tasks placed in them")
  split_note = "" if not tab.split else (
      f"; {layout_note} (the faster of the two under these stage costs); W takes "
      f"{pipeline.w_share(cfg.model, *args[1:]):.2f} forwards of a layer's "
      f"backward (k2jax.parallel.bwsplit), "
      f"{tab.sizes['cut']} slots per device hold what B hands W (in activations above)")
  prefix_note = "stage 0 recomputes the embedding and dense layers in its backward"
  padded = (f", {sp.padded} padding row(s) stored, first on the stage with the embedding"
            if sp.padded else "")
  # one SPMD program: every device allocates the busiest device's residual slots
  used_slots = tab.used("res")
  unused = ""
  if used_slots.min() < tab.in_flight:
    spare = (tab.in_flight - used_slots.mean()) * acts.moved if acts.moved else 0.0
    unused = (f" on the busiest (every device allocates its slots: one SPMD program; "
              f"devices use {used_slots.min()}-{used_slots.max()}, mean "
              f"{used_slots.mean():.0f}" + (f", {spare / GB:.1f} GB of host slots unused "
                                            f"on the average device" if spare else "") + ")")
  return (f"pipeline ({schedule}): {P} devices x {V} virtual stages of "
          f"{sp.per_stage} layer(s), {M} microbatches{rounded}: {tab.ticks} ticks, idle "
          f"{tab.idle_fraction(costs):.1%} of device time by stage FLOPs "
          f"({tab.idle_fraction():.1%} if stages did equal work), {tab.in_flight} "
          f"stage activations in flight per device{unused}{padded}{split_note}; the tasks it "
          f"runs are {tab.work_ratio(costs):.3f}x the work of the model's forward + backward "
          f"without a pipeline ({prefix_note})")


def _state_lines(cfg, st: dict, mesh) -> tuple[list[str], float]:
  """plan's lines on the states a device holds (params, the gradient sums, ZeRO-1's
  optimizer states, the weights the loop gathers or casts, a stack's gradient), and their
  bytes."""
  M = cfg.train.grad_accum
  lines = []
  for key, label in (("params", "params"), ("loop_sums", "grads / accumulation"),
                     ("optimizer", "optimizer (ZeRO-1)")):
    lines.append(f"  {label:<24}{st[key] / GB:>10.2f}")
    if key == "loop_sums" and st["loop_sums"] != st["grads"]:
      lines[-1] += (f"   the pipeline's float32 sums, each weight's as its loop holds it "
                    f"(reduce-scattered once a step into ZeRO-1's slices: "
                    f"{st['grads'] / GB:.2f})")
  if st["optimizer_host"]:
    lines[-1] = (f"  {'optimizer on device':<24}{st['optimizer'] / GB:>10.2f}   (not mirroring "
                 f"a parameter: QK-Clip's record, counts)")
  opt_all = st["optimizer"] + st["optimizer_host"]
  if st["optimizer_unsplit"] > max(0.01 * opt_all, 1e6):
    lines.append(f"    of which {st['optimizer_unsplit'] / GB:.2f} GB is not split over its whole "
                 f"data-parallel group (data = {mesh['data']}): no dimension of "
                 f"{', '.join(st['optimizer_unsplit_leaves'][:3])} is divisible by it (ZeRO-1 "
                 f"keeps those shards whole over the axes that do not divide)")
  states = st["params"] + st["loop_sums"] + st["optimizer"]
  lines.append(f"  {'all states on device':<24}{states / GB:>10.2f}   "
               f"(from parallel.state_shardings)")
  if st["loop_copy"]:
    lines.append(f"  {'weights in the loop':<24}{st['loop_copy'] / GB:>10.2f}   those stored "
                 f"split only to save memory, gathered once a step as the pipeline opens "
                 f"(pipeline.inner_specs)")
    states += st["loop_copy"]
  if st["cast_copy"]:
    lines.append(f"  {'weights in ' + cfg.model.dtype:<24}{st['cast_copy'] / GB:>10.2f}   cast once "
                 f"per step for its {M} microbatches (train.cast_once)")
    states += st["cast_copy"]
  if st["loop_grad"]:
    lines.append(f"  {'a stack gradient':<24}{st['loop_grad'] / GB:>10.2f}   the largest stack's "
                 f"gradient in {cfg.model.dtype}, as the layers' scan returns it for a "
                 f"microbatch, before it joins the accumulator")
    states += st["loop_grad"]
  return lines, states


def report(config, mesh, seq_len=None, micro_batch=None, grad_bytes=4, *, virtual_stages=None,
           microbatches=None, remat=None, storage=None, param_dtype=None, name=None,
           platform="gpu", est: Estimate | None = None) -> str:
  """The per-device table of a preset name or a full config on `mesh` ({axis: size});
  `est`: its `estimate`, where the caller has it already."""
  name = name or (config if isinstance(config, str) else "config")
  est = est or estimate(config, mesh, seq_len, micro_batch, grad_bytes,
                        virtual_stages=virtual_stages, microbatches=microbatches, remat=remat,
                        storage=storage, param_dtype=param_dtype, platform=platform)
  cfg, seq_len, micro_batch, geometry, rounded, st, acts = est
  P = mesh["pipeline"]
  act, used = acts.device, acts.settings
  n = math.prod(mesh.values())
  lines = [f"{name} on mesh {', '.join(f'{a}={mesh.get(a, 1)}' for a in MESH_AXES)} ({n} devices), "
           f"params {cfg.model.param_dtype}, grads {grad_bytes} B, seq_len {seq_len}, "
           f"micro_batch {micro_batch} ({geometry})",
           f"{'per device':<26}{'GB':>10}"]
  state_lines, states = _state_lines(cfg, st, mesh)
  lines += state_lines
  offloaded = "" if not acts.host else (
      ", the stage residuals of the microbatches in flight in host memory (model.offload)"
      if P > 1 else ", the layers' saved activations in host memory (model.offload)")
  lines.append(f"  {'activations':<24}{act / GB:>10.2f}   remat={used['remat']}, "
               f"attention={used['attention_impl']}, storage={used['storage']}, "
               f"{used['platform']} kernels (traced){offloaded}")
  lines.append(f"  {'total':<24}{(states + act) / GB:>10.2f}")
  if st["optimizer_host"]:
    lines.append(f"  {'host memory':<24}{st['optimizer_host'] / GB:>10.2f}   ZeRO-1 optimizer "
                 f"states (optimizer.host_state: on the device during the update only)")
  if st["optimizer_host"] or est.update > est.loop:
    brought = " brought from host (step.on_device)" if st["optimizer_host"] else ""
    lines.append(f"  {'during the update':<24}{est.update / GB:>10.2f}   params, gradient "
                 f"slices, the states{brought}, Muon's gathered momenta "
                 f"{st['muon_gather'] / GB:.2f}")
    lines.append(f"  {'peak':<24}{est.device / GB:>10.2f}   "
                 f"{'the update' if est.update > est.loop else 'the gradient loop'}")
  # XLA's check is these plus its heap's packing (README: none of XLA:TPU's algorithms packs
  # K2's step tighter), which no count of the program's values can give
  lines.append("  (bytes held; XLA's heap adds its packing: --compile TOPOLOGY prints XLA's "
               "figure)")
  if acts.host and P > 1:
    lines.append(f"  {'host activations':<24}{acts.host / GB:>10.2f}   stage residuals waiting "
                 f"for their backward (k2jax.parallel.executor.Slots); a tick moves "
                 f"{acts.moved / GB:.2f} GB there and reads back what its backward needs")
  elif acts.host:
    lines.append(f"  {'host activations':<24}{acts.host / GB:>10.2f}   what the remat policy "
                 f"keeps, offloaded by each layer (model.offload); a layer moves up to "
                 f"{acts.moved / GB:.2f} GB there and reads it back in its backward")
  if P > 1:
    lines.append(_pipeline_line(cfg, mesh, seq_len, platform, acts, rounded))
  group = mesh["pipeline"] * mesh["expert"]
  tb = (st["total_params"] + st["total_grads"]) / 1e12
  lines.append(f"params + grads of the whole model: {tb:.2f} TB over a {group}-device "
               f"model-parallel group: {tb * 1e12 / group / GB:.1f} GB per device on average, "
               f"{(st['params'] + st['grads_whole']) / GB:.1f} GB on the fullest")
  lines.append("for scale, report 2.4.2 (K2 on 256 GPUs): ~6 TB of bf16 params + fp32 grad "
               "buffer, ~30 GB per GPU for all states")
  return "\n".join(lines)


# devices per host by platform: a TPU v4 / v5p VM host has 4 chips, a GPU node 8
CHIPS_PER_HOST = {"tpu": 4, "gpu": 8}


def loading(cfg, mesh, chips_per_host: int) -> str:
  """What starting `cfg` (a full config, as `estimate` returns it) from published weights
  costs each host: the bytes it reads and the buffers it holds, asked of the loader itself
  (k2jax.interop.hf.load_plan) for the trainer's stored layout on this mesh."""
  from k2jax.interop import hf
  sp = layout.of(cfg)
  stored = layout.stored_model(cfg.model, sp)
  amesh = AbstractMesh(tuple(mesh.get(a, 1) for a in MESH_AXES), MESH_AXES)
  param_specs = model.param_specs(stored)
  shardings = jax.tree_util.tree_flatten_with_path(
      parallel_param_shardings(param_specs, amesh))[0]
  specs = {tuple(k.key for k in p): s.spec for p, s in shardings}
  n = math.prod(mesh.get(a, 1) for a in MESH_AXES)
  chips = min(chips_per_host, n)
  hosts = (np.arange(n) // chips).reshape([mesh.get(a, 1) for a in MESH_AXES])
  held = sum(int(np.prod(s.shard_shape(p.shape))) for (_, s), p in zip(
      shardings, jax.tree.leaves(param_specs, is_leaf=model_spec.is_spec)))
  held *= np.dtype(cfg.model.param_dtype).itemsize * chips
  lines = [f"starting from published weights (sft / rl --init HF_DIR; k2jax.interop.hf.load), "
           f"per host of {chips} devices ({n // chips} hosts), params {cfg.model.param_dtype}:"]
  for label, kw in (("FP8 linears (as Kimi-K2-Instruct)", dict(fp8=True)),
                    ("INT4 experts (as K2-Thinking)", dict(int4=True))):
    f = hf.load_plan(cfg.model, specs, mesh, hosts, layout=sp, **kw)
    r = np.array(list(f["read"].values()))
    lines.append(f"  {label}, {f['file'] / 1e12:.2f} TB of files: each host reads "
                 f"{r.max() / GB:.2f} GB (least {r.min() / GB:.2f}), holds {held / GB:.1f} GB "
                 f"of params on its devices, at most {f['block'] / 1e6:.1f} MB in one host "
                 f"buffer; a device receives at most {f['chunk'] / 1e6:.1f} MB of raw codes "
                 f"at once beside its params")
  return "\n".join(lines)


def main(argv=None):
  p = argparse.ArgumentParser(prog="python -m k2jax.plan", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", required=True,
                 help=f"preset ({', '.join(configs.PRESETS)}) or config file; override any "
                 "value with --config.KEY=VALUE")
  p.add_argument("--mesh", default=None,
                 help="pipeline=P,expert=E,data=D (missing axes = 1; default: the config's)")
  p.add_argument("--devices", type=int, default=None, help="total devices; fills in data")
  p.add_argument("--seq_len", type=int, default=None)
  p.add_argument("--micro_batch", type=int, default=None,
                 help="sequences per device per microbatch (default: the config's, "
                 "train.batch_size / train.grad_accum over the devices the batch splits over)")
  p.add_argument("--param_dtype", choices=("bfloat16", "float32"), default=None,
                 help="parameter dtype (default: the config's model.param_dtype)")
  p.add_argument("--grad_bytes", type=int, default=4)
  p.add_argument("--virtual_stages", type=int, default=None,
                 help="pipeline stages per device (default: the config's)")
  p.add_argument("--microbatches", type=int, default=None,
                 help="pipeline microbatches (train.grad_accum; default the config's)")
  p.add_argument("--remat", choices=("none", "selective", "full"), default=None)
  p.add_argument("--platform", choices=("gpu", "tpu", "cpu"), default=None,
                 help="whose `auto` kernels the activation figure traces (default gpu; with "
                 "--compile, the target's)")
  p.add_argument("--storage", choices=("model", "fp8"), default=None,
                 help="activation storage of MoE / SwiGLU inputs (report 2.4.3)")
  p.add_argument("--chips_per_host", type=int, default=None,
                 help="devices per host, for what loading weights costs each host (default "
                 "4 on tpu, 8 on gpu)")
  p.add_argument("--compile", metavar="TOPOLOGY", default=None,
                 help="also ask the compiler: XLA's per-device memory of this train step "
                 "compiled for a TPU topology (v5p:8x16x16; libtpu: pip install -e "
                 "\".[tpu]\"; plan then traces TPU kernels) or `local`, read from its buffer "
                 "assignment (k2jax.compile --memory_only), beside plan's count")
  try:
    from k2jax.tools.params import parse_config
    args, config, overrides = parse_config("k2jax.plan", p, argv, positive=(
        "devices", "seq_len", "micro_batch", "grad_bytes", "virtual_stages", "microbatches",
        "chips_per_host"))
    target = None
    if args.compile:   # plan the mesh k2jax.compile fits to the chips, with their kernels
      try:
        target = xla_target.topology_devices(args.compile)
      except ValueError as e:
        raise ValueError(str(e).replace("--topology", "--compile", 1)) from None
      if args.devices not in (None, len(target)):
        raise ValueError(f"--devices {args.devices} with --compile {args.compile}: the "
                         f"topology has {len(target)} chips; leave --devices out")
      args.devices = len(target)
      args.platform = args.platform or target[0].platform
    args.platform = args.platform or "gpu"
    if args.mesh is None:
      m = config.mesh
      args.mesh = ",".join(f"{a}={m.get(a, 1)}" for a in MESH_AXES
                           if a != "data" or args.devices is None)
    mesh = parse_mesh(args.mesh, args.devices)
    if args.microbatches is not None and args.microbatches < mesh["pipeline"]:
      raise ValueError(f"--microbatches {args.microbatches}: must be >= pipeline "
                       f"({mesh['pipeline']})")
    if args.compile and args.micro_batch is not None:
      raise ValueError("--micro_batch with --compile: the compiled step takes its geometry "
                       "from the config (set --config.train.batch_size / grad_accum)")
    if args.compile and args.grad_bytes != 4:
      raise ValueError("--grad_bytes with --compile: the compiled step accumulates float32 "
                       "gradients")
    kw = dict(virtual_stages=args.virtual_stages, microbatches=args.microbatches,
              remat=args.remat, storage=args.storage, param_dtype=args.param_dtype,
              platform=args.platform)
    est = estimate(config, mesh, args.seq_len, args.micro_batch, args.grad_bytes, **kw)
    print(report(config, mesh, args.seq_len, args.micro_batch, args.grad_bytes,
                 name=args.config, est=est, **kw))
    print(loading(est.cfg, mesh, args.chips_per_host or CHIPS_PER_HOST.get(args.platform, 1)))
  except ValueError as e:
    print(f"k2jax.plan: error: {e}", file=sys.stderr)
    raise SystemExit(2)
  if args.compile:
    print(compiled_beside(args, overrides, mesh, est, target))


def compiled_beside(args, overrides, mesh, est, devices) -> str:
  """XLA's figures of the same step (k2jax.tools.xla_target.until_buffer_assignment: its buffer
  assignment, where its out-of-memory check runs) beside `est`'s: the compiler is the truth
  for memory; plan's count says where it goes. Exits 1 with XLA's one line
  where it refuses the step."""

  # the step plan counted: its mesh, and its microbatches where plan rounded them for it
  settings = [f"--config.mesh.{a}={mesh.get(a, 1)}" for a in MESH_AXES]
  settings.append(f"--config.train.grad_accum={est.cfg.train.grad_accum}")
  for flag, key in (("seq_len", "train.seq_len"),
                    ("virtual_stages", "mesh.virtual_stages"), ("remat", "model.remat"),
                    ("storage", "model.activation_storage"),
                    ("param_dtype", "model.param_dtype")):
    if getattr(args, flag) is not None:
      settings.append(f"--config.{key}={getattr(args, flag)}")
  device, host, seconds = xla_target.until_buffer_assignment(
      ["--config", args.config, "--topology", args.compile, *overrides, *settings])
  if device is None:
    print(f"k2jax.plan: {host.removeprefix('k2jax.compile: ')}", file=sys.stderr)
    raise SystemExit(1)
  hbm = xla_target.hbm_bytes(devices[0])
  lines = [f"compiled for {args.compile} ({devices[0].device_kind}), XLA's buffer assignment "
           f"in {seconds:.0f} s:",
           f"  {'XLA per device':<24}{'GB':>10}{'plan GB':>10}{'XLA / plan':>12}",
           f"  {'arguments (states)':<24}{device['arguments'] / GB:>10.2f}",
           f"  {'temporary heap':<24}{device['heap'] / GB:>10.2f}",
           f"  {'peak (its OOM check)':<24}{device['check'] / GB:>10.2f}{est.device / GB:>10.2f}"
           f"{device['check'] / est.device:>12.2f}",
           f"  {'host':<24}{host['peak'] / GB:>10.2f}{est.host / GB:>10.2f}" + (
               f"{host['peak'] / est.host:>12.2f}" if est.host else "")]
  if device["thread_local"]:
    lines.append(f"  {'thread-local (host-run)':<24}{device['thread_local'] / GB:>10.2f}   "
                 "buffers of the part XLA runs on the host (the update beside host states)")
  if hbm:   # the verdict as k2jax.compile gives it: on the whole device memory space
    lines.append(f"  HBM {hbm / GB:.1f} GB per chip: XLA's peak is {device['check'] / hbm:.0%} "
                 f"of it, {device['peak'] / hbm:.0%} with the thread-local buffers "
                 f"({xla_target.verdict(device['peak'], hbm)})")
  lines.append("  XLA's peak is the figure of record; plan's lines above say where it goes "
               "(what they do not count: XLA's layout copies and transposes of weights, the "
               "expert exchange's buffers beyond the residuals, heap fragmentation)")
  return "\n".join(lines)


if __name__ == "__main__":
  main()
