"""Compile K2's post-training and serving programs for v5p slices and tabulate XLA:TPU's
memory per chip against the shardings' (compile only, on any machine with libtpu).

    python experiments/compile_post_training.py                  # every row (~1 h on 2 cores)
    python experiments/compile_post_training.py --rows decode_64x4k_32,rl_512
    python experiments/compile_post_training.py --table          # rewrite the .md from the .csv

Each row runs `python -m k2jax.compile --program ... --json` in its own process and writes
one CSV line per program it compiles (the RL row: the update, the sampler's prefill and its
decode steps) to experiments/results/compile/post_training_k2.csv, and the table with the
exact commands to post_training_k2.md. Rows not run keep their earlier lines.
"""

import argparse
import csv
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "experiments", "results", "compile")
CSV = os.path.join(OUT, "post_training_k2.csv")
MD = os.path.join(OUT, "post_training_k2.md")
GB = 1e9


def serve(program, preset, topology, mesh, rows, context, prompt=None):
  args = ["--config", preset, "--program", program, "--topology", topology, "--mesh", mesh,
          "--rows", str(rows), "--context", str(context)]
  return args + (["--prompt", str(prompt)] if prompt else [])


K2, LONG = "kimi_k2", "kimi_k2_long_context"
ROWS = {
    # the smallest slice: bf16 weights (2.05 TB) over the chips, experts split over all
    "decode_8x4k_16": serve("decode", K2, "v5p:2x2x4", "expert=16", 8, 4096),
    "decode_8x4k_24": serve("decode", K2, "v5p:2x2x6", "expert=24", 8, 4096),
    "decode_8x4k_32": serve("decode", K2, "v5p:2x4x4", "expert=32", 8, 4096),
    "decode_64x4k_32": serve("decode", K2, "v5p:2x4x4", "expert=32", 64, 4096),
    "decode_256x4k_32": serve("decode", K2, "v5p:2x4x4", "expert=32", 256, 4096),
    "decode_8x32k_32": serve("decode", LONG, "v5p:2x4x4", "expert=32", 8, 32768),
    "decode_64x32k_32": serve("decode", LONG, "v5p:2x4x4", "expert=32", 64, 32768),
    "decode_256x32k_32": serve("decode", LONG, "v5p:2x4x4", "expert=32", 256, 32768),
    # new rows are admitted in a batch of at least the mesh's batch devices (rows_bucket),
    # each as long as the longest prompt's bucket
    "prefill_8x4k_32": serve("prefill", K2, "v5p:2x4x4", "expert=32", 8, 4096),
    "prefill_8x8k_32": serve("prefill", LONG, "v5p:2x4x4", "expert=32", 8, 32768, 8192),
    "prefill_8x32k_32": serve("prefill", LONG, "v5p:2x4x4", "expert=32", 8, 32768),
    "prefill_8x32k_64": serve("prefill", LONG, "v5p:4x4x4", "expert=64", 8, 32768),
    "prefill_8x32k_128": serve("prefill", LONG, "v5p:4x4x8", "expert=128", 8, 32768),
    # RL: kimi_k2's model and optimizer with tiny_rl's RL group (the kimi_k2_rl preset), and
    # the same on half the chips
    "rl_256": ["--config", "kimi_k2_rl", "--program", "rl", "--topology", "v5p:4x8x8",
               "--config.mesh.data=2", "--config.rl.inference_mesh.data=2",
               "--config.rl.prompts=64", "--config.rl.ptx_batch_size=256",
               "--config.train.batch_size=256"],
    "rl_512": ["--config", "kimi_k2_rl", "--program", "rl", "--topology", "v5p:8x8x8"],
}


def command(args) -> str:
  return "python -m k2jax.compile " + " ".join(shlex.quote(a) for a in args)


def run(name, args) -> list[dict]:
  with tempfile.TemporaryDirectory() as d:
    out = os.path.join(d, "figures.json")
    env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "k2jax.compile", *args, "--json", out],
                       capture_output=True, text=True, cwd=ROOT, env=env)
    wall = time.perf_counter() - t0
    print(r.stdout, end="")
    fig = json.load(open(out)) if os.path.exists(out) else None
  base = dict(row=name, command=command(args), wall_seconds=round(wall))
  if fig is None:
    line = [ln for ln in r.stderr.splitlines() if ln.startswith("k2jax.compile")]
    return [dict(base, compiled=False, refusal=(line or ["no output"])[-1])]
  if not fig["compiled"]:
    return [dict(base, config=fig["config"], topology=fig["topology"], compiled=False,
                 refusal=fig["refusal"])]
  rows = []
  for p in fig["programs"]:
    d, plan = p["xla_device"], p["plan"]
    args_plan = sum(v for k, v in plan.items() if not k.startswith("plan"))
    step_plan = next((v for k, v in plan.items() if k.startswith("plan")), None)
    rows.append(dict(
        base, program=p["program"], config=p["config"], topology=p["topology"],
        mesh=p["mesh"], geometry=p["geometry"], compiled=True,
        xla_arguments_gb=round(d["arguments"] / GB, 2),
        xla_temporaries_gb=round(d["temporaries"] / GB, 2),
        xla_peak_gb=round(d["peak"] / GB, 2), xla_host_gb=round(p["xla_host"]["peak"] / GB, 2),
        plan_arguments_gb=round(args_plan / GB, 2),
        plan_parts=" ".join(f"{k.split(' ')[0]}={v / GB:.2f}" for k, v in plan.items()),
        plan_step_gb=round(step_plan / GB, 2) if step_plan else None,
        hbm_gb=round(p["hbm"] / GB, 2), hbm_pct=round(100 * d["peak"] / p["hbm"], 1),
        slots=p.get("slots"), positions=p.get("positions"),
        cache_gb_per_slot=round(p["cache_bytes_per_slot"] / GB, 4)
        if "cache_bytes_per_slot" in p else None,
        cache_gb_per_slot_per_chip=round(p["cache_bytes_per_slot_per_device"] / GB, 4)
        if "cache_bytes_per_slot_per_device" in p else None,
        verdict=p["verdict"], seconds=p["seconds"]))
  return rows


