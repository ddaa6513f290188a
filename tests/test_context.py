"""Context parallelism (k2jax.model.context): each sequence's tokens split over the `context`
mesh axis, equal to one device; the placement's balance. The attention of a device's query
blocks against the whole sequence is in test_attention.py; the trainer on context meshes in
test_parallel.py."""

import numpy as np
import pytest

from k2jax.model import context
from tests.multidevice import worker


def test_context_meshes_equal_one_device_and_faults_are_seen():
  """Loss, every gradient leaf, max logits, the per-sequence balance loss and expert load of
  CP = 2, 4, 8 alone and with data and expert (8 simulated devices, float32, packed
  documents with padding) equal one device's (rel < 1e-5). A placement that disagrees with
  the query blocks, or max logits left unreduced over context, are far off: the test can
  fail."""
  got = worker(8, "context_meshes", "1x2x1", "1x4x1", "1x8x1", "2x2x2", "2x4x1", "1x2x4")
  for mesh, err in got["meshes"].items():
    worst = max(err["grads"].values())
    assert max(err["loss"], err["max_logits"], err["aux"], err["load"], worst) < 1e-5, (
        mesh, err, got["seed"])
  assert len(got["meshes"]["2x2x2"]["grads"]) > 20          # every leaf, not a summary
  assert got["placement_fault"]["loss"] > 1e-4, got["placement_fault"]
  # (NaN counts as far off: a query row the wrong blocks leave without keys)
  assert any(not e <= 1e-3 for e in got["placement_fault"]["grads"].values())
  assert got["pmax_fault"]["max_logits"] > 1e-3, got["pmax_fault"]
  assert got["pmax_fault"]["loss"] < 1e-5      # the fault touches the statistic only


@pytest.mark.parametrize("C", [1, 2, 3, 8])
def test_placement_is_a_permutation_of_head_and_tail_chunks(C):
  T = 2 * C * 5
  order = context.placement(T, C)
  assert sorted(order) == list(range(T))
  for c in range(C):
    mine = order[c * 10:(c + 1) * 10]
    assert list(mine) == list(range(c * 5, c * 5 + 5)) + list(range((2 * C - 1 - c) * 5,
                                                                     (2 * C - c) * 5))
  x = np.random.default_rng(0).standard_normal((2, T, 3)).astype(np.float32)
  np.testing.assert_array_equal(context.from_placement(context.to_placement(x, C), C), x)


def test_each_device_runs_the_same_causal_work():
  """Block pairs each device's queries meet under the causal mask: equal on every device with
  head-tail chunks, where contiguous chunks leave the last device (2C - 1) / C of the mean."""
  for C in (2, 4, 8):
    n = 2 * C * 4                                          # blocks in the sequence
    order = context.placement(n, C)
    work = [sum(b + 1 for b in order[c * n // C:(c + 1) * n // C]) for c in range(C)]
    assert max(work) == min(work), (C, work)
    chunks = [sum(b + 1 for b in range(c * n // C, (c + 1) * n // C)) for c in range(C)]
    assert max(chunks) / np.mean(chunks) > (2 * C - 1) / C - 0.1


def test_a_length_the_chunks_do_not_divide_is_refused():
  with pytest.raises(ValueError, match="multiple of 2 x context"):
    context.placement(30, 4)
