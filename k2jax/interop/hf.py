"""Hugging Face checkpoints in the published K2 / DeepSeek-V3 layout <-> k2jax params, at any
size, shard by shard.

    cfg = hf.read_config(path)                                   # config.json only
    params = hf.load(path, cfg, shardings)                        # straight into shardings
    cfg, params = hf.load_checkpoint(path)                        # one device (small models)
    hf.save_checkpoint(cfg, params, out, dtype="bfloat16")        # sharded params in, streamed

Loading: every parameter leaf is a global `jax.Array` built shard by shard
(k2jax.interop.shards.build): each process reads from the safetensors files only the blocks
of the published tensors its devices' shards cover (layers and experts are stacked from many
published tensors; a shard split inside a tensor reads that tensor's block), dequantizes FP8
and INT4 blocks only there (k2jax.interop.quant) and casts them to the leaf's stored dtype
(the one `model.init` gives it: model.param_dtype, the router bias float32). No host buffer
holds more than one shard, no float32 copy of a narrower model exists, and a leaf that the
target sharding splits is never whole on one device. The header of every file is checked
against the config before any tensor is read, so a missing tensor, a wrong shape, a truncated
file or a scale that does not fit its weight ends in one line naming the tensor and the file.

Saving streams the other way (k2jax.interop.export): one tensor at a time from the shards
that hold it, each file written once, by one process.

The format itself (config.json, names, shapes, storage) is k2jax.interop.hf_format.
"""

import concurrent.futures
import functools
import time

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from k2jax.interop import loader, quant, safetensors_io, shards
from k2jax.interop.hf_format import (  # noqa: F401 (the API, in one place)
    CheckpointError, Leaf, _read_json, config_from_hf, config_to_hf, kinds, leaves,
    published_layout, read_config, tensor_map)
from k2jax.interop.quant import FP8_BLOCK, dequantize_fp8, quantize_fp8  # noqa: F401 (API)
from k2jax.model import spec
from k2jax.model.transformer import init, param_specs

# threads that compile the conversion programs while the loader reads
COMPILE_THREADS = 1

# --------------------------------------------------------------------------- load


def stored_dtypes(cfg) -> dict:
  """Each leaf's stored dtype: what model.init makes (model.param_dtype; the router bias
  float32), the one source of truth for what a loaded leaf holds."""
  return jax.eval_shape(functools.partial(init, cfg), jax.random.key(0))


def _open(path: str, cfg):
  """(reader, sources) of the directory, every file's header checked against `cfg`."""
  hf_json = _read_json(path)
  try:
    reader = safetensors_io.Reader(path)
  except (safetensors_io.FormatError, FileNotFoundError) as e:
    raise CheckpointError(str(e)) from None
  try:
    return reader, kinds(cfg, {n: reader.info(n) for n in reader.names()}, path,
                         quant.int4_group_size(hf_json))
  except CheckpointError:
    reader.close()
    raise


def check(path: str, cfg=None) -> None:
  """CheckpointError (one line) unless the directory's files hold every tensor of `cfg`
  (default: its config.json's) whole, in the published shapes: headers only, no tensor
  read. What load checks first, for callers that want the verdict before anything else."""
  reader, _ = _open(path, read_config(path) if cfg is None else cfg)
  reader.close()


_SUFFIXES = {"plain": ("",), "fp8": ("", "_scale_inv"), "int4": ("_packed", "_scale")}


def split_of(sharding) -> tuple:
  """(PartitionSpec, {mesh axis: size}, the mesh axes across processes) of a target
  sharding (one device: no split)."""
  if isinstance(sharding, NamedSharding):
    mesh = sharding.mesh
    processes = np.vectorize(lambda d: d.process_index)(mesh.devices)
    return sharding.spec, dict(mesh.shape), loader.spanning_axes(dict(mesh.shape), processes)
  return P(), {}, ()


