"""Runs in a subprocess whose XLA_FLAGS fix the simulated device count (tests/test_parallel.py,
tests/test_pipeline_meshes.py).

    python -m tests.parallel_worker meshes OUT D1xE1 D2xE2 -- CLI_ARGS...   train on each mesh
    python -m tests.parallel_worker zero1                                    shard sizes
    python -m tests.parallel_worker context_meshes DxCxE ...       context parallelism
"""

import functools
import json
import os
import re
import sys

import jax
import numpy as np


def meshes(out, *rest):
  """Train with the k2jax.train command line CLI_ARGS on each mesh spec: DxE (data x
  expert) or PxDxE (pipeline x data x expert), optionally /bB (train.batch_size B), /aA
  (train.grad_accum A), /cC (mesh.context C), /vV (mesh.virtual_stages V), /sNAME (mesh.pipeline_schedule),
  /kMODE (mesh.pipeline_skip), /o (model.offload: the pipeline's residual slots in host
  memory) and /g (zbh1's table built for stages of equal cost, which runs on its grid of one
  task per device and tick, schedules._grid; the tiny model's traced costs pick 1F1B's
  ticks); /fFAULT injects a gradient fault (`_faulty_grads`: the tests show their state
  comparison sees it). Each run's final train state is saved as it is checkpointed (the
  logical layout) and written leaf by leaf to WORKDIR/state.npz (`_save_state`)."""
  import contextlib
  from unittest import mock
  from k2jax.training import metrics, train
  from k2jax.training import step as step_lib
  from k2jax.parallel import pipeline, schedules
  from orbax.checkpoint._src.serialization import replica_slices
  sep = rest.index("--")
  specs, cli = rest[:sep], list(rest[sep + 1:])
  # Each replicated array orbax saves is cut into one slice per replica, each slice an eager
  # jit XLA:CPU compiles (~320 programs a pipelined mesh, about a fifth of its run); one
  # replica writing each shard whole saves the same bytes. (test_parallel's other
  # checkpoint tests save as a run does.)
  sliced = replica_slices.get_replica_slices
  unsliced = mock.patch.object(replica_slices, "get_replica_slices",
                               lambda arr, replica_id, _, *a, **k: sliced(arr, replica_id, False,
                                                                         *a, **k))
  base, _ = train.parse(["k2jax.train", *cli, f"--workdir={out}"])
  result = {}
  for s in specs:
    mesh, *opts = s.split("/")
    sizes = [1] * (3 - len(mesh.split("x"))) + list(map(int, mesh.split("x")))
    config = base.copy_and_resolve_references()
    config.mesh.update(dict(zip(("pipeline", "data", "expert"), sizes)))
    patch = contextlib.nullcontext()
    for o in opts:
      if o[0] == "v":
        config.mesh.virtual_stages = int(o[1:])
      elif o[0] == "s":
        config.mesh.pipeline_schedule = o[1:]
      elif o[0] == "k":
        config.mesh.pipeline_skip = o[1:]
      elif o == "o":
        config.model.offload = True
      elif o[0] == "c":
        config.mesh.context = int(o[1:])
      elif o[0] == "f":
        patch = mock.patch.object(step_lib, "_grads", _faulty_grads(step_lib._grads, o[1:]))
      elif o == "g":
        def equal_stages(mcfg, P, V, M, schedule, *args, per_device=None, **kwargs):
          tab = schedules.build(schedule, P, V, M, None, per_device is not False)
          assert tab.grid, (P, V, M)
          return tab
        patch = mock.patch.object(pipeline, "schedule_table", equal_stages)
      else:
        config.train[{"b": "batch_size", "a": "grad_accum"}[o[0]]] = int(o[1:])
    # one checkpoint, of the final state: what _save_state reads back
    config.train.checkpoint_every = config.train.steps
    workdir = f"{out}/{s.replace('/', '_')}"
    with patch, unsliced:
      train.train(config, workdir)
    result[s] = {r["step"]: [r["loss"], r["max_logit"]] for r in metrics.read(workdir)}
    _save_state(workdir)
  print("RESULT " + json.dumps(result))


def _faulty_grads(grads_fn, fault):
  """`k2jax.training.step._grads` with a fault a pipeline or mesh bug could make: "2x" doubles the
  gradient of the MoE experts' down-projections (every update MuonClip makes is the same:
  Muon orthogonalizes its momentum, whatever its scale), "drop" leaves the first of the
  microbatches out of the gradient (the loss still counts it)."""
  import jax.numpy as jnp

  def faulty(mcfg, params, batch, grad_accum, tab=None, skip=None, reduce_to=None):
    g, loss, aux = grads_fn(mcfg, params, batch, grad_accum, tab, skip, reduce_to)
    if fault == "2x":
      hit = lambda path: "['experts']['down']" in jax.tree_util.keystr(path)
      assert any(hit(p) for p, _ in jax.tree_util.tree_flatten_with_path(g)[0])
      g = jax.tree_util.tree_map_with_path(lambda p, x: 2 * x if hit(p) else x, g)
    elif fault == "drop":
      assert tab is None and grad_accum > 1, "one device, several microbatches"
      # microbatch i holds rows i, i + A, ... (step.microbatches): drop the rows of i = 0
      rest = jax.tree.map(lambda x: x.reshape((-1, grad_accum) + x.shape[1:])[:, 1:].reshape(
          (-1,) + x.shape[1:]), batch)
      g = grads_fn(mcfg, params, rest, grad_accum - 1, tab, skip, reduce_to)[0]
    else:
      raise ValueError(f"unknown fault {fault!r}")
    return jax.tree.map(lambda x: x.astype(jnp.float32), g), loss, aux
  return faulty


def _save_state(workdir):
  """The run's newest checkpoint (the logical layout, whatever the mesh), every leaf of its
  train state (params, optimizer moments and master weights, QK-Clip's record, counters) as
  WORKDIR/state.npz, keyed by tree path. Muon's and Adam's first moments are running sums of
  the gradients, so a wrong gradient leaf shows in its moment even where MuonClip's update,
  which ignores the gradient's scale, hides it from the losses."""
  from k2jax.training.checkpoint import load_state
  _, state, _ = load_state(workdir)
  leaves = jax.tree_util.tree_flatten_with_path(state)[0]
  np.savez(os.path.join(workdir, "state.npz"),
           **{jax.tree_util.keystr(p): np.asarray(a) for p, a in leaves})


