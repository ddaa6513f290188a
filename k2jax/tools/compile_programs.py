"""Post-training and serving programs compiled for a target, beside the train step:
`python -m k2jax.compile --program PROGRAM`.

    python -m k2jax.compile --config kimi_k2 --program decode --topology v5p:2x4x4 \\
        --mesh expert=32 --rows 64 --context 4096
    python -m k2jax.compile --config kimi_k2_rl --program rl --topology v5p:4x8x8

Each program is the one k2jax runs, traced from ShapeDtypeStructs placed as its caller
places the arrays, and compiled to the end of code generation (XLA's memory analysis of
the executable) with the kernels `auto` picks for the target's platform:

  train    k2jax.training.step.program (k2jax.compile's own path). SFT is this program: k2jax.sft
           trains through k2jax.training.train.train, which builds it from the config like
           pre-training; SFT's data (chat rows with loss masks) fills the same batch arrays.
  rl       the RL update, k2jax.rl.train.step_program, on config.mesh with the state's
           shardings rl.train's loop gives it; then its sampler, k2jax.generate's prefill
           and decode-steps programs as Rollouts.decode runs them on rl.inference_mesh:
           `--rows` trajectories, a prompt of `--prompt` tokens, rl.segment_tokens more.
  prefill  k2jax.serving.engine's admit: `--rows` new rows of `--prompt` tokens into the cache.
  decode   k2jax.serving.engine's steps: one dispatch (engine.CHUNK steps) of `--rows` rows over
           the whole cache.

Serving runs on `--mesh` over the topology's chips (generate.inference_mesh): params in
model.param_dtype where generate.target_shardings puts them, the cache of `--rows` slots
x engine.cache_length(`--context`) positions where generate.cache_shardings puts it, and
the host's arrays (tokens, settings) unplaced, as the engine passes numpy arrays. A
program's inputs that are another program's outputs (the sampler's cache after its
prefill) take the shardings XLA compiled that program to return.

Beside XLA's figures each program prints what the code that shards says a device holds:
the shard of each argument (params, cache, train state) by its sharding; for the RL update
k2jax.plan's estimate of the step (states, activations).
"""

import dataclasses
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from k2jax.tools import xla_target
from k2jax import configs, kernels, model, parallel
from k2jax.serving import engine, generate
from k2jax.kernels import platform as kernel_platform

GB = xla_target.GB
PROGRAMS = ("train", "sft", "rl", "prefill", "decode")
SFT_NOTE = ("sft: k2jax.sft trains through k2jax.training.train.train, which compiles "
            "k2jax.training.step.program from the config as pre-training does: the program below")


def add_arguments(p) -> None:
  p.add_argument("--program", default="train",
                 help=f"what to compile: {', '.join(PROGRAMS)} (default train)")
  p.add_argument("--mesh", default=None,
                 help="prefill / decode: the serving mesh over the topology's chips, as "
                 "data=D,context=C,expert=E (data fills the rest; default: expert over all)")
  p.add_argument("--rows", type=int, default=None,
                 help="prefill / decode: the engine's max_batch (default 8; its slots: "
                 "engine.slot_count), prefill admitting that many rows at once, decode "
                 "running with every slot occupied; rl: trajectories, the update's rows "
                 "(default rl.prompts x rl.samples)")
  p.add_argument("--context", type=int, default=None,
                 help="prefill / decode: the engine's max_len (default: the model's "
                 "context); rl: the update's row length and the sampler's cache "
                 "(default train.seq_len)")
  p.add_argument("--prompt", type=int, default=None,
                 help="prefill: prompt tokens of each new row (default --context); rl: "
                 "the sampler's prompts (default --context - rl.segment_tokens)")


