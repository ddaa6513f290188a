"""mkdocs hooks: the results pages read the experiments' own files, and the figures are drawn
by the code that does the thing.

- Every file under `experiments/results/` is published at `results/data/...`, so pages link
  the CSVs and plots the benchmarks wrote instead of copies of them.
- `<!-- table: AREA/FILE.csv [cols=a,b,c] [digits=3] -->` in a page becomes a table of that
  CSV (the columns named, in that order; floats to `digits` significant digits). A results
  page states the table's date, machine and commit once, above it.
- `guides/img/schedule_*.png`: tick diagrams of the pipeline schedules, drawn from
  `k2jax.parallel.schedules.build`, the table the jitted loop runs.
- `guides/img/memory_kimi_k2.png`: memory per device of the K2 preset on its 2,048 chips,
  from `k2jax.tools.plan.estimate`, the count `python -m k2jax.plan` prints; and
  `<!-- plan: PRESET -->` in a page, the same count as a table.

Python-Markdown, mkdocs-material and mkdocstrings do the rest; these are the two things no
plugin knows about our repository.
"""

import csv
import functools
import io
import math
import os
import re
import subprocess

from mkdocs.structure.files import File

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "experiments", "results")
PUBLISHED = (".csv", ".png", ".md", ".json", ".log", ".txt", ".svg")
# a directive is a line of its own (quoted in code, as in docs/development.md, it is text)
TABLE = re.compile(r"^<!--\s*table:\s*(\S+)((?:\s+\w+=\S+)*)\s*-->$", re.M)
# (schedule, pipeline devices P, virtual stages V, microbatches M) drawn for the guide
SCHEDULE_FIGURES = (("1f1b", 4, 2, 8), ("gpipe", 4, 2, 8), ("zbh1", 4, 2, 8))
MEMORY_MESH = {"pipeline": 16, "data": 8, "context": 1, "expert": 16}   # the report's layout
PLAN = re.compile(r"^<!--\s*plan:\s*(\w+)\s*-->$", re.M)


def on_files(files, config):
  for dirpath, _, names in os.walk(RESULTS):
    for name in sorted(names):
      if name.endswith(PUBLISHED):
        path = os.path.join(dirpath, name)
        uri = "results/data/" + os.path.relpath(path, RESULTS).replace(os.sep, "/")
        files.append(File.generated(config, uri, abs_src_path=path))
  for name, P, V, M in SCHEDULE_FIGURES:
    files.append(File.generated(config, f"guides/img/schedule_{name}.png",
                                content=schedule_png(name, P, V, M)))
  files.append(File.generated(config, "guides/img/memory_kimi_k2.png",
                              content=memory_png("kimi_k2", MEMORY_MESH)))
  return files


def on_page_markdown(markdown, page, config, files):
  markdown = PLAN.sub(lambda m: plan_table(m.group(1), MEMORY_MESH), markdown)
  return TABLE.sub(lambda m: csv_table(m.group(1), m.group(2)), markdown)


@functools.cache
def _estimate(preset: str, mesh: tuple):
  """plan.estimate of `preset` on `mesh` ((axis, size) pairs), once a build: the bar chart
  and the table read the same count."""
  from k2jax.tools import plan
  return plan.estimate(preset, dict(mesh))


def plan_table(preset: str, mesh: dict) -> str:
  """What one device holds (plan.estimate), as the rows `python -m k2jax.plan` prints."""
  est = _estimate(preset, tuple(mesh.items()))
  st, acts = est.states, est.acts
  loop = st["params"] + st["loop_sums"] + st["loop_copy"] + st["cast_copy"]
  rows = [
      ("params (bf16)", st["params"]),
      ("gradient buffer (fp32)", st["grads_whole"]),
      ("while the pipeline's loop runs: params, its float32 gradient sums (every weight but "
       "the experts and the embedding whole: `pipeline.inner_specs`) and the bf16 weights "
       "it gathers once a step", loop),
      (f"activations on the device ({acts.settings['remat']} recomputation, "
       f"{acts.settings['storage']} storage; traced)", acts.device),
      ("**on the device while the gradients are computed (the step's peak)**",
       loop + acts.device),
      ("on the device during the update: params, the gradients in ZeRO-1's slices, the "
       "states brought from host and the momenta Muon gathers", est.update),
      ("host memory: optimizer states, ZeRO-1 over data", st["optimizer_host"]),
      ("host memory: stage residuals in flight (`model.offload`)", acts.host),
  ]
  where = " x ".join(f"{k} {v}" for k, v in mesh.items() if v > 1)
  lines = [f"| `{preset}` on {where}, per device | GB |", "|---|---|"]
  lines += [f"| {what} | {b / 1e9:.2f} |" for what, b in rows]
  return "\n".join(lines) + "\n"


def _number(text: str, digits: int) -> str:
  try:
    x = float(text)
  except ValueError:
    return text
  if math.isnan(x):
    return ""
  if x == int(x) and abs(x) < 1e15 and "." not in text and "e" not in text.lower():
    return f"{int(x):,}" if abs(x) >= 10_000 else str(int(x))
  return f"{x:.{digits}g}"


