"""XLA's targets, asked without running anything on them: the chips of a TPU topology as
devices XLA:TPU compiles for, the HBM one program may use on each, and XLA's figures at its
buffer assignment (where its out-of-memory check runs) from a `python -m k2jax.compile` child
process.

`k2jax.compile` (the whole compile, beside plan's figures) and `k2jax.plan --compile` (plan
beside XLA's buffer assignment) both stand on this module, so neither imports the other's
command line.
"""

import copy
import glob
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple

import jax

from k2jax.tools import xla_heap
from k2jax.parallel.mesh import MESH_AXES

GB = 1e9
GIB = 1 << 30

# HBM XLA:TPU lets one program use per chip, by device kind: the figure its own
# out-of-memory message gives ("exceeds available HBM (95.74G)", GiB), read once per
# generation by compiling a program that does not fit (libtpu 0.0.42.1).
TPU_HBM = {
    "TPU v4": 15.25 * GIB,        # per TensorCore device (megacore off)
    "TPU v5 lite": 15.75 * GIB,   # v5e
    "TPU v5": 95.74 * GIB,        # v5p
    "TPU v6 lite": 31.25 * GIB,   # v6e
}
# What a run needs beside the compiled program (the runtime, collectives' buffers,
# fragmentation): a compiled peak above this share of HBM is reported as too tight to run.
ROOM = 0.8


def verdict(peak: float, hbm: float) -> str:
  """Whether a compiled peak (bytes on one chip) leaves a run room in `hbm`."""
  return ("fits" if peak <= ROOM * hbm else
          f"fits, but above {ROOM:.0%} of HBM: little room to run" if peak <= hbm else
          "does NOT fit")


def topology_devices(name: str):
  """The devices of a TPU topology name ("v5p:8x16x16"; "v5e:1x1" is one chip, as Colab
  gives it) or of this machine ("local"). ValueError (one line) for an unknown name."""
  if name == "local":
    return jax.devices()
  from jax.experimental import topologies
  kind, _, shape = name.partition(":")
  dims = [int(d) for d in shape.split("x")] if re.fullmatch(r"\d+(x\d+)*", shape) else None
  if not dims:
    raise ValueError(f"--topology {name!r}: expected local or GENERATION:AxB[xC] "
                     "(v5e:1x1, v5e:2x2, v5p:2x2x2, v5p:8x16x16)")
  # a single chip is its own host; larger slices take libtpu's host layout
  extra = {"chips_per_host_bounds": (1, 1, 1)} if math.prod(dims) == 1 else {}
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")   # beside other libtpu users
  try:
    return topologies.get_topology_desc(platform="tpu", topology_name=name, **extra).devices
  except Exception as e:  # libtpu missing, or a name it does not know
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    hint = ("install the TPU compiler: pip install -e \".[tpu]\""
            if "tpu" in first.lower() and ("not" in first.lower() or "unknown" in
                                           first.lower()) else
            "names look like v5e:1x1, v5e:2x2, v5p:2x2x2, v5p:8x16x16")
    raise ValueError(f"--topology {name!r}: {first} ({hint})") from None


def hbm_bytes(device) -> float | None:
  """Memory one program may use on `device`: XLA:TPU's figure per device kind, or what a
  local GPU reports; None where unknown."""
  if device.platform == "tpu":
    return TPU_HBM.get(device.device_kind)
  try:
    return float(device.memory_stats()["bytes_limit"])
  except Exception:
    return None


# Colors of XLA:TPU's memory spaces in a buffer assignment (libtpu 0.0.42.1): 0 is HBM,
# 5 host memory (its memory-usage report calls it cmem); the others are on-chip scratch.
_DEVICE_COLOR, _HOST_COLOR = 0, 5


def buffer_assignment(text: str) -> tuple[dict, dict]:
  """(device, host) bytes of XLA's dumped buffer assignment
  (`*after_optimizations-buffer-assignment.txt`) by kind: arguments (the entry parameters),
  heap (the preallocated temporaries: XLA packs every temporary into one heap) and
  thread_local (buffers of computations XLA:TPU runs on the host: at K2 the part of the Muon
  update beside host-resident optimizer states). check: what XLA's out-of-memory check
  counts, arguments + heap (its "HLO temporaries" in the refusals of the 32k step, to the
  hundredth of a GiB); peak: all three, the device memory space's total."""
  out = {c: dict(arguments=0, heap=0, thread_local=0) for c in (_DEVICE_COLOR, _HOST_COLOR)}
  for a in filter(None, map(xla_heap.allocation, text.splitlines())):
    size, color, kind = a
    if kind and color in out:
      out[color][kind] += size
  for d in out.values():
    d["check"] = d["arguments"] + d["heap"]
    d["peak"] = d["check"] + d["thread_local"]
  return out[_DEVICE_COLOR], out[_HOST_COLOR]