def check_program(args) -> None:
  """ValueError (one line) for a --program / geometry the CLI cannot compile."""
  if args.program not in PROGRAMS:
    raise ValueError(f"--program {args.program!r}: choose one of {', '.join(PROGRAMS)}")
  for flag in ("rows", "context", "prompt"):
    v = getattr(args, flag)
    if v is not None and v < 1:
      raise ValueError(f"--{flag} {v}: must be >= 1")
  if args.program in ("train", "sft", "rl") and args.mesh:
    raise ValueError(f"--mesh: only for the serving programs (prefill, decode); --program "
                     f"{args.program} runs on the config's mesh (--config.mesh.*)")
  if args.program not in ("train", "sft") and (args.memory_only or args.explain):
    raise ValueError("--memory_only / --explain: only with --program train")


@dataclasses.dataclass
class Job:
  """One program to compile: the jitted function, its arguments (ShapeDtypeStructs; None
  and Python scalars as the caller passes them) and what the code that shards says each
  device holds of them."""
  label: str
  fn: object
  args: tuple
  kwargs: dict
  mesh: object
  plan: dict            # {what: bytes on the fullest device}
  geometry: str
  notes: list = dataclasses.field(default_factory=list)
  cache_at: int | None = None   # output index of a donated cache that must come back in place
  shape: dict = dataclasses.field(default_factory=dict)   # geometry figures for the record


def placed(tree, shardings):
  """ShapeDtypeStructs of `tree` placed by `shardings` (a matching tree, or one sharding)."""
  if isinstance(shardings, jax.sharding.Sharding):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=shardings),
                        tree)
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                      tree, shardings)


def held(tree, memory: str = "device") -> int:
  """Bytes of the fullest device's shards of placed ShapeDtypeStructs in `memory` (device,
  or host: the pinned_host memory kind)."""
  total = 0
  for a in jax.tree.leaves(tree):
    on_host = getattr(a.sharding, "memory_kind", None) == "pinned_host"
    if on_host == (memory == "host"):
      total += math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
  return total


def host(shape, dtype):
  """A host array's stand-in: unplaced, as numpy arrays reach a jitted program (XLA places
  them whole on the program's devices)."""
  return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))


def run(job: Job, dump: str | None = None) -> xla_target.Compiled:
  """Trace, lower and compile `job` for its mesh's devices. Raises what XLA raises."""
  device = job.mesh.devices.flat[0]
  t0 = time.perf_counter()
  with kernel_platform.target(device.platform), jax.set_mesh(job.mesh):
    compiled = job.fn.trace(*job.args, **job.kwargs).lower().compile(
        compiler_options={"xla_dump_to": dump} if dump else None)
  dev, host_mem = xla_target.memory(compiled.memory_analysis())
  return xla_target.Compiled(compiled, time.perf_counter() - t0, dev, host_mem,
                            device.device_kind, device.platform, xla_target.hbm_bytes(device))


def abstract_params(cfg, shardings):
  """The model's params (model.param_dtype) placed by `shardings`."""
  return placed(jax.eval_shape(lambda: model.init(cfg, jax.random.key(0))), shardings)


# ------------------------------------------------------------------------------ serving


def serving_mesh(cfg, text: str | None, devices):
  """The --mesh of a serving compile over all of `devices` (default: expert over all of
  them, data filling what 384 experts do not divide). ValueError (one line)."""
  if not text:
    e = math.gcd(len(devices), int(cfg.n_routed_experts))
    text = f"expert={e}"
  return generate.inference_mesh(text, devices=devices)


