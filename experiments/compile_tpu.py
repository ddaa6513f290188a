"""Compile presets for the TPU slices they are meant for and tabulate XLA:TPU's memory
against plan's (compile only, on any machine with libtpu: `pip install -e ".[tpu]"`).

    python experiments/compile_tpu.py                       # every row (long on 2 cores)
    python experiments/compile_tpu.py --rows tiny_v5e,k2_preset_no_offload
    python experiments/compile_tpu.py --rows k2_preset,k2_long_context --memory_only

Each row runs `python -m k2jax.compile ... --json` in its own process (a libtpu abort ends
that row only) and adds one line to experiments/results/compile/compile_tpu.csv: whether
XLA compiled it (or its one-line refusal), XLA's device and host bytes per chip, plan's,
their ratio, and the compile time on this machine. With --memory_only each compile stops at
XLA's buffer assignment (`k2jax.compile --memory_only`): the device figure is then the
device memory space's total, and the note gives XLA's out-of-memory check (arguments +
temporary heap), and `--explain` adds the bytes live at the heap's fullest moment in all
device memory (arguments + heap, before XLA's packing: xla_heap.HeapPeak.all_live), with
plan's figure over both.
"""

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "experiments", "results", "compile")
GB = 1e9

# K2's widths, fewer layers and experts, on 8 chips: pipeline 2 x data 2 x expert 2
K2_SHAPED = ["--config.model.num_hidden_layers=9", "--config.model.n_routed_experts=32",
             "--config.mesh.pipeline=2", "--config.mesh.expert=2", "--config.mesh.data=2",
             "--config.train.batch_size=32"]

ROWS = {   # name: (preset, topology, overrides)
    "tiny_v5e": ("tiny", "v5e:1x1", []),
    "tiny_v5e_4": ("tiny", "v5e:2x2", []),
    "k2_shaped_v5p_8": ("kimi_k2", "v5p:2x2x2", K2_SHAPED),
    "k2_shaped_v5p_8_no_offload": ("kimi_k2", "v5p:2x2x2",
                                   K2_SHAPED + ["--config.model.offload=False"]),
    # the suite's K2-shaped step (tests/test_tpu_compile.py), 1f1b with the preset's offload
    # and host optimizer states
    "k2_shaped_5l_v5p_8_host_state": ("kimi_k2", "v5p:2x2x2", [
        "--config.model.num_hidden_layers=5", "--config.model.n_routed_experts=16",
        "--config.mesh.pipeline=2", "--config.mesh.expert=2", "--config.mesh.data=2",
        "--config.mesh.virtual_stages=1", "--config.train.batch_size=16",
        "--config.train.seq_len=1024", "--config.mesh.pipeline_schedule=1f1b"]),
    # ... and its zbh1 (device slots and states) and gpipe on two virtual stages (host slots)
    "k2_shaped_5l_v5p_8_zbh1": ("kimi_k2", "v5p:2x2x2", [
        "--config.model.num_hidden_layers=5", "--config.model.n_routed_experts=16",
        "--config.mesh.pipeline=2", "--config.mesh.expert=2", "--config.mesh.data=2",
        "--config.mesh.virtual_stages=1", "--config.train.batch_size=16",
        "--config.train.seq_len=1024", "--config.mesh.pipeline_schedule=zbh1",
        "--config.model.offload=False", "--config.optimizer.host_state=False"]),
    "k2_shaped_5l_v5p_8_gpipe_v2": ("kimi_k2", "v5p:2x2x2", [
        "--config.model.num_hidden_layers=5", "--config.model.n_routed_experts=16",
        "--config.mesh.pipeline=2", "--config.mesh.expert=2", "--config.mesh.data=2",
        "--config.mesh.virtual_stages=2", "--config.train.batch_size=16",
        "--config.train.seq_len=1024", "--config.mesh.pipeline_schedule=gpipe",
        "--config.optimizer.host_state=False"]),
    # ... and with no pipeline: data 2 x expert 4, two microbatches in the trainer's scan
    "k2_shaped_5l_v5p_8_ep": ("kimi_k2", "v5p:2x2x2", [
        "--config.model.num_hidden_layers=5", "--config.model.n_routed_experts=16",
        "--config.mesh.pipeline=1", "--config.mesh.expert=4", "--config.mesh.data=2",
        "--config.train.batch_size=16", "--config.train.seq_len=1024",
        "--config.train.grad_accum=2", "--config.model.offload=False",
        "--config.optimizer.host_state=False"]),
    "k2_preset": ("kimi_k2", "v5p:8x16x16", []),
    "k2_preset_no_offload": ("kimi_k2", "v5p:8x16x16", ["--config.model.offload=False"]),
    "k2_long_context": ("kimi_k2_long_context", "v5p:8x16x16", []),
}


