"""Sequence packing: documents -> one token stream -> fixed-length training rows.

Each document becomes [BOS] + tokens + [EOS]; the documents of a split are concatenated and
cut into rows of seq_len + 1 tokens that overlap by one, so every token after the first is a
target exactly once and nothing is thrown away. Document boundaries inside a row are recovered
from BOS tokens (tokenizers never emit BOS for text), which is why the stream is the only
array kept in memory: rows are built on demand, a few microseconds each.
"""

from collections.abc import Sequence

import numpy as np


def stream_dtype(vocab_size: int) -> np.dtype:
  """uint16 halves the memory of byte-level and small-BPE streams; rows are int32 anyway."""
  return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.int32)


def concat_documents(token_docs: Sequence[np.ndarray], bos_id: int, eos_id: int,
                     dtype=np.int32) -> np.ndarray:
  """[BOS] + doc + [EOS] for every document, concatenated into one stream."""
  lengths = np.fromiter((len(t) for t in token_docs), dtype=np.int64, count=len(token_docs))
  ends = np.cumsum(lengths + 2)
  starts = ends - (lengths + 2)
  stream = np.empty(int(ends[-1]) if len(ends) else 0, dtype=dtype)
  for start, n, toks in zip(starts, lengths, token_docs):  # a loop over documents, not tokens
    stream[start + 1:start + 1 + n] = toks
  stream[starts] = bos_id
  stream[starts + lengths + 1] = eos_id
  return stream


def num_rows(stream_len: int, seq_len: int) -> int:
  """Rows needed so that every stream token but the first is a target once."""
  return max(0, -(-(stream_len - 1) // seq_len))


class PackedRows:
  """Random access to the packed rows of one stream: `rows[i]` is a dict of length-seq_len
  arrays inputs, targets, segment_ids, positions (int32) and loss_mask (float32)."""

  def __init__(self, stream: np.ndarray, seq_len: int, bos_id: int, pad_id: int):
    if seq_len <= 0:
      raise ValueError(f"train.seq_len = {seq_len}: must be positive")
    self.stream, self.seq_len = stream, seq_len
    self.bos_id, self.pad_id = bos_id, pad_id
    self._arange = np.arange(seq_len, dtype=np.int32)

  def __len__(self) -> int:
    return num_rows(len(self.stream), self.seq_len)

  def __getitem__(self, i: int) -> dict[str, np.ndarray]:
    i = int(i)
    if not 0 <= i < len(self):
      raise IndexError(f"row {i} out of range [0, {len(self)})")
    L, idx = self.seq_len, self._arange
    chunk = self.stream[i * L:i * L + L + 1]
    n = len(chunk)  # < L + 1 only in the last row, which is padded
    row = np.full(L + 1, self.pad_id, dtype=np.int32)
    row[:n] = chunk
    inputs, targets = row[:-1], row[1:]
    real_in = idx < n           # the input is a stream token, not padding
    real_tgt = idx + 1 < n
    starts = inputs == self.bos_id
    # A row that begins mid-document opens with segment 1 too.
    segment_ids = np.cumsum(starts, dtype=np.int32) + np.int32(not starts[0])
    # Position = distance to the latest document start in this row (or the row start).
    last_start = np.maximum.accumulate(np.where(starts, idx, 0))
    positions = idx - last_start
    # EOS -> next BOS is a guess across documents: not a training signal.
    loss_mask = (real_tgt & (targets != self.bos_id)).astype(np.float32)
    return dict(
        inputs=inputs, targets=targets,
        segment_ids=np.where(real_in, segment_ids, 0).astype(np.int32),
        positions=np.where(real_in, positions, 0).astype(np.int32),
        loss_mask=loss_mask)


def unigram_cross_entropy(train_stream: np.ndarray, eval_stream: np.ndarray, vocab_size: int,
                          ignore_ids: Sequence[int] = ()) -> float:
  """Eval cross-entropy (nats/token) of an add-one-smoothed unigram model fit on train_stream.

  A trained model must beat this to have learnt anything beyond token frequencies. Tokens in
  `ignore_ids` (e.g. BOS, which the loss masks) are neither counted nor scored.
  """
  train_counts = np.bincount(np.asarray(train_stream).ravel(), minlength=vocab_size)
  eval_counts = np.bincount(np.asarray(eval_stream).ravel(), minlength=vocab_size)
  if len(train_counts) > vocab_size or len(eval_counts) > vocab_size:
    raise ValueError(f"token ids must be < vocab_size ({vocab_size})")
  for t in ignore_ids:
    train_counts[t] = eval_counts[t] = 0
  if eval_counts.sum() == 0:
    return float("nan")
  log_p = np.log(train_counts + 1.0) - np.log(train_counts.sum() + float(vocab_size))
  return float(-(eval_counts * log_p).sum() / eval_counts.sum())