FIELDS = ["row", "program", "config", "topology", "mesh", "geometry", "compiled",
          "xla_arguments_gb", "xla_temporaries_gb", "xla_peak_gb", "xla_host_gb",
          "plan_arguments_gb", "plan_parts", "plan_step_gb", "hbm_gb", "hbm_pct", "verdict",
          "slots", "positions", "cache_gb_per_slot", "cache_gb_per_slot_per_chip",
          "seconds", "wall_seconds", "refusal", "command"]


def write_md(lines) -> None:
  head = ("| row | program | config | topology | mesh | rows x context | XLA args / temps / "
          "peak GB | plan GB | HBM % | compile s |\n|---|---|---|---|---|---|---|---|---|---|\n")
  body = []
  for x in lines:
    if x.get("compiled") in (True, "True"):
      plan = f"{x['plan_arguments_gb']}" + (f" (step {x['plan_step_gb']})"
                                            if x.get("plan_step_gb") else "")
      body.append(f"| {x['row']} | {x['program']} | {x['config']} | {x['topology']} | "
                  f"{x['mesh']} | {x['geometry']} | {x['xla_arguments_gb']} / "
                  f"{x['xla_temporaries_gb']} / {x['xla_peak_gb']} | {plan} | {x['hbm_pct']} "
                  f"| {x['seconds']} |")
    else:
      body.append(f"| {x['row']} | refused | {x.get('config', '')} | {x.get('topology', '')} "
                  f"| | | {x['refusal']} | | | |")
  cmds = {x["row"]: x["command"] for x in lines}
  notes = ""      # a "## Notes" section written by hand stays
  if os.path.exists(MD):
    text = open(MD).read()
    notes = text[text.index("\n## Notes"):] if "\n## Notes" in text else ""
  with open(MD, "w") as f:
    f.write("# K2 post-training and serving programs compiled for v5p (XLA:TPU, compile "
            "only)\n\nPer chip. XLA: `compiled.memory_analysis()` of the executable (code "
            "generation ended); plan: the arguments' shards by the shardings the engine / "
            "trainer gives them (RL update: also k2jax.plan's step estimate); HBM: XLA's "
            "95.74 GiB of a v5p chip. Written by experiments/compile_post_training.py.\n\n")
    f.write(head + "\n".join(body) + "\n")
    seen, per_row = set(), []
    for x in lines:      # what a row of the engine's cache costs, from its shape
      key = (x.get("config"), x.get("positions"), x.get("mesh"))
      if x.get("cache_gb_per_slot") not in (None, "") and key not in seen:
        seen.add(key)
        per_row.append(f"| {x['config']} | {x['positions']} | {x['cache_gb_per_slot']} | "
                       f"{x['mesh']} | {x['cache_gb_per_slot_per_chip']} |")
    if per_row:
      f.write("\nThe engine's latent cache per slot (engine.cache_length positions x "
              "decode.cache_bytes_per_token), and per chip with the slots split over the "
              "mesh (generate.cache_shardings):\n\n| config | positions | GB per slot | "
              "mesh | GB per slot per chip |\n|---|---|---|---|---|\n" +
              "\n".join(per_row) + "\n")
    f.write("\nCommands (JAX_PLATFORMS=cpu):\n\n")
    f.write("\n".join(f"- {r}: `{c}`" for r, c in cmds.items()) + "\n" + notes)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--rows", default=",".join(ROWS), help="comma-separated rows to run")
  p.add_argument("--table", action="store_true", help="only rewrite the .md from the .csv")
  a = p.parse_args(argv)
  old = list(csv.DictReader(open(CSV))) if os.path.exists(CSV) else []
  if not a.table:
    names = [n for n in a.rows.split(",") if n]
    unknown = [n for n in names if n not in ROWS]
    if unknown:
      p.error(f"unknown rows {unknown}: choose from {', '.join(ROWS)}")
    for name in names:
      new = run(name, ROWS[name])
      old = [x for x in old if x["row"] != name] + new
      old.sort(key=lambda x: list(ROWS).index(x["row"]) if x["row"] in ROWS else len(ROWS))
      os.makedirs(OUT, exist_ok=True)
      with open(CSV, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        w.writeheader()
        w.writerows(old)
  write_md(old)


if __name__ == "__main__":
  main()
