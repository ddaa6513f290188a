"""Everything that needs a GPU, in one call: kernel checks and timings, and end-to-end MFU.

    python experiments/gpu_check.py [--out DIR] [--only offload,tune,mfu,tokamax,attention,gmm_roles]
    python experiments/gpu_check.py --only attention_tune   # tokamax's attention tiles, timed

Runs on a machine with one NVIDIA GPU and jax[cuda] (plus tokamax for its rows). Parts, in
the order given, each catching its own failures:
  tokamax    the units of each tokamax attention kernel's softmax-residual row max against
             float64 (kernels/flash_tokamax.residual_check); a kernel found in natural or
             base-2 units gets its factor for the rest of this run, so the attention part
             can time it with QK-Clip's S_max (the factor goes into flash_tokamax.RESIDUAL_MAX
             once recorded in experiments/results/attention/tokamax_residuals.csv);
  gmm_roles  every grouped matmul of an MoE training step at K2's expert shapes (forward,
             input gradient, weight gradient): ours vs XLA's ragged_dot vs tokamax's Mosaic
             GPU kernel (its own tiles and a sweep), against a dense matmul of the same FLOPs
             (bench_moe.gpu_roles); writes the best tokamax tiles per role;
  attention  correctness of pallas_gpu and checked tokamax kernels against XLA in f32 /
             bf16 (values, S_max, gradients), then TFLOP/s at MLA's 192 / 128 against
             cuDNN (bench_attention.gpu, --tune to sweep pallas_gpu's tiles again);
  attention_tune  tokamax's own candidate tiles for its Mosaic GPU attention (forward, then
             backward), timed at MLA's shape as k2jax calls it, and k2jax's impl="tokamax"
             with the best pair against tokamax's own choice (bench_attention.tokamax_tune;
             the entry for kernels/flash_tokamax.TILES goes to attention/tokamax_tiles.json);
  wgrad      the weight gradient (and the down / input-gradient products) at --gmm-shape:
             ours at more tiles, jax's own Mosaic GPU ragged dots (with the gather they
             need), XLA's ragged_dot and a batched dense dot of equal groups as the
             ceiling (bench_moe.gpu_wgrad);
  moe_bwd    the routed-expert layer's forward + backward under each kernel choice
             (moe_gpu.FORCE: all our Triton kernels; the MGPU table, on Hopper the backward
             on jax's Mosaic GPU ones; that and the forward's down projection on jax's too)
             at --tune-shapes, every gradient against float32 XLA (bench_moe.gpu_backward);
  tune       tile sweep of our grouped-matmul kernels (forward, input and weight gradients)
             at the bench_train model's and K2's expert shapes, against the previous
             weight-gradient kernel; the winners serve the rest of the run
             (bench_moe.gpu_tune);
  train      the ~1B-activated K2-shaped model's train step: tokens/s, MFU and a per-part
             breakdown per kernel choice (bench_train.py);
  mfu        the end-to-end figures: 8K tokens per step with and without recomputation,
             then 256K tokens per step (32 microbatches) with the faster (train_runs);
  offload    the pipeline's stage residuals in host memory (model.offload) against device
             memory on one GPU: equal gradients, device / host temp bytes, step time,
             and the offloaded step's compiled HLO with its host copies counted
             (bench_pipeline.offload; XLA's host offloading is what this checks);
  moe        the older grouped-matmul / fused-layer table and our Triton tile sweeps;
  decode     tokens/s of decoding (bench_decode.py --gpu).
CSVs go to --out (default $OUT or experiments/results).
"""

import argparse
import math
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# k2jax when not installed; last, so that the root's kernels/ hides no installed package
sys.path.append(ROOT)
sys.path.insert(0, HERE)

from kernels_map import map_kernels as _map_kernels  # its old name here