def csv_table(rel: str, options: str) -> str:
  """A Markdown table of experiments/results/REL, or an error the --strict build reports."""
  path = os.path.join(RESULTS, rel)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"<!-- table: {rel} -->: no such file under experiments/results")
  opts = dict(kv.split("=", 1) for kv in options.split())
  digits = int(opts.get("digits", 3))
  with open(path, newline="") as f:
    rows = list(csv.DictReader(f))
  columns = opts["cols"].split(",") if "cols" in opts else list(rows[0])
  missing = [c for c in columns if c not in rows[0]]
  if missing:
    raise KeyError(f"<!-- table: {rel} -->: no column {missing}; it has {list(rows[0])}")
  out = io.StringIO()
  out.write("| " + " | ".join(columns) + " |\n|" + "---|" * len(columns) + "\n")
  for row in rows:
    cells = [_number(row[c] or "", digits).replace("|", "\\|") for c in columns]
    out.write("| " + " | ".join(cells) + " |\n")
  out.write(f"\n[{os.path.basename(rel)}](data/{rel}){_provenance(path)}\n")
  return out.getvalue()


def _provenance(path: str) -> str:
  """', written DATE at COMMIT' from git: the table's date and commit, stated once, by the
  file itself (results pages sit beside data/)."""
  try:
    stamp = subprocess.run(["git", "log", "-1", "--format=%cs at %h", "--", path], cwd=ROOT,
                           capture_output=True, text=True, timeout=30).stdout.strip()
  except (OSError, subprocess.TimeoutExpired):
    return ""
  return f", committed {stamp}" if stamp else ""


def schedule_png(name: str, P: int, V: int, M: int) -> bytes:
  """Tick diagram of one schedule: a row per device, a column per tick, a box per phase."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  from k2jax.parallel import schedules

  tab = schedules.build(name, P, V, M)
  kinds = ("F", "B", "W") if tab.split else ("F", "B")
  colours = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868"}
  ticks = tab.ticks
  fig, ax = plt.subplots(figsize=(max(6.0, ticks * 0.32), 0.5 + P * 0.55 * len(kinds) / 2))
  height = 0.8 / len(kinds)
  for t in range(ticks):
    for p in range(P):
      for k, kind in enumerate(kinds):
        v, m = (int(x) for x in tab.task[kind][t, p])
        if v < 0:
          continue
        y = p - 0.4 + k * height
        ax.add_patch(plt.Rectangle((t, y), 0.95, height * 0.95, color=colours[kind],
                                   alpha=0.35 + 0.65 * (v + 1) / V))
        ax.text(t + 0.47, y + height * 0.47, f"{m}", ha="center", va="center", fontsize=6)
  ax.set_xlim(0, ticks)
  ax.set_ylim(P - 0.5, -0.5)
  ax.set_yticks(range(P), [f"device {p}" for p in range(P)])
  ax.set_xlabel(f"tick; a box's number is its microbatch, darker = a later virtual stage "
                f"(idle {tab.idle_fraction():.1%} of device time at equal stage costs)", fontsize=8)
  ax.set_title(f"{name}: {P} devices x {V} virtual stages, {M} microbatches", fontsize=10)
  handles = [plt.Rectangle((0, 0), 1, 1, color=colours[k]) for k in kinds]
  ax.legend(handles, kinds, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
  buf = io.BytesIO()
  fig.tight_layout()
  fig.savefig(buf, format="png", dpi=110)
  plt.close(fig)
  return buf.getvalue()


def memory_png(preset: str, mesh: dict) -> bytes:
  """Stacked bars of what one device holds (plan.estimate): on the device while the
  gradients are computed and during the update, and in host memory."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  est = _estimate(preset, tuple(mesh.items()))
  st, GB = est.states, 1e9
  device = [("params", st["params"]), ("gradient sums", st["loop_sums"]),
            ("weights gathered in the loop", st["loop_copy"] + st["cast_copy"]),
            ("activations", est.acts.device)]
  bars = {"device: gradients": device,
          "device: update": [("the update (params, gradient slices, states, Muon's gathers)",
                              est.update)],
          "host": [("optimizer states", st["optimizer_host"]),
                   ("stage residuals (offload)", est.acts.host)]}
  fig, ax = plt.subplots(figsize=(8.0, 2.8))
  colours = iter(plt.cm.tab10.colors)
  for y, (label, parts) in enumerate(bars.items()):
    left = 0.0
    for name, b in parts:
      ax.barh(y, b / GB, left=left, color=next(colours), label=f"{name} {b / GB:.1f}")
      left += b / GB
  ax.set_yticks(range(len(bars)), list(bars))
  ax.invert_yaxis()
  ax.set_xlabel("GB per device (bytes held, as plan counts them)")
  ax.set_title(f"{preset} on {' x '.join(f'{k} {v}' for k, v in mesh.items() if v > 1)}",
               fontsize=10)
  ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
  buf = io.BytesIO()
  fig.tight_layout()
  fig.savefig(buf, format="png", dpi=110)
  plt.close(fig)
  return buf.getvalue()
