"""Pipeline schedule tables (k2jax.parallel.schedules), checked by brute force from the table
alone: every task once, every dependency met, buffers never overwritten while live, and the
idle time against the closed forms of the literature."""

import itertools

import numpy as np
import pytest

from k2jax.parallel import schedules

SHAPES = [(2, 1, 2), (2, 1, 6), (4, 1, 8), (4, 2, 4), (4, 2, 8), (2, 3, 4), (8, 1, 8),
          (3, 2, 6), (16, 2, 32)]


def _when(tab):
  out = {k: {} for k in tab.task}
  for k, a in tab.task.items():
    for t, p in itertools.product(range(tab.ticks), range(tab.P)):
      v, m = a[t, p]
      if v >= 0:
        assert (p, v, m) not in out[k], f"{k} {(p, v, m)} twice"
        out[k][(p, v, m)] = t
  return out


@pytest.mark.parametrize("name", schedules.SCHEDULES)
@pytest.mark.parametrize("P,V,M", SHAPES)
def test_every_task_once_in_dependency_order(name, P, V, M):
  tab = schedules.build(name, P, V, M)
  when = _when(tab)
  S = P * V
  for k in tab.task:
    assert set(when[k]) == {(p, v, m) for p in range(P) for v in range(V) for m in range(M)}
  dev = lambda s: (s % P, s // P)
  for key, t in when.get("W", {}).items():    # a weight gradient after its input gradient
    assert t >= when["B"][key]
  for s, m in itertools.product(range(S), range(M)):
    f = when["F"][(*dev(s), m)]
    b = when["B"][(*dev(s), m)]
    if s:        # the input arrives at the end of the previous stage's tick
      assert f > when["F"][(*dev(s - 1), m)]
    if s < S - 1:
      assert b > when["B"][(*dev(s + 1), m)]
    else:        # the head's cotangent is ready within the tick, which has a head phase
      assert b >= f
      assert schedules.head_ticks(tab)[f]
  assert schedules.head_ticks(tab).sum() == M


@pytest.mark.parametrize("name", schedules.SCHEDULES)
@pytest.mark.parametrize("P,V,M", SHAPES[:-1])
def test_buffer_slots_hold_each_value_until_it_is_read(name, P, V, M):
  """Replay the table with symbolic values: every read finds exactly what was stored for it
  (a slot reused too early, or an arrival stored in the wrong slot, fails here)."""
  tab = schedules.build(name, P, V, M)
  sl = tab.slots
  S = P * V
  bufs = [{k: {} for k in ("act", "grad", "res", "cut")} for _ in range(P)]
  sent_f, sent_b = [None] * P, [None] * P
  for t in range(tab.ticks):
    recv_f = [sent_f[(p - 1) % P] for p in range(P)]
    recv_b = [sent_b[(p + 1) % P] for p in range(P)]
    sent_f, sent_b = [None] * P, [None] * P
    for p in range(P):
      b = bufs[p]
      if sl["act_in"][t, p] >= 0:
        b["act"][sl["act_in"][t, p]] = recv_f[p]
      v, m = tab.task["F"][t, p]
      if v >= 0:
        s = v * P + p
        x = ("embed", m) if s == 0 else b["act"][sl["act_read"][t, p]]
        assert x == (("embed", m) if s == 0 else ("out", s - 1, m)), (t, p, x)
        b["res"][sl["res_write"][t, p]] = ("res", s, m)
        sent_f[p] = ("out", s, m)
        if s == S - 1:
          b["grad"][sl["head_write"][t, p]] = ("dout", s, m)
      if sl["grad_in"][t, p] >= 0:
        b["grad"][sl["grad_in"][t, p]] = recv_b[p]
      v, m = tab.task["B"][t, p]
      if v >= 0:
        s = v * P + p
        assert b["grad"][sl["grad_read"][t, p]] == ("dout", s, m)
        assert b["res"][sl["res_read"][t, p]] == ("res", s, m)
        sent_b[p] = ("dout", s - 1, m) if s else None
        if tab.split:
          b["cut"][sl["cut_write"][t, p]] = ("cut", s, m)
      if tab.split and tab.task["W"][t, p, 0] >= 0:
        v, m = tab.task["W"][t, p]
        s = v * P + p
        assert b["res"][sl["res_wread"][t, p]] == ("res", s, m)
        assert b["cut"][sl["cut_read"][t, p]] == ("cut", s, m)
    for k, n in tab.sizes.items():
      assert all(0 <= i < n for i in bufs[0][k]), k


@pytest.mark.parametrize("P,V,M", SHAPES)
def test_1f1b_idle_time_is_the_interleaved_closed_form(P, V, M):
  """Lockstep time with idle phases skipped: (P - 1) / (M V + P - 1) idle (Narayanan et al.,
  interleaved 1F1B), counted here from the table."""
  tab = schedules.build("1f1b", P, V, M)
  assert tab.idle_fraction() == pytest.approx((P - 1) / (M * V + P - 1))


def test_1f1b_memory_is_bounded_and_gpipe_grows_with_microbatches():
  for P, V in ((4, 1), (4, 2), (2, 3)):
    flat = {M: schedules.build("1f1b", P, V, M).in_flight for M in (4 * P, 8 * P)}
    assert flat[4 * P] == flat[8 * P] == min(4 * P * V, 2 * (P - 1) + (V - 1) * P + 1)
    assert schedules.build("gpipe", P, V, 8 * P).in_flight == 8 * P * V


def test_k2_shape_meets_the_bubble_target():
  tab = schedules.build("1f1b", 16, 2, 32)
  assert tab.idle_fraction() <= 0.19
  assert tab.in_flight == 47


@pytest.mark.parametrize("P,V,M", SHAPES)
def test_zbh1_is_never_slower_than_1f1b_and_keeps_its_memory(P, V, M):
  """The B/W-split table, for stages of equal work and for random per-stage costs: lockstep
  time never above interleaved 1F1B's with the same total work (B + W = 1F1B's B), no more
  stage residuals alive per device than 1F1B's peak, and no more cuts waiting than P. On
  CPU's per-tick skipping (a tick costs each phase's slowest device) the grid, which runs
  different phases on different devices in a tick, is taken only where it is faster there."""
  rng = np.random.default_rng(P * 100 + V * 10 + M)
  S = P * V
  f1b = schedules.build("1f1b", P, V, M)
  for trial in range(4):
    if trial == 0:
      costs = plain = None
    else:
      F = rng.uniform(0.5, 2.0, S)
      w = rng.uniform(0.0, 1.0, S)
      costs, plain = {"F": F, "B": (2 - w) * F, "W": w * F}, {"F": F, "B": 2 * F}
    zb = schedules.build("zbh1", P, V, M, costs and schedules.frozen(costs))
    assert zb.time(costs) <= f1b.time(plain) + 1e-9
    assert zb.in_flight <= f1b.in_flight and zb.sizes["cut"] <= P
    if not zb.grid:       # 1F1B's F / B ticks, the W's placed into them
      assert (zb.task["F"] == f1b.task["F"]).all() and (zb.task["B"] == f1b.task["B"]).all()
    tick = schedules.build("zbh1", P, V, M, costs and schedules.frozen(costs), False)
    grid = schedules._grid(P, V, M, costs, f1b.in_flight, P)
    grid_time = schedules._lockstep(schedules._phase_costs(grid, P, V, costs), False)
    assert tick.time(costs, False) <= grid_time + 1e-9


@pytest.mark.parametrize("P,V,M", SHAPES)
def test_zbh1_on_equal_stages_has_zb_h1s_bubble(P, V, M):
  """Stages of equal work, F = B = W (the grid, one task per device and tick): the bubble
  of ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism"), (P - 1) (F + B - W) = P - 1
  ticks per device against 3 M V of work, a third of interleaved 1F1B's (P - 1) (F + B + W)
  here, with 1F1B's residual peak."""
  zb, f1b = schedules.build("zbh1", P, V, M), schedules.build("1f1b", P, V, M)
  assert zb.grid
  assert zb.idle_fraction() == pytest.approx((P - 1) / (3 * M * V + P - 1))
  assert zb.in_flight <= f1b.in_flight


def test_zbh1_idles_less_at_k2_shape():
  """Equal stages, F = B = W: 19.0% (1F1B) -> 7.2%, the same 47 stage residuals and at most
  16 cuts; with K2's traced stage costs (plan) 1F1B's ticks with W's placed in them win."""
  zb, f1b = schedules.build("zbh1", 16, 2, 32), schedules.build("1f1b", 16, 2, 32)
  assert f1b.idle_fraction() == pytest.approx(15 / 79)
  assert zb.idle_fraction() == pytest.approx(15 / 207) and zb.idle_fraction() < 0.10
  assert zb.in_flight == f1b.in_flight == 47 and zb.sizes["cut"] == 16


def test_bad_shapes_say_what_to_change():
  with pytest.raises(ValueError, match="multiple of the pipeline size"):
    schedules.build("1f1b", 4, 1, 6)
  with pytest.raises(ValueError, match="must be one of"):
    schedules.build("zigzag", 2, 1, 2)


@pytest.mark.parametrize("name", ["1f1b", "zbh1", "gpipe"])
def test_work_ratio_counts_each_task_once_and_no_idle_slot(name):
  """The pipelined step's work over the unpipelined model's: every (stage, microbatch) runs
  one F, one B (and one W) and every microbatch one head phase per device, whatever the
  table's idle slots; with K2's stage costs that is the model's 3 forwards per layer, plus
  stage 0 recomputing the embedding and dense layers (1 forward of them)."""
  from k2jax import configs
  from k2jax.model import counting, transformer
  from k2jax.parallel.layout import split
  c = configs.get_config("kimi_k2").model
  P, V, M = 16, 2, 32
  sp = split(c, P, V)
  costs = schedules.stage_costs(c, sp, 4096, 0.3 if name == "zbh1" else None)
  tab = schedules.build(name, P, V, M, schedules.frozen(costs) if name == "zbh1" else None)
  unit = counting.layer_flops(c, "moe", 4096)
  pre = sum(counting.layer_flops(c, st.ffn, 4096) * st.size
            for st in transformer.stacks(c) if st.ffn != "moe") / unit
  layers, head = 60.0, 3 * counting.head_flops(c) / unit      # 60 MoE layers, head's 3 products
  # stage 0 holds padding only here; its backward recomputes the prefix (3 forwards of it)
  assert sp.layers_per_stage()[0] == 0
  want = (3 * layers + 4 * pre + head) / (3 * layers + 3 * pre + head)
  assert tab.work_ratio(costs) == pytest.approx(want, rel=1e-9)
  assert tab.work_ratio(costs) < 1.01


@pytest.mark.parametrize("name,P,V,M", [("1f1b", 16, 2, 32), ("1f1b", 4, 2, 8),
                                         ("gpipe", 4, 1, 8), ("zbh1", 4, 1, 8)])
def test_each_devices_slot_use_is_its_most_residuals_alive_at_once(name, P, V, M):
  """Table.used: the residual slots a device's own tasks use equal the most stage
  residuals it holds at one tick (counted from the task table: an F to its B, or W), and
  the buffer every device allocates is the busiest device's. At K2's 16 x 2: 17 to 47."""
  tab = schedules.build(name, P, V, M)
  F, B = tab.task["F"], tab.task["W" if tab.split else "B"]
  alive = np.zeros((tab.ticks, P), int)
  for p in range(P):
    ends = {(int(v), int(m)): t for t in range(tab.ticks)
            for v, m in [B[t, p]] if v >= 0}
    for t in range(tab.ticks):
      v, m = F[t, p]
      if v >= 0:
        alive[t:ends[(int(v), int(m))] + 1, p] += 1
  np.testing.assert_array_equal(tab.used("res"), alive.max(axis=0))
  assert tab.used("res").max() == tab.sizes["res"]
  if (name, P, V) == ("1f1b", 16, 2):
    assert (tab.used("res").min(), tab.sizes["res"]) == (17, 47)
