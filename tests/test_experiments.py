"""The small-scale experiment drivers (experiments/*_sweep.py) on a 2-step size: they run
through the public trainer, write their CSV and PNG, and a rerun reuses finished runs."""

import os
import sys

import pytest

EXPERIMENTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "experiments")
sys.path.insert(0, EXPERIMENTS)

CASES = [
    ("sparsity_sweep", ["--experts", "4,8"], "sparsity.png"),
    ("heads_sweep", [], "heads.png"),
    ("qk_clip_sweep", ["--taus", "30,none"], "qk_clip.png"),
    ("logit_growth_sweep", ["--settings", "lr0.01_wd0"], "logit_growth.png"),
]


@pytest.mark.parametrize("script,extra,png", CASES, ids=[c[0] for c in CASES])
def test_sweep_driver_runs_and_resumes(tmp_path, capsys, script, extra, png):
  module = __import__(script)
  argv = ["--scale", "tiny", "--seeds", "1", "--out", str(tmp_path / "out"),
          "--workdir", str(tmp_path / "runs"), *extra]
  module.main(argv)
  first = capsys.readouterr().out
  assert "report:" in first and "ours:" in first and "->" in first
  assert os.path.getsize(tmp_path / "out" / png) > 5_000
  assert os.path.exists(tmp_path / "out" / "summary.csv")
  done = sorted((tmp_path / "runs").glob("*/summary.json"))
  assert done
  stamps = [p.stat().st_mtime_ns for p in done]
  module.main(argv)                              # a rerun trains nothing again
  assert [p.stat().st_mtime_ns for p in done] == stamps
  assert capsys.readouterr().out.split("report:")[1] == first.split("report:")[1]


def test_bench_train_runs_end_to_end_on_cpu(tmp_path):
  """experiments/bench_train.py --tiny: the script the GPU runs measure with (its step, every
  part of the breakdown, the CSVs), on CPU at toy size, so a script mistake costs no device
  time. No part may come back FAILED."""
  import csv
  import bench_train
  bench_train.main(["--tiny", "--reps", "1", "--out", str(tmp_path)])
  with open(tmp_path / "train" / "bench_train_tiny.csv") as f:
    rows = list(csv.DictReader(f))
  with open(tmp_path / "train" / "bench_train_parts_tiny.csv") as f:
    parts = list(csv.DictReader(f))
  assert rows and all(float(r["tokens_per_s"]) > 0 for r in rows), rows
  assert not [p for p in parts if p["part"].startswith("FAILED")], parts
  assert any(p["part"].startswith("Muon: Newton-Schulz") for p in parts)
