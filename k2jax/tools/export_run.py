"""Export a k2jax run (pre-trained, fine-tuned, RL) as a Hugging Face checkpoint in the
published K2 / DeepSeek-V3 layout, which transformers, vLLM and SGLang load.

    python -m k2jax.export --workdir runs/k2_sft --hf out/k2_sft [--dtype bfloat16] [--fp8] \\
        [--mesh expert=8]

The run's newest checkpoint is restored onto `--mesh`, its params only (orbax reads each
shard's chunks; no optimizer state), then written tensor by tensor
(k2jax.interop.export): each process writes the files of the tensors its devices hold,
host memory bounded by one tensor. Several processes run the same command with
--coordinator_address host:port --num_processes N --process_id I (or --distributed).
"""

import argparse
import logging
import os
import shutil
import time

import jax

from k2jax.tools.convert import UserError, mesh_of, new_directory, run_cli, shardings_on

log = logging.getLogger("k2jax.export")


def main(argv=None):
  p = argparse.ArgumentParser(prog="python -m k2jax.export", description=__doc__.splitlines()[0])
  p.add_argument("--workdir", required=True, help="a k2jax.train / sft / rl / convert run")
  p.add_argument("--hf", required=True, help="the Hugging Face directory to write (new or empty)")
  p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                 help="dtype of the written tensors (default bfloat16)")
  p.add_argument("--fp8", action="store_true", help="decoder-layer linear weights as FP8 "
                 "e4m3 with 128x128-block scales, as Kimi-K2-Instruct and DeepSeek-V3 ship")
  p.add_argument("--max_shard_gb", type=float, default=4.0, help="largest file (GB)")
  p.add_argument("--mesh", help="devices that restore and write, e.g. expert=8 (default: "
                 "expert = every device)")
  run_cli("export", p, argv, _export)


def _export(args):
  from k2jax.training import checkpoint, weights
  from k2jax.interop import export
  if not args.max_shard_gb > 0:
    raise UserError(f"--max_shard_gb {args.max_shard_gb}: must be > 0")
  new_directory(args.hf, "--hf")
  if not weights.is_run(args.workdir):
    raise UserError(f"--workdir {args.workdir}: not a k2jax run (no config.json with the "
                    "trainer's groups)")
  try:
    config = checkpoint.run_config(args.workdir)
  except (OSError, ValueError) as e:
    raise UserError(f"--workdir {args.workdir}: {str(e).splitlines()[0]}") from None
  cfg = config.model
  mesh = mesh_of(args.mesh)
  t0 = time.perf_counter()
  try:
    _, params = checkpoint.load_run(args.workdir, shardings_on(cfg, mesh, f"--mesh {args.mesh}"))
  except (OSError, ValueError) as e:
    raise UserError(f"--workdir {args.workdir}: {str(e).splitlines()[0]}") from None
  restored = time.perf_counter()
  out = export.save(cfg, params, args.hf, dtype=args.dtype, fp8=args.fp8,
                    max_shard_bytes=int(args.max_shard_gb * 1e9))
  tok = config.data.tokenizer
  if jax.process_index() == 0 and tok != "byte" and os.path.isfile(tok):
    shutil.copyfile(tok, os.path.join(args.hf, "tiktoken.model"))
  log.info("exported %s -> %s: restored in %.1f s, wrote %d files (%.2f GB) in %.1f s on "
           "process %d of %d", args.workdir, args.hf, restored - t0, len(out["files"]),
           out["bytes"] / 1e9, time.perf_counter() - restored, jax.process_index(),
           jax.process_count())


if __name__ == "__main__":
  main()