def leaf_plan(leaf: Leaf, srcs: dict, infos: dict, spec, mesh_shape: dict,
              spanning: tuple = (), group_size: int = 32):
  """How `leaf` is read and converted into a split `spec` over a mesh of `mesh_shape`
  whose `spanning` axes cross processes (k2jax.interop.loader.Plan)."""
  names = [n for n in leaf.names.reshape(-1) if n is not None]
  stored = sorted({srcs[n] for n in names})
  if len(stored) > 1:
    raise CheckpointError(f"the tensors of {names[0]} and its kind are stored "
                          f"{' and '.join(stored)}: a leaf's tensors must be quantized alike")
  kind = stored[0]
  dtypes = {x: infos[names[0] + x].dtype for x in _SUFFIXES[kind]}
  for n in names:
    for x, d in dtypes.items():
      if infos[n + x].dtype != d:
        raise CheckpointError(f"tensor {n + x} is {infos[n + x].dtype}, where {names[0] + x} "
                              f"is {d}: tensors of one kind must be stored alike")
  return loader.plan(leaf, kind, dtypes, spec, mesh_shape, group_size, spanning)


def load(path: str, cfg, shardings, *, layout=None, stats: dict | None = None):
  """The params of the Hugging Face directory `path` for model config `cfg` (its config.json
  read with `read_config`, the stored dtype `cfg.param_dtype` of the caller's choosing),
  built straight into `shardings` (a params tree of Shardings: the trainer's, the RL
  sampler's, the server's). With `layout` (a k2jax.parallel.layout.Split) the pipelined
  stack is built as the trainer stores it (padded, in schedule order) and `shardings` are
  the stored ones.

  Each process reads only its devices' blocks (k2jax.interop.loader). A thread compiles the
  conversion programs while this one reads; the devices convert a chunk while the next is
  read. stats, if given, is filled with what loading took: bytes read, the largest host
  block, conversion programs run, seconds spent reading and sending to the devices."""
  from k2jax.parallel import layout as layouts
  reader, srcs = _open(path, cfg)
  group_size = quant.int4_group_size(_read_json(path))
  acct = {"block": 0, "seconds": 0.0}

  def build(*args):
    t0 = time.perf_counter()
    try:
      array, block = shards.build(*args)
    except safetensors_io.FormatError as e:
      raise CheckpointError(str(e)) from None
    acct["block"] = max(acct["block"], block)
    acct["seconds"] += time.perf_counter() - t0
    return array
  with reader, concurrent.futures.ThreadPoolExecutor(COMPILE_THREADS) as compiler:
    infos = {n: reader.info(n) for n in reader.names()}
    table = leaves(cfg, layout)
    abstract = stored_dtypes(cfg if layout is None else layouts.stored_model(cfg, layout))
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    jobs = []
    for (kpath, a), target in zip(flat, treedef.flatten_up_to(shardings)):
      leaf = table[tuple(k.key for k in kpath)]
      p = leaf_plan(leaf, srcs, infos, *split_of(target), group_size=group_size)
      shape, dtype = tuple(a.shape), np.dtype(a.dtype)
      compiled = None if loader.direct(p) else compiler.submit(
          loader.programs, p, shape, dtype, target)
      jobs.append((leaf, p, shape, dtype, target, compiled))
    out, calls = [], 0
    for leaf, p, shape, dtype, target, compiled in jobs:
      if compiled is None:
        out.append(build(shape, dtype, target, functools.partial(
            loader.read_leaf, reader, leaf, dtype)))
        continue
      array = None
      for k in np.ndindex(*p.chunks):
        raws = [build(loader.raw_shape(shape, p, part), part.dtype,
                      loader.raw_sharding(target, spec),
                      functools.partial(loader.read_block, reader, leaf, p, part, k))
                for part, spec in zip(p.parts, p.read_specs)]
        zeros, write = compiled.result()
        if zeros is None:
          array = write(*raws)
        else:
          # the chunk before was converted while these were read; one chunk in flight
          array = write(zeros() if array is None else jax.block_until_ready(array),
                        np.asarray(k, np.int32), *raws)
        calls += 1
      out.append(array)
    jax.block_until_ready(out)
    if stats is not None:
      stats.update(bytes_read=reader.bytes_read, host_peak=acct["block"], programs=calls,
                   read_seconds=acct["seconds"])
  return jax.tree_util.tree_unflatten(treedef, out)