def zero1():
  from k2jax import configs, model, optim, parallel
  from k2jax.training.step import init_state
  cfg = configs.get_config("tiny")
  cfg.mesh.data = 8
  mesh = parallel.make_mesh(cfg.mesh)
  tx = optim.optimizer(cfg)
  abstract = jax.eval_shape(functools.partial(init_state, cfg, tx), jax.random.key(0))
  sh = parallel.state_shardings(model.param_specs(cfg.model), mesh, abstract, tx)

  def per_device(tree, shardings):
    return sum(int(np.prod(s.shard_shape(a.shape))) * a.dtype.itemsize
               for a, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)))

  def total(tree):
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree))

  print("RESULT " + json.dumps({
      "params_per_device": per_device(abstract.params, sh.params),
      "params_total": total(abstract.params),
      "opt_per_device": per_device(abstract.opt_state, sh.opt_state),
      "opt_total": total(abstract.opt_state),
      "param_specs_mention_data": any("data" in str(s.spec) for s in jax.tree.leaves(sh.params))}))


def reduce_into():
  """pipeline._reduce on fresh random sums [lead, ...] of a data 2 x expert 4 mesh, into
  ZeRO-1-like shardings; and parallel.grad_shardings against the optimizer states that
  mirror each parameter (tiny on data 8)."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  from k2jax import configs, model, optim, parallel
  from k2jax.parallel import pipeline
  from k2jax.training.step import init_state
  mesh = jax.make_mesh((2, 4), ("data", "expert"))
  rng = np.random.default_rng(7)
  out = {}
  cases = {   # name: (global shape, its spec, lead axes, target spec)
      "scatter_on_expert_dim": ((2, 8, 6), P("data", "expert", None), ("data",),
                                P(("expert", "data"), None)),
      "scatter_on_free_dim": ((2, 8, 6), P("data", "expert", None), ("data",),
                              P("expert", "data")),
      "both_leads": ((8, 8, 6), P(("data", "expert"), None, None), ("data", "expert"),
                     P(("expert", "data"), None)),
      "both_leads_moved": ((8, 8, 16), P(("data", "expert"), None, None), ("data", "expert"),
                           P(("expert", "data"), None)),
      "summed_not_scattered": ((2, 8, 6), P("data", "expert", None), ("data",),
                               P("expert", None)),
      "lead_not_last": ((2, 8, 6), P("data", "expert", None), ("data",),
                        P(("data", "expert"), None)),
  }
  with jax.set_mesh(mesh):
    for name, (shape, spec, lead, target) in cases.items():
      host = rng.standard_normal(shape).astype(np.float32)
      g = jax.device_put(host, NamedSharding(mesh, spec))
      r = jax.jit(lambda g: pipeline._reduce(g, lead, NamedSharding(mesh, target)))(g)
      if r is None:
        out[name] = None
        continue
      out[name] = {"rel": _rel(r, host.sum(0)),
                   "spec_ok": r.sharding.is_equivalent_to(NamedSharding(mesh, target), r.ndim)}
  cfg = configs.get_config("tiny")
  cfg.mesh.data = 8
  cfg.model.param_dtype = "bfloat16"     # float32 master weights in the optimizer state
  m8 = parallel.make_mesh(cfg.mesh)
  tx = optim.optimizer(cfg)
  abstract = jax.eval_shape(functools.partial(init_state, cfg, tx), jax.random.key(0))
  specs = model.param_specs(cfg.model)
  sh = parallel.state_shardings(specs, m8, abstract, tx)
  grads = parallel.grad_shardings(specs, m8, abstract.params)
  master = sh.opt_state.master
  out["grad_equals_master"] = all(
      g.is_equivalent_to(m, len(a.shape)) for g, m, a in zip(
          jax.tree.leaves(grads), jax.tree.leaves(master), jax.tree.leaves(abstract.params)))
  out["grad_split_over_data"] = sum("data" in str(g.spec) for g in jax.tree.leaves(grads))
  print("RESULT " + json.dumps(out))


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                               recv_sizes, *, axis_name):
  """lax.ragged_all_to_all as its docstring defines it, built from a dense all_to_all (XLA:CPU
  has no ragged one): slice j of my operand (input_offsets[j], send_sizes[j] rows) lands on
  device j at output_offsets[j]; everything else of `output` is kept."""
  import jax.numpy as jnp
  n = operand.shape[0]
  ep = jax.lax.axis_size(axis_name)
  r = jnp.arange(n)
  src = jnp.clip(input_offsets[:, None] + r[None, :], 0, n - 1)            # [ep, n]
  slots = jnp.where((r[None, :] < send_sizes[:, None]).reshape((ep, n) + (1,) * (operand.ndim - 1)),
                    operand[src], jnp.zeros((), operand.dtype))
  got = jax.lax.all_to_all(slots, axis_name, 0, 0, tiled=True)           # slot i: from device i
  offs = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # where i wanted it
  dst = jnp.where(r[None, :] < recv_sizes[:, None], offs[:, None] + r[None, :], output.shape[0])
  return output.at[dst.reshape(-1)].set(got.reshape((ep * n,) + operand.shape[1:]), mode="drop")


def ep_layer(mesh, **kwargs):
  """run(p, x, idx, w): sharded_routed_experts(**kwargs) over the expert axis of a data x expert
  `mesh`, tokens split over both (ragged transport emulated: XLA:CPU has none)."""
  from jax.sharding import PartitionSpec as P
  from k2jax.model import expert_parallel
  fn = functools.partial(expert_parallel.sharded_routed_experts, axis="expert", sync_axes=("data",),
                         ragged_all_to_all=emulated_ragged_all_to_all, **kwargs)
  batch = P(("data", "expert"))
  return jax.shard_map(lambda p, x, i, w: fn(p, x, i, w), mesh=mesh,
                       in_specs=(P("expert"), batch, batch, batch), out_specs=batch)


def ep_transports(part="0/1"):
  """Every expert-parallel transport on a data=2 x expert=4 mesh against a float64 per-token
  reference: the output and the gradients of sum(y r) for x, the combine weights and the
  three expert matrices, for an even routing (every shard receives the balanced load: the
  residuals the forward kept), random, skewed and all-to-one routings (larger buffers: the
  backward recomputes the exchange); with the layer's remat policies around it and FP8
  storage. Returns the largest relative error per case; `part` "i/n": the i-th of n
  interleaved shares of the cases (the test runs the shares in parallel processes)."""
  import jax.numpy as jnp
  from k2jax import configs, parallel
  from k2jax.model.remat import remat_policy
  cfg = configs.get_config("tiny")
  cfg.mesh.update(dict(data=2, expert=4))
  m = cfg.model
  mesh = parallel.make_mesh(cfg.mesh)
  E, d, f, k, N = m.n_routed_experts, m.hidden_size, m.moe_intermediate_size, 2, 8 * 12
  seed = int.from_bytes(os.urandom(4), "little")     # fresh inputs every run
  keys = jax.random.split(jax.random.key(seed), 7)
  p = {n: 0.2 * jax.random.normal(kk, s) for n, kk, s in
       (("gate", keys[0], (E, d, f)), ("up", keys[1], (E, d, f)), ("down", keys[2], (E, f, d)))}
  x = jax.random.normal(keys[3], (N, d))
  w = jax.random.uniform(keys[4], (N, k))
  r = jax.random.normal(keys[6], (N, d))
  routings = {
      "even": (jnp.arange(N * k, dtype=jnp.int32) % E).reshape(N, k),
      "random": jax.random.randint(keys[5], (N, k), 0, E),
      "skewed": jnp.stack([jnp.zeros((N,), jnp.int32) + 3, jnp.arange(N) % E], 1),
      "all_to_one": jnp.full((N, k), 13, jnp.int32).at[:, 1].set(12),
  }
  p64 = {n: np.asarray(v, np.float64) for n, v in p.items()}
  x64, w64, r64 = (np.asarray(a, np.float64) for a in (x, w, r))

  def e4m3(v):
    """v rounded through FP8-E4M3 in tiles of 128 of the last dim, scale max |tile| / 448
    (ml_dtypes' float8, not ours)."""
    import ml_dtypes
    t = np.pad(v, [(0, 0), (0, -v.shape[1] % 128)]).reshape(v.shape[0], -1, 128)
    sc = np.max(np.abs(t), -1, keepdims=True) / 448
    sc = np.where(sc > 0, sc, 1.0)
    return ((t / sc).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * sc).reshape(
        v.shape[0], -1)[:, :v.shape[1]]

  def reference(idx, fp8=False):
    """y and the gradients of sum(y r), written out per assignment in float64; with `fp8`
    the backward pass reads the expert inputs and SwiGLU inputs rounded through E4M3."""
    tok, e = np.repeat(np.arange(N), k), np.asarray(idx).reshape(-1)
    a, wa = x64[tok], w64.reshape(-1)
    g = np.einsum("ad,adf->af", a, p64["gate"][e])
    u = np.einsum("ad,adf->af", a, p64["up"][e])
    sig = 1 / (1 + np.exp(-g))
    o = np.einsum("af,afd->ad", g * sig * u, p64["down"][e])
    y = np.zeros((N, d))
    np.add.at(y, tok, wa[:, None] * o)
    if fp8:
      a, g, u = e4m3(a), e4m3(g), e4m3(u)
      sig = 1 / (1 + np.exp(-g))
    h = g * sig * u
    do = wa[:, None] * r64[tok]
    dh = np.einsum("ad,afd->af", do, p64["down"][e])
    du, dg = dh * g * sig, dh * u * sig * (1 + g * (1 - sig))
    grads = {"w": np.sum(np.einsum("af,afd->ad", h, p64["down"][e]) * r64[tok],
                         -1).reshape(N, k), "x": np.zeros((N, d))}
    np.add.at(grads["x"], tok, np.einsum("af,adf->ad", dg, p64["gate"][e])
              + np.einsum("af,adf->ad", du, p64["up"][e]))
    for name, outer in (("gate", np.einsum("ad,af->adf", a, dg)),
                        ("up", np.einsum("ad,af->adf", a, du)),
                        ("down", np.einsum("af,ad->afd", h, do))):
      grads[name] = np.zeros_like(p64[name])
      np.add.at(grads[name], e, outer)
    return y, grads

  out = {}
  stored = [(t, "none", False) for t in ("padded", "bucketed", "ragged")]
  stored += [("ragged", "selective", False), ("bucketed", "full", False),
             ("bucketed", "selective", True)]
  # skewed and all-to-one routing overflow the smallest capacity (the recompute path);
  # padded has one capacity, the worst case, and keeps it
  others = {"skewed": ("bucketed", "none", False), "all_to_one": ("ragged", "selective", False),
            "random": ("padded", "none", False)}
  share, shares = map(int, part.split("/"))
  jobs = [(name, t) for name in routings for t in (stored if name == "even" else [others[name]])]
  only = os.environ.get("K2JAX_EP_ONLY")       # a debugging filter: one case's name prefix
  for name, (transport, remat, fp8) in jobs[share::shares]:
    if only and not f"{name}/{transport}/{remat}/{'fp8' if fp8 else 'exact'}".startswith(only):
      continue
    idx = routings[name]
    y64, g64 = reference(idx)
    run = ep_layer(mesh, transport=transport, fp8_storage=fp8)
    policy = remat_policy(remat)
    if policy is not None:
      run = jax.checkpoint(run, policy=policy)
    def both(p, x, w):
      y, vjp = jax.vjp(lambda p, x, w: run(p, x, idx, w), p, x, w)
      return y, vjp(r)
    y, grads = jax.jit(both)(p, x, w)
    got = dict(grads[0], x=grads[1], w=grads[2])
    case = f"{name}/{transport}/{remat}/{'fp8' if fp8 else 'exact'}"
    out[case] = dict(y=_rel(y, y64), **{n: _rel(got[n], g64[n]) for n in g64})
    if fp8:
      # Against the E4M3-rounded reference, entry by entry: the share of each gradient's
      # entries off by more than 1e-4 of its largest. Where f32 and f64 round a value lying
      # within f32 error of an E4M3 midpoint to neighbouring numbers (16% of draws here),
      # the gradient entries that value feeds differ by up to ~1e-2 (a row of x's, a column
      # of an expert matrix's): an absolute norm bound fails by chance, this share moves by
      # 1-2%. The same share for unrounded values (what skipping FP8 would give) is the
      # check's power.
      rounded = reference(idx, fp8=True)[1]
      off = lambda got, want: float(np.mean(np.abs(np.asarray(got, np.float64) - want)
                                            > 1e-4 * np.max(np.abs(want))))
      out[case + "/rounded"] = {n: off(got[n], rounded[n]) for n in g64}
      out[case + "/unrounded"] = {n: off(g64[n], rounded[n]) for n in g64}
  print("RESULT " + json.dumps(out))


def param_forms(params):
  """[(shape, path)]: every parameter of a params tree as a device can see it: its global
  shape, its shard on the mesh (as stored), and with the leading dimensions of either
  dropped (one layer of a stack, one expert, one row): the weight-shaped operands a
  collective inside the pipeline's loop must not have."""
  forms = []
  for path, a in jax.tree_util.tree_flatten_with_path(params)[0]:
    name = jax.tree_util.keystr(path)
    for shape in {tuple(a.shape), tuple(a.sharding.shard_shape(a.shape))}:
      forms += [(shape[k:], name) for k in range(len(shape)) if shape[k:]]
  return forms


def tick_collectives():
  """Every collective inside the tick loop of the pipelined step on pipeline 2 x data 2 x
  expert 2 with phases skipped per device (compiled, not run), as
  experiments/tick_collectives.py reads them: op, bytes, the parameters it is shaped like,
  mesh axes spanned, operand shapes; and the same for the collectives after the loop (the
  gradient reductions, which are weight-shaped). Weight shapes come from every parameter of
  the state the step takes (`param_forms`; each split by 2, 4, 8 as the mesh could split
  it, tick_collectives.weight_shapes)."""
  from unittest import mock
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "experiments"))
  import pipeline_hlo
  import tick_collectives
  mesh = (2, 2, 2)
  compiled, _, state, _, _, _ = pipeline_hlo.build(mesh, seq=tick_collectives.SEQ,
                                                   skip="device")
  names = {}   # {weight shape: the parameters it is a form of}
  for f, name in param_forms(state.params):
    for shape in tick_collectives.weight_shapes([f]):
      names.setdefault(shape, set()).add(name)
  weights = dict.fromkeys(names, 0)
  hlo = compiled.as_text()
  comps, inside = pipeline_hlo.tick_loop(hlo)

  def rows(where):
    with mock.patch.object(pipeline_hlo, "tick_loop", lambda _: (comps, where)):
      found = tick_collectives.loop_collectives(hlo, weights, mesh=mesh)
    return [[op, b, sorted({n for s in re.findall(r"\[([\d, ]*)\]", shapes)
                            for n in names.get(tuple(int(x) for x in s.split(",")
                                                     if x.strip() not in ("", "1")), ())}),
             list(axes), shapes] for op, b, _, shapes, _, axes in found]
  print("RESULT " + json.dumps({"rows": rows(inside), "after": rows(set(comps) - inside),
                                "params": sorted({n for v in names.values() for n in v})}))