def serving(cfg, mesh, program: str, rows: int, context: int, prompt: int | None) -> Job:
  """The engine's admit (`program` prefill) or steps (decode) as Engine(cfg, params,
  max_batch=rows, max_len=context, mesh=mesh) runs them: its slots (engine.slot_count) and
  cache; admit of `rows` new rows of `prompt` tokens, or one dispatch with every slot
  occupied over the whole cache; rows greedy or sampled, without top-k / top-p, logits
  processors, penalties or log probabilities."""
  max_len = min(context, cfg.max_position_embeddings)
  if context > max_len:
    raise ValueError(f"--context {context}: the model's context is {max_len} tokens "
                     "(kimi_k2_long_context has 131072)")
  slots = engine.slot_count(rows, mesh)
  S = engine.cache_length(max_len, engine.CHUNK)
  with kernel_platform.target(mesh.devices.flat[0].platform):
    admit, steps, _ = engine._compiled(cfg, slots, S)
  params = abstract_params(cfg, generate.target_shardings(cfg, mesh))
  cache = placed(jax.eval_shape(lambda: engine.decode.init_cache(cfg, slots, S)),
                 generate.cache_shardings(cfg, slots, S, mesh))
  plan = {"params": held(params), "cache": held(cache)}
  where = (f"slots split over {' x '.join(generate.cache_axes(slots, mesh))}"
           if generate.cache_axes(slots, mesh) else "every slot on every device")
  notes = [f"cache: {slots} slots x {S} positions ({engine.decode.cache_bytes_per_token(cfg)}"
           f" B a token), {where}: {held(cache) / slots / GB:.3f} GB of each device per slot"]
  slotted = f"{slots} slots x {S}" + (f" ({rows} asked; slot_count)" if slots != rows else "")
  shape = dict(slots=slots, positions=S, cache_bytes_per_slot=S * engine.decode.
               cache_bytes_per_token(cfg), cache_bytes_per_slot_per_device=held(cache) / slots)
  if program == "prefill":
    b = generate.rows_bucket(rows, mesh)          # Engine._slots of `rows` new rows
    T = min(generate.bucket(prompt or max_len), S)   # Engine._prefill's prompt bucket
    kw = dict(seeds=host((b,), np.uint32), temperature=host((b,), np.float32),
              top_k=host((b,), np.int32), top_p=host((b,), np.float32), allowed=None,
              filtered=False, top=-1, echo=False)
    args = (params, cache, host((b, T), np.int32), host((b,), np.int32), host((b,), np.int32))
    return Job(f"{program} (k2jax.serving.engine admit)", admit, args, kw, mesh, plan,
               f"{rows} new rows (batch {b}) x {T} prompt tokens into {slotted}", notes, 2,
               dict(shape, batch=b, prompt_bucket=T))
  b, every = engine.dispatch_rows(slots, slots, mesh)     # Engine._advance, all occupied
  kw = dict(seeds=host((b,), np.uint32), t=host((b,), np.int32),
            temperature=host((b,), np.float32), top_k=host((b,), np.int32),
            top_p=host((b,), np.float32), active=host((b,), np.bool_), allowed=None,
            n=engine.CHUNK, span=S, filtered=False, top=-1, every=every)
  args = (params, cache, host((b,), np.int32), host((b,), np.int32))
  return Job(f"{program} (k2jax.serving.engine steps)", steps, args, kw, mesh, plan,
             f"{engine.CHUNK} steps of batch {b} over {slotted}", notes, 2,
             dict(shape, batch=b))


# ----------------------------------------------------------------------------------- RL


def fit(mesh_cfg, n: int, name: str) -> dict:
  """{axis: size} of a mesh group with data filling `n` devices. ValueError (one line)."""
  shape = {a: int(mesh_cfg.get(a, 1)) for a in parallel.MESH_AXES}
  others = math.prod(v for a, v in shape.items() if a != "data")
  if math.prod(shape.values()) != n:
    if n % others:
      raise ValueError(f"{name}: {n} devices are not a multiple of its axes other than data "
                       f"({others}): set --config.{name}.* for this topology")
    shape["data"] = n // others
  return shape