def load_plan(cfg, specs: dict, mesh_shape: dict, hosts: np.ndarray, *, layout=None,
              fp8: bool = False, int4: bool = False, dtype="bfloat16") -> dict:
  """What `load` takes on each host of a slice, for a checkpoint of `cfg` in the published
  layout (FP8 decoder linears as Kimi-K2-Instruct and DeepSeek-V3 ship, INT4 routed experts
  as K2-Thinking, the rest `dtype`), counted by the code that loads (leaf_plan, the
  loader's blocks) with no file and no device: the params split as `specs` ({param path:
  PartitionSpec}, the stored layout with `layout`) over a mesh of `mesh_shape` whose
  devices belong to `hosts` (an int array of the mesh's shape), stored as cfg.param_dtype.

  -> {"file": bytes of the checkpoint, "read": {host: bytes it reads}, "block": the largest
  host buffer (one raw block), "chunk": the most raw bytes one device receives at once
  (one chunk of one leaf, beside the params)}."""
  infos = {n: safetensors_io.Info("", 0, d, s)
           for n, d, s in published_layout(cfg, dtype, fp8=fp8, int4=int4)}
  srcs = kinds(cfg, infos, "the published layout")
  spanning = loader.spanning_axes(mesh_shape, hosts)
  read = {int(h): 0 for h in np.unique(hosts)}
  stored = np.dtype(cfg.param_dtype).itemsize
  block = chunk = 0
  first = {a: 0 for a in mesh_shape}
  for path, leaf in leaves(cfg, layout).items():
    spec = specs[path]
    p = leaf_plan(leaf, srcs, infos, spec, mesh_shape, spanning)
    if loader.direct(p):     # (shape, spec, chunks, bytes of a host block element, count)
      arrays = [(leaf.spec.shape, spec, [()], stored,
                 lambda b, k: loader.leaf_bytes(leaf, b, infos))]
    else:
      arrays = [(loader.raw_shape(leaf.spec.shape, p, part), raw, list(np.ndindex(*p.chunks)),
                 part.dtype.itemsize,
                 lambda b, k, part=part: loader.block_bytes(leaf, p, part, k, b, infos))
                for part, raw in zip(p.parts, p.read_specs)]
    on_device = 0
    for shape, raw, chunks, itemsize, count in arrays:
      for host, blocks in shards.host_blocks(raw, shape, mesh_shape, hosts).items():
        read[host] += sum(count(b, k) for b in blocks for k in chunks)
      held = shards.nbytes(shards.block_at(raw, shape, mesh_shape, first), itemsize)
      block, on_device = max(block, held), on_device + held
    chunk = max(chunk, on_device)
  return {"file": sum(i.nbytes for i in infos.values()), "read": read, "block": block,
          "chunk": chunk}


def load_checkpoint(path: str, dtype=np.float32, device=None):
  """Read a Hugging Face K2 / DeepSeek-V3 directory -> (model config, params) on one device
  (`device`, default the first), in `dtype` (the model's param_dtype). For models that fit
  one device; larger ones load into their mesh's shardings with `load`."""
  cfg = read_config(path)
  cfg.param_dtype = np.dtype(dtype).name
  one = jax.sharding.SingleDeviceSharding(device or jax.devices()[0])
  shardings = jax.tree.map(lambda _: one, param_specs(cfg), is_leaf=spec.is_spec)
  return cfg, load(path, cfg, shardings)


def save_checkpoint(cfg, params, path: str, *, dtype: str = "float32", fp8: bool = False,
                    max_shard_bytes: int = 4 << 30) -> None:
  """Write `params` (a params tree of global arrays, sharded or not, over one process or
  many) as a Hugging Face directory that `transformers.DeepseekV3ForCausalLM` loads:
  config.json + safetensors in the published names (k2jax.interop.export).

  dtype: float32 | bfloat16 for every tensor; fp8=True stores decoder-layer linear weights
  as float8_e4m3fn with 128x128-block `weight_scale_inv` (as released)."""
  from k2jax.interop import export
  export.save(cfg, params, path, dtype=dtype, fp8=fp8, max_shard_bytes=max_shard_bytes)