def pipeline_collectives():
  """Bytes the compiled train step moves between pipeline devices (4 x 2 virtual x expert 2,
  1 dense + 8 MoE layers), read from its HLO by experiments/pipeline_hlo.py."""
  import os
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "experiments"))
  import pipeline_hlo
  from k2jax import model
  from k2jax.model import spec
  from k2jax.training import step as step_lib
  from k2jax.parallel import layout
  compiled, mesh, state, batch, ticks, stack = pipeline_hlo.build((4, 1, 2))
  out, loop, rows = pipeline_hlo.pipeline_collectives(compiled.as_text(), (4, 1, 2), ticks)
  # evaluation (the pipeline's F phases and head phases only) against the unpipelined loss
  # of the same params, their stack back in logical order
  c = pipeline_hlo.tiny_config((4, 1, 2))
  with jax.set_mesh(mesh):
    ce, n = jax.jit(functools.partial(step_lib.eval_step, c))(state.params, batch)
  sp = layout.of(c)
  logical = dict(jax.device_get(state.params))
  logical["moe_layers"] = jax.tree.map(lambda a: layout.to_logical(sp, a), logical["moe_layers"])
  host = {k: np.asarray(v) for k, v in jax.device_get(batch).items()}
  ref, ref_n, _ = step_lib.lm_loss(c.model, logical, host)
  pipeline_hlo.build((4, 1, 2), param_dtype="bfloat16")   # K2's bf16 params compile too
  # f32 bytes of the parameters outside the pipelined stack that every pipeline device holds
  # (embedding, dense layers, final norm; not the head, whose columns are split over them)
  specs = model.param_specs(pipeline_hlo.tiny_config((4, 1, 2)).model)
  rest = sum(4 * spec.size(s) for k, v in specs.items() if k not in ("moe_layers", "lm_head")
             for s in jax.tree.leaves(v, is_leaf=spec.is_spec))
  print("RESULT " + json.dumps({"outside": out, "loop": loop, "stack": stack, "ticks": ticks,
                                "eval": [float(ce), float(n)], "eval_ref": [float(ref),
                                                                            float(ref_n)],
                                "rest": rest, "outside_ops": sorted({r[1] for r in rows
                                                                     if not r[0]}),
                                "loop_ops": sorted({r[1] for r in rows if r[0]})}))


