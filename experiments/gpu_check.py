"""Everything that needs a GPU, in one call: kernel checks and timings, and end-to-end MFU.

    python experiments/gpu_check.py [--out DIR] [--only tokamax,gmm_roles,attention,train]

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
  train      the ~1B-activated K2-shaped model's train step: tokens/s, MFU and a per-part
             breakdown per kernel choice (bench_train.py);
  moe        the older grouped-matmul / fused-layer table and our Triton tile sweeps;
  decode     tokens/s of decoding (bench_decode.py --gpu).
CSVs go to --out (default $OUT or experiments/results).
"""

import argparse
import importlib.util
import math
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)


def _map_kernels():
  """`k2jax.kernels` lives in kernels/ (pyproject maps it); map it without installing."""
  import k2jax  # noqa: F401
  if "k2jax.kernels" in sys.modules:
    return
  spec = importlib.util.spec_from_file_location(
      "k2jax.kernels", os.path.join(ROOT, "kernels", "__init__.py"),
      submodule_search_locations=[os.path.join(ROOT, "kernels")])
  mod = importlib.util.module_from_spec(spec)
  sys.modules["k2jax.kernels"] = mod
  spec.loader.exec_module(mod)


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(HERE, "results"))
  p.add_argument("--only", default="tokamax,gmm_roles,attention,train")
  p.add_argument("--tokens", type=int, default=8192)
  p.add_argument("--tune", action="store_true", help="attention: sweep pallas_gpu's tiles")
  p.add_argument("--no-check", action="store_true", help="attention: timings only")
  p.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192], help="attention")
  p.add_argument("--attention-impls", default="", help="attention: rows to time (default all)")
  p.add_argument("--kernels", default="auto,tokamax", help="train: kernel choices")
  p.add_argument("--train-args", default="", help="train: extra bench_train.py arguments")
  args = p.parse_args()
  _map_kernels()
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
            tune=args.tune, check=not args.no_check,
            only=args.attention_impls.split(",") if args.attention_impls else None))
      elif part == "gmm_roles":
        import bench_moe
        bench_moe.gpu_roles(argparse.Namespace(out=os.path.join(args.out, "moe"),
                                               tokens=args.tokens))
      elif part == "train":
        import bench_train
        sys.argv = ["bench_train.py", "--kernels", args.kernels, "--out", args.out,
                    *args.train_args.split()]
        bench_train.main()
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
