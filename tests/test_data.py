"""Tests for k2jax.data: tokenizers, readers, split, packing, the grain pipeline."""

import base64
import json
import pathlib
import time

import grain
import numpy as np
import pytest

import k2jax
from k2jax.configs import base
from k2jax.data import corpus, packing, pipeline, tokenizer

KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")
BOS, EOS, PAD = 257, 256, 258


def test_imports_this_worktree():
  # The venv's editable install may point at another checkout; tests must see this one.
  assert pathlib.Path(k2jax.__file__).is_relative_to(pathlib.Path(__file__).parents[1])


def cfgs(files="", seq_len=16, batch_size=4, eval_fraction=0.1, **data):
  d, t = base.data_config(), base.train_config()
  d.update(dict(files=files, eval_fraction=eval_fraction, **data))
  t.update(dict(seq_len=seq_len, batch_size=batch_size, seed=3))
  return d, t


def write_docs(tmp_path, n=40, seed=0):
  """n random documents as one JSONL file; returns the glob and the texts."""
  rng = np.random.default_rng(seed)
  words = ["alpha", "beta", "gamma", "dé", "€", "x", "\n"]
  texts = [" ".join(rng.choice(words, rng.integers(1, 30))) for _ in range(n)]
  path = tmp_path / "docs.jsonl"
  path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)))
  return str(path), texts


# --- tokenizers ----------------------------------------------------------------------------

def test_byte_tokenizer_round_trip():
  tok = tokenizer.get_tokenizer("byte")
  text = "héllo wörld ✓ \x00\n"
  ids = tok.encode(text)
  assert ids.dtype == np.int32 and ids.max() < 256
  assert tok.decode(ids) == text
  assert tok.decode([BOS, *ids, EOS, PAD, 263]) == text  # specials dropped
  assert np.array_equal(tok.encode(text.encode()), ids)
  assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (BOS, EOS, PAD, 264)
  assert tok.decode([0xC3]) == "\ufffd"


def write_bpe(tmp_path):
  ranks = [bytes([b]) for b in range(256)] + [b"th", b"the", b" the"]
  path = tmp_path / "tiny.tiktoken"
  path.write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % r for r, t in enumerate(ranks)))
  return path


def test_tiktoken_tokenizer(tmp_path):
  path = write_bpe(tmp_path)
  tok = tokenizer.get_tokenizer(str(path))
  # K2's reserved-special layout after the 259 ranks: BOS +0, EOS +1, PAD +255, 256 in all.
  assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (259, 260, 259 + 255, 259 + 256)
  assert tok.special_ids["<|im_end|>"] == 261 and tok.special_ids["<|im_middle|>"] == 259 + 17
  ids = tok.encode("the cat, the end")
  assert ids.dtype == np.int32 and 257 in ids and 258 in ids
  assert tok.decode([259, *ids, 260, 261]) == "the cat, the end"
  assert tok.decode([*ids[:1], 261], specials=True) == "the<|im_end|>"
  assert [list(x) for x in tok.encode_batch(["the", b"the"])] == [[257], [257]]


def test_tokenizer_missing_file():
  with pytest.raises(ValueError, match=r"data\.tokenizer.*/no/such.model.*'byte'"):
    tokenizer.get_tokenizer("/no/such.model")


# --- readers -------------------------------------------------------------------------------

def test_readers(tmp_path):
  import pyarrow as pa
  import pyarrow.parquet as pq
  (tmp_path / "a.txt").write_text("first doc")
  (tmp_path / "b.md").write_text("# second")
  (tmp_path / "c.jsonl").write_text('{"body": "x1"}\n\n{"body": "x2"}\n')
  pq.write_table(pa.table({"body": ["p1", None, "p2"], "n": [1, 2, 3]}), tmp_path / "d.parquet")
  glob = f"{tmp_path}/*.parquet, {tmp_path}/*.jsonl,{tmp_path}/*.[tm][xd]*"
  docs = corpus.file_documents(glob, text_field="body")
  assert docs == [b"first doc", b"# second", b"x1", b"x2", b"p1", b"p2"]  # sorted by path
  assert corpus.file_documents(glob, "body", max_bytes=18) == [b"first doc", b"# second"]


