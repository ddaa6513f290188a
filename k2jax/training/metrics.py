"""Metrics sinks: DIR/metrics.jsonl (one JSON object per logged step) and TensorBoard.

A resumed run appends to metrics.jsonl after dropping rows past the checkpoint it resumed
from, so the file reads as one uninterrupted run.
"""

import json
import logging
import os

import numpy as np
from tensorboardX import SummaryWriter

log = logging.getLogger(__name__)


def _plain(v):
  if isinstance(v, (np.ndarray, np.generic)):
    return v.tolist()
  return v


class MetricsWriter:

  def __init__(self, workdir: str, resume_step: int, enabled: bool = True):
    self.enabled = enabled
    self.path = os.path.join(workdir, "metrics.jsonl")
    if not enabled:
      return
    _truncate_after(self.path, resume_step)
    self.jsonl = open(self.path, "a")
    self.tb = SummaryWriter(os.path.join(workdir, "tensorboard"), purge_step=resume_step + 1)

  def write(self, step: int, metrics: dict) -> None:
    if not self.enabled:
      return
    row = {"step": int(step), **{k: _plain(v) for k, v in metrics.items()}}
    self.jsonl.write(json.dumps(row) + "\n")
    self.jsonl.flush()
    for k, v in row.items():
      if k == "step":
        continue
      if isinstance(v, list):
        for i, x in enumerate(v):
          self.tb.add_scalar(f"{k}/{i}", x, step)
      elif isinstance(v, (int, float)):
        self.tb.add_scalar(k, v, step)
    self.tb.flush()

  def close(self) -> None:
    if self.enabled:
      self.jsonl.close()
      self.tb.close()


def _rows(path: str) -> tuple[list[tuple[str, dict]], int]:
  """((line, row) of every complete row, number of non-blank lines). A line that is not JSON
  (a kill mid-write, a full disk) is dropped with a log line; the complete rows are kept."""
  out, lines = [], 0
  with open(path) as f:
    for i, line in enumerate(f, 1):
      if not line.strip():
        continue
      lines += 1
      try:
        row = json.loads(line)
      except json.JSONDecodeError:
        log.warning("%s: line %d is not a complete JSON row (%d bytes, a write cut short?); "
                    "dropped", path, i, len(line))
        continue
      out.append((line if line.endswith("\n") else line + "\n", row))
  return out, lines


def _truncate_after(path: str, step: int) -> None:
  """Drop rows past `step` (a resumed run writes them again) and any partial row. A run
  that starts over from step 0 with rows on file keeps them: the old file is renamed
  metrics.<n>.jsonl."""
  if not os.path.exists(path):
    return
  rows, lines = _rows(path)
  keep = [line for line, row in rows if row.get("step", 0) <= step]
  if step == 0 and lines:
    n = 1
    while os.path.exists(f"{path[:-len('.jsonl')]}.{n}.jsonl"):
      n += 1
    backup = f"{path[:-len('.jsonl')]}.{n}.jsonl"
    os.replace(path, backup)
    log.warning("no checkpoint to resume from: starting at step 0; the earlier metrics are "
                "kept in %s", backup)
    return
  if len(keep) < lines:
    with open(path, "w") as f:
      f.writelines(keep)


def read(workdir_or_file: str) -> list[dict]:
  path = workdir_or_file
  if os.path.isdir(path):
    path = os.path.join(path, "metrics.jsonl")
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path}: no metrics.jsonl: pass the --workdir of a k2jax.train run")
  return [row for _, row in _rows(path)[0]]
