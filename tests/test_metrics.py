"""metrics.jsonl survives a write cut short: readers and a resumed writer keep every complete
row and drop the partial one with a log line."""

import json
import logging

from k2jax.training import metrics


def _write(path, rows, tail):
  with open(path, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
    f.write(tail)


def test_partial_last_line_is_dropped_by_read_and_resume(tmp_path, caplog):
  rows = [{"step": s, "loss": 5.0 - s} for s in (1, 2, 3)]
  _write(tmp_path / "metrics.jsonl", rows, '{"step": 4, "lo')     # killed mid-write
  with caplog.at_level(logging.WARNING, logger="k2jax.metrics"):
    assert metrics.read(str(tmp_path)) == rows
  assert "line 4 is not a complete JSON row" in caplog.text
  w = metrics.MetricsWriter(str(tmp_path), resume_step=2)          # resumed from step 2
  w.write(3, {"loss": 1.5})
  w.close()
  got = metrics.read(str(tmp_path))
  assert [r["step"] for r in got] == [1, 2, 3] and got[-1]["loss"] == 1.5
  assert all(json.loads(line) for line in open(tmp_path / "metrics.jsonl"))
