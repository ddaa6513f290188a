"""Tokenizers: a byte-level one (the CPU default, no files needed) and tiktoken BPE files.

Both share one small interface: `encode(str | bytes) -> int32 array`, `encode_batch(docs)`,
`decode(ids) -> str`, `token_bytes(id) -> bytes`, `text_bytes(id) -> bytes` (what the id
adds to decode's UTF-8: decode(ids) == b"".join(map(text_bytes, ids)).decode("utf-8",
"replace"), so a server can decode a reply a token at a time), and the ids `bos_id`,
`eos_id`, `pad_id`, `vocab_size`. Special ids sit
after the ordinary ones and `encode` never emits them, so packing can find document starts
by looking for `bos_id` in the token stream.
"""

import hashlib
import os
from collections.abc import Iterable, Sequence

import numpy as np

# Splits text into words, number runs, punctuation runs and whitespace before BPE merges
# (the GPT-4 family convention; Kimi K2's own pattern adds CJK-specific rules on top).
SPLIT_PATTERN = "|".join([
    r"""'(?i:[sdmt]|ll|ve|re)""",        # English contractions
    r"""[^\r\n\p{L}\p{N}]?\p{L}+""",     # a word, with at most one leading non-letter
    r"""\p{N}{1,3}""",                   # digits in groups of up to three
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",    # punctuation runs
    r"""\s*[\r\n]+""",                   # line breaks with their indentation
    r"""\s+(?!\S)""",                    # whitespace not followed by a word
    r"""\s+""",
])


def _as_str(text: str | bytes) -> str:
  return text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text


class ByteTokenizer:
  """ids 0..255 are bytes, then EOS 256, BOS 257, PAD 258 and five reserved ids (264 total).

  It has no chat specials: k2jax.serving.chat writes K2's markers as their text, which a byte-level
  model learns like any other text."""

  eos_id = 256
  bos_id = 257
  pad_id = 258
  vocab_size = 264
  name = "byte"
  special_ids: dict = {}

  def encode(self, text: str | bytes) -> np.ndarray:
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    return np.frombuffer(data, dtype=np.uint8).astype(np.int32)

  def encode_batch(self, docs: Sequence[str | bytes]) -> list[np.ndarray]:
    """Zero-copy uint8 views: packing copies them once, into the stream (the corpus is 30 MB+)."""
    return [np.frombuffer(d.encode("utf-8") if isinstance(d, str) else d, dtype=np.uint8)
            for d in docs]

  def decode(self, ids: Iterable[int]) -> str:
    ids = np.asarray(ids, dtype=np.int64).ravel()
    return ids[ids < 256].astype(np.uint8).tobytes().decode("utf-8", errors="replace")

  def text_bytes(self, i: int) -> bytes:
    """The bytes id i adds to `decode`'s text: its byte, none for a special."""
    return bytes([i]) if 0 <= i < 256 else b""

  def token_bytes(self, i: int) -> bytes:
    """The bytes one id stands for (a special's name; b"" for a reserved id): what a
    server's logprobs show per token."""
    names = {self.eos_id: b"[EOS]", self.bos_id: b"[BOS]", self.pad_id: b"[PAD]"}
    return bytes([i]) if 0 <= i < 256 else names.get(i, b"")

  def byte_ids(self, data: bytes) -> list[int]:
    """One id per byte (what finishes a character a token left open)."""
    return list(data)


# Kimi K2's 256 reserved special ids after the BPE ranks (tokenizer_config.json of the
# published checkpoint), as offsets from the rank count: [BOS] 163584 = n_ranks + 0, ...
K2_SPECIALS = {
    "[BOS]": 0, "[EOS]": 1, "<|im_end|>": 2, "<|im_user|>": 3, "<|im_assistant|>": 4,
    "<|im_system|>": 10, "<|tool_calls_section_begin|>": 11, "<|tool_calls_section_end|>": 12,
    "<|tool_call_begin|>": 13, "<|tool_call_argument_begin|>": 14, "<|tool_call_end|>": 15,
    "<|im_middle|>": 17, "[UNK]": 254, "[PAD]": 255,
}
RESERVED_SPECIALS = 256


