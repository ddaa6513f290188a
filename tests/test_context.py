"""Context parallelism (k2jax.model.context): each sequence's tokens split over the `context`
mesh axis, equal to one device; the placement's balance. The attention of a device's query
blocks against the whole sequence is in test_attention.py; the trainer on context meshes in
test_parallel.py."""

import numpy as np
import pytest

from k2jax import configs
from k2jax.model import context
from tests.multidevice import worker

try:
  import tokamax  # noqa: F401  (optional extra)
  HAVE_TOKAMAX = True
except ImportError:
  HAVE_TOKAMAX = False


def test_context_meshes_equal_one_device_and_faults_are_seen():
  """Loss, every gradient leaf, max logits, the per-sequence balance loss and expert load of
  CP = 2, 4, 8 alone and with data and expert (8 simulated devices, float32, packed
  documents with padding, 4 / 2 / 1 groups of striped chunks) equal one device's
  (rel < 1e-5). A placement that disagrees with
  the query blocks, or max logits left unreduced over context, are far off: the test can
  fail."""
  got = worker(8, "context_meshes", "1x2x1", "1x4x1", "1x8x1", "2x2x2", "2x4x1", "1x2x4")
  for mesh, err in got["meshes"].items():
    worst = max(err["grads"].values())
    assert max(err["loss"], err["max_logits"], err["aux"], err["load"], worst) < 1e-5, (
        mesh, err, got["seed"])
  assert len(got["meshes"]["2x2x2"]["grads"]) > 20          # every leaf, not a summary
  # The fault is far off in the gradients (NaN counts as far off: a query row the wrong
  # blocks leave without keys). Its loss, a sum over every token, moved by only 8e-5 for
  # one random packing (CI, 2026-11-28), so the loss alone is not asked to show it.
  assert any(not e <= 1e-3 for e in got["placement_fault"]["grads"].values()), (
      got["placement_fault"], got["seed"])
  assert got["pmax_fault"]["max_logits"] > 1e-3, got["pmax_fault"]
  assert got["pmax_fault"]["loss"] < 1e-5      # the fault touches the statistic only


def test_the_accelerator_kernels_run_each_devices_query_blocks():
  """model.attention_impl under context parallelism: our Pallas GPU and TPU kernels (interpret
  mode) and, where installed, tokamax's XLA attention run each device's query blocks
  against the gathered sequence on data 2 x context 4; loss, every gradient leaf and max
  logits equal one device's chunked attention (rel < 1e-5, float32, packed documents with
  padding, 2 groups of striped chunks)."""
  impls = ["pallas_gpu", "pallas_tpu"] + (["tokamax"] if HAVE_TOKAMAX else [])
  got = worker(8, "context_kernels", *impls)
  for impl in impls:
    err = got[impl]
    assert err["ran"] == [impl], err
    assert err["leaves"] > 20 and max(err["loss"], err["max_logits"], err["grads"]) < 1e-5, (
        impl, err, got["seed"])


def test_generate_prefills_a_prompt_split_over_context_devices():
  """Under a context 4 x data 2 mesh generate's prefill runs context-parallel (the prompts'
  bucket of 64 tokens over 4 devices) and its decode steps whole on each: the greedy tokens
  of prompts of 5 to 64 tokens are one device's, log probabilities within 1e-4."""
  got = worker(8, "generate_context")
  assert got["context_ran"] and got["equal"], got
  assert got["logprob_err"] < 1e-4, got


def test_the_server_engine_prefills_over_context_devices():
  """k2jax.serve's engine on --mesh data=2,context=4: four prompts of 5 to 100 tokens admitted
  in one prefill split over the context devices (their 128-token bucket), then decoded
  whole on each; greedy tokens are generate's on one device, log probabilities within 1e-4."""
  got = worker(8, "serve_context")
  assert not got["errors"] and got["context_ran"] and got["prefix"], got
  assert got["logprob_err"] < 1e-4, got


@pytest.mark.parametrize("C,chunk", [(1, 5), (2, 5), (3, 1), (8, 2)])
def test_placement_is_a_permutation_of_head_and_tail_chunks(C, chunk):
  T = 2 * C * chunk * 3                                      # three groups of 2C chunks
  order = context.placement(T, C, chunk)
  assert sorted(order) == list(range(T))
  for c in range(C):
    mine = order[c * T // C:(c + 1) * T // C]
    want = [g * 2 * C * chunk + k * chunk + i for g in range(3) for k in (c, 2 * C - 1 - c)
            for i in range(chunk)]
    assert list(mine) == want
  x = np.random.default_rng(0).standard_normal((2, T, 3)).astype(np.float32)
  np.testing.assert_array_equal(
      context.from_placement(context.to_placement(x, C, chunk), C, chunk), x)


def test_each_device_runs_the_same_causal_work():
  """Block pairs each device's queries meet under the causal mask (one block per chunk):
  equal on every device, where contiguous chunks leave the last device (2C - 1) / C of the
  mean."""
  for C in (2, 4, 8):
    for groups in (1, 3):
      n = 2 * C * groups                                     # blocks in the sequence
      order = context.placement(n, C, 1)
      work = [sum(b + 1 for b in order[c * n // C:(c + 1) * n // C]) for c in range(C)]
      assert max(work) == min(work), (C, groups, work)
    chunks = [sum(b + 1 for b in range(c * n // C, (c + 1) * n // C)) for c in range(C)]
    assert max(chunks) / np.mean(chunks) > (2 * C - 1) / C - 0.1


def test_packed_documents_spread_over_the_devices():
  """Valid (same document, causal) pairs per device, busiest over mean, on 32k rows of packed
  documents of log-uniform lengths from 64 to 32k: <= 1.05 on average over packings with the
  default 128-token chunks on 8 devices; one head and one tail chunk of the row are far
  off."""
  rng = np.random.default_rng(1)
  T, C = 32768, 8
  striped, halves = [], []
  for _ in range(50):
    lengths = []
    while sum(lengths) < T:
      lengths.append(int(np.exp(rng.uniform(np.log(64), np.log(T)))))
    work = np.concatenate([np.arange(k) + 1 for k in lengths])[:T]
    for out, chunk in ((striped, 128), (halves, T // (2 * C))):
      per = work[context.placement(T, C, chunk)].reshape(C, -1).sum(1)
      out.append(per.max() / per.mean())
  assert np.mean(striped) <= 1.05, np.mean(striped)
  assert np.mean(halves) > 1.3, np.mean(halves)


def test_the_chunk_divides_what_the_sequence_allows():
  cfg = configs.get_config("tiny").model
  assert context.chunk_size(cfg, 32768, 8) == 128
  assert context.chunk_size(cfg, 48, 4) == 6                 # T / 2C = 6 < 128
  assert context.chunk_size(cfg, 2 * 8 * 96, 8) == 96
  cfg.context_chunk = 64
  assert context.chunk_size(cfg, 2 * 8 * 96, 8) == 48       # the largest divisor of 96 <= 64
  # 136 = 8 x 17: 68 divides it, but the TPU kernel's blocks need a multiple of 8 rows
  assert context.chunk_size(cfg, 2 * 4 * 136, 4) == 8


def test_a_length_the_chunks_do_not_divide_is_refused():
  cfg = configs.get_config("tiny").model
  with pytest.raises(ValueError, match="multiple of 2 x context"):
    context.chunk_size(cfg, 30, 4)
  with pytest.raises(ValueError, match="multiple of 2 x context x chunk"):
    context.placement(32, 4, 8)