@pytest.mark.parametrize("name,content,field,match", [
    ("a.jsonl", '{"text": "ok"}\n{"body": 1}\n', "text", r"text_field = 'text'.*a\.jsonl:2.*body"),
    ("a.jsonl", '{"text": 5}\n', "text", r"a\.jsonl:1 holds a int"),
    ("a.jsonl", "not json\n", "text", r"a\.jsonl:1 is not valid JSON"),
    ("a.parquet", None, "text", r"text_field = 'text'.*a\.parquet has no such column.*body"),
    ("a.csv", "x", "text", r"data\.files.*a\.csv has an unknown extension"),
])
def test_reader_errors(tmp_path, name, content, field, match):
  if content is None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / name)
  else:
    (tmp_path / name).write_text(content)
  with pytest.raises(ValueError, match=match) as e:
    corpus.file_documents(str(tmp_path / "*"), text_field=field)
  assert "\n" not in str(e.value)


def test_glob_matching_nothing(tmp_path):
  with pytest.raises(ValueError, match=r"data\.files: no file matches .*nothing\*\.txt"):
    corpus.file_documents(str(tmp_path / "nothing*.txt"))


# --- split ---------------------------------------------------------------------------------

def test_split_deterministic_and_disjoint():
  rng = np.random.default_rng(0)
  docs = [rng.bytes(int(rng.integers(0, 50))) + b"%d" % i for i in range(2000)]
  train, evals = corpus.split_documents(docs, 0.1)
  assert corpus.split_documents(list(docs), 0.1) == (train, evals)
  assert not set(train) & set(evals) and len(train) + len(evals) == len(docs)
  assert 140 < len(evals) < 260
  # A document's side does not depend on the documents after it.
  assert corpus.split_documents(docs[:1000], 0.1)[1] == [d for d in evals if d in docs[:1000]]
  assert corpus.split_documents(docs, 0.0)[1] == []


def test_split_always_has_eval_doc():
  for n in (2, 3, 5):
    train, evals = corpus.split_documents([b"doc %d" % i for i in range(n)], 1e-9)
    assert len(evals) == 1 and len(train) == n - 1


# --- packing -------------------------------------------------------------------------------

def brute_force_rows(docs, seq_len):
  """Packing written the slow, obvious way: tokens tagged with (document, offset)."""
  toks = []  # (token, doc index, offset in the document)
  for d, doc in enumerate(docs):
    toks += [(t, d, k) for k, t in enumerate([BOS, *doc, EOS])]
  rows, i = [], 0
  while i * seq_len + 1 < len(toks):
    out = {k: [] for k in KEYS}
    chunk = toks[i * seq_len:i * seq_len + seq_len + 1]
    chunk += [(PAD, None, None)] * (seq_len + 1 - len(chunk))
    first_doc, first_off = chunk[0][1], chunk[0][2]
    docs_seen = []
    for j in range(seq_len):
      (t, d, off), (tt, _, toff) = chunk[j], chunk[j + 1]
      out["inputs"].append(t)
      out["targets"].append(tt)
      if d is None:
        out["segment_ids"].append(0)
        out["positions"].append(0)
      else:
        if d not in docs_seen:
          docs_seen.append(d)
        out["segment_ids"].append(len(docs_seen))
        out["positions"].append(off - first_off if d == first_doc else off)
      out["loss_mask"].append(0.0 if tt == PAD or toff == 0 else 1.0)
    rows.append(out)
    i += 1
  return rows