def train_runs(args):
  """The end-to-end figures, each a bench_train run with its own CSVs (--tag):
    step8k     8K tokens per step (one microbatch), selective recomputation, with the
               per-part breakdown: the previous runs' geometry;
    step8k_nr  the same without recomputation (remat=none: fits one GPU at 1B activated);
    step256k   256K tokens per step (32 microbatches of 8K), the faster of the two remat
               policies, Newton-Schulz in bf16: the optimizer step amortized as a real
               pretraining batch amortizes it (K2: 67M tokens per step)."""
  import bench_train
  base = ["--kernels", args.mfu_kernels, "--out", args.out, "--seq", "4096",
          *(["--tiny"] if args.tiny else [])]
  rows = {}
  for tag, extra in (("step8k", ["--batch", "2"]),
                     ("step8k_nr", ["--batch", "2", "--remat", "none", "--no-breakdown"])):
    try:
      rows[tag] = [r for r in bench_train.main(base + extra + ["--tag", tag]) if "step_ms" in r]
    except Exception:
      traceback.print_exc()
  ms = {tag: min(r["step_ms"] for r in rs) for tag, rs in rows.items() if rs}
  remat = "none" if ms.get("step8k_nr", math.inf) < ms.get("step8k", math.inf) else "selective"
  print(f"=== step256k with remat={remat} ({ms})", flush=True)
  bench_train.main(base + ["--batch", "64", "--grad-accum", "32", "--ns-dtype", "bfloat16",
                           "--remat", remat, "--reps", "2", "--no-breakdown", "--tag",
                           "step256k"])


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(HERE, "results"))
  p.add_argument("--only", default="offload,tune,mfu,tokamax,attention,gmm_roles")
  p.add_argument("--tokens", type=int, default=8192)
  p.add_argument("--tune", action="store_true", help="attention: sweep pallas_gpu's tiles")
  p.add_argument("--no-check", action="store_true", help="attention: timings only")
  p.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192], help="attention")
  p.add_argument("--attention-impls", default="", help="attention: rows to time (default all)")
  p.add_argument("--attention-tokens", type=int, default=16384,
                 help="attention: tokens per timed call (B = tokens / T); at 16K a call takes "
                      "about a millisecond and the host's dispatch shows in its time")
  p.add_argument("--kernels", default="auto,tokamax", help="train: kernel choices")
  p.add_argument("--train-args", default="", help="train: extra bench_train.py arguments")
  p.add_argument("--mfu-kernels", default="tokamax_attention", help="mfu: kernel choices")
  p.add_argument("--tiny", action="store_true",
                 help="tune, mfu: toy sizes, Pallas in interpret mode (a CPU smoke run)")
  p.add_argument("--gmm-shape", default="k2", help="gmm_roles: a bench_moe.TUNE_SHAPES entry")
  p.add_argument("--gmm-impls", default="",
                 help="gmm_roles: rows to time, e.g. 'ours (pallas_gpu),tokamax (its choice)' "
                      "(default all, tokamax's tile candidates included)")
  p.add_argument("--tune-shapes", default="bench_train,k2,k2_ep16",
                 help="tune: bench_moe.TUNE_SHAPES entries to sweep")
  p.add_argument("--attention-tune-budget", type=float, default=300.0,
                 help="attention_tune: seconds for all of tokamax's candidate tiles")
  p.add_argument("--tune-budget", type=float, default=40.0,
                 help="tune: seconds per kernel and shape for the tile sweep")
  args = p.parse_args()
  known = {"offload", "tune", "mfu", "tokamax", "attention", "gmm_roles", "train", "moe",
           "decode", "attention_tune", "wgrad", "moe_bwd"}
  unknown = [x for x in args.only.split(",") if x not in known]
  if unknown:
    p.error(f"--only {','.join(unknown)}: unknown part; choose from {', '.join(sorted(known))}")
  _map_kernels()
  from bench_moe import TUNE_SHAPES
  for flag, names in (("--gmm-shape", args.gmm_shape), ("--tune-shapes", args.tune_shapes)):
    bad = [n for n in names.split(",") if n not in TUNE_SHAPES]
    if bad:
      p.error(f"{flag} {','.join(bad)}: not a bench_moe.TUNE_SHAPES entry; choose from "
              f"{', '.join(TUNE_SHAPES)}")
  import jax
  print(f"jax {jax.__version__}, devices {jax.devices()}", flush=True)
  parts = args.only.split(",")
  summary = []
  for part in parts:
    t0 = time.time()
    try:
      if part == "attention":
        import bench_attention
        bench_attention.gpu(argparse.Namespace(
            out=os.path.join(args.out, "attention"), gpu_lengths=args.lengths, heads=16,
            tune=args.tune, check=not args.no_check, tokens=args.attention_tokens,
            only=args.attention_impls.split(",") if args.attention_impls else None))
      elif part == "attention_tune":
        import bench_attention
        bench_attention.tokamax_tune(os.path.join(args.out, "attention"),
                                     budget=args.attention_tune_budget, lengths=args.lengths)
      elif part == "gmm_roles":
        import bench_moe
        bench_moe.gpu_roles(argparse.Namespace(
            out=os.path.join(args.out, "moe"), tokens=args.tokens,
            shape=bench_moe.TUNE_SHAPES[args.gmm_shape],
            impls=args.gmm_impls.split(",") if args.gmm_impls else None))
      elif part == "wgrad":
        import bench_moe
        bench_moe.gpu_wgrad(argparse.Namespace(
            out=os.path.join(args.out, "moe"), tokens=48 if args.tiny else args.tokens,
            shape=(64, 48, 4, 2) if args.tiny else bench_moe.TUNE_SHAPES[args.gmm_shape],
            budget=args.tune_budget, reps=3 if args.tiny else 5, interpret=args.tiny))
      elif part == "moe_bwd":
        import bench_moe
        shapes = ({"tiny": (64, 48, 4, 2)} if args.tiny
                  else {n: bench_moe.TUNE_SHAPES[n] for n in args.tune_shapes.split(",")})
        bench_moe.gpu_backward(argparse.Namespace(
            out=os.path.join(args.out, "moe"), tokens=48 if args.tiny else args.tokens,
            shapes=shapes, reps=3 if args.tiny else 10, interpret=args.tiny))
      elif part == "tune":
        import bench_moe
        shapes = ({"bench_train": (64, 48, 4, 2), "k2": (32, 80, 3, 2)} if args.tiny
                  else {n: bench_moe.TUNE_SHAPES[n] for n in args.tune_shapes.split(",")})
        bench_moe.gpu_tune(argparse.Namespace(
            out=os.path.join(args.out, "moe"), tokens=48 if args.tiny else args.tokens,
            shapes=shapes, apply="bench_train", budget=args.tune_budget, reps=5,
            interpret=args.tiny))
      elif part == "train":
        import bench_train
        bench_train.main(["--kernels", args.kernels, "--out", args.out,
                          *args.train_args.split()])
      elif part == "mfu":
        train_runs(args)
      elif part == "offload":
        import bench_pipeline
        bench_pipeline.OUT = os.path.join(args.out, "pipeline")
        bench_pipeline.offload("gpu_offload.csv", tiny=args.tiny)
      elif part == "moe":
        import bench_moe
        bench_moe.gpu(argparse.Namespace(out=os.path.join(args.out, "moe"), tokens=args.tokens,
                                         layer_experts=96))
      elif part == "decode":
        if not os.path.exists(os.path.join(HERE, "bench_decode.py")):
          print("decode: experiments/bench_decode.py not present, skipped")
          continue
        import bench_decode
        bench_decode.gpu(argparse.Namespace(out=os.path.join(args.out, "decode"), new_tokens=64))
      elif part == "tokamax":
        import csv
        from k2jax.kernels import flash_tokamax
        ops, _ = flash_tokamax._ops()
        rows = []
        for name in ("mosaic_gpu", "triton", "xla"):
          for dtype in ("float32", "bfloat16"):
            if name not in ops:
              continue
            try:
              rows.append(dict(flash_tokamax.residual_check(name, dtype=dtype), note=""))
              r = rows[-1]
              if dtype == "float32" and name not in flash_tokamax.RESIDUAL_MAX and (
                  r["natural"] or r["base2"] or r["rel"] < 1e-3):
                # for this run only: the factor the residuals were measured in (natural,
                # base 2, or another constant that fits every row to f32 rounding)
                flash_tokamax.RESIDUAL_MAX[name] = (
                    1.0 if r["natural"] else 1.0 / math.log2(math.e) if r["base2"]
                    else 1.0 / r["factor"])
            except Exception as e:  # one kernel failing must not hide the others
              rows.append(dict(name=name, dtype=dtype, factor=float("nan"), rel=float("nan"),
                               natural=False, base2=False, note=f"FAILED {type(e).__name__}: "
                               f"{str(e).splitlines()[0][:160]}"))
            print(rows[-1], flush=True)
        os.makedirs(os.path.join(args.out, "attention"), exist_ok=True)
        with open(os.path.join(args.out, "attention", "tokamax_residuals.csv"), "w",
                  newline="") as f:
          w = csv.DictWriter(f, fieldnames=list(rows[0]))
          w.writeheader()
          w.writerows(rows)
      summary.append(f"{part}: ok in {time.time() - t0:.0f}s")
    except Exception:
      traceback.print_exc()
      summary.append(f"{part}: FAILED after {time.time() - t0:.0f}s")
    print(f"=== {summary[-1]}", flush=True)
  print("\n".join(summary))


if __name__ == "__main__":
  main()