def lower(platform, moe_impl, attention_impl, shape="tiny"):
  """Lower (no compile) the pipelined bf16 train step with per-device skipping, as a GPU / TPU
  runs it, for `platform` with the given kernels, on 8 CPU devices: pipeline 4 x 2 virtual x
  expert 2. shape "k2": kimi_k2's widths (7168 hidden, 64 MLA heads, 384 experts of 2048,
  top-8 + shared, 163,840 vocabulary) at 9 layers on pipeline 2 x 2 virtual x data 2 x
  expert 2, so ZeRO-1 over data and Muon's per-device update lower too; "data": the tiny
  model on pipeline 4 x data 2 (expert 1: inside the pipeline's shard_map no batch axis is
  left automatic, and Mosaic kernels still need a shard_map of their own); nothing is
  allocated."""
  import os
  from jax import numpy as jnp
  from k2jax import model, optim, parallel
  from k2jax.kernels import platform as kernels_platform
  from k2jax.parallel import layout
  from k2jax.training.step import init_state, train_step
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "experiments"))
  import pipeline_hlo
  mesh_shape = {"k2": (2, 2, 2), "data": (4, 2, 1)}.get(shape, (4, 1, 2))
  c = pipeline_hlo.tiny_config(mesh_shape, grad_accum=4, batch=16, skip="device",
                               param_dtype="bfloat16")
  c.model.offload = True        # the pipeline's residual slots in host memory
  if shape in ("tiny", "data"):
    # every tiny slot leaf is under the size XLA:TPU needs before it moves a leaf to host
    # memory (a compile-time refusal, not a lowering one); lower them all to host here
    from k2jax.parallel import executor
    executor.Slots.HOST_MIN = 0
  if shape == "k2":
    from k2jax import configs
    c.model = configs.get_config("kimi_k2").model
    c.model.num_hidden_layers = 9
    c.optimizer.host_state = True   # as the preset: ZeRO-1 states in host memory
  c.model.update(dict(dtype="bfloat16", remat="selective", activation_storage="fp8",
                      moe_impl=moe_impl, attention_impl=attention_impl))
  mesh = parallel.make_mesh(c.mesh)
  stored = layout.stored_config(c)
  tx = optim.optimizer(stored)
  with jax.set_mesh(mesh):
    ab = jax.eval_shape(functools.partial(init_state, stored, tx), jax.random.key(0))
    sh = parallel.state_shardings(model.param_specs(stored.model), mesh, ab, tx,
                                  host_state=c.optimizer.host_state)
    ab = jax.tree.map(lambda a, x: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=x), ab, sh)
    bs = parallel.batch_sharding(mesh, 16, 4)
    b = {k: jax.ShapeDtypeStruct((16, 32), jnp.float32 if k == "loss_mask" else jnp.int32,
                                 sharding=bs)
         for k in ("inputs", "targets", "positions", "segment_ids", "loss_mask")}
    step = functools.partial(train_step, c, tx, optim.learning_rate_schedule(c))
    with kernels_platform.target(platform):   # `auto` picks the target's kernels
      text = jax.jit(step).trace(ab, b).lower(lowering_platforms=(platform,)).as_text()
  low = text.lower()
  print("RESULT " + json.dumps({"chars": len(text), "ppermute": text.count("collective_permute"),
                                "host": text.count("pinned_host"),
                                "kernels": {"triton": "triton" in low,
                                            "mosaic": "tpu_custom_call" in low}}))