@pytest.mark.parametrize("seq_len", [1, 2, 5, 16])
def test_packing_matches_brute_force(seq_len):
  rng = np.random.default_rng(seq_len)
  docs = [rng.integers(0, 256, rng.integers(0, 3 * seq_len + 2)) for _ in range(12)]
  stream = packing.concat_documents(docs, BOS, EOS, np.uint16)
  rows = packing.PackedRows(stream, seq_len, BOS, PAD)
  expected = brute_force_rows(docs, seq_len)
  assert len(rows) == len(expected) == packing.num_rows(len(stream), seq_len)
  for i, exp in enumerate(expected):
    got = rows[i]
    for k in KEYS:
      assert got[k].shape == (seq_len,) and got[k].dtype == (
          np.float32 if k == "loss_mask" else np.int32)
      assert got[k].tolist() == exp[k], (i, k)
  with pytest.raises(IndexError):
    rows[len(rows)]


def test_every_token_is_a_target_once():
  rng = np.random.default_rng(1)
  docs = [rng.integers(0, 256, rng.integers(0, 40)) for _ in range(30)]
  stream = packing.concat_documents(docs, BOS, EOS)
  rows = [packing.PackedRows(stream, 7, BOS, PAD)[i] for i in range(packing.num_rows(len(stream), 7))]
  targets = np.concatenate([r["targets"] for r in rows])
  mask = np.concatenate([r["loss_mask"] for r in rows])
  n = len(stream) - 1
  assert np.array_equal(targets[:n], stream[1:]) and (targets[n:] == PAD).all()
  # loss_mask is zero exactly at the document-start BOS targets and at padding.
  assert np.array_equal(mask == 0, np.concatenate([stream[1:] == BOS, np.ones(len(targets) - n, bool)]))
  assert (stream == BOS).sum() == len(docs)


def test_unigram_cross_entropy_by_hand():
  # train counts over vocab 4: [2, 1, 0, 0] -> add-one probabilities [3, 2, 1, 1] / 7
  ce = packing.unigram_cross_entropy(np.array([0, 0, 1]), np.array([0, 2, 2]), 4)
  assert ce == pytest.approx(-(np.log(3 / 7) + 2 * np.log(1 / 7)) / 3)
  # Ignored ids are neither fit nor scored: train [0], eval [1] over vocab 3 -> p = 1/4.
  ce = packing.unigram_cross_entropy(np.array([0, 2, 2]), np.array([2, 1]), 3, ignore_ids=(2,))
  assert ce == pytest.approx(np.log(4))


# --- pipeline ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def embedded():
  d, t = cfgs(seq_len=256, batch_size=16, eval_fraction=0.02)
  start = time.perf_counter()
  data = pipeline.build(d, t, 264)
  return data, time.perf_counter() - start


def test_embedded_corpus(embedded):
  data, seconds = embedded
  assert seconds < 20
  assert data.num_train_rows * 256 > 1e6 and data.num_eval_rows > 0
  assert 0 < data.unigram_baseline < np.log(264)
  batch = next(data.train_iter())
  assert set(batch) == set(KEYS)
  assert all(v.shape == (16, 256) for v in batch.values())
  assert batch["inputs"].dtype == np.int32 and batch["loss_mask"].dtype == np.float32
  assert np.array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])


def test_eval_batches_are_fixed(embedded):
  data, _ = embedded
  a, b = data.eval_batches(3), data.eval_batches(3)
  assert len(a) == 3
  for x, y in zip(a, b):
    assert all(np.array_equal(x[k], y[k]) for k in KEYS)
  # Stream order: eval batch 0 is eval rows 0..15.
  assert np.array_equal(a[0]["inputs"][1], data.eval_rows[1]["inputs"])