class TiktokenTokenizer:
  """A tiktoken BPE ranks file (one `base64token rank` per line, like Kimi K2's tiktoken.model).

  The 256 ids after the ranks are reserved specials laid out as K2's (K2_SPECIALS): BOS,
  EOS, the chat markers, PAD; `special_ids` maps their names to ids and `encode` never emits
  them (k2jax.serving.chat places the markers).
  """

  def __init__(self, path: str):
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe
    with open(path, "rb") as f:
      digest = hashlib.sha256(f.read()).hexdigest()
    # tiktoken keeps a copy keyed by the path under its cache dir; passing the content hash makes
    # it drop a stale copy when the file at this path has changed since.
    ranks = load_tiktoken_bpe(path, expected_hash=digest)
    n_ranks = max(ranks.values()) + 1
    self.special_ids = {name: n_ranks + off for name, off in K2_SPECIALS.items()}
    self.bos_id, self.eos_id = self.special_ids["[BOS]"], self.special_ids["[EOS]"]
    self.pad_id = self.special_ids["[PAD]"]
    self.vocab_size = n_ranks + RESERVED_SPECIALS
    self.ranks = ranks
    self.name = path
    self._n_ranks = n_ranks
    self._enc = tiktoken.Encoding(
        name=os.path.basename(path), pat_str=SPLIT_PATTERN, mergeable_ranks=ranks,
        special_tokens={})

  def encode(self, text: str | bytes) -> np.ndarray:
    return np.asarray(self._enc.encode_ordinary(_as_str(text)), dtype=np.int32)

  def encode_batch(self, docs: Sequence[str | bytes]) -> list[np.ndarray]:
    # tiktoken releases the GIL inside its Rust core, so a batch runs on several threads.
    out = self._enc.encode_ordinary_batch([_as_str(d) for d in docs], num_threads=4)
    return [np.asarray(ids, dtype=np.int32) for ids in out]

  def decode(self, ids: Iterable[int], specials: bool = False) -> str:
    """Text of the ordinary ids; with specials=True the chat markers appear as their names."""
    ids = [int(i) for i in np.asarray(ids, dtype=np.int64).ravel()]
    if not specials:
      return self._enc.decode([i for i in ids if i < self._n_ranks], errors="replace")
    names = {v: k for k, v in self.special_ids.items()}
    out, run = [], []
    for i in ids + [-1]:
      if 0 <= i < self._n_ranks:
        run.append(i)
        continue
      if run:
        out.append(self._enc.decode(run, errors="replace"))
        run = []
      if i in names:
        out.append(names[i])
    return "".join(out)

  def text_bytes(self, i: int) -> bytes:
    """The bytes id i adds to `decode`'s text (specials=False): none for a special."""
    return self._enc.decode_single_token_bytes(i) if 0 <= i < self._n_ranks else b""

  def token_bytes(self, i: int) -> bytes:
    """The bytes one id stands for (a special's name; b"" for an unnamed reserved id)."""
    if 0 <= i < self._n_ranks:
      return self.text_bytes(i)
    names = {v: k for k, v in self.special_ids.items()}
    return names.get(i, "").encode()

  def byte_ids(self, data: bytes) -> list[int]:
    """One id per byte (byte-level BPE has a rank for every byte): what finishes a character
    a token left open."""
    return [self._enc.encode_single_token(bytes([b])) for b in data]


def get_tokenizer(name: str) -> ByteTokenizer | TiktokenTokenizer:
  """`data.tokenizer`: "byte", or a path to a tiktoken BPE ranks file."""
  if name == "byte":
    return ByteTokenizer()
  path = os.path.expanduser(name)
  if not os.path.isfile(path):
    raise ValueError(f"data.tokenizer = {name!r}: no such file; pass 'byte' or the path to a "
                     "tiktoken BPE file (e.g. Kimi K2's tiktoken.model)")
  return TiktokenTokenizer(path)