def attend_shards():
  """model.attention.attend with the Pallas kernels (interpret mode) per batch shard under a
  data 2 x expert 4 mesh, against the XLA attention on the whole batch: max relative error
  of the output and of S_max (pmax over the shards), forward and gradient."""
  import jax.numpy as jnp
  import numpy as np
  from k2jax import configs, parallel
  from k2jax.kernels import flash
  from k2jax.model import attention as attn
  real = attn.attention
  attn.attention = functools.partial(real, interpret=True)
  cfg = configs.get_config("tiny").model
  c = configs.get_config("tiny")
  c.mesh.update(dict(data=2, expert=4))
  mesh = parallel.make_mesh(c.mesh)
  rng = np.random.default_rng(0)
  B, T, H = 8, 40, cfg.num_attention_heads
  dq, dv = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
  q, k = (jnp.asarray(rng.standard_normal((B, T, H, dq)), jnp.float32) for _ in range(2))
  v = jnp.asarray(rng.standard_normal((B, T, H, dv)), jnp.float32)
  seg = jnp.asarray(np.repeat(np.array([[1] * 25 + [2] * 10 + [0] * 5]), B, 0), jnp.int32)
  seg = seg.at[3].set(1)
  errors = {}
  for impl in ("pallas_gpu", "pallas_tpu"):
    cfg.attention_impl = impl

    def loss(q, k, v):
      out, m = attn.attend(cfg, q, k, v, seg)
      return jnp.sum(out * jnp.cos(out)), (out, m)
    with jax.set_mesh(mesh):
      sh = jax.sharding.NamedSharding(mesh, parallel.logical_spec(("batch",)))
      args = [jax.device_put(a, sh) for a in (q, k, v)]
      (_, (out, m)), g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
          *args)
    cfg.attention_impl = "xla"
    (_, (out0, m0)), g0 = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    errors[impl] = max([_rel(out, out0), _rel(m, m0)] + [_rel(a, b) for a, b in zip(g, g0)])
  print("RESULT " + json.dumps(errors))


def _muon_setup(mesh_spec):
  """(config as stored, mesh, tx) of the tiny model whose routed experts are [*, 128, 40]
  (40 is no other matrix's smaller side, so Newton-Schulz's [B, 40, 40] products are theirs),
  with two MoE layers on every device holding the stack: mesh PxDxE."""
  from k2jax import configs, optim, parallel
  from k2jax.parallel import layout
  sizes = [int(s) for s in mesh_spec.split("x")]
  c = configs.get_config("tiny")
  c.model.update(dict(moe_intermediate_size=40, n_shared_experts=2,
                      num_hidden_layers=1 + 2 * sizes[0]))
  c.mesh.update(dict(zip(("pipeline", "data", "expert"), sizes)))
  stored = layout.stored_config(c)
  return stored, parallel.make_mesh(c.mesh), optim.muon(stored.model, 0.01)


def muon_local(*mesh_specs):
  """Muon's update alone on each PxDxE mesh, compiled and run, against one device.

  Per mesh: the compiled update's all-gathers (result elements) against the largest
  matrix stack a device holds whole (its parameter shard, matrix dimensions gathered), the
  batch sizes of the routed experts' Newton-Schulz products [B, 40, 40], the expert matrices
  a device holds and the 1 / data share of them, XLA's temporary bytes; and the largest
  relative difference from the single-device update (updates and momentum, two steps)."""
  import math
  import re
  from jax.sharding import NamedSharding
  from k2jax import model, parallel
  from k2jax.configs.sharding_rules import param_spec
  from k2jax.model import spec
  from k2jax.training.step import init_state
  out = {}
  for ms in mesh_specs:
    stored, mesh, tx = _muon_setup(ms)
    P, D, E = (mesh.shape[a] for a in ("pipeline", "data", "expert"))
    mcfg = stored.model
    specs = model.param_specs(mcfg)
    state = init_state(stored, tx, jax.random.key(0))
    keys = iter(jax.random.split(jax.random.key(1), 64))
    grads = [jax.tree.map(lambda p: jax.random.normal(next(keys), p.shape, p.dtype),
                          state.params) for _ in range(2)]
    # one device: no mesh, so Muon's update runs as optax's, unsharded
    ref, o = [], state.opt_state
    upd = jax.jit(tx.update)
    for g in grads:
      u, o = upd(g, o, state.params)
      ref.append((u, o))
    with jax.set_mesh(mesh):
      ab = jax.eval_shape(functools.partial(init_state, stored, tx), jax.random.key(0))
      sh = parallel.state_shardings(specs, mesh, ab, tx)
      f = jax.jit(tx.update, in_shardings=(sh.params, sh.opt_state, sh.params),
                  out_shardings=(sh.params, sh.opt_state))
      compiled = f.lower(ab.params, ab.opt_state, ab.params).compile()
      o = jax.device_put(state.opt_state, sh.opt_state)
      p = jax.device_put(state.params, sh.params)
      err = 0.0
      for g, (ru, ro) in zip(grads, ref):
        u, o = compiled(jax.device_put(g, sh.params), o, p)
        for a, b in zip(jax.tree.leaves((u, o)), jax.tree.leaves((ru, ro))):
          a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
          if a.size:
            err = max(err, float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30)))
    text = compiled.as_text()
    gathers = [math.prod(int(d) for d in dims.split(",") if d) for dims in
               re.findall(r"= \w+\[([\d,]*)\]\{[^}]*\} all-gather(?:-start)?\(", text)]
    whole = max(math.prod(NamedSharding(mesh, param_spec(s.axes, s.shape, mesh, whole=True))
                          .shard_shape(s.shape))
                for s in jax.tree.leaves(specs, is_leaf=spec.is_spec) if s.group == "muon")
    ns = sorted({int(b) for b, r, c in re.findall(r"= f32\[(\d+),(\d+),(\d+)\]\{[^}]*\} dot\(",
                                                  text) if r == c == "40"})
    held = mcfg.num_hidden_layers - mcfg.first_k_dense_replace
    held = held // P * mcfg.n_routed_experts // E
    out[ms] = {"all_gathers": gathers, "whole_local": whole, "ns_batches": ns, "held": held,
               "share": held // D if held % D == 0 else held,
               "temp": compiled.memory_analysis().temp_size_in_bytes, "rel_err": err}
  print("RESULT " + json.dumps(out))


