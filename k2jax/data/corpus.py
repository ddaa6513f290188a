"""Documents as bytes: the embedded corpus, user files, and the train/eval split.

The embedded corpus is the standard library source of the running interpreter: always
present, tens of MB, no download. Everything here is deterministic (sorted file order, a
content hash for the split) so two runs, or two hosts, see the same documents.
"""

import glob
import hashlib
import json
import os
import sysconfig
from collections.abc import Iterator

TEXT_SUFFIXES = (".txt", ".md")
FORMATS = ".txt, .md, .jsonl, .parquet"


def _capped(docs: Iterator[bytes], max_bytes: int) -> list[bytes]:
  """Whole documents in order while their total stays within max_bytes (0 = no cap)."""
  out, total = [], 0
  for doc in docs:
    total += len(doc)
    if max_bytes > 0 and total > max_bytes:
      break
    out.append(doc)
  return out


def stdlib_root() -> str:
  return sysconfig.get_paths()["stdlib"]


def _stdlib_files(root: str) -> list[str]:
  found = []
  for dirpath, dirnames, filenames in os.walk(root):
    # Third-party packages differ between machines; the corpus must not.
    dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages")]
    found += [os.path.relpath(os.path.join(dirpath, f), root)
              for f in filenames if f.endswith(".py")]
  return sorted(found, key=lambda p: p.replace(os.sep, "/"))


def embedded_documents(max_bytes: int = 0) -> list[bytes]:
  """The interpreter's standard library `.py` files, one document each, in sorted path order."""
  root = stdlib_root()
  paths = _stdlib_files(root)
  if not paths:
    raise ValueError(f"embedded corpus: no .py files under {root}; set data.files to a glob "
                     "of your own text files")

  def read():
    for rel in paths:
      with open(os.path.join(root, rel), "rb") as f:
        yield f.read()
  docs = _capped(read(), max_bytes)
  if not docs:
    raise ValueError(f"data.max_corpus_bytes = {max_bytes} is smaller than the first document; "
                     "raise it or set it to 0 (no cap)")
  return docs


def match_files(files: str) -> list[str]:
  """`data.files`: one glob or several separated by commas; the union in sorted order."""
  paths = set()
  for pattern in (p.strip() for p in files.split(",")):
    if not pattern:
      continue
    hits = [p for p in glob.glob(os.path.expanduser(pattern), recursive=True)
            if os.path.isfile(p)]
    if not hits:
      raise ValueError(f"data.files: no file matches {pattern!r}; give a glob of existing "
                       f"{FORMATS} files, or leave data.files empty for the embedded corpus")
    paths.update(hits)
  for p in paths:
    if not p.endswith(TEXT_SUFFIXES + (".jsonl", ".parquet")):
      raise ValueError(f"data.files: {p} has an unknown extension; use {FORMATS} files "
                       "or narrow the glob")
  return sorted(paths)


def _jsonl_documents(path: str, field: str) -> Iterator[bytes]:
  with open(path, "rb") as f:
    for lineno, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"data.files: {path}:{lineno} is not valid JSON ({e.msg}); "
                         "fix the line or remove the file from the glob") from None
      if not isinstance(record, dict) or field not in record:
        keys = ", ".join(record) if isinstance(record, dict) else type(record).__name__
        raise ValueError(f"data.text_field = {field!r}: {path}:{lineno} has no such field "
                         f"(found: {keys}); set data.text_field to the field holding the text")
      text = record[field]
      if not isinstance(text, str):
        raise ValueError(f"data.text_field = {field!r}: {path}:{lineno} holds a "
                         f"{type(text).__name__}, not a string; point it at a text field")
      yield text.encode("utf-8")


def _parquet_documents(path: str, field: str) -> Iterator[bytes]:
  import pyarrow.parquet as pq
  pf = pq.ParquetFile(path)
  names = pf.schema_arrow.names
  if field not in names:
    raise ValueError(f"data.text_field = {field!r}: {path} has no such column "
                     f"(found: {', '.join(names)}); set data.text_field to the text column")
  # Record batches keep memory bounded on large files; nulls are skipped.
  for batch in pf.iter_batches(columns=[field]):
    for text in batch.column(0).to_pylist():
      if text is not None:
        yield text.encode("utf-8") if isinstance(text, str) else bytes(text)


def _file_documents(path: str, field: str) -> Iterator[bytes]:
  if path.endswith(".jsonl"):
    yield from _jsonl_documents(path, field)
  elif path.endswith(".parquet"):
    yield from _parquet_documents(path, field)
  else:
    with open(path, "rb") as f:
      yield f.read()


def file_documents(files: str, text_field: str = "text", max_bytes: int = 0) -> list[bytes]:
  """Documents from the files `files` matches: a text file is one document, a JSONL line or a
  Parquet row is one document (its `text_field`)."""
  paths = match_files(files)
  texts = (d for p in paths for d in _file_documents(p, text_field) if d.strip())
  docs = _capped(texts, max_bytes)
  if not docs:
    raise ValueError(f"data.files = {files!r}: the {len(paths)} matched file(s) hold no text "
                     "(empty or whitespace only, or data.max_corpus_bytes below the first "
                     "document); point data.files at files with text")
  return docs


def load_documents(data_cfg) -> list[bytes]:
  """The documents the `data` config group names: data.files, or the embedded corpus."""
  if data_cfg.files:
    return file_documents(data_cfg.files, data_cfg.text_field, data_cfg.max_corpus_bytes)
  return embedded_documents(data_cfg.max_corpus_bytes)


def _unit_hash(index: int, doc: bytes) -> float:
  """A stable pseudo-random number in [0, 1) per document (never Python's salted hash())."""
  h = hashlib.blake2b(index.to_bytes(8, "little") + doc[:1024], digest_size=8)
  return int.from_bytes(h.digest(), "little") / 2.0**64


def split_documents(docs: list[bytes], eval_fraction: float) -> tuple[list[bytes], list[bytes]]:
  """(train, eval): a document is held out iff its hash falls below eval_fraction.

  Hashing each document on its own keeps the split of a document fixed when others are
  added or the corpus cap changes. At least one eval document when eval_fraction > 0 and
  there are two or more documents, so eval loss always exists.
  """
  if not 0.0 <= eval_fraction < 1.0:
    raise ValueError(f"data.eval_fraction = {eval_fraction!r}: must be in [0, 1)")
  u = [_unit_hash(i, d) for i, d in enumerate(docs)]
  held = {i for i, x in enumerate(u) if x < eval_fraction}
  if eval_fraction > 0 and not held and len(docs) >= 2:
    held = {min(range(len(docs)), key=u.__getitem__)}
  if len(held) == len(docs):  # keep something to train on
    held.discard(max(range(len(docs)), key=u.__getitem__))
  train = [d for i, d in enumerate(docs) if i not in held]
  evals = [d for i, d in enumerate(docs) if i in held]
  return train, evals