def run(name, preset, topology, overrides, timeout, memory_only=False):
  with tempfile.TemporaryDirectory() as d:
    path = os.path.join(d, "fig.json")
    env = dict(os.environ, ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    env.setdefault("JAX_PLATFORMS", "cpu")
    t0 = time.perf_counter()
    try:
      r = subprocess.run([sys.executable, "-m", "k2jax.compile", "--config", preset,
                          "--topology", topology, "--json", path, *overrides,
                          *(["--memory_only", "--explain", "1"] if memory_only else [])],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout)
      fig = json.load(open(path)) if os.path.exists(path) else None
      note = r.stderr.strip().splitlines()[-1] if r.returncode and r.stderr.strip() else ""
    except subprocess.TimeoutExpired:
      fig, note = None, f"no result in {timeout} s"
    seconds = time.perf_counter() - t0
  row = dict(row=name, config=preset, topology=topology, overrides=" ".join(overrides),
             compiled=bool(fig and fig.get("compiled")), seconds=round(seconds))
  if fig and fig.get("compiled"):
    dev, host = fig["xla_device"], fig["xla_host"]
    temporaries = dev["temporaries"] if "temporaries" in dev else dev["heap"] + dev[
        "thread_local"]
    row.update(xla_device_gb=dev["peak"] / GB, xla_temporaries_gb=temporaries / GB,
               xla_arguments_gb=dev["arguments"] / GB, xla_host_gb=host["peak"] / GB,
               plan_device_gb=(fig["plan_device"] or 0) / GB,
               plan_host_gb=(fig["plan_host"] or 0) / GB, hbm_gb=(fig["hbm"] or 0) / GB,
               fits=fig["fits"])
    row["device_ratio"] = row["xla_device_gb"] / row["plan_device_gb"] if row[
        "plan_device_gb"] else ""
    row["host_ratio"] = row["xla_host_gb"] / row["plan_host_gb"] if row["plan_host_gb"] else ""
    if fig.get("stage") == "buffer assignment":
      row["xla_check_gb"] = dev["check"] / GB
      if fig.get("xla_live") and fig["plan_device"]:
        row["xla_live_gb"] = fig["xla_live"] / GB
        row["check_ratio"] = dev["check"] / fig["plan_device"]
        row["live_ratio"] = fig["xla_live"] / fig["plan_device"]
      row["refusal"] = (
          f"buffer assignment only (k2jax.compile --memory_only): XLA's out-of-memory check "
          f"(arguments + heap) {dev['check'] / GB:.2f} GB ({dev['check'] / 2**30:.2f} GiB), "
          f"plan / check {(fig['plan_device'] or 0) / dev['check']:.2f}; heap "
          f"{dev['heap'] / 2**30:.2f} GiB, thread-local {dev['thread_local'] / 2**30:.2f} GiB")
  else:
    row["refusal"] = (fig or {}).get("refusal") or note
  return row


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--rows", default=",".join(ROWS), help=f"of {', '.join(ROWS)}")
  p.add_argument("--timeout", type=int, default=3600, help="seconds per compile")
  p.add_argument("--out", default=os.path.join(OUT, "compile_tpu.csv"))
  p.add_argument("--memory_only", action="store_true",
                 help="stop each compile at XLA's buffer assignment (k2jax.compile)")
  args = p.parse_args()
  names = [n for n in args.rows.split(",") if n]
  unknown = [n for n in names if n not in ROWS]
  if unknown:
    print(f"compile_tpu: unknown rows {', '.join(unknown)}; choose from {', '.join(ROWS)}",
          file=sys.stderr)
    raise SystemExit(2)
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  fields = ["row", "config", "topology", "overrides", "compiled", "xla_device_gb",
            "xla_arguments_gb", "xla_temporaries_gb", "xla_host_gb", "plan_device_gb",
            "plan_host_gb", "device_ratio", "host_ratio", "hbm_gb", "fits", "seconds", "refusal",
            "xla_check_gb", "xla_live_gb", "check_ratio", "live_ratio"]
  new = not os.path.exists(args.out)
  if not new:   # rows from before a column was added keep their figures, the new ones empty
    with open(args.out, newline="") as f:
      old = list(csv.DictReader(f))
    if old and list(old[0]) != fields:
      with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fields)
        w.writeheader()
        w.writerows({k: r.get(k, "") for k in fields} for r in old)
  print(f"{'row':<30}{'XLA dev GB':>11}{'check':>7}{'live':>7}{'plan GB':>9}{'check/plan':>11}"
        f"{'live/plan':>10}{'XLA host':>10}{'plan host':>10}{'s':>5}")
  for name in names:
    row = run(name, *ROWS[name], args.timeout, args.memory_only)
    with open(args.out, "a", newline="") as f:
      w = csv.DictWriter(f, fields)
      if new:
        w.writeheader()
        new = False
      w.writerow(row)
    if row["compiled"]:
      fmt = lambda k: f"{row[k]:.2f}" if isinstance(row.get(k), float) else "-"
      print(f"{name:<30}{fmt('xla_device_gb'):>11}{fmt('xla_check_gb'):>7}"
            f"{fmt('xla_live_gb'):>7}{fmt('plan_device_gb'):>9}{fmt('check_ratio'):>11}"
            f"{fmt('live_ratio'):>10}{fmt('xla_host_gb'):>10}{fmt('plan_host_gb'):>10}"
            f"{row['seconds']:>5}")
    else:
      print(f"{name:<30} refused ({row['seconds']} s): {row['refusal']}")


if __name__ == "__main__":
  main()