def embedding():
  """k2jax.model.embedding's lookup and written backward against jnp.take and its autodiff on
  one device: the lookup bit for bit, the gradient of sum(x w) in float64 (and with bf16
  cotangents into a float32 table), on data 2 x expert 4, expert 8 and pipeline 2 x expert
  4 with the lookup inside a shard_map over `pipeline` (as stage.pre runs it);
  vocabularies the expert group divides (264: the table split on its rows) and does not
  (203: stored whole, padded for the backward's exchange); fresh random ids with an id on
  every device, one device's tokens all one id, and a block of the last id; rows sent in ep
  (default), 1 and 5 rounds (5 does not divide a device's 24 tokens). Returns per case the
  largest relative error of the gradient, whether the lookup is exact, the gradient stored
  as the table is and the exchange taken, and for one case what a deliberately wrong
  routing (every row sent to the next shard, both ways) gives."""
  from unittest import mock
  import jax.numpy as jnp
  from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
  from k2jax.configs.sharding_rules import param_spec
  from k2jax.model.embedding import embed
  jax.config.update("jax_enable_x64", True)
  seed = int.from_bytes(os.urandom(4), "little")     # fresh inputs every run
  rng = np.random.default_rng(seed)
  B, T, d = 16, 12, 8
  meshes = {"2x4": (1, 2, 4), "1x8": (1, 1, 8), "p2x4": (2, 1, 4)}
  cases = [(m, V, 0, "float64") for m in meshes for V in (264, 203)]
  cases += [("2x4", 203, 1, "float64"), ("2x4", 203, 5, "float64"), ("1x8", 264, 5, "float64"),
            ("2x4", 264, 0, "bfloat16"), ("1x8", 203, 0, "bfloat16")]

  def inputs(V, dtype):
    table = rng.normal(size=(V, d))
    ids = rng.integers(0, V, (B, T))
    ids[:, :2] = rng.integers(0, V)            # one id on every device, twice per sequence
    ids[2:4] = rng.integers(0, V)              # one device's tokens (expert 8): all one id
    ids[-3:, -4:] = V - 1                      # the last row (the padded slice's, for 203)
    w = rng.normal(size=(B, T, d))
    tdt = jnp.float64 if dtype == "float64" else jnp.float32
    return jnp.asarray(table, tdt), jnp.asarray(ids, jnp.int32), jnp.asarray(w, tdt)

  def grad(mesh, table, ids, w, dtype, rounds):
    def g(t, i, w):        # the lookup (its forward) and the gradient of sum(x w)
      x, vjp = jax.vjp(lambda t: embed(t, i, dtype, chunks=rounds), t)
      return x, vjp(w.astype(x.dtype))[0]
    if mesh.shape["pipeline"] > 1:
      g = jax.shard_map(g, in_specs=(P(), P(), P()), out_specs=(P(), P()),
                        axis_names={"pipeline"}, check_vma=False)
    with jax.set_mesh(mesh):
      t = jax.device_put(table, NamedSharding(mesh, param_spec(("vocab", "embed"), table.shape,
                                                               mesh)))
      i, w = (jax.device_put(a, NamedSharding(mesh, P(("data", "expert")))) for a in (ids, w))
      x, out = jax.jit(g)(t, i, w)
    return x, out, out.sharding.is_equivalent_to(t.sharding, 2)

  from k2jax.model import embedding as module
  scatter, traced = module._scatter, []
  module._scatter = lambda *a: traced.append(1) or scatter(*a)   # the exchange was taken
  out = {}
  for m, V, rounds, dtype in cases:
    mesh = jax.make_mesh(meshes[m], ("pipeline", "data", "expert"),
                         axis_types=(AxisType.Auto,) * 3)
    table, ids, w = inputs(V, dtype)
    x_want, vjp = jax.vjp(lambda t: jnp.take(t, ids, axis=0).astype(dtype), table)
    want = vjp(w.astype(x_want.dtype))[0]
    traced.clear()
    x, got, stored = grad(mesh, table, ids, w, dtype, rounds)
    err = lambda g: float(np.max(np.abs(np.asarray(g, np.float64) - np.asarray(want, np.float64)))
                          / np.max(np.abs(np.asarray(want, np.float64))))
    key = f"{m}/V{V}/r{rounds}/{dtype}"
    out[key] = {"err": err(got), "stored_as_table": bool(stored), "exchanged": bool(traced),
                "forward_equal": bool(np.array_equal(np.asarray(x), np.asarray(x_want)))}
    if (m, V, rounds, dtype) == ("2x4", 264, 0, "float64"):
      a2a = jax.lax.all_to_all
      wrong = lambda x, *a, **k: a2a(jnp.roll(x, 1, 0), *a, **k)
      with mock.patch.object(jax.lax, "all_to_all", wrong):
        x, g, _ = grad(mesh, table, ids, w, dtype, rounds)
      out[key]["wrong_routing_err"] = err(g)
      out[key]["wrong_routing_forward_equal"] = bool(np.array_equal(np.asarray(x),
                                                                    np.asarray(x_want)))
  print("RESULT " + json.dumps({"seed": seed, "cases": out}))


def _packed_batch(cfg, seg, pos, rng):
  """A batch of packed rows with segment ids `seg` and positions `pos` [B, T], random
  tokens and targets, loss on every real token."""
  import jax.numpy as jnp
  B, T = seg.shape
  batch = dict(inputs=rng.integers(0, cfg.vocab_size, (B, T)),
               targets=rng.integers(0, cfg.vocab_size, (B, T)), positions=pos,
               segment_ids=seg, loss_mask=(seg > 0).astype(np.float32))
  return {k: jnp.asarray(v) for k, v in batch.items()}