def rl_update(config, devices, rows: int, length: int) -> Job:
  """k2jax.rl.train.step_program with what rl.train's loop passes it: the state placed by
  parallel.state_shardings on config.mesh (its opt_state's shardings handed to the step),
  batch_of's host arrays of `rows` trajectories x `length` tokens, and a PTX batch of
  rl.ptx_batch_size chat rows of train.seq_len when rl.ptx_weight > 0. (logp_old, the
  trainer's forward's [P, K] output, is given whole on the mesh.)"""
  from k2jax import optim
  from k2jax.tools import plan
  from k2jax.rl import train as rl
  from k2jax.training.step import init_state
  r, t = config.rl, config.train
  if rows % r.samples:
    raise ValueError(f"--rows {rows}: the update's rows are rl.prompts x rl.samples, a "
                     f"multiple of rl.samples = {r.samples}")
  config = xla_target.fit_mesh(config, len(devices))
  shape = xla_target.mesh_sizes(config)
  mesh = parallel.make_mesh(config.mesh, devices)
  platform = devices[0].platform
  with kernel_platform.target(platform):
    kernels.prepare(config.model.attention_impl, config.model.moe_impl)
    tx = optim.optimizer(config)      # as rl.train._run builds them, outside the mesh
    abstract = jax.eval_shape(lambda: init_state(config, tx, jax.random.key(t.seed)))
    specs = model.param_specs(config.model)
    shardings = parallel.state_shardings(specs, mesh, abstract, tx,
                                         host_state=config.optimizer.host_state)
    step = rl.step_program(config, tx, shardings.opt_state,
                           parallel.grad_shardings(specs, mesh, abstract.params))
  state = placed(abstract, shardings)
  P, K = rows // r.samples, r.samples
  batch = dict(inputs=host((rows, length), np.int32), targets=host((rows, length), np.int32),
               mask=host((rows, length), np.float32), weights=host((rows, length), np.float32),
               segment_ids=host((rows, length), np.int32),
               positions=host((rows, length), np.int32), rewards=host((P, K), np.float32),
               sample_mask=host((P, K), np.bool_),
               logp_old=jax.ShapeDtypeStruct((P, K), jnp.float32,
                                             sharding=parallel.replicated(mesh)))
  ptx = None
  if float(r.ptx_weight) > 0:      # sft.ChatRows' arrays
    ptx = {k: host((int(r.ptx_batch_size), t.seq_len), dt)
           for k, dt in (("inputs", np.int32), ("targets", np.int32),
                         ("segment_ids", np.int32), ("positions", np.int32),
                         ("loss_mask", np.float32))}
  batch_devices = generate.batch_devices(mesh)
  est = plan.estimate(config, shape, seq_len=length, micro_batch=max(1, rows // batch_devices),
                      microbatches=1, platform=platform)
  plan_bytes = {"state": held(state), "plan (K1.5 forward; PTX not counted)": est.device}
  notes = [f"state on the device {held(state) / GB:.2f} GB, in host memory "
           f"{held(state, 'host') / GB:.2f} GB (parallel.state_shardings); plan: device "
           f"{est.device / GB:.2f} GB, host {est.host / GB:.2f} GB"]
  ptx_rows = f", PTX {r.ptx_batch_size} x {t.seq_len}" if ptx is not None else ""
  return Job("rl update (k2jax.rl.train.step_program)", step, (state, batch, ptx), {}, mesh,
             plan_bytes, f"{P} prompts x {K} samples = {rows} rows x {length}{ptx_rows}",
             notes)


def rl_sampler(config, devices, rows: int, length: int, prompt: int | None):
  """(prefill Job, fn(compiled prefill) -> decode-steps Job): k2jax.generate's programs as
  Rollouts.decode calls generate on rl.inference_mesh: params in model.param_dtype placed
  by parallel.param_shardings there (rl.train's inf_shardings), `rows` trajectories with
  prompts of `prompt` tokens and rl.segment_tokens more, sampled at a traced temperature
  with their log probabilities."""
  r, cfg = config.rl, config.model
  mesh = parallel.make_mesh(fit(r.inference_mesh, len(devices), "rl.inference_mesh"), devices)
  new = min(int(r.segment_tokens), int(r.budget))
  prompt = prompt or max(1, length - new)
  generate.check_context(cfg, [[0] * prompt], new, flag="--")
  # generate's shapes: rows bucketed for the mesh, prompt and cache lengths bucketed
  B, T, S = (generate.rows_bucket(rows, mesh), generate.bucket(prompt),
             generate.bucket(prompt + new))
  with kernel_platform.target(devices[0].platform):
    prefill, _, steps = generate._programs(cfg)
  params = abstract_params(cfg, parallel.param_shardings(model.param_specs(cfg), mesh))
  whole = parallel.replicated(mesh)       # what generate makes eagerly under the mesh
  cache = jax.eval_shape(lambda: generate.decode.init_cache(cfg, B, S))
  cache = placed(cache, generate.cache_shardings(cfg, B, S, mesh)
                 if generate.cache_axes(B, mesh) else whole)   # as generate() makes it
  key = placed(jax.eval_shape(lambda: jax.random.key(0)), whole)
  opts = dict(greedy=False, top_k=None, top_p=None,
              temperature=jax.ShapeDtypeStruct((), jnp.float32, sharding=whole))
  plan = {"params": held(params), "cache": held(cache)}
  notes = [f"cache: {S} positions a row, {held(cache) / B / GB:.3f} GB of each device per row"]
  first = Job("rl sampler prefill (k2jax.generate)", prefill,
              (params, placed(jax.ShapeDtypeStruct((B, T), jnp.int32), whole),
               placed(jax.ShapeDtypeStruct((B,), jnp.int32), whole), cache, key, None), opts,
              mesh, plan, f"{rows} trajectories (batch {B}) x {T} prompt tokens, cache {S}",
              notes)

  def then(compiled) -> Job:
    nxt, _, out = placed(compiled.out_info, compiled.output_shardings)
    n = min(generate.CHUNK, new - 1) or 1
    plan2 = {"params": held(params), "cache": held(out)}
    return Job("rl sampler decode steps (k2jax.generate)", steps,
               (params, out, nxt, key, 1), dict(opts, n=n, logp=True), mesh, plan2,
               f"{n} steps of batch {B} over {S} positions",
               [f"cache as the prefill returns it: {held(out) / B / GB:.3f} GB of each "
                "device per row"], 1)
  return first, then


# ---------------------------------------------------------------------------------- CLI


def main(args, config, devices) -> list[dict]:
  """Compile what --program asks for on `devices`, print each table; -> records. Raises
  ValueError for the user's mistakes; XLA's refusals as Refused."""
  jobs = []       # Jobs, or fn(the previous one's compiled executable) -> Job
  # (generate.UserError, raised below for a bad --mesh, is a ValueError: cli says it)
  if args.program in ("prefill", "decode"):
    configs.validate(config)
    cfg = config.model
    mesh = serving_mesh(cfg, args.mesh, devices)
    jobs.append(serving(cfg, mesh, args.program, args.rows or 8,
                        args.context or cfg.max_position_embeddings, args.prompt))
  else:   # rl
    if "rl" not in config:
      raise ValueError(f"--config {args.config} has no rl group: use kimi_k2_rl or tiny_rl "
                       "(or a config with an rl group)")
    from k2jax.rl.train import configs_validate
    configs_validate(config)
    rows = args.rows or int(config.rl.prompts) * int(config.rl.samples)
    length = args.context or int(config.train.seq_len)
    jobs.append(rl_update(config, devices, rows, length))
    jobs.extend(rl_sampler(config, devices, rows, length, args.prompt))
  out, result = [], None
  for job in jobs:
    job = job if isinstance(job, Job) else job(result.compiled)
    try:
      result = run(job, args.dump)
    except ValueError as e:     # a trace-time check: the geometry on this mesh
      raise ValueError(f"{job.label}: {str(e).splitlines()[0]}") from None
    except Exception as e:
      raise Refused(xla_target.refusal(e, what=f"the {job.label.split(' (')[0]}")) from None
    if job.cache_at is not None:   # the engine's next call takes what this one returns
      out_at = result.compiled.output_shardings[job.cache_at]
      same = all(o.is_equivalent_to(a.sharding, len(a.shape)) for o, a in
                 zip(jax.tree.leaves(out_at), jax.tree.leaves(job.args[1])))
      job.notes.append("the cache comes back placed as it went in" if same else
                       "the cache comes back placed otherwise: the next call reshards it")
    print(table(args, job, result))
    out.append(record(args, job, result))
  return out


class Refused(Exception):
  """XLA refused a program: its one line."""


def cli(args, config, devices) -> None:
  """k2jax.compile's main for --program rl / prefill / decode: a mistake ends in one line
  and exit code 2, XLA's refusal in its line and exit code 1 (as the train step's)."""
  import sys
  try:
    records = main(args, config, devices)
  except ValueError as e:
    print(f"k2jax.compile: error: {str(e).splitlines()[0]}", file=sys.stderr)
    raise SystemExit(2)
  except Refused as e:
    if args.json:
      xla_target.write_json(args.json, dict(config=args.config, topology=args.topology,
                                            program=args.program, compiled=False,
                                            refusal=str(e)))
    print(f"k2jax.compile: {e}", file=sys.stderr)
    raise SystemExit(1)
  if args.json:
    xla_target.write_json(args.json, dict(config=args.config, topology=args.topology,
                                          program=args.program, compiled=True,
                                          programs=records))


def mesh_text(mesh) -> str:
  return ",".join(f"{a}={v}" for a, v in mesh.shape.items() if v > 1) or "one device"


def table(args, job: Job, result: xla_target.Compiled) -> str:
  d = result.device
  mesh_total = math.prod(job.mesh.shape.values())
  planned = sum(v for k, v in job.plan.items() if not k.startswith("plan"))
  estimate = next((v for k, v in job.plan.items() if k.startswith("plan")), None)
  lines = [f"{args.config} {job.label}: {job.geometry}, compiled for {args.topology} "
           f"({mesh_total} x {result.kind}; mesh {mesh_text(job.mesh)}) in "
           f"{result.seconds:.0f} s",
           f"{'per device':<34}{'XLA GB':>10}{'plan GB':>10}"]
  parts = ", ".join(f"{k} {v / GB:.2f}" for k, v in job.plan.items() if not k.startswith("plan"))
  rows = [("arguments", d["arguments"], planned, f"  ({parts})"),
          ("outputs not donated", d["outputs"] - d["aliased"], None, ""),
          ("temporaries", d["temporaries"], None, ""),
          ("peak", d["peak"], estimate, "  (plan: k2jax.plan's step estimate)"
           if estimate else "")]
  if result.host["peak"]:
    rows.append(("host", result.host["peak"], None, ""))
  for label, xla, plan_bytes, note in rows:
    plan_col = f"{plan_bytes / GB:>10.2f}" if plan_bytes is not None else f"{'':>10}"
    lines.append(f"  {label:<32}{xla / GB:>10.2f}{plan_col}{note}")
  lines += [f"  {x}" for x in job.notes]
  if result.hbm:
    lines.append(f"HBM {result.hbm / GB:.1f} GB per chip ({result.hbm / xla_target.GIB:.2f} "
                 f"GiB, XLA's figure): peak {d['peak'] / result.hbm:.0%} of it: "
                 f"{xla_target.verdict(d['peak'], result.hbm)}")
  return "\n".join(lines)


def record(args, job: Job, result: xla_target.Compiled) -> dict:
  """One compiled program's figures, flat (JSON, CSV rows)."""
  d = result.device
  return dict(program=job.label, config=args.config, topology=args.topology,
              kind=result.kind, mesh=mesh_text(job.mesh), geometry=job.geometry,
              rows=args.rows, context=args.context, prompt=args.prompt,
              seconds=round(result.seconds, 1), xla_device=d, xla_host=result.host,
              plan={k: int(v) for k, v in job.plan.items()}, hbm=result.hbm, **job.shape,
              fits=bool(result.hbm and d["peak"] <= xla_target.ROOM * result.hbm),
              verdict=xla_target.verdict(d["peak"], result.hbm) if result.hbm else None)
