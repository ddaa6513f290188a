"""k2jax.xla_heap's arithmetic on made-up buffer assignments (no compiler needed; the
compiled cases are in test_tpu_compile.py)."""

import numpy as np

from k2jax.tools import xla_heap


def test_heap_peak_is_the_most_bytes_live_at_once_brute_force():
  """xla_heap.fullest against brute force on fresh random values: at every moment, the union
  of the live values' [offset, offset + size) (values sharing a place, or overlapping, count
  once); the sweep must find the largest, and the moment it names must have that many."""
  seed = np.random.SeedSequence().entropy
  rng = np.random.default_rng(seed)
  for _ in range(50):
    values, ranges = {}, {}
    for i in range(int(rng.integers(1, 60))):
      offset, size = int(rng.integers(0, 40)) * 8, int(rng.integers(1, 12)) * 8
      a = int(rng.integers(0, 50))
      values[f"v.{i}{{}}"] = (size, offset, "f32[2]")
      ranges[f"v.{i}{{}}"] = (a, a + int(rng.integers(0, 20)))

    def union(t):
      cover = set()
      for name, (size, offset, _) in values.items():
        if ranges[name][0] <= t <= ranges[name][1]:
          cover.update(range(offset, offset + size))
      return len(cover)
    best = max(union(t) for t in range(80))
    t, live, places = xla_heap.fullest(values, ranges)
    assert live == best == union(t), f"seed {seed}"
    assert all(ranges[n][0] <= t <= ranges[n][1] for names in places.values() for n in names)


def test_several_heaps_are_laid_end_to_end_and_other_memory_spaces_left_out():
  """A buffer assignment with two device heaps: the second's values sit past the first, so
  values at the same offset in different heaps are different places; host (color 5) and
  on-chip (color 1) heaps are not counted."""
  text = "\n".join([
      "allocation 0: size 100, preallocated-temp:",
      " value: <1 a @0> (size=100,offset=0): f32[25]{0}",
      "allocation 1: size 64, color 5, preallocated-temp:",
      " value: <2 h @0> (size=64,offset=0): f32[16]{0}",
      "allocation 2: size 40, preallocated-temp:",
      " value: <3 b @0> (size=40,offset=0): (bf16[20]{0}, s32[])",
      "allocation 3: size 8, color 1, preallocated-temp:",
      " value: <4 s @0> (size=8,offset=0): f32[2]{0}"])
  size, values = xla_heap.heap_values(text)
  assert size == 140
  assert values == {"a{}": (100, 0, "f32[25]"), "b{}": (40, 100, "bf16[20]")}
  t, live, places = xla_heap.fullest(values, {"a{}": (0, 5), "b{}": (3, 9)})
  assert (live, sorted(places)) == (140, [(0, 100), (100, 40)]) and 3 <= t <= 5


def test_argument_buffers_are_read_apart_from_the_heap():
  """kind="arguments": the entry parameters' device buffers, one after another, with what
  XLA placed in them; the heap, host-resident arguments and outputs left out."""
  text = "\n".join([
      "allocation 0: size 64, parameter 0, shape |f32[16]| at ShapeIndex {}, maybe-live-out:",
      " value: <1 param.0 @0> (size=64,offset=0): f32[16]{0}",
      " value: <2 fusion.3 @0> (size=64,offset=0): f32[16]{0}",
      "allocation 1: size 32, color 5, parameter 1, shape |f32[8]| at ShapeIndex {}:",
      " value: <3 param.1 @0> (size=32,offset=0): f32[8]{0}",
      "allocation 2: size 100, preallocated-temp:",
      " value: <4 a @0> (size=100,offset=0): f32[25]{0}",
      "allocation 3: size 40, parameter 2, shape |f32[10]| at ShapeIndex {}:",
      " value: <5 param.2 @0> (size=40,offset=0): f32[10]{0}",
      " value: <6 while.1{2} (phi) @0> (size=40,offset=0): f32[10]{0}"])
  size, values = xla_heap.heap_values(text, "arguments")
  assert size == 104
  assert values == {"param.0{}": (64, 0, "f32[16]"), "fusion.3{}": (64, 0, "f32[16]"),
                    "param.2{}": (40, 64, "f32[10]"), "while.1{2}": (40, 64, "f32[10]")}
  assert xla_heap.heap_values(text) == (100, {"a{}": (100, 0, "f32[25]")})