def _rel(a, b) -> float:
  """max |a - b| / max |b| in float64."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))


def context_meshes(*specs):
  """The model's loss, every gradient leaf, max logits, balance loss and expert load in float32
  on DxCxE (data x context x expert) meshes against one device, on packed documents with
  padding (random lengths, so documents cross the context chunks' borders) and a balance
  loss that is per sequence; then two faults that the comparison must see: the token
  placement and the query blocks disagreeing, and max logits not reduced over context."""
  from unittest import mock
  from k2jax import configs, model, parallel
  from k2jax.model import context
  from k2jax.training.step import lm_loss

  cfg = configs.get_config("tiny").model
  # chunks of 3 tokens: 4, 2 and 1 groups of 2C chunks on C = 2, 4, 8 (k2jax.model.context)
  cfg.update(dtype="float32", param_dtype="float32", aux_loss_alpha=0.01,
             attention_impl="chunked", context_chunk=3)
  B, T = 4, 48
  seed = int(np.random.SeedSequence().entropy % 2 ** 32)
  rng = np.random.default_rng(seed)
  seg, pos = np.zeros((B, T), np.int32), np.zeros((B, T), np.int32)
  for b in range(B):
    t, s = 0, 1
    while t < T:
      if t and rng.random() < 0.15:                  # the row ends in padding
        pos[b, t:] = np.arange(T - t)
        break
      n = min(int(rng.integers(1, T // 2)), T - t)
      seg[b, t:t + n], pos[b, t:t + n] = s, np.arange(n)
      s, t = s + 1, t + n
  batch = _packed_batch(cfg, seg, pos, rng)
  params = model.init(cfg, jax.random.key(seed))

  def run(d, c, e):
    mc = configs.get_config("tiny").mesh
    mc.update(data=d, context=c, expert=e)
    mesh = parallel.make_mesh(mc, jax.devices()[:d * c * e])

    def f(p, b):
      def loss(p):
        ce, n, aux = lm_loss(cfg, p, b)
        return ce + aux.aux_loss, (ce, aux)
      (_, (ce, aux)), g = jax.value_and_grad(loss, has_aux=True)(p)
      return ce, g, aux
    with jax.set_mesh(mesh):
      p = jax.device_put(params, parallel.param_shardings(model.param_specs(cfg), mesh))
      ce, g, aux = jax.jit(f)(p, batch)
    return dict(loss=ce, grads=g, max_logits=aux.max_logits, aux=aux.aux_loss,
                load=aux.expert_load)

  def errors(got, want):
    out = {k: _rel(got[k], want[k]) for k in ("loss", "max_logits", "aux", "load")}
    out["grads"] = {jax.tree_util.keystr(path): _rel(a, b) for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(got["grads"]), jax.tree.leaves(want["grads"]))}
    return out

  want = run(1, 1, 1)
  result = {"seed": seed, "meshes": {s: errors(run(*map(int, s.split("x"))), want)
                                     for s in specs}}
  contiguous = lambda T, C, chunk: np.arange(T)
  with mock.patch.object(context, "placement", contiguous):
    result["placement_fault"] = errors(run(1, 4, 1), want)
  pmax = jax.lax.pmax
  local = lambda x, axes: pmax(x, tuple(a for a in axes if a != "context")) if len(
      [a for a in axes if a != "context"]) else x
  with mock.patch.object(jax.lax, "pmax", local):
    result["pmax_fault"] = errors(run(1, 4, 1), want)
  print("RESULT " + json.dumps(result))


def _greedy_jobs(engine, prompts, max_tokens=6):
  """Submit `prompts` to the engine together as greedy jobs with log probabilities; wait for
  all: (errors, [[tokens], ...], [[log p], ...])."""
  import threading
  from k2jax.serving.engine import Job
  got, done = {}, threading.Semaphore(0)

  def emit(i):
    def on(e):
      if e.kind in ("done", "error"):
        got[i] = e
        done.release()
    return on
  for i, p in enumerate(prompts):
    engine.submit(Job(prompt=p, max_tokens=max_tokens, temperature=0.0, logprobs=0,
                      emit=emit(i)))
  for _ in prompts:
    done.acquire()
  errors = [str(e.error) for e in got.values() if e.kind == "error"]
  tokens = [[entry[0] for entry in got[i].logprobs or []] for i in range(len(prompts))]
  lps = [[entry[1] for entry in got[i].logprobs or []] for i in range(len(prompts))]
  return errors, tokens, lps


def serve_context():
  """The server's engine (k2jax.serving.engine, what k2jax.serve runs) on --mesh data=2,context=4
  against generate on one device: greedy tokens and their log probabilities for prompts
  of 5 to 100 tokens admitted together (the prefill of their 128-token bucket split over 4
  context devices), and whether the context path ran."""
  from unittest import mock
  from k2jax import configs, model
  from k2jax.serving import generate
  from k2jax.data import ByteTokenizer
  from k2jax.serving.engine import Engine
  from k2jax.model import context
  cfg = configs.get_config("tiny").model
  cfg.update(dtype="float32", param_dtype="float32", attention_impl="chunked")
  params = model.init(cfg, jax.random.key(5))
  rng = np.random.default_rng(5)
  prompts = [[int(t) for t in rng.integers(3, 250, n)] for n in (5, 37, 100, 64)]
  want, want_lp = generate.generate(cfg, params, prompts, max_new_tokens=6,
                                    return_logprobs=True)
  mesh = generate.inference_mesh("data=2,context=4")
  calls, attend = [], context.attend
  with mock.patch.object(context, "attend", lambda *a, **k: calls.append(1) or attend(*a, **k)):
    engine = Engine(cfg, jax.device_put(params, generate.target_shardings(cfg, mesh)),
                    ByteTokenizer(), max_batch=4, mesh=mesh, window_s=0.5)
    errors, tokens, lps = _greedy_jobs(engine, prompts)
    engine.close()
  print("RESULT " + json.dumps({
      "errors": errors, "context_ran": bool(calls), "prefills": engine.stats["prefills"],
      "prefix": all(t == w[:len(t)] and len(t) > 0 for t, w in zip(tokens, want)),
      "logprob_err": max(abs(a - b) for r, w in zip(lps, want_lp) for a, b in zip(r, w))}))


def context_kernels(*impls):
  """The model's loss, every gradient leaf and max logits in float32 on data 2 x context 4
  with each attention implementation in `impls` (the Pallas kernels in interpret mode) as
  every device's attention of its query blocks against the whole sequence, against one
  device's chunked attention: max relative errors per implementation."""
  from k2jax import configs, model, parallel
  from k2jax.kernels import flash
  from k2jax.training.step import lm_loss
  called, real = [], flash.attention_blocks

  def blocks(*a, impl, **k):          # interpret mode, and which implementation ran
    called.append(impl)
    return real(*a, impl=impl, interpret=True, **k)
  flash.attention_blocks = blocks
  cfg = configs.get_config("tiny").model
  # chunks of 8 tokens (pallas_tpu's blocks are multiples of 8), 2 groups of 2C on C = 4
  cfg.update(dtype="float32", param_dtype="float32", attention_impl="chunked", context_chunk=8)
  B, T = 2, 128
  seed = int(np.random.SeedSequence().entropy % 2 ** 32)
  rng = np.random.default_rng(seed)
  cuts = np.sort(rng.choice(np.arange(1, T), size=4, replace=False))
  seg = np.searchsorted(cuts, np.arange(T), side="right").astype(np.int32) + 1
  seg = np.stack([seg, np.where(np.arange(T) < cuts[-1], seg, 0)])      # row 1 ends padded
  starts = np.concatenate([[0], cuts])
  pos = np.broadcast_to(np.arange(T) - starts[seg[0] - 1], (B, T))       # per document
  batch = _packed_batch(cfg, seg, pos, rng)
  params = model.init(cfg, jax.random.key(seed))

  def run(impl, d, c):
    cfg.attention_impl = impl
    mc = configs.get_config("tiny").mesh
    mc.update(data=d, context=c)
    mesh = parallel.make_mesh(mc, jax.devices()[:d * c])

    def f(p, b):
      (ce, aux), g = jax.value_and_grad(lambda p: lm_loss(cfg, p, b)[::2], has_aux=True)(p)
      return ce, g, aux.max_logits
    with jax.set_mesh(mesh):
      p = jax.device_put(params, parallel.param_shardings(model.param_specs(cfg), mesh))
      return jax.jit(f)(p, batch)

  want = run("chunked", 1, 1)
  result = {"seed": seed}
  for impl in impls:
    called.clear()
    got = run(impl, 2, 4)
    result[impl] = {"ran": sorted(set(called)), "loss": _rel(got[0], want[0]), "max_logits": _rel(got[2], want[2]),
                    "grads": max(_rel(a, b) for a, b in zip(jax.tree.leaves(got[1]),
                                                           jax.tree.leaves(want[1]))),
                    "leaves": len(jax.tree.leaves(got[1]))}
  print("RESULT " + json.dumps(result))


def generate_context():
  """Greedy generation and its log probabilities for prompts of several lengths, without a
  mesh and under context 4 x data 2 (the prompt's prefill split over context devices,
  k2jax.model.context; decode steps of one token run whole on each), and the prefill
  alone: whether the context path ran, and the largest log-probability difference."""
  from unittest import mock
  from k2jax import configs, model, parallel
  from k2jax.serving import generate
  from k2jax.model import context
  cfg = configs.get_config("tiny").model
  cfg.update(dtype="float32", param_dtype="float32", attention_impl="chunked")
  params = model.init(cfg, jax.random.key(3))
  rng = np.random.default_rng(3)
  prompts = [list(rng.integers(1, cfg.vocab_size, n)) for n in (5, 37, 20, 64)]
  want, want_lp = generate.generate(cfg, params, prompts, max_new_tokens=6,
                                    return_logprobs=True)
  mc = configs.get_config("tiny").mesh
  mc.update(data=2, context=4)
  mesh = parallel.make_mesh(mc)
  calls = []
  attend = context.attend
  with mock.patch.object(context, "attend", lambda *a, **k: calls.append(1) or attend(*a, **k)):
    generate._PROGRAMS.clear()
    with jax.set_mesh(mesh):
      got, got_lp = generate.generate(cfg, params, prompts, max_new_tokens=6,
                                      return_logprobs=True)
  generate._PROGRAMS.clear()
  print("RESULT " + json.dumps({
      "equal": got == want, "context_ran": bool(calls),
      "logprob_err": max(abs(a - b) for r, w in zip(got_lp, want_lp) for a, b in zip(r, w))}))


def engine_mesh():
  """One request on --mesh data=2,expert=2 (4 batch devices, more than its rows): generate
  pads its prompt to 4 rows; the engine (max_batch 3: 4 slots, engine.slot_count) decodes
  it alone, then two requests together. Greedy tokens and log probabilities of each against
  generate's on one device."""
  from k2jax import configs, model
  from k2jax.serving import generate
  from k2jax.data import ByteTokenizer
  from k2jax.serving.engine import Engine
  cfg = configs.get_config("tiny").model
  cfg.update(dtype="float32", param_dtype="float32", attention_impl="chunked")
  params = model.init(cfg, jax.random.key(7))
  prompts = [[5, 9, 200, 31, 77], list(range(40, 77))]
  want = [generate.generate(cfg, params, [p], max_new_tokens=6, return_logprobs=True)
          for p in prompts]
  mesh = generate.inference_mesh("data=2,expert=2")
  placed = lambda: jax.device_put(params, generate.target_shardings(cfg, mesh))
  with jax.set_mesh(mesh):
    gen = generate.generate(cfg, placed(), [prompts[0]], max_new_tokens=6,
                            return_logprobs=True)
  engine = Engine(cfg, placed(), ByteTokenizer(), max_batch=3, mesh=mesh, window_s=0.0)
  alone = _greedy_jobs(engine, prompts[:1])
  both = _greedy_jobs(engine, prompts)
  engine.close()
  runs = [[gen[0][0], gen[1][0]]] + [[t, lp] for e, ts, lps in (alone, both)
                                       for t, lp in zip(ts, lps)]
  print("RESULT " + json.dumps({
      "errors": alone[0] + both[0], "slots": engine.max_batch, "runs": runs,
      "want": [[w[0][0], w[1][0]] for w in want]}))


if __name__ == "__main__":
  {"meshes": meshes, "zero1": zero1, "reduce_into": reduce_into, "ep_transports": ep_transports,
   "pipeline_collectives": pipeline_collectives, "tick_collectives": tick_collectives,
   "lower": lower,
   "attend_shards": attend_shards, "muon_local": muon_local,
   "embedding": embedding, "context_meshes": context_meshes,
   "generate_context": generate_context,
   "context_kernels": context_kernels, "serve_context": serve_context,
   "engine_mesh": engine_mesh}[sys.argv[1]](
       *sys.argv[2:])
