"""The input pipeline: config -> documents -> packed rows -> grain iterators of batches.

Row order is a grain index shuffle over the whole split, repeated with a fresh order each
epoch, and only then sliced by process: process p of P takes global positions p, p + P, ...,
so the union of the processes' batches at step s is exactly the batch a single process with
the full batch size would see at step s. The data a run sees therefore does not depend on how
many hosts it runs on. Iterator state is one integer per process (grain's next index), which
orbax saves through grain.checkpoint.CheckpointSave.
"""

import dataclasses
import logging
import time

import grain
import numpy as np

from k2jax.data import corpus, packing
from k2jax.data.tokenizer import get_tokenizer

log = logging.getLogger(__name__)

READ_THREADS = 2        # row building is cheap numpy work; the machine is for the model
PREFETCH_BATCHES = 4


@dataclasses.dataclass
class Data:
  """Built splits and the iterators over them; see `build`."""
  tokenizer: object
  train_rows: packing.PackedRows
  eval_rows: packing.PackedRows
  batch_size: int           # per process
  seed: int
  process_index: int = 0
  process_count: int = 1
  worker_count: int = 0
  unigram_baseline: float = float("nan")

  @property
  def num_train_rows(self) -> int:
    return len(self.train_rows)

  @property
  def num_eval_rows(self) -> int:
    return len(self.eval_rows)

  def _batches(self, rows: packing.PackedRows, shuffle: bool) -> grain.MapDataset:
    ds = grain.MapDataset.range(len(rows))
    if shuffle:
      ds = ds.shuffle(seed=self.seed)
    # Repeat before slicing by process: see the module docstring. For eval, repeating lets
    # a small held-out set still fill the requested batches (rows wrap around).
    ds = ds.repeat()[self.process_index::self.process_count]
    return ds.map(rows.__getitem__).batch(self.batch_size, drop_remainder=True)

  def train_dataset(self) -> grain.IterDataset:
    """Infinite batches of dicts of [per_process_batch, seq_len] numpy arrays."""
    ds = self._batches(self.train_rows, shuffle=True).to_iter_dataset(
        grain.ReadOptions(num_threads=READ_THREADS, prefetch_buffer_size=PREFETCH_BATCHES))
    if self.worker_count > 0:
      _absl_flags_ready()
      ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=self.worker_count))
    return ds

  def train_iter(self) -> grain.DatasetIterator:
    """A fresh iterator at the start of the data; `get_state`/`set_state` move it."""
    return iter(self.train_dataset())

  def eval_batches(self, n: int) -> list[dict[str, np.ndarray]]:
    """The first n eval batches in stream order: the same list on every call."""
    if self.num_eval_rows == 0:
      return []
    ds = self._batches(self.eval_rows, shuffle=False)
    return [ds[k] for k in range(n)]


def _absl_flags_ready():
  """grain's worker processes read absl flags; outside absl.app (tests, notebooks) nobody has
  parsed them, so accept their defaults instead of failing inside a worker thread."""
  from absl import flags
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()


def _check(tok, data_cfg, train_cfg, vocab_size, process_index, process_count):
  if tok.vocab_size > vocab_size:
    raise ValueError(f"model.vocab_size = {vocab_size} is smaller than the tokenizer's "
                     f"{tok.vocab_size} ids (data.tokenizer = {data_cfg.tokenizer!r}); set "
                     f"model.vocab_size >= {tok.vocab_size}")
  if process_count <= 0 or not 0 <= process_index < process_count:
    raise ValueError(f"process_index {process_index} / process_count {process_count}: "
                     "need 0 <= process_index < process_count")
  bs = train_cfg.batch_size
  if bs <= 0 or bs % process_count:
    raise ValueError(f"train.batch_size = {bs}: must be a positive multiple of the "
                     f"process count ({process_count})")
  if train_cfg.seq_len <= 0:
    raise ValueError(f"train.seq_len = {train_cfg.seq_len}: must be positive")


def _stream(tok, docs: list[bytes]) -> np.ndarray:
  dtype = packing.stream_dtype(tok.vocab_size)
  return packing.concat_documents(tok.encode_batch(docs), tok.bos_id, tok.eos_id, dtype)


def build(data_cfg, train_cfg, vocab_size: int, *, process_index: int = 0,
          process_count: int = 1) -> Data:
  """Read, split, tokenize and pack the corpus the `data` config names.

  vocab_size is the model's (model.vocab_size): the tokenizer must fit inside it. Each of
  the process_count processes gets batches of train.batch_size // process_count rows.
  """
  t0 = time.perf_counter()
  tok = get_tokenizer(data_cfg.tokenizer)
  _check(tok, data_cfg, train_cfg, vocab_size, process_index, process_count)
  train_docs, eval_docs = corpus.split_documents(corpus.load_documents(data_cfg),
                                                 data_cfg.eval_fraction)
  streams = {"train": _stream(tok, train_docs), "eval": _stream(tok, eval_docs)}
  rows = {k: packing.PackedRows(s, train_cfg.seq_len, tok.bos_id, tok.pad_id)
          for k, s in streams.items()}
  bs = train_cfg.batch_size
  if len(rows["train"]) < bs:
    raise ValueError(
        f"data: the train split ({len(train_docs)} documents, {len(streams['train'])} tokens) "
        f"packs into {len(rows['train'])} rows of train.seq_len = {train_cfg.seq_len}, fewer than "
        f"one batch of train.batch_size = {bs}: it needs at least "
        f"{bs * train_cfg.seq_len + 1} tokens; add text or lower train.batch_size / seq_len")
  if train_cfg.eval_batches and data_cfg.eval_fraction > 0 and not len(rows["eval"]):
    raise ValueError(
        f"data: no eval split: {len(train_docs) + len(eval_docs)} document(s) cannot be split "
        f"into train and eval (data.eval_fraction = {data_cfg.eval_fraction}); add documents "
        "(a held-out split needs at least 2), or set --config.train.eval_batches=0")
  baseline = packing.unigram_cross_entropy(streams["train"], streams["eval"], tok.vocab_size,
                                           ignore_ids=(tok.bos_id,))
  for name, docs in (("train", train_docs), ("eval", eval_docs)):
    log.info("data %s: %d docs, %d tokens, %d rows of %d (tokenizer %s)", name, len(docs),
             len(streams[name]), len(rows[name]), train_cfg.seq_len, tok.name)
  log.info("data: built in %.1fs; unigram eval baseline %.4f nats/token",
           time.perf_counter() - t0, baseline)
  return Data(tokenizer=tok, train_rows=rows["train"], eval_rows=rows["eval"],
              batch_size=train_cfg.batch_size // process_count,
              seed=int(train_cfg.seed) % 2**32, process_index=process_index,
              process_count=process_count, worker_count=int(data_cfg.worker_count),
              unigram_baseline=baseline)
