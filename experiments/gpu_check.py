"""Everything that needs a GPU, in one call: kernel checks and timings.

    python experiments/gpu_check.py [--out DIR] [--only attention,moe,decode]

Runs on a machine with one NVIDIA GPU and jax[cuda] (no grain / ml-collections needed: only
k2jax.kernels and what the benchmarks import). In order:
  1. attention: pallas_gpu vs xla correctness (values, S_max, gradients; f32 and bf16),
     then TFLOP/s at MLA dims vs cuDNN (experiments/bench_attention.py --gpu);
  2. moe: grouped-matmul correctness and TFLOP/s at K2 expert shapes vs a dense matmul of the
     same FLOPs and ragged_dot, and the fused routed-experts layer (bench_moe.py --gpu);
  3. decode: tokens/s of a ~1B-activated K2-shaped model (bench_decode.py --gpu), if present;
  4. tokamax: the units of each tokamax attention kernel's softmax-residual row max against
     float64 (kernels/flash_tokamax.residual_check): the factor that goes into
     flash_tokamax.RESIDUAL_MAX before attention_impl=tokamax may read QK-Clip's S_max from
     it (tokamax's timings are rows of part 1's table).
Each part catches its own failures; CSVs go to --out (default $OUT or experiments/results).
"""

import argparse
import importlib.util
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
  p.add_argument("--only", default="attention,moe,decode,tokamax")
  p.add_argument("--tokens", type=int, default=8192)
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
        bench_attention.gpu(argparse.Namespace(out=os.path.join(args.out, "attention"),
                                               gpu_lengths=[4096, 8192], heads=16))
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
