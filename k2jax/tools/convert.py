"""Convert a Hugging Face checkpoint into a k2jax run once, for users who start from it often.

    python -m k2jax.convert --hf /path/to/Kimi-K2-Instruct --workdir runs/k2 \\
        [--mesh expert=8] [--param_dtype bfloat16]
    python -m k2jax.sft --init runs/k2 --workdir runs/k2_sft ...     # then restore, any mesh

The published safetensors (FP8 / INT4 dequantized on the way) are loaded shard by shard onto
`--mesh` (k2jax.interop.hf.load: each process reads only its devices' blocks) and saved as
an orbax checkpoint (each process writes its own shards) holding the params only, in the
logical layout every k2jax run keeps, with the run's config.json and the tokenizer file.
Orbax restores it into any mesh's shardings reading only the chunks each shard needs
(`--init RUN` of sft / rl, `--workdir RUN` of generate / serve / synth), with no
dequantization and no file headers to check again. Training cannot resume it (it has no
optimizer state): it is a starting point.

Several processes (a TPU slice's hosts) run the same command with --coordinator_address
host:port --num_processes N --process_id I (or --distributed on a TPU VM / SLURM).
"""

import argparse
import logging
import os
import shutil
import sys
import time

import jax

from k2jax.training import console

log = logging.getLogger("k2jax.convert")


class UserError(Exception):
  """A mistake in the command line or the files: one line, exit code 2."""


def add_distributed(p: argparse.ArgumentParser) -> None:
  p.add_argument("--distributed", action="store_true", help="jax.distributed.initialize() "
                 "with cluster auto-detection (TPU VM slices, SLURM)")
  p.add_argument("--coordinator_address", help="host:port of process 0 of several")
  p.add_argument("--num_processes", type=int)
  p.add_argument("--process_id", type=int)


def init_distributed(args) -> None:
  if args.distributed or args.coordinator_address:
    from k2jax.training.train import start_distributed
    start_distributed(args.coordinator_address, args.num_processes, args.process_id)


def run_cli(name: str, parser: argparse.ArgumentParser, argv, body) -> None:
  """Parse, log to stderr, run body(args); a UserError ends in its one line, exit code 2."""
  add_distributed(parser)
  args = parser.parse_args(argv)
  console.setup()
  try:
    init_distributed(args)    # before any other JAX call
    body(args)
  except UserError as e:
    print(f"k2jax.{name}: error: {e}", file=sys.stderr)
    raise SystemExit(2)


def new_directory(path: str, flag: str) -> None:
  """UserError unless `path` is absent or empty: nothing of an earlier output is overwritten."""
  if os.path.isdir(path) and os.listdir(path):
    raise UserError(f"{flag} {path} is not empty: give a new directory (nothing there was "
                    "touched)")


def mesh_of(text: str | None):
  """The mesh that loads / saves: --mesh, else every device on the expert axis (each then
  holds 1 / devices of the experts and of the other weights' model dims, as the trainer's
  rules split them). UserError naming the flag for a mesh that cannot be had."""
  from k2jax.serving.generate import UserError as MeshError, inference_mesh
  try:
    return inference_mesh(text or f"expert={jax.device_count()}", "--mesh")
  except MeshError as e:
    raise UserError(str(e)) from None


def shardings_on(cfg, mesh, flag: str):
  from k2jax.serving.generate import UserError as MeshError, target_shardings
  try:
    return target_shardings(cfg, mesh, flag)
  except MeshError as e:
    raise UserError(f"{e}: pass --mesh with sizes that divide the model "
                    f"({cfg.n_routed_experts} experts)") from None


def run_config(model_cfg, tokenizer: str):
  """A run's full config around a model config: the base config's other groups."""
  from k2jax.configs import base
  config = base.get_config()
  config.model = model_cfg
  config.data.tokenizer = tokenizer
  return config


def save_params(workdir: str, config, params) -> str:
  """A weights-only run in `workdir`: config.json and checkpoints/0/state = {"params"}."""
  import orbax.checkpoint as ocp

  from k2jax.training import checkpoint
  workdir = os.path.abspath(workdir)
  os.makedirs(workdir, exist_ok=True)
  if jax.process_index() == 0:
    with open(os.path.join(workdir, "config.json"), "w") as f:
      f.write(config.to_json_best_effort(indent=2))
  directory = os.path.join(workdir, "checkpoints")
  with ocp.CheckpointManager(directory, item_handlers={
      "state": ocp.StandardCheckpointHandler()}) as manager:
    manager.save(0, args=ocp.args.Composite(state=ocp.args.StandardSave({"params": params})))
    manager.wait_until_finished()
  if jax.process_index() == 0:
    checkpoint.seal(os.path.join(directory, "0"))
  return directory


def main(argv=None):
  p = argparse.ArgumentParser(prog="python -m k2jax.convert", description=__doc__.splitlines()[0])
  p.add_argument("--hf", required=True, help="a Hugging Face checkpoint directory")
  p.add_argument("--workdir", required=True, help="the k2jax run to write (new or empty)")
  p.add_argument("--mesh", help="devices that load and save, e.g. expert=8 or data=2,expert=4 "
                 "(default: expert = every device)")
  p.add_argument("--param_dtype", default="bfloat16", choices=("bfloat16", "float32"),
                 help="the dtype the run stores its weights in (default bfloat16)")
  run_cli("convert", p, argv, _convert)


def _convert(args):
  from k2jax.training import weights
  new_directory(args.workdir, "--workdir")
  try:
    source = weights.open_source(args.hf)
  except (OSError, ValueError) as e:
    raise UserError(f"--hf {args.hf}: {str(e).splitlines()[0]}") from None
  if source.kind != "hf":
    raise UserError(f"--hf {args.hf} is already a k2jax run: use it as it is")
  cfg = source.model
  cfg.param_dtype = args.param_dtype
  mesh = mesh_of(args.mesh)
  t0, stats = time.perf_counter(), {}
  try:
    params = source.load(cfg, shardings_on(cfg, mesh, f"--mesh {args.mesh}"), stats=stats)
  except (OSError, ValueError) as e:
    raise UserError(f"--hf {args.hf}: {str(e).splitlines()[0]}") from None
  loaded = time.perf_counter()
  tokenizer = "byte"
  if source.tokenizer() != "byte":
    os.makedirs(args.workdir, exist_ok=True)
    tokenizer = os.path.join(os.path.abspath(args.workdir), "tiktoken.model")
    if jax.process_index() == 0:
      shutil.copyfile(source.tokenizer(), tokenizer)
  save_params(args.workdir, run_config(cfg, tokenizer), params)
  log.info("converted %s -> %s on mesh %s: read %.2f GB in %.1f s, saved in %.1f s (process "
           "%d of %d); start from it with --init %s", args.hf, args.workdir, dict(mesh.shape),
           stats["bytes_read"] / 1e9, loaded - t0, time.perf_counter() - loaded,
           jax.process_index(), jax.process_count(), args.workdir)


if __name__ == "__main__":
  main()
