"""Compile the train step for a TPU slice, or this machine's GPU, before renting one.

    pip install -e ".[tpu]"          # libtpu: XLA:TPU compiles on any machine, runs on none
    python -m k2jax.compile --config kimi_k2 --topology v5p:8x16x16
    python -m k2jax.compile --config tiny --topology v5e:1x1        # Colab's single chip
    python -m k2jax.compile --config tiny --topology local           # this machine's devices
    python -m k2jax.compile --config kimi_k2 --program decode --topology v5p:2x4x4 --mesh expert=32

`--program` rl, prefill or decode compiles the RL update with its sampler, or the serving
engine's programs, instead of the train step (k2jax.tools.compile_programs; sft: the train step).

`jax.experimental.topologies` gives the chips of a TPU slice as devices that XLA:TPU
compiles for (nothing can run on them). The step compiled is the trainer's own
(`k2jax.training.step.program`: its state and batch shardings, donation, the kernels `auto` picks
for the target's platform), on a mesh of the topology's chips: the config's mesh, with
`data` filled in from the chip count when the config's product is not it. XLA's memory
analysis of the compiled program is the truth for memory; it is printed beside
`k2jax.plan`'s figures for the same config and mesh, and the chip's HBM.

A config XLA refuses ends in one line: XLA's reason and the k2jax source line of the
instruction it names, exit code 1 (a config the trainer itself refuses: exit code 2).

`--memory_only` stops once XLA has placed every buffer (its buffer assignment, where its
out-of-memory check runs) and reads the figures from there: for K2 on 2,048 chips that is
a minute or two on a small machine, where code generation takes longer than the rest.
`--explain N` then says what the heap holds at its fullest, by the k2jax line that made each
buffer (k2jax.tools.xla_heap): where XLA's figure departs from plan's.
"""

import argparse
import math
import os
import sys
import tempfile
import time

import jax

from k2jax.tools import compile_programs as programs
from k2jax import configs, kernels, optim, parallel
from k2jax.tools import plan, xla_heap
from k2jax.tools.params import parse_config
from k2jax.parallel import layout, schedules
# (re-exported: k2jax.tools.compile.topology_devices and the rest were its names first)
from k2jax.tools.xla_target import (GB, GIB, ROOM, TPU_HBM, Compiled, buffer_assignment,  # noqa: F401
                              fit_mesh, hbm_bytes, memory, mesh_sizes, refusal,
                              topology_devices, until_buffer_assignment, verdict, write_json)
from k2jax.kernels import platform as kernel_platform

def compile_step(config, devices, dump: str | None = None) -> Compiled:
  """Compile `config`'s train step (`k2jax.training.step.program`) for `devices` (a topology's or
  local ones) on the mesh of `config.mesh`. dump: a directory for XLA's dump of the
  compiled module (its HLO, buffer assignment and memory-usage report). Raises what XLA
  raises."""
  from k2jax.training import step
  platform = devices[0].platform
  mesh = parallel.make_mesh(config.mesh, devices)
  t0 = time.perf_counter()
  with kernel_platform.target(platform):
    kernels.prepare(config.model.attention_impl, config.model.moe_impl)
    # outside set_mesh: optax builds the state's shardings by running init eagerly, on
    # the default device (a topology's chips run nothing)
    prog = step.program(config, mesh)
  with kernel_platform.target(platform), jax.set_mesh(mesh):
    options = {"xla_dump_to": dump} if dump else None
    compiled = prog.step.trace(*prog.abstract_args(config)).lower().compile(
        compiler_options=options)
  dev, host = memory(compiled.memory_analysis())
  return Compiled(compiled, time.perf_counter() - t0, dev, host, devices[0].device_kind,
                  platform, hbm_bytes(devices[0]))


def table(name: str, topology: str, config, result: Compiled, est) -> str:
  """XLA's per-device memory beside plan's (`est`: k2jax.tools.plan.Estimate, or None). Figures
  read from a buffer assignment (`--memory_only`: `buffer_assignment`'s keys) show its
  heap, XLA's out-of-memory check and the thread-local buffers."""
  d, h = result.device, result.host
  partial = "heap" in d
  sizes = mesh_sizes(config)
  mesh = ", ".join(f"{a}={v}" for a, v in sizes.items())
  n = math.prod(sizes.values())
  what = "XLA's buffer assignment of the train step for" if partial else "train step compiled for"
  lines = [f"{name}: {what} {topology} ({n} x {result.kind}; mesh {mesh}) in "
           f"{result.seconds:.0f} s" + (" (code generation not run)" if partial else ""),
           f"{'per device':<34}{'XLA GB':>10}{'plan GB':>10}{'XLA / plan':>12}"]
  planned = est.device if est else None
  rows = [("arguments (state, batch)", d["arguments"], None)]
  rows += ([("temporary heap", d["heap"], None),
            ("out-of-memory check (both)", d["check"], planned),
            ("thread-local (host-run code)", d["thread_local"], None),
            ("device memory space", d["peak"], planned)] if partial else
           [("outputs not donated", d["outputs"] - d["aliased"], None),
            ("temporaries", d["temporaries"], None), ("device peak", d["peak"], planned)])
  rows.append(("host", h["peak"], est.host if est else None))
  for label, xla, plan_bytes in rows:
    ratio = f"{xla / plan_bytes:>12.2f}" if plan_bytes else ""
    lines.append(f"  {label:<32}{xla / GB:>10.2f}"
                 f"{(f'{plan_bytes / GB:>10.2f}' if plan_bytes is not None else ''):>10}{ratio}")
  if result.hbm:
    share = d["peak"] / result.hbm
    shares = (f"XLA's check {d['check'] / result.hbm:.0%} of it, the device memory space "
              f"{share:.0%}" if partial else f"peak {share:.0%} of it")
    lines.append(f"HBM {result.hbm / GB:.1f} GB per chip ({result.hbm / GIB:.2f} GiB, XLA's "
                 f"figure): {shares}: {verdict(d['peak'], result.hbm)}")
  return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m k2jax.compile", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", required=True,
                 help=f"preset ({', '.join(configs.PRESETS)}) or config file; override any "
                 "value with --config.KEY=VALUE")
  p.add_argument("--topology", default="local",
                 help="TPU topology (v5e:1x1, v5e:2x2, v5p:2x2x2, v5p:8x16x16) or local "
                 "(this machine's devices: its GPU)")
  p.add_argument("--no_plan", action="store_true", help="skip plan's figures")
  p.add_argument("--dump", default=None,
                 help="directory for XLA's dump of the compiled step: its HLO, buffer "
                 "assignment and memory-usage report (what the temporaries are)")
  p.add_argument("--json", default=None, help="also write the figures to this JSON file")
  p.add_argument("--memory_only", action="store_true",
                 help="stop at XLA's buffer assignment (where its out-of-memory check runs) "
                 "and report its figures from there, without code generation")
  p.add_argument("--explain", type=int, default=0, metavar="N",
                 help="also print XLA's device heap at its fullest by the k2jax line that made "
                 "each buffer, the N largest (k2jax.tools.xla_heap; dumps to --dump or a temporary "
                 "directory)")
  programs.add_arguments(p)
  return p


