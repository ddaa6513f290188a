"""What every pipeline shares: resumable output, shards, seeds, JSON out of model text.

Output is append-only JSONL keyed by item id. Kept records go to `out.jsonl`; every dropped
item is a line in `out.jsonl.drops` ({"id", "reason"}), so a rerun skips what was kept or
dropped (no duplicates), and nothing is lost silently: an item is either in one of the two
files or still to do. A write cut short by a kill leaves a partial last line: it is cut off
when the file is opened again, and that item is redone.
"""

import collections
import hashlib
import json
import logging
import os
import re

log = logging.getLogger("k2jax.synth")


def item_seed(seed: int, *parts) -> int:
  """A stable per-item seed (independent of shard, order and process): sha256 of the parts."""
  h = hashlib.sha256(json.dumps([seed, *map(str, parts)]).encode()).digest()
  return int.from_bytes(h[:4], "little") & 0x7FFFFFFF


def parse_shard(text: str) -> tuple[int, int]:
  """'i/n' -> (i, n) with 0 <= i < n; ValueError naming the rule."""
  m = re.fullmatch(r"(\d+)/(\d+)", text or "")
  if not m or not 0 <= int(m[1]) < int(m[2]):
    raise ValueError(f"--shard {text!r}: must be i/n with 0 <= i < n (e.g. 0/4)")
  return int(m[1]), int(m[2])


def in_shard(item_id: str, shard: tuple[int, int]) -> bool:
  """Items are split by a hash of their id: stable when the input grows or is reordered."""
  return item_seed(0, "shard", item_id) % shard[1] == shard[0]


def _clean_tail(path: str) -> None:
  """Cut a partial last line (a write killed midway) so appends start on a line boundary."""
  if not os.path.exists(path) or os.path.getsize(path) == 0:
    return
  with open(path, "rb+") as f:
    data = f.read()
    if data.endswith(b"\n"):
      return
    keep = data.rfind(b"\n") + 1
    log.warning("%s: dropping a partial last line (%d bytes) from an interrupted write; "
                "its item is redone", path, len(data) - keep)
    f.truncate(keep)


class Output:
  """Append-only JSONL with a drops file beside it; `seen` holds every finished item id."""

  def __init__(self, path: str):
    self.path, self.drops_path = path, path + ".drops"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    self.seen: set[str] = set()
    self.kept = self.dropped = 0
    self.reasons: collections.Counter = collections.Counter()
    for p in (self.path, self.drops_path):
      _clean_tail(p)
      self._load(p)
    self._files = [open(self.path, "a", encoding="utf-8"),
                   open(self.drops_path, "a", encoding="utf-8")]

  def _load(self, path: str) -> None:
    """Finished item ids of a file; an item whose records were cut off (the kill came
    between two of its lines, always the file's last item) is cut away to be redone."""
    if not os.path.exists(path):
      return
    offset, start, last, count, total = 0, 0, None, 0, 0
    with open(path, "rb") as f:
      for line in f:
        rec = json.loads(line)
        if rec["item"] != last:
          if last is not None and count == total:
            self.seen.add(last)
          last, start, count = rec["item"], offset, 0
        count, total = count + 1, rec.get("records", 1)
        offset += len(line)
    if last is None:
      return
    if count == total:
      self.seen.add(last)
      return
    log.warning("%s: item %s has %d of its %d records (an interrupted write): redone",
                path, last, count, total)
    with open(path, "rb+") as f:
      f.truncate(start)

  def _write(self, f, record: dict) -> None:
    f.write(json.dumps(record, ensure_ascii=False) + "\n")
    f.flush()
    os.fsync(f.fileno())        # a kill after this keeps the line: the item is not redone

  def keep(self, item: str, records: list[dict]) -> None:
    """All records of one item, written together (an item is never half kept)."""
    self._files[0].write("".join(
        json.dumps(dict(r, item=item, record=k, records=len(records)), ensure_ascii=False)
        + "\n" for k, r in enumerate(records)))
    self._files[0].flush()
    os.fsync(self._files[0].fileno())
    self.seen.add(item)
    self.kept += len(records)

  def drop(self, item: str, reason: str) -> None:
    self._write(self._files[1], {"item": item, "reason": reason})
    self.seen.add(item)
    self.dropped += 1
    self.reasons[reason.split(":")[0]] += 1

  def close(self) -> None:
    for f in self._files:
      f.close()

  def summary(self) -> str:
    why = ", ".join(f"{n} {r}" for r, n in self.reasons.most_common()) or "none"
    return f"kept {self.kept} records; dropped {self.dropped} items ({why})"


# Files beside OUTPUT: its drops, the agentic tool cache, the settings it was written with.
SIDE_FILES = (".drops", ".tools.json", ".settings.json")


def settings_path(output: str) -> str:
  return output + ".settings.json"


def _pipeline_of(record: dict) -> str:
  """Which pipeline wrote a record (outputs written before settings were recorded)."""
  if "messages" in record:
    return "agentic"
  return "math" if record.get("style") == "learning_note" else "rephrase"


def settings_changes(output: str, settings: dict) -> list[str]:
  """'key: old -> new' for each setting (pipeline, model, seed, styles, thresholds ...) that
  differs from those OUTPUT was written with; [] when they agree or OUTPUT is new. An output
  from before settings were recorded is compared by the pipeline of its first record."""
  path = settings_path(output)
  if os.path.exists(path):
    with open(path) as f:
      old = json.load(f)
  elif os.path.exists(output) and os.path.getsize(output):
    with open(output, "rb") as f:
      old = {"pipeline": _pipeline_of(json.loads(f.readline()))}
  else:
    return []
  return [f"{k}: {_show(old[k])} -> {_show(settings.get(k))}" for k in old
          if k in settings and old[k] != settings[k]]


def _show(v) -> str:
  return ",".join(map(str, v)) if isinstance(v, list) else str(v)


def record_settings(output: str, settings: dict) -> None:
  path = settings_path(output)
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path + ".tmp", "w") as f:
    json.dump(settings, f, indent=1)
  os.replace(path + ".tmp", path)


def set_aside(output: str) -> list[str]:
  """Move OUTPUT and its side files to NAME.prev (replacing older .prev files) so a run
  starts it afresh; -> the names moved."""
  moved = []
  for p in [output] + [output + s for s in SIDE_FILES]:
    if os.path.exists(p):
      os.replace(p, p + ".prev")
      moved.append(p)
  return moved


def extract_json(text: str):
  """The first JSON object or list in model text (fenced or not), or ValueError."""
  decoder = json.JSONDecoder(strict=False)
  for m in re.finditer(r"[\[{]", text):
    try:
      return decoder.raw_decode(text[m.start():])[0]
    except json.JSONDecodeError:
      continue
  raise ValueError(f"no JSON in the reply ({text[:60]!r})")
