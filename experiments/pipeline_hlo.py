"""What a compiled train step moves between pipeline devices, read from its optimized HLO.

    python experiments/pipeline_hlo.py            (8 simulated devices; prints one CSV row)

Used by bench_pipeline.py (`--only collectives`, `--only step_time`) and runnable against
any commit of k2jax (it detects the stored layout of k2jax.parallel.layout, and builds the
state the way k2jax.train of that commit does), so the before / after rows come from the
same measurement. Every collective whose device groups (or source / target pairs) span two
pipeline devices is counted with its bytes; one inside the schedule's tick loop counts once
per tick.
"""

import functools
import os
import re
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

DTYPE_BYTES = {"f32": 4, "bf16": 2, "s32": 4, "u32": 4, "pred": 1, "f16": 2, "s8": 1, "u8": 1,
               "f8e4m3fn": 1, "s64": 8, "f64": 8}
COLLECTIVE = re.compile(r"= (\(?[a-z0-9]+\[[^=]*?) (all-reduce|all-gather|all-to-all|"
                        r"collective-permute|reduce-scatter)(-start)?\(")


def _groups(line, n):
  """Device groups of a collective line (replica_groups or source_target_pairs)."""
  m = re.search(r"source_target_pairs=\{(.*?)\}\}", line)
  if m:
    return [tuple(map(int, p.split(","))) for p in re.findall(r"\{(\d+,\d+)", m.group(0))]
  m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
  if m:
    shape = tuple(map(int, m.group(1).split(",")))
    dims = tuple(map(int, m.group(2).split(",")))
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if m.group(3):
      ids = ids.transpose(tuple(map(int, m.group(3).split(","))))
    return [tuple(g) for g in ids.reshape(shape[0], -1)]
  m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]+)\]"
                r"(?:T\(([\d,]+)\))?\))? \{([^}]*)\}", line)
  if m:   # newer XLA: a device mesh (device ids in iota order, or reshaped and transposed)
    axes = re.findall(r"'(\w+)'=(\d+)", m.group(1))   # and the axes a group varies over
    names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
    vary = [names.index(a) for a in re.findall(r"'(\w+)'", m.group(4))]
    keep = [i for i in range(len(names)) if i not in vary]
    ids = np.arange(int(np.prod(sizes)))
    if m.group(2):
      ids = ids.reshape(tuple(map(int, m.group(2).split(","))))
      if m.group(3):
        ids = ids.transpose(tuple(map(int, m.group(3).split(","))))
    ids = ids.reshape(sizes).transpose(keep + vary)
    return [tuple(g) for g in ids.reshape(-1, int(np.prod([sizes[i] for i in vary] or [1])))]
  m = re.search(r"replica_groups=\{(.*?)\}\}", line)
  if m:
    return [tuple(map(int, g.split(","))) for g in re.findall(r"\{([\d,]+)\}", m.group(0))]
  return [tuple(range(n))]


def _bytes(shapes):
  total = 0
  for dt, dims in re.findall(r"([a-z0-9]+)\[([\d,]*)\]", shapes):
    total += DTYPE_BYTES.get(dt, 4) * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
  return total


def tick_loop(hlo: str):
  """(computations {name: lines}, names of those inside the schedule's tick loop) of an
  optimized HLO module: the tick loop is the outermost while of ENTRY whose body (or what it
  calls: the phases' branches, the layer loops) holds the ring's collective-permute."""
  comps, current = {}, None
  for line in hlo.splitlines():
    if line and not line.startswith(" ") and line.rstrip().endswith("{"):
      current = line.split(" ")[0].lstrip("%")
      if line.startswith("ENTRY"):
        current = "ENTRY"
      comps[current] = []
    elif current:
      comps[current].append(line)
  calls = {c: set(re.findall(r"(?:body|condition|calls|to_apply|branch_computations|"
                             r"true_computation|false_computation)=\{?%?([\w.\-]+)",
                             "\n".join(lines))) |
           set(re.findall(r"branch_computations=\{([^}]*)\}", "\n".join(lines)))
           for c, lines in comps.items()}
  for c in calls:   # branch lists come as "%a, %b"
    calls[c] = {x.strip().lstrip("%") for y in calls[c] for x in y.split(",")}

  def reach(c, seen):
    for d in calls.get(c, ()):
      if d not in seen:
        seen.add(d)
        reach(d, seen)
    return seen
  loops = [m for line in comps.get("ENTRY", []) for m in re.findall(r"body=%?([\w.\-]+)", line)]
  inside = set()
  for body in loops:
    r = reach(body, {body})
    if any("collective-permute" in l for c in r for l in comps.get(c, [])):
      inside |= r
  return comps, inside


