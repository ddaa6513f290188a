"""Weights load at any size: straight into the consumer's shardings, shard by shard, each
process reading only its blocks, bit for bit what the whole-model reference gives
(tests/published.py: written and read by safetensors' torch frontend, dequantized by the
formats' formulas); host memory measured; a flawed checkpoint named in one line."""

import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from tests import published
from tests.multidevice import REPO, env, python_module

from k2jax import model, parallel  # noqa: E402
from k2jax.interop import hf, safetensors_io, shards  # noqa: E402

MESHES = {"data8": "data=8", "ep8": "expert=8", "dp2xep4": "data=2,expert=4",
          "pp2xdp2xep2": "pipeline=2,data=2,expert=2"}
# checkpoint kind -> the dtype its params are stored in once loaded
KINDS = {"bf16": "bfloat16", "fp8": "float32", "int4": "bfloat16"}


def _targets(cfg, mesh_text):
  """(shardings, layout): the trainer's on this mesh; with a pipeline the pipelined stack
  as it stores it (padded, in schedule order: k2jax.parallel.layout), else None."""
  from k2jax.parallel import layout
  from k2jax.parallel.mesh import parse_mesh
  shape = parse_mesh(mesh_text, len(jax.devices()))
  mesh = parallel.make_mesh(shape)
  sp = layout.split(cfg, shape["pipeline"]) if shape["pipeline"] > 1 else None
  stored = layout.stored_model(cfg, sp) if sp else cfg
  return parallel.param_shardings(model.param_specs(stored), mesh), sp


def _stored(want: dict, sp) -> dict:
  """The reference's pipelined stack laid out as the trainer stores it."""
  from k2jax.parallel import layout
  if sp is None:
    return want
  return {p: np.asarray(layout.to_stored(sp, a)) if p[0] == sp.stack.name else a
          for p, a in want.items()}


def _differences(params, want, targets) -> list[str]:
  """Leaves whose sharding is not the target or whose any shard differs in one bit."""
  bad = []
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  for (p, a), t in zip(flat, jax.tree.leaves(targets)):
    name = tuple(k.key for k in p)
    if a.sharding != t or a.dtype != want[name].dtype:
      bad.append(f"{'/'.join(name)}: {a.sharding} {a.dtype}")
      continue
    for s in a.addressable_shards:
      if not np.array_equal(published.bits(s.data), published.bits(want[name][s.index])):
        bad.append(f"{'/'.join(name)} at {s.index}")
  return bad


def _cases(tmp):
  """8 devices: every kind of checkpoint on every mesh."""
  out = {}
  for i, (kind, dtype) in enumerate(KINDS.items()):
    path = os.path.join(tmp, kind)
    published.write(path, published.arch(num_hidden_layers=4), kind, seed=i)
    cfg = hf.read_config(path)
    cfg.param_dtype = dtype
    want = published.load_whole(path, cfg)
    logical = None
    for name, text in MESHES.items():
      (targets, sp), stats = _targets(cfg, text), {}
      got = hf.load(path, cfg, targets, layout=sp, stats=stats)
      logical = logical or (got if sp is None else None)
      out[f"{kind}/{name}"] = dict(bad=_differences(got, _stored(want, sp), targets),
                                   read=stats["bytes_read"], file=published.tensor_bytes(path))
    if kind == "bf16":     # the same weights as a k2jax run, restored into the stored layout
      from k2jax.tools import convert
      from k2jax.training import weights
      run = os.path.join(tmp, "run")
      convert.save_params(run, convert.run_config(cfg, "byte"), logical)
      targets, sp = _targets(cfg, MESHES["pp2xdp2xep2"])
      restored = weights.open_source(run).load(cfg, targets, layout=sp)
      out["run/pp2xdp2xep2"] = dict(bad=_differences(restored, _stored(want, sp), targets))
  out["host_blocks"] = _host_blocks_are_jaxs()
  print("RESULT " + json.dumps(out), flush=True)


