"""Loading published weights onto a mesh: host memory, speed and bytes read per process.

    python experiments/bench_load.py [--gb 3] [--mesh pipeline=2,data=2,expert=2]
                                     [--dir /tmp/k2jax_bench_ckpt] [--before_gb 0.6]

Writes a DeepSeek-V3-shaped checkpoint (MLA, group-limited routing, dense leading layers,
shared experts) of about `--gb` on disk in the published layout: decoder linears FP8 with
128x128 block scales, routed experts INT4 pack-quantized (group 32), the rest bf16, in
several files. Then, each in a fresh process with 8 simulated CPU devices (params stored
bf16, the trainer's shardings on `--mesh`):

  raw      read every file, cold (its pages dropped from the page cache first), in 64 MB
           reads: what the disk gives
  load     k2jax.interop.hf.load, cold: each shard's blocks read, dequantized, cast
  before   the loader this replaced (k2jax as of 2ddd0a3, from git): the whole model in
           float32 on the host, then on device 0, then device_put to the mesh; run on a
           `--before_gb` checkpoint (on the big one it needs more memory than the machine)
  2 procs  load with 2 processes x 4 devices (jax.distributed on localhost): bytes each
           process read, against its share (the bytes in the file of the elements its
           devices hold, each counted once)

Reported: peak RSS growth during the load over the loaded arrays' bytes (all devices' shards:
CPU devices live in host memory), throughput (bytes on disk / s) over raw's, bytes read, and
the host's own part (host_seconds: reading the blocks and sending them to the devices, what
an accelerator's host does; the rest is the devices' conversion, here XLA:CPU on the same two
cores). Beside them, this machine's ceilings: the memory copy rate, the cold disk read rate
and XLA:CPU's rate for the loader's INT4 -> bf16 conversion program on one device.
Writes experiments/results/load/load.csv.
"""

import argparse
import csv
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OUT = os.path.join(HERE, "results", "load")
BEFORE = "2ddd0a3"      # the commit whose loader this replaced
sys.path.append(HERE)   # experiments/from_git.py (after site-packages, as ROOT below)


def arch(gb: float) -> dict:
  """A DeepSeek-V3-shaped config whose checkpoint is about `gb` on disk (FP8 + INT4)."""
  layers = max(4, int(round(8 * gb)))
  return dict(vocab_size=32768, hidden_size=1536, intermediate_size=4096,
              moe_intermediate_size=512, num_hidden_layers=layers, first_k_dense_replace=1,
              num_attention_heads=16, q_lora_rank=512, kv_lora_rank=256, qk_nope_head_dim=64,
              qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=64, num_experts_per_tok=6,
              n_shared_experts=1, n_group=8, topk_group=4, routed_scaling_factor=2.5,
              norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=10000.0, bos_token_id=0,
              eos_token_id=1, max_position_embeddings=4096, architectures=[
                  "DeepseekV3ForCausalLM"], model_type="deepseek_v3", torch_dtype="bfloat16")


def write_checkpoint(path: str, gb: float, seed: int = 0) -> None:
  import ml_dtypes

  from k2jax.interop import hf, quant, safetensors_io
  cj = arch(gb)
  cj["quantization_config"] = {
      "quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
          "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
          "group_size": 32}}}}
  cfg = hf.config_from_hf(cj)
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(cj, f)
  fp8 = {n for n, _, _ in hf.published_layout(cfg, fp8=True) if n.endswith("_scale_inv")}
  layout = []
  for name, dtype, shape in hf.published_layout(cfg, int4=True):
    if name + "_scale_inv" in fp8:
      layout += [(name, np.dtype(ml_dtypes.float8_e4m3fn), shape),
                 (name + "_scale_inv", np.dtype(np.float32), quant.fp8_scale_shape(shape))]
    else:
      layout.append((name, dtype, shape))
  writer = safetensors_io.Writer(path, layout, int(0.6e9))
  writer.write_index()
  rng = np.random.default_rng(seed)
  shapes = {n: s for n, _, s in layout}
  for name, dtype, shape in layout:
    if name.endswith(("_scale_inv", "_scale", "_shape")):
      continue
    base = name[:-len("_packed")] if name.endswith("_packed") else name
    if name.endswith("_packed"):
      rows, cols = shape[0], shape[1] * 8
      w = rng.standard_normal((rows, cols), np.float32) / math.sqrt(cols)
      packed, scale = quant.quantize_int4(w)
      writer.write(name, packed)
      writer.write(base + "_scale", scale)
      writer.write(base + "_shape", np.array([rows, cols], np.int64))
    elif name + "_scale_inv" in shapes:
      w = rng.standard_normal(shape, np.float32) / math.sqrt(shape[-1])
      q, s = quant.quantize_fp8(w)
      writer.write(name, q)
      writer.write(name + "_scale_inv", s)
    else:
      w = rng.standard_normal(shape, np.float32) / math.sqrt(shape[-1])
      writer.write(name, w.astype(dtype))