def main(argv=None):
  p = _parser()
  try:
    args, config, overrides = parse_config("k2jax.compile", p, argv)
    programs.check_program(args)
    devices = topology_devices(args.topology)
    if args.topology != "local":
      # a compile-only client's executables go into JAX's persistent cache but cannot be
      # read back from it (libtpu 0.0.42.1: "PjRtCompiler must be constructed with a
      # Client"): every later read would warn and compile again
      jax.config.update("jax_enable_compilation_cache", False)
    if args.program not in ("train", "sft"):
      return programs.cli(args, config, devices)
    if args.program == "sft":
      print(programs.SFT_NOTE)
    config = fit_mesh(config, len(devices))
    est = None
    if not args.no_plan:
      est = plan.estimate(config, mesh_sizes(config),
                          platform=devices[0].platform)
    for validate in (configs.validate, optim.validate, layout.validate, schedules.validate):
      validate(config)   # what the trainer checks first, on the fitted mesh
  except ValueError as e:
    print(f"k2jax.compile: error: {str(e).splitlines()[0]}", file=sys.stderr)
    raise SystemExit(2)

  def refused(line):   # XLA's refusal: exit 1 with its one line (and the JSON saying so)
    if args.json:
      write_json(args.json, dict(config=args.config, topology=args.topology,
                                  compiled=False, refusal=line))
    print(f"k2jax.compile: {line}", file=sys.stderr)
    raise SystemExit(1)

  scratch = tempfile.TemporaryDirectory(prefix="k2jax-explain-") if (
      args.explain and not args.dump) else None
  dump = args.dump or (scratch.name if scratch else None)
  if args.dump and os.path.isdir(args.dump) and os.listdir(args.dump):
    # never read an earlier run's files as this one's: a new directory inside the one given
    dump = tempfile.mkdtemp(prefix="k2jax-compile-", dir=args.dump)
    print(f"k2jax.compile: {args.dump} is not empty: XLA's dump goes to {dump}",
          file=sys.stderr)
  if args.memory_only:
    device, host, seconds = until_buffer_assignment(
        ["--config", args.config, "--topology", args.topology, *overrides], dump=dump)
    if device is None:
      refused(host.removeprefix("k2jax.compile: "))
    result = Compiled(None, seconds, device, host, devices[0].device_kind,
                      devices[0].platform, hbm_bytes(devices[0]))
  else:
    try:
      result = compile_step(config, devices, dump=dump)
    except ValueError as e:   # the trainer's own checks (batch geometry on this mesh)
      print(f"k2jax.compile: error: {str(e).splitlines()[0]}", file=sys.stderr)
      raise SystemExit(2)
    except Exception as e:   # XLA's refusal: a compile error or out of memory
      refused(refusal(e))
  print(table(args.config, args.topology, config, result, est))
  peak = xla_heap.explain(dump, top=args.explain) if args.explain else None
  if peak:
    print(xla_heap.table(peak))
    if est:   # plan counts what the program holds; XLA's check adds its packing
      print(f"plan's device figure {est.device / 1e9:.2f} GB; XLA's live bytes at its fullest / "
            f"plan: {peak.all_live / est.device:.2f}")
  if args.json:
    rec = record(args.config, args.topology, config, result, est)
    if peak:
      rec["xla_live"] = peak.all_live
    write_json(args.json, dict(rec, stage="buffer assignment") if args.memory_only else rec)


def record(name, topology, config, result: Compiled, est) -> dict:
  """The figures of one compile as a flat dict (JSON, CSV rows)."""
  out = dict(config=name, topology=topology, compiled=True, kind=result.kind,
             mesh=mesh_sizes(config), seconds=result.seconds,
             hbm=result.hbm, xla_device=result.device, xla_host=result.host,
             plan_device=est.device if est else None, plan_host=est.host if est else None,
             plan_states={k: v for k, v in est.states.items()
                          if isinstance(v, (int, float))} if est else None,
             plan_activations=dict(device=est.acts.device, host=est.acts.host)
             if est else None)
  out["fits"] = bool(result.hbm and result.device["peak"] <= ROOM * result.hbm)
  return out


if __name__ == "__main__":
  main()