def until_buffer_assignment(argv, timeout: float = 3600, poll: float = 2.0,
                            grace: float = 10.0, dump: str | None = None):
  """Run `python -m k2jax.compile *argv` (without --memory_only) in a child process that
  dumps XLA's passes, and stop it once the buffer assignment is written and XLA's
  out-of-memory check has had `grace` seconds to refuse it. -> (device, host, seconds) from
  `buffer_assignment`, or (None, the child's last k2jax.compile line, seconds) where the
  child ended with an error (XLA refused the step). XLA's dump is left in `dump` where given
  (`xla_heap.explain` reads it)."""
  t0 = time.perf_counter()
  with tempfile.TemporaryDirectory(prefix="k2jax-compile-") as d:
    xla = dump or os.path.join(d, "xla")
    env = dict(os.environ)
    env.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    err = os.path.join(d, "stderr")
    with open(err, "w") as e:
      child = subprocess.Popen([sys.executable, "-m", "k2jax.tools.compile", *argv, "--no_plan",
                                "--dump", xla],
                               stdout=subprocess.DEVNULL, stderr=e, env=env)
    try:
      while True:
        # the memory-usage report is written after the buffer assignment is complete
        done = glob.glob(os.path.join(xla, "*jit_train_step*memory-usage-report.txt"))
        if done or child.poll() is not None or time.perf_counter() - t0 > timeout:
          break
        time.sleep(poll)
      if done:   # XLA's out-of-memory check runs right after: a refusal ends the child
        try:
          child.wait(timeout=grace)
        except subprocess.TimeoutExpired:
          pass
        done = child.returncode in (None, 0)
    finally:
      child.kill()
      child.wait()
    seconds = time.perf_counter() - t0
    found = glob.glob(os.path.join(xla, "*jit_train_step*after_optimizations-buffer-assignment.txt"))
    if done and found:
      with open(found[0]) as f:
        return (*buffer_assignment(f.read()), seconds)
    lines = [ln for ln in open(err).read().splitlines() if ln.startswith("k2jax.compile")]
    return None, (lines[-1] if lines else f"k2jax.compile: no buffer assignment in "
                  f"{seconds:.0f} s"), seconds


def mesh_sizes(config) -> dict:
  """{mesh axis: size} of a full config; an axis its mesh group lacks (a config written
  before the axis existed) is 1."""
  return {a: int(config.mesh.get(a, 1)) for a in MESH_AXES}


def fit_mesh(config, n: int):
  """`config` with mesh.data set so pipeline x data x context x expert = n devices (the
  config's own mesh where it already is). ValueError (one line) where pipeline x expert x
  context does not divide n."""
  m = config.mesh
  if math.prod(mesh_sizes(config).values()) == n:
    return config
  pe = int(m.pipeline) * int(m.expert) * int(m.get("context", 1))
  if n % pe:
    raise ValueError(f"{n} devices are not a multiple of mesh.pipeline x mesh.expert x "
                     f"mesh.context = {pe}: set --config.mesh.* for this topology")
  config = copy.deepcopy(config)   # references unresolved: kimi_k2's microbatches follow
  config.mesh.data = n // pe
  return config.copy_and_resolve_references()


class Compiled(NamedTuple):
  """A train step compiled for a target, and XLA's memory analysis of it (per device)."""
  compiled: object
  seconds: float
  device: dict      # arguments, outputs, aliased, temporaries, code, peak (bytes)
  host: dict        # the same in host memory
  kind: str         # device kind
  platform: str
  hbm: float | None


def memory(analysis) -> tuple[dict, dict]:
  """(device, host) byte counts of a `compiled.memory_analysis()`. peak: what the program
  needs at once, arguments + outputs not aliased to them + temporaries (+ code)."""
  a = analysis

  def side(prefix):
    get = lambda k: int(getattr(a, f"{prefix}{k}_size_in_bytes", 0) or 0)
    d = dict(arguments=get("argument"), outputs=get("output"), aliased=get("alias"),
             temporaries=get("temp"), code=get("generated_code"))
    d["peak"] = d["arguments"] + d["outputs"] - d["aliased"] + d["temporaries"] + d["code"]
    return d
  return side(""), side("host_")


_SOURCE = re.compile(r"(k2jax/[\w/]+\.py|kernels/[\w/]+\.py)[\":, line]*(\d+)")


def refusal(error: BaseException, what: str = "the step") -> str:
  """One line for a compile XLA refused: its reason and the k2jax source line it names
  (the instruction's metadata in the message), where it names one."""
  text = str(error)
  lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
  reason = lines[0] if lines else type(error).__name__
  where = _SOURCE.search(text)
  at = f" (at {where.group(1)}:{where.group(2)})" if where else ""
  return f"XLA refused {what}: {reason[:400]}{at}"


def write_json(path, obj):
  """The figures of a compile as a JSON file (`--json`)."""
  with open(path, "w") as f:
    json.dump(obj, f, indent=1)