def files(path):
  return sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))


def drop_cache(path):
  """Evict the files' pages from the page cache (a cold read, as from a new host's disk)."""
  for f in files(path):
    fd = os.open(f, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


def rss() -> int:
  return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss() -> int:
  for line in open("/proc/self/status"):
    if line.startswith("VmHWM:"):
      return int(line.split()[1]) * 1024
  return 0


def reset_peak():
  with open("/proc/self/clear_refs", "w") as f:   # VmHWM back to the current RSS
    f.write("5")


def disk_bytes(path) -> int:
  from k2jax.interop import safetensors_io
  r = safetensors_io.Reader(path)
  return sum(r.info(n).nbytes for n in r.names())


# --------------------------------------------------------------------------- children


def child_raw(args):
  drop_cache(args.dir)
  buf = bytearray(64 << 20)
  t0, n = time.perf_counter(), 0
  for f in files(args.dir):
    with open(f, "rb", buffering=0) as fh:
      while (k := fh.readinto(buf)):
        n += k
  return {"seconds": time.perf_counter() - t0, "bytes_read": n}


def _mesh_and_cfg(args):
  """(model config, the trainer's param shardings on --mesh, its pipeline layout or None)."""
  import jax

  from k2jax import model, parallel
  from k2jax.interop import hf
  from k2jax.parallel import layout
  from k2jax.parallel.mesh import parse_mesh
  cfg = hf.read_config(args.dir)
  cfg.param_dtype = "bfloat16"
  shape = parse_mesh(args.mesh, jax.device_count())
  mesh = parallel.make_mesh(shape)
  sp = layout.split(cfg, shape["pipeline"]) if shape["pipeline"] > 1 else None
  stored = layout.stored_model(cfg, sp) if sp else cfg
  return cfg, parallel.param_shardings(model.param_specs(stored), mesh), sp


def _held(params) -> int:
  import jax
  return sum(s.data.nbytes for a in jax.tree.leaves(params) for s in a.addressable_shards)


def child_load(args):
  import jax

  from k2jax.interop import hf
  cfg, shardings, sp = _mesh_and_cfg(args)
  drop_cache(args.dir)
  base = rss()
  reset_peak()
  t0, stats = time.perf_counter(), {}
  params = hf.load(args.dir, cfg, shardings, layout=sp, stats=stats)
  jax.block_until_ready(params)
  return {"seconds": time.perf_counter() - t0, "bytes_read": stats["bytes_read"],
          "rss_growth": peak_rss() - base, "held": _held(params),
          "host_peak": stats["host_peak"], "read_seconds": stats["read_seconds"],
          "process": jax.process_index()}


def _before_module():
  """k2jax.interop.hf as of BEFORE, with its safetensors_io and quant, from git."""
  from from_git import module_at
  for name in ("quant", "safetensors_io"):
    module_at(BEFORE, f"k2jax/interop/{name}.py", f"before_{name}")
  return module_at(BEFORE, "k2jax/interop/hf.py", "before_hf", replace=[(
      "from k2jax.interop import quant, safetensors_io",
      "import before_quant as quant, before_safetensors_io as safetensors_io")])


def child_before(args):
  import jax
  import jax.numpy as jnp
  from k2jax.parallel import layout
  before = _before_module()
  cfg, shardings, sp = _mesh_and_cfg(args)
  drop_cache(args.dir)
  base = rss()
  reset_peak()
  t0 = time.perf_counter()
  _, params = before.load_checkpoint(args.dir)     # the whole model, float32, on device 0
  params = jax.device_put(layout.convert_params(sp, jax.tree.map(
      lambda a: a.astype(jnp.bfloat16), params), layout.to_stored), shardings)
  jax.block_until_ready(params)
  return {"seconds": time.perf_counter() - t0, "bytes_read": disk_bytes(args.dir),
          "rss_growth": peak_rss() - base, "held": _held(params), "host_peak": 0,
          "process": 0}


def share(args) -> dict:
  """{process: bytes in the files of the elements its devices hold, each counted once}
  (2 processes x 4 devices, processes owning consecutive devices of the mesh): each
  distinct block's share of every published tensor it covers (its codes and scales)."""
  from jax.sharding import AbstractMesh

  from k2jax.configs.sharding_rules import param_spec
  from k2jax.interop import hf, safetensors_io, shards
  from k2jax.parallel import layout
  from k2jax.parallel.mesh import MESH_AXES, parse_mesh
  cfg = hf.read_config(args.dir)
  shape = parse_mesh(args.mesh, 8)
  sp = layout.split(cfg, shape["pipeline"]) if shape["pipeline"] > 1 else None
  mesh = AbstractMesh(tuple(shape[a] for a in MESH_AXES), MESH_AXES)
  hosts = (np.arange(8) // 4).reshape([shape[a] for a in MESH_AXES])
  reader = safetensors_io.Reader(args.dir)
  tensor_bytes = {}       # published tensor -> bytes of it and its scales / packing parts
  for n in reader.names():
    base = n
    for suffix in ("_scale_inv", "_packed", "_scale", "_shape"):
      base = base[:-len(suffix)] if base.endswith(suffix) else base
    tensor_bytes[base] = tensor_bytes.get(base, 0) + reader.info(n).nbytes
  out = {0: 0.0, 1: 0.0}
  for leaf in hf.leaves(cfg, sp).values():
    s = leaf.spec
    pspec = param_spec(s.axes, s.shape, mesh)
    inner = math.prod(s.shape[leaf.lead:])
    for host, blocks in shards.host_blocks(pspec, s.shape, dict(mesh.shape), hosts).items():
      for b in blocks:
        names = np.asarray(leaf.names[tuple(b[:leaf.lead])], object).reshape(-1)
        frac = shards.nbytes(b[leaf.lead:], 1) / inner
        out[host] += frac * sum(tensor_bytes[n] for n in names if n is not None)
  return out


def run_child(kind, args, devices=8, extra=()):
  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
             JAX_PLATFORMS="cpu")
  p = subprocess.run([sys.executable, __file__, "--child", kind, "--dir", args.dir, "--mesh",
                      args.mesh, *extra], env=env, capture_output=True, text=True)
  if p.returncode:
    raise RuntimeError(f"{kind}: {p.stderr[-3000:]}")
  return json.loads(next(l for l in p.stdout.splitlines() if l.startswith("RESULT "))[7:])


def two_processes(args):
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
             JAX_PLATFORMS="cpu")
  procs = [subprocess.Popen([sys.executable, __file__, "--child", "load", "--dir", args.dir,
                             "--mesh", args.mesh, "--coordinator", f"127.0.0.1:{port}",
                             "--process", str(i)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True) for i in range(2)]
  out = []
  for p in procs:
    o, e = p.communicate(timeout=3600)
    if p.returncode:
      raise RuntimeError(f"2 processes: {e[-3000:]}")
    out.append(json.loads(next(l for l in o.splitlines() if l.startswith("RESULT "))[7:]))
  return out


def ceilings(path) -> dict:
  """This machine's memory copy rate, and XLA:CPU's rate for the loader's own conversion
  program of the routed experts (INT4 -> bf16, transposed) on one device, both cores."""
  import jax

  from k2jax.interop import hf, loader, safetensors_io
  a, b = np.ones(1 << 28, np.uint8), np.zeros(1 << 28, np.uint8)   # both pages touched
  t0 = time.perf_counter()
  for _ in range(4):
    np.copyto(b, a)
  copy = 4 * a.nbytes / (time.perf_counter() - t0)
  del a, b
  cfg = hf.read_config(path)
  cfg.param_dtype = "bfloat16"
  reader = safetensors_io.Reader(path)
  infos = {n: reader.info(n) for n in reader.names()}
  leaf = hf.leaves(cfg)[("moe_layers", "moe", "experts", "gate")]
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  p = hf.leaf_plan(leaf, hf.kinds(cfg, infos, path), infos, *hf.split_of(one))
  shape = tuple(leaf.spec.shape)
  zeros, write = loader.programs(p, shape, np.dtype("bfloat16"), one)
  raws = [jax.device_put(np.zeros(loader.raw_shape(shape, p, part), part.dtype), one)
          for part in p.parts]
  out = write(zeros(), np.zeros(p.lead, np.int32), *raws).block_until_ready()
  t0, n = time.perf_counter(), 5
  for _ in range(n):
    out = write(out, np.zeros(p.lead, np.int32), *raws)
  out.block_until_ready()
  per_chunk = math.prod(loader.raw_shape(shape, p, p.parts[0])[:p.lead]) * math.prod(
      shape[p.lead:])
  return {"memory_copy_GBps": copy / 1e9,
          "convert_Gelt_per_s": n * per_chunk / (time.perf_counter() - t0) / 1e9}


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--gb", type=float, default=3.0)
  p.add_argument("--before_gb", type=float, default=0.6)
  p.add_argument("--mesh", default="pipeline=2,data=2,expert=2")
  p.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "k2jax_bench_load"))
  p.add_argument("--out", default=OUT)
  p.add_argument("--child")
  p.add_argument("--coordinator")
  p.add_argument("--process", type=int, default=0)
  args = p.parse_args()
  if args.child:
    if args.coordinator:
      import jax
      jax.config.update("jax_cpu_collectives_implementation", "gloo")
      jax.distributed.initialize(args.coordinator, 2, args.process)
    r = {"raw": child_raw, "load": child_load, "before": child_before}[args.child](args)
    print("RESULT " + json.dumps(r), flush=True)
    return
  sys.path.append(ROOT)   # k2jax when not installed, after site-packages
  rows = []
  big, small = args.dir, args.dir + "_small"
  for path, gb in ((big, args.gb), (small, args.before_gb)):
    if not os.path.exists(os.path.join(path, "config.json")):
      print(f"writing a {gb} GB checkpoint to {path}", flush=True)
      write_checkpoint(path, gb)
  ceil = ceilings(big)
  for path in (big, small):
    a = argparse.Namespace(**{**vars(args), "dir": path})
    on_disk = disk_bytes(path)
    raw = run_child("raw", a)
    ceil.setdefault("disk_cold_GBps", raw["bytes_read"] / raw["seconds"] / 1e9)
    runs = [("raw", raw), ("load", run_child("load", a))]
    if path == small:
      runs.append(("before", run_child("before", a)))
    for name, r in runs:
      rows.append({
          "checkpoint_GB": round(on_disk / 1e9, 3), "run": name,
          "seconds": round(r["seconds"], 2),
          "throughput_GBps": round(on_disk / r["seconds"] / 1e9, 3),
          "throughput_vs_raw": round(raw["seconds"] / r["seconds"], 3),
          "arrays_GB": round(r.get("held", 0) / 1e9, 3),
          "rss_growth_GB": round(r.get("rss_growth", 0) / 1e9, 3),
          "rss_over_arrays": round(r["rss_growth"] / r["held"], 3) if r.get("held") else "",
          "rss_over_file": round(r["rss_growth"] / on_disk, 3) if r.get("held") else "",
          "bytes_read_GB": round(r["bytes_read"] / 1e9, 3),
          "host_seconds": round(r.get("read_seconds", r["seconds"]), 2),
          "host_vs_raw": round(raw["seconds"] / r.get("read_seconds", r["seconds"]), 3)
          if name != "before" else "",
          "process": "all"})
  a = argparse.Namespace(**{**vars(args), "dir": big})
  shares = share(a)
  on_disk = disk_bytes(big)
  for r in two_processes(a):
    i = r["process"]
    rows.append({"checkpoint_GB": round(on_disk / 1e9, 3), "run": "load, 2 processes",
                 "seconds": round(r["seconds"], 2),
                 "bytes_read_GB": round(r["bytes_read"] / 1e9, 3),
                 "share_GB": round(shares[i] / 1e9, 3),
                 "read_over_share": round(r["bytes_read"] / shares[i], 3), "process": i})
  keys = ["checkpoint_GB", "run", "process", "seconds", "throughput_GBps", "throughput_vs_raw",
          "host_seconds", "host_vs_raw", "arrays_GB", "rss_growth_GB", "rss_over_arrays",
          "rss_over_file", "bytes_read_GB", "share_GB", "read_over_share"]
  print(f"mesh {args.mesh}, 8 CPU devices, params bfloat16; machine: memory copy "
        f"{ceil['memory_copy_GBps']:.1f} GB/s, cold disk read {ceil['disk_cold_GBps']:.2f} GB/s, "
        f"XLA:CPU converts INT4 experts to bf16 at {ceil['convert_Gelt_per_s']:.2f} G weights/s")
  print(" | ".join(keys))
  for r in rows:
    print(" | ".join(str(r.get(k, "")) for k in keys))
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "load.csv"), "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=keys + list(ceil))
    w.writeheader()
    for r in rows:
      w.writerow({**r, **{k: round(v, 3) for k, v in ceil.items()}})


if __name__ == "__main__":
  main()