def _host_blocks_are_jaxs() -> bool:
  """shards.host_blocks (the index arithmetic plan sizes a slice's hosts with, no devices
  needed) gives each device of a mesh the block jax's NamedSharding gives it."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh_shape = {"pipeline": 2, "data": 2, "context": 1, "expert": 2}
  mesh = parallel.make_mesh(mesh_shape)
  hosts = np.vectorize(lambda d: d.id)(mesh.devices)      # every device its own host
  for spec in (P("pipeline", "expert"), P(("expert", "data")), P(None, ("data", "pipeline")),
               P()):
    shape = (8, 12)
    want = {d.id: [shards.key(tuple(slice(*s.indices(n)[:2]) for s, n in zip(i, shape)))]
            for d, i in NamedSharding(mesh, spec).devices_indices_map(shape).items()}
    got = {h: [shards.key(b) for b in bs]
           for h, bs in shards.host_blocks(spec, shape, mesh_shape, hosts).items()}
    if got != want:
      return False
  return True


def test_loads_equal_the_whole_model_bit_for_bit_in_the_targets_shardings(tmp_path):
  """bf16, FP8 (+ block scales) and INT4 (pack-quantized) checkpoints in three files, loaded
  onto four meshes of 8 devices (replicated, experts split, data x expert, pipeline x data x
  expert with the pipelined stack stored as the trainer stores it: padded, in schedule
  order): every shard of every leaf equals the reference's block bit for bit, in the
  target sharding and stored dtype; one process reads every byte of the files once (the
  quantized formats re-read only the scales and words that shard edges share). The same
  weights saved as a k2jax run restore into the stored layout bit for bit too."""
  p = subprocess.run(python_module("tests.test_load", "cases", str(tmp_path)), cwd=REPO,
                     env=env(8), capture_output=True, text=True, timeout=900)
  assert p.returncode == 0, p.stderr[-3000:]
  got = json.loads(next(l for l in p.stdout.splitlines() if l.startswith("RESULT "))[7:])
  assert got.pop("host_blocks")
  assert len(got) == len(KINDS) * len(MESHES) + 1
  for case, r in got.items():
    assert not r["bad"], (case, r["bad"][:5])
    if case.startswith("run"):
      continue
    if case.startswith("bf16"):
      assert r["read"] == r["file"], case
    else:
      assert r["file"] <= r["read"] <= 1.05 * r["file"], case


def test_one_device_load_and_block_reads(tmp_path):
  """load_checkpoint (one device) equals the reference; Reader.read returns numpy's slice
  of any block and counts exactly its bytes."""
  published.write(tmp_path, published.arch(num_hidden_layers=2), "int4", seed=5)
  cfg, params = hf.load_checkpoint(str(tmp_path), np.float32)
  want = published.load_whole(tmp_path, cfg)
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  assert not _differences(params, want, jax.tree.map(lambda _: one, params))
  rng = np.random.default_rng()
  with safetensors_io.Reader(str(tmp_path)) as r:
    names = [n for n in r.names() if len(r.info(n).shape) == 2]
    whole = {n: r.read(n) for n in names}
    for _ in range(200):
      n = names[rng.integers(len(names))]
      block = []
      for size in whole[n].shape[:rng.integers(0, 3)]:
        a = int(rng.integers(0, size))
        block.append(slice(a, int(rng.integers(a + 1, size + 1))))
      before = r.bytes_read
      got = r.read(n, tuple(block))
      np.testing.assert_array_equal(published.bits(got), published.bits(whole[n][tuple(block)]))
      assert r.bytes_read - before == got.nbytes


# --------------------------------------------------------------------------- memory


def _rss() -> int:
  return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _growth(fn):
  """(result of fn(), peak resident memory it added, bytes it read by syscalls)."""
  def io():
    return int(next(l for l in open("/proc/self/io") if l.startswith("rchar")).split()[1])
  base, read = _rss(), io()
  with open("/proc/self/clear_refs", "w") as f:   # the peak (VmHWM) back to the current RSS
    f.write("5")
  out = jax.block_until_ready(fn())
  peak = int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1])
  return out, peak * 1024 - base, io() - read


def _held(params) -> int:
  return sum(s.data.nbytes for a in jax.tree.leaves(params) for s in a.addressable_shards)


MEMORY_ARCH = dict(hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
                   num_hidden_layers=5, n_routed_experts=64, vocab_size=8192, q_lora_rank=256,
                   kv_lora_rank=128, num_attention_heads=8, qk_nope_head_dim=64,
                   qk_rope_head_dim=32, v_head_dim=64)


def _memory(path, what):
  """In a fresh process (so no memory freed earlier is reused unseen): the peak RSS `what`
  adds on 8 devices, data 2 x expert 4, params bf16, over the arrays' bytes (CPU devices'
  buffers are host memory), and the bytes it read by syscalls over the params' bytes."""
  from k2jax.training import checkpoint
  cfg = hf.read_config(os.path.join(path, "hf"))
  cfg.param_dtype = "bfloat16"
  targets, _ = _targets(cfg, "data=2,expert=4")
  if what == "hf":
    fn = lambda: hf.load(os.path.join(path, "hf"), cfg, targets)   # noqa: E731
  elif what == "run":
    fn = lambda: checkpoint.load_run(os.path.join(path, "run"), targets)[1]   # noqa: E731
  else:  # the control: the whole model in float32 on the host, then placed (loading before)
    fn = lambda: _whole(os.path.join(path, "hf"), cfg, targets)   # noqa: E731
  params, grew, read = _growth(fn)
  print("RESULT " + json.dumps([grew, _held(params), read / sum(
      a.nbytes for a in jax.tree.leaves(params))]), flush=True)


