"""Data: tokenizers, corpora (embedded stdlib source or user files), packing, grain pipeline.

  data = k2jax.data.build(cfg.data, cfg.train, cfg.model.vocab_size)
  it = data.train_iter()          # grain iterator; orbax saves it via grain.checkpoint
  batch = next(it)                # inputs, targets, segment_ids, positions, loss_mask

May import: nothing of k2jax.
"""

from k2jax.data.corpus import (embedded_documents, file_documents, load_documents,
                               split_documents)
from k2jax.data.packing import (PackedRows, concat_documents, num_rows,
                                unigram_cross_entropy)
from k2jax.data.pipeline import Data, build
from k2jax.data.tokenizer import ByteTokenizer, TiktokenTokenizer, get_tokenizer

__all__ = [
    "ByteTokenizer", "Data", "PackedRows", "TiktokenTokenizer", "build", "concat_documents",
    "embedded_documents", "file_documents", "get_tokenizer", "load_documents", "num_rows",
    "split_documents", "unigram_cross_entropy",
]