def test_checkpoint_restore_through_orbax(embedded, tmp_path):
  import orbax.checkpoint as ocp
  data, _ = embedded
  it = data.train_iter()
  for _ in range(3):
    next(it)
  with ocp.CheckpointManager(tmp_path.absolute() / "ckpt") as mngr:
    mngr.save(3, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
    mngr.wait_until_finished()
    expected = [next(it) for _ in range(3)]
    fresh = data.train_iter()
    mngr.restore(3, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(fresh)))
  for want in expected:
    got = next(fresh)
    assert all(np.array_equal(got[k], want[k]) for k in KEYS)
  other = data.train_iter()  # and plain get_state / set_state
  other.set_state(fresh.get_state())
  assert np.array_equal(next(other)["inputs"], next(fresh)["inputs"])


def row_ids(data, batch):
  """Which train rows a batch holds (rows of random documents are distinct)."""
  rows = data.train_rows
  if not hasattr(rows, "lookup"):
    rows.lookup = {rows[i]["targets"].tobytes(): i for i in range(len(rows))}
  return [rows.lookup[r.tobytes()] for r in batch["targets"]]


def test_process_shards_cover_the_global_batch(tmp_path):
  glob, _ = write_docs(tmp_path, n=60)
  d, t = cfgs(glob, batch_size=4)
  single = pipeline.build(d, t, 264)
  shards = [pipeline.build(d, t, 264, process_index=p, process_count=2) for p in (0, 1)]
  it1, its = single.train_iter(), [s.train_iter() for s in shards]
  assert single.num_train_rows % 4  # so that the steps below cross an epoch boundary mid-batch
  for _ in range(single.num_train_rows // 4 + 3):
    whole = row_ids(single, next(it1))
    parts = [row_ids(single, next(i)) for i in its]
    assert all(len(p) == 2 for p in parts) and not set(parts[0]) & set(parts[1])
    assert sorted(parts[0] + parts[1]) == sorted(whole)
  again = pipeline.build(d, t, 264, process_index=1, process_count=2)
  assert row_ids(single, next(again.train_iter())) == row_ids(single, next(shards[1].train_iter()))


def test_epochs_are_reshuffled_permutations(tmp_path):
  glob, _ = write_docs(tmp_path, n=30)
  d, t = cfgs(glob, batch_size=1)
  data = pipeline.build(d, t, 264)
  n = data.num_train_rows
  it = data.train_iter()
  seen = [row_ids(data, next(it))[0] for _ in range(2 * n)]
  assert sorted(seen[:n]) == sorted(seen[n:]) == list(range(n))
  assert seen[:n] != seen[n:] and seen[:n] != list(range(n))


def test_build_with_bpe_tokenizer(tmp_path):
  glob, texts = write_docs(tmp_path, n=10)
  data = pipeline.build(*cfgs(glob, tokenizer=str(write_bpe(tmp_path)), eval_fraction=0.0), 515)
  assert data.tokenizer.bos_id == 259 and data.num_eval_rows == 0 and data.eval_batches(2) == []
  stream = data.train_rows.stream
  assert (stream == 259).sum() == (stream == 260).sum() == len(texts)
  assert data.tokenizer.decode(stream) == "".join(texts)


def test_build_errors(tmp_path):
  glob, _ = write_docs(tmp_path)
  with pytest.raises(ValueError, match=r"model\.vocab_size = 256 .* 264"):
    pipeline.build(*cfgs(glob), 256)
  with pytest.raises(ValueError, match=r"train\.batch_size = 6"):
    pipeline.build(*cfgs(glob, batch_size=6), 264, process_index=0, process_count=4)


def test_worker_processes_give_the_same_batches(tmp_path):
  glob, _ = write_docs(tmp_path, n=30)
  d, t = cfgs(glob)
  data = pipeline.build(d, t, 264)
  want = [next(it) for it in [data.train_iter()] for _ in range(3)]
  data.worker_count = 1
  it = data.train_iter()
  got = [next(it) for _ in range(3)]
  it.close()
  for g, w in zip(got, want):
    assert all(np.array_equal(g[k], w[k]) for k in KEYS)