def _with_moments(path):
  """Adds to the run a state whose float32 moments are 4x its params' bytes."""
  import orbax.checkpoint as ocp

  from k2jax.training import checkpoint
  _, params = checkpoint.load_run(os.path.join(path, "run"))
  moments = jax.tree.map(lambda a: a.astype(np.float32), params)
  with ocp.CheckpointManager(os.path.join(path, "run", "checkpoints"), item_handlers={
      "state": ocp.StandardCheckpointHandler()}) as m:
    m.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(
        {"params": params, "opt_state": {"mu": moments, "nu": moments}})))


def _whole(path, cfg, targets):
  want = published.load_whole(path, cfg)     # float32 tensors, then the stored dtype
  flat, treedef = jax.tree_util.tree_flatten_with_path(hf.stored_dtypes(cfg))
  return jax.device_put(treedef.unflatten([want[tuple(k.key for k in p)] for p, _ in flat]),
                        targets)


def test_host_memory_is_the_arrays_and_a_run_restores_its_params_only(tmp_path):
  """Peak RSS added by loading a Hugging Face checkpoint (bf16, 4 files), and by restoring
  the k2jax run `k2jax.convert` made of it, onto 8 devices is the loaded arrays' bytes
  (+ 5%) and a fixed 200 MB (the runtime, the ~30 conversion programs XLA compiles, orbax);
  restoring reads the params' bytes (+ 25% for orbax's metadata), not the float32 moments
  beside them (4x). The control, the whole model in float32 then placed, adds more than
  1.5x the arrays: the bound sees a float32 copy of the model."""
  published.write(tmp_path / "hf", published.arch(**MEMORY_ARCH), "bf16", files=4)

  def run(*cmd):
    p = subprocess.run(cmd, cwd=REPO, env=env(8), capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout
  run(sys.executable, "-m", "k2jax.convert", "--hf", str(tmp_path / "hf"), "--workdir",
      str(tmp_path / "run"), "--mesh", "data=2,expert=4")
  run(*python_module("tests.test_load", "with_moments", str(tmp_path)))
  got = {}
  for what in ("hf", "run", "whole"):
    out = run(*python_module("tests.test_load", "memory", str(tmp_path), what))
    got[what] = json.loads(next(l for l in out.splitlines() if l.startswith("RESULT "))[7:])
  for what in ("hf", "run"):
    grew, held, _ = got[what]
    assert grew <= 1.05 * held + 200e6, (what, grew / held, got)
  assert got["run"][2] <= 1.25, got
  assert got["whole"][0] > 1.5 * got["whole"][1], got


# --------------------------------------------------------------------------- processes


def _two(tmp, rank, port):
  """One of 2 processes x 4 devices: load onto expert = 8, then export."""
  from k2jax.interop import export
  jax.distributed.initialize(f"localhost:{port}", 2, int(rank))
  path = os.path.join(tmp, "hf")
  cfg = hf.read_config(path)
  cfg.param_dtype = "bfloat16"
  targets, _ = _targets(cfg, "expert=8")
  stats = {}
  params = hf.load(path, cfg, targets, stats=stats)
  hosts = np.arange(8).reshape(1, 1, 1, 8) // 4
  specs = {tuple(k.key for k in p): s.spec
           for p, s in jax.tree_util.tree_flatten_with_path(targets)[0]}
  planned = hf.load_plan(cfg, specs, dict(targets["embed"].mesh.shape), hosts)["read"]
  wrote = export.save(cfg, params, os.path.join(tmp, "out"), dtype="bfloat16",
                      max_shard_bytes=300_000)
  print("RESULT " + json.dumps(dict(read=stats["bytes_read"], planned=planned[int(rank)],
                                    files=wrote["files"])), flush=True)


def test_two_processes_read_their_share_and_export_their_own_files(tmp_path):
  """2 processes x 4 devices (jax.distributed on localhost), experts and the model dims split
  over all 8: each process reads half the files' bytes (within 10%), exactly what plan's
  count of the same loader says; exporting, each writes the files of the tensors it holds,
  none twice, and the directory they make is the source, bit for bit."""
  from safetensors import safe_open
  from tests.multidevice import cores_to_itself, free_port
  published.write(tmp_path / "hf", published.arch(num_hidden_layers=3), "bf16", seed=7)
  port = free_port()
  e = env(4)
  with cores_to_itself():
    procs = [subprocess.Popen(python_module("tests.test_load", "two", str(tmp_path), str(i),
                                            str(port)), cwd=REPO, env=e,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outs = [p.communicate(timeout=900) for p in procs]
  got = []
  for p, (out, err) in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
    got.append(json.loads(next(l for l in out.splitlines() if l.startswith("RESULT "))[7:]))
  total = published.tensor_bytes(tmp_path / "hf")
  for r in got:
    assert r["read"] == r["planned"], got
    assert 0.45 * total <= r["read"] <= 0.55 * total, (r, total)
  assert got[0]["read"] + got[1]["read"] >= total
  files = [set(r["files"]) for r in got]
  with open(tmp_path / "out" / "model.safetensors.index.json") as f:
    index = json.load(f)["weight_map"]
  assert files[0] and files[1] and not files[0] & files[1]
  assert files[0] | files[1] == set(index.values())
  src = {}
  for f in (tmp_path / "hf").glob("*.safetensors"):
    with safe_open(f, "pt") as h:
      src.update({k: h.get_tensor(k) for k in h.keys()})
  seen = set()
  for f in files[0] | files[1]:
    with safe_open(tmp_path / "out" / f, "pt") as h:
      for k in h.keys():
        assert _same(h.get_tensor(k), src[k]), k
        seen.add(k)
  assert seen == set(src)


def _same(a, b) -> bool:
  """Two torch tensors hold the same bits (dtype, shape and every bit of every value)."""
  import torch
  ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
  return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(ints), b.view(ints))


def _sft_args(tmp_path, init, workdir, devices_mesh):
  return [sys.executable, "-m", "k2jax.sft", "--config", "tiny_sft", "--init", str(init),
          "--workdir", str(workdir), *devices_mesh, "--config.train.steps=1",
          "--config.train.batch_size=8", "--config.train.seq_len=256",
          "--config.train.checkpoint_every=1", "--config.train.eval_batches=0",
          "--config.optimizer.learning_rate=1e-30", "--config.optimizer.end_learning_rate=1e-30",
          "--config.optimizer.warmup_steps=1", "--config.optimizer.decay_steps=0"]


def test_convert_export_and_fine_tune_from_published_weights_on_meshes(tmp_path):
  """k2jax.convert (expert = 4) makes a run whose params are the published ones bit for bit;
  k2jax.export (data 2 x expert 2) writes them back as they were; sft --init HF_DIR of an FP8
  checkpoint on data 2 x expert 4 trains (learning rate 1e-30) from exactly its weights (the
  router bias aside: balancing moves it each step). Wrong inputs end in one line, exit 2."""
  from safetensors import safe_open

  from k2jax.training import checkpoint
  a = published.arch(num_hidden_layers=3, vocab_size=272)
  published.write(tmp_path / "hf", a, "bf16", seed=9)
  published.write(tmp_path / "fp8", a, "fp8", seed=10)

  def run(cmd, devices, code=0):
    p = subprocess.run(cmd, cwd=REPO, env=env(devices), capture_output=True, text=True,
                       timeout=900)
    assert p.returncode == code, p.stderr[-3000:]
    return p
  run([sys.executable, "-m", "k2jax.convert", "--hf", str(tmp_path / "hf"), "--workdir",
       str(tmp_path / "run"), "--mesh", "expert=4", "--param_dtype", "bfloat16"], 4)
  config, params = checkpoint.load_run(str(tmp_path / "run"))
  want = published.load_whole(tmp_path / "hf", config.model)
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  assert not _differences(params, want, jax.tree.map(lambda _: one, params))
  run([sys.executable, "-m", "k2jax.export", "--workdir", str(tmp_path / "run"), "--hf",
       str(tmp_path / "out"), "--mesh", "data=2,expert=2", "--max_shard_gb", "0.0003"], 4)
  for f in (tmp_path / "hf").glob("*.safetensors"):
    with safe_open(f, "pt") as h:
      for k in h.keys():
        with open(tmp_path / "out" / "model.safetensors.index.json") as idx:
          where = json.load(idx)["weight_map"][k]
        with safe_open(tmp_path / "out" / where, "pt") as o:
          assert _same(o.get_tensor(k), h.get_tensor(k)), k
  run(_sft_args(tmp_path, tmp_path / "fp8", tmp_path / "sft",
                ["--config.mesh.data=2", "--config.mesh.expert=4"]), 8)
  config, params = checkpoint.load_run(str(tmp_path / "sft"))
  want = published.load_whole(tmp_path / "fp8", config.model)
  for p, a in jax.tree_util.tree_flatten_with_path(params)[0]:
    name = tuple(k.key for k in p)
    if name[-1] != "router_bias":      # an update of 1e-30 moves no weight by more than that
      np.testing.assert_allclose(np.asarray(a), want[name], rtol=0, atol=1e-20, err_msg=name)
  for cmd, fragment in (
      ([sys.executable, "-m", "k2jax.convert", "--hf", str(tmp_path / "hf"), "--workdir",
        str(tmp_path / "run")], "is not empty"),
      ([sys.executable, "-m", "k2jax.export", "--workdir", str(tmp_path / "hf"), "--hf",
        str(tmp_path / "x")], "not a k2jax run")):
    p = run(cmd, 1, code=2)
    assert p.stderr.count("\n") == 1 and fragment in p.stderr, p.stderr


def test_init_sources_say_their_config_and_tokenizer_before_any_weight(tmp_path):
  """weights.open_source reads config.json only; --init takes the source's tokenizer (a
  Hugging Face directory's tiktoken.model) unless the command line names one."""
  from k2jax import configs, sft
  from k2jax.training import weights
  published.write(tmp_path / "hf", published.arch(num_hidden_layers=2), "bf16", files=1)
  src = weights.open_source(str(tmp_path / "hf"))
  assert src.kind == "hf" and src.model.hidden_size == 160 and src.tokenizer() == "byte"
  (tmp_path / "hf" / "tiktoken.model").write_text("")
  config = configs.get_config("tiny_sft")
  sft.tokenizer_from_init(src, config, [])
  assert config.data.tokenizer == str(tmp_path / "hf" / "tiktoken.model")
  config.data.tokenizer = "byte"
  sft.tokenizer_from_init(src, config, ["--config.data.tokenizer=byte"])
  assert config.data.tokenizer == "byte"
  with open(tmp_path / "hf" / "model-00001-of-00001.safetensors", "r+b") as f:   # cut short
    f.truncate(100)
  with pytest.raises(hf.CheckpointError, match="00001.safetensors: the file is shorter than"):
    src.check()


# --------------------------------------------------------------------------- flaws


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  path = tmp_path_factory.mktemp("ckpt")
  published.write(path, published.arch(num_hidden_layers=2), "fp8", seed=3, files=2)
  return path


def _flawed(src, dst, fn):
  shutil.copytree(src, dst)
  fn(dst)
  return str(dst)


def _rewrite(path, name, fn):
  """Rewrite the file holding `name` with fn(tensors) applied (torch tensors)."""
  from safetensors import safe_open
  from safetensors.torch import save_file
  with open(os.path.join(path, "model.safetensors.index.json")) as f:
    fname = json.load(f)["weight_map"][name]
  with safe_open(os.path.join(path, fname), "pt") as h:
    tensors = {k: h.get_tensor(k) for k in h.keys()}
  fn(tensors)
  save_file(tensors, os.path.join(path, fname), metadata={"format": "pt"})
  return fname


def _truncate(path):
  f = os.path.join(path, "model-00002-of-00002.safetensors")
  os.truncate(f, os.path.getsize(f) - 1000)


@pytest.mark.parametrize("flaw,message", [
    ("missing", r"tensor model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight is missing from "
                r".*\(expected shape \[96, 160\]\)"),
    ("shape", r"tensor model\.layers\.0\.self_attn\.kv_b_proj\.weight in model-0000\d-of-00002"
              r"\.safetensors: expected \[128, 40\] for this config, found \[7, 3\]"),
    ("truncated", r"tensor .* in .*model-00002-of-00002\.safetensors ends at byte \d+, past "
                  r"the end of the file \(\d+ bytes\): the file is truncated"),
    ("scale", r"model\.layers\.1\.self_attn\.o_proj\.weight_scale_inv of shape \[1, 2\] does "
              r"not tile a \[160, 64\] weight"),
])
def test_a_flawed_checkpoint_is_one_line_naming_tensor_and_file(checkpoint, tmp_path, flaw,
                                                                message):
  """... before any tensor is read (the headers are checked first), through the sharded
  path and the sft CLI (exit code 2, no traceback)."""
  import torch
  fix = {
      "missing": lambda d: _rewrite(d, "model.layers.1.mlp.experts.3.up_proj.weight",
                                    lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight")),
      "shape": lambda d: _rewrite(d, "model.layers.0.self_attn.kv_b_proj.weight", lambda t:
                                  t.__setitem__("model.layers.0.self_attn.kv_b_proj.weight",
                                                torch.zeros(7, 3))),
      "truncated": _truncate,
      "scale": lambda d: _rewrite(d, "model.layers.1.self_attn.o_proj.weight_scale_inv",
                                  lambda t: t.__setitem__(
                                      "model.layers.1.self_attn.o_proj.weight_scale_inv",
                                      torch.ones(1, 2))),
  }[flaw]
  path = _flawed(checkpoint, tmp_path / "flawed", fix)
  cfg = hf.read_config(path)
  with pytest.raises(hf.CheckpointError, match=message) as e:
    hf.load(path, cfg, _targets(cfg, "data=1")[0])
  assert "\n" not in str(e.value)
  if flaw == "truncated":     # the CLI: one line, exit code 2
    p = subprocess.run([sys.executable, "-m", "k2jax.sft", "--config", "tiny_sft", "--workdir",
                        str(tmp_path / "run"), "--init", path], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert p.stderr.count("\n") == 1 and "--init" in p.stderr and "truncated" in p.stderr


if __name__ == "__main__":
  {"cases": _cases, "memory": _memory, "with_moments": _with_moments, "two": _two}[
      sys.argv[1]](*sys.argv[2:])