def pipeline_collectives(hlo: str, mesh_shape, ticks: int):
  """-> (bytes per step outside the tick loop, bytes per step inside it) of collectives that
  cross pipeline devices, and the per-op rows."""
  per_stage = mesh_shape[1] * mesh_shape[2]
  n = int(np.prod(mesh_shape))
  comps, inside = tick_loop(hlo)
  out, loop, rows = 0, 0, []
  for c, lines in comps.items():
    for line in lines:
      # Tuple shapes carry /*index=N*/ comments, whose "=" the shape pattern stops at:
      # unstripped, every collective of a tuple of 6+ arrays went uncounted.
      line = re.sub(r"/\*.*?\*/", "", line)
      m = COLLECTIVE.search(line)
      if not m or "-done" in line.split("=")[1][:40]:
        continue
      groups = _groups(line, n)
      if not any(len({d // per_stage for d in g}) > 1 for g in groups):
        continue
      b = _bytes(m.group(1))
      rows.append((c in inside, m.group(2), b))
      if c in inside:
        loop += b * ticks
      else:
        out += b
  return out, loop, rows


def tiny_config(mesh_shape, virtual=2, layers=9, grad_accum=8, batch=64, seq=32, skip=None,
                param_dtype="float32", schedule=None, remat=None):
  """The tiny model with `layers` layers (1 dense) on a (pipeline, data, expert) mesh."""
  from k2jax import configs
  c = configs.get_config("tiny")
  c.model.num_hidden_layers = layers
  c.model.aux_loss_alpha = 0.01
  c.model.param_dtype = param_dtype
  if remat:
    c.model.remat = remat
  c.train.update(dict(batch_size=batch, seq_len=seq, grad_accum=grad_accum))
  c.mesh.update(dict(zip(("pipeline", "data", "expert"), mesh_shape)))
  c.mesh.virtual_stages = virtual if mesh_shape[0] > 1 else 1
  if skip:
    c.mesh.pipeline_skip = skip
  if schedule:
    c.mesh.pipeline_schedule = schedule
  return c


def build(mesh_shape, virtual=2, layers=9, grad_accum=8, batch=64, seq=32, skip=None,
          param_dtype="float32", schedule=None, remat=None):
  """(compiled train step, mesh, state, batch, ticks, stack parameter bytes) of
  `tiny_config(...)` on 8 devices, as this checkout's k2jax.train builds it."""
  from k2jax import model, optim, parallel
  from k2jax.training.step import init_state, train_step
  try:
    from k2jax.parallel import layout
  except ImportError:
    layout = None
  c = tiny_config(mesh_shape, virtual, layers, grad_accum, batch, seq, skip, param_dtype,
                  schedule, remat)
  mesh = parallel.make_mesh(c.mesh)
  stored = layout.stored_config(c) if layout else c
  tx = optim.optimizer(stored)
  sched = optim.learning_rate_schedule(c)
  with jax.set_mesh(mesh):
    abstract = jax.eval_shape(functools.partial(init_state, stored, tx), jax.random.key(0))
    sh = parallel.state_shardings(model.param_specs(stored.model), mesh, abstract, tx)
    state = jax.jit(functools.partial(init_state, stored, tx), out_shardings=sh)(
        jax.random.key(0))
    bs = parallel.batch_sharding(mesh, batch, grad_accum)
    toks = np.random.default_rng(0).integers(0, c.model.vocab_size, (batch, seq + 1))
    b = dict(inputs=toks[:, :-1], targets=toks[:, 1:],
             positions=np.broadcast_to(np.arange(seq), (batch, seq)),
             segment_ids=np.ones((batch, seq), np.int32), loss_mask=np.ones((batch, seq), np.float32))
    b = {k: jax.device_put(jnp.asarray(v), bs) for k, v in b.items()}
    step = jax.jit(functools.partial(train_step, c, tx, sched), in_shardings=(sh, bs),
                   out_shardings=(sh, parallel.replicated(mesh)), donate_argnums=0)
    compiled = step.lower(state, b).compile()
  stack = sum(a.size * a.dtype.itemsize
              for a in jax.tree.leaves(model.init(c.model, jax.random.key(0))["moe_layers"]))
  if mesh_shape[0] > 1:
    try:
      from k2jax.parallel import pipeline
      ticks = pipeline.table(c).ticks
    except (ImportError, AttributeError):   # the index-arithmetic loop of older commits
      P, V, M = mesh_shape[0], c.mesh.virtual_stages, grad_accum
      ticks = P * V + M * V + P - 1
  else:
    ticks = 0
  return compiled, mesh, state, b, ticks, stack


def measure(mesh_shape, virtual=2, steps=3, skip=None, schedule=None, **kw):
  """Collective bytes and step time of `build(...)` (kw: its other arguments)."""
  compiled, mesh, state, b, ticks, stack = build(mesh_shape, virtual, skip=skip,
                                                 schedule=schedule, **kw)
  out, loop, _ = pipeline_collectives(compiled.as_text(), mesh_shape, ticks)
  with jax.set_mesh(mesh):
    state, m = compiled(state, b)
    jax.block_until_ready(m)
    t = time.perf_counter()
    for _ in range(steps):
      state, m = compiled(state, b)
    jax.block_until_ready(m)
  return dict(mesh="x".join(map(str, mesh_shape)), virtual=virtual, ticks=ticks,
              stack_param_bytes=stack, outside_loop_bytes=out, in_loop_bytes=loop,
              outside_vs_stack=out / stack, step_s=(time.perf_counter() - t) / steps)


if __name__ == "__main__":
  sys.path.append(os.getcwd())
  for shape in ((4, 1, 2), (4, 2, 1), (1, 8, 1)):
    print(measure(shape))
