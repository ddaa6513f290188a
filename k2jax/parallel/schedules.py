"""Pipeline schedules as static tables (report 2.4.2): what every device does at every tick.

A schedule is, per device, an ordered list of tasks on (virtual stage v, microbatch m):

    F  forward of stage s = v P + p on microbatch m (stage 0 also embeds)
    B  backward of that stage: input gradient, and weight gradient unless W takes it
    W  the weight gradient alone (zbh1 only: k2jax.parallel.bwsplit cuts the backward)

`build` turns the lists into a table by simulating the dependencies tick by tick (a tick has
an F, a B and, for zbh1, a W phase on every device; a stage's output reaches the next
device at the end of the tick). Between F and B, the ticks whose F runs the last stage have
a head phase on every device (`head_ticks`: the loss and its gradient, the vocabulary split
over the pipeline devices), so the last stage's B may follow its F in the same tick. The
jitted loop (k2jax.parallel.pipeline) reads its task and buffer slots from the table; the
idle fraction, the buffers' sizes and `plan` read the same table. A new schedule is one
`Schedule` entry (`register`): a task order and how far forwards may run ahead, not new
index arithmetic, and nothing in the loop changes (tests/test_schedules.py adds one).

The idle fraction counts time, not slots: a phase no device of a tick works in costs nothing
(the loop skips it with a condition every device of a stage agrees on), so a tick costs the
largest per-device sum of its phases' costs (F = 1, B = 2). Under that measure interleaved
1F1B idles (P - 1) / (M V + P - 1), GPipe's figure, with at most (P - 1) 2 + (V - 1) P + 1
stage activations in flight per device instead of M V.

zbh1 is interleaved 1F1B with the weight gradients split off (report 2.4.2; Qi et al.,
"Zero Bubble Pipeline Parallelism", ZB-H1), built two ways, and the table faster under the
stage costs (`build(costs=...)`; k2jax.parallel.pipeline.costs traces W's share) and the
loop's skipping (`per_device`) is the one that runs:
  - 1F1B's ticks: the F and B tasks are 1F1B's; each W starts in its B's tick (the cost of
    1F1B's unsplit backward) and moves, on a tick's slowest device, to a later tick where
    it fits in time the slowest device there spends anyway, while the residuals it keeps
    alive (now from F to W) stay within 1F1B's peak. No move lengthens a tick, so this
    one is never slower than 1f1b.
  - the grid (`_grid`): one task per device and tick (more where a tick's longest task
    leaves room), B before F before W, within 1F1B's residual peak and P cuts waiting.
    B's chain back to stage 0 then takes a tick a stage instead of a tick of F + B + W,
    and W's fill both ends: on stages of equal cost with F = B = W it idles ZB-H1's own
    (P - 1) / (3 M V + P - 1), a third of 1F1B's. Tasks of unequal cost (K2's traced
    stages: W 1.12 forwards a layer, B 0.88, the prefix's stage and the last two lighter)
    leave the shorter ones waiting in every tick, and 1F1B's ticks win.
"""

import functools
from typing import NamedTuple

import numpy as np

from k2jax.parallel.layout import placed, stage_of

# Work per task in forward units: a backward does twice a forward's matmuls; split, its
# input and weight halves one each (what `build` plans with; real stages: `stage_costs`).
COST = {"F": 1.0, "B": 2.0}
SPLIT_COST = {"F": 1.0, "B": 1.0, "W": 1.0}


class Table(NamedTuple):
  """One schedule for P devices x V virtual stages x M microbatches.

  task[k]: int32 [ticks, P, 2] = (v, m) of the device's phase-k task (k = "F", "B", and
  "W" for a split schedule), -1 where idle.
  Buffer slots (int32 [ticks, P], -1 = none), sized by interval colouring of what is alive:
    act_in    slot where the activation arriving this tick (sent at the end of the previous
              tick) is stored; act_read: slot the F task reads (-1 on stage 0: the embedding)
    grad_in   slot where the arriving cotangent is stored; grad_read: slot B reads (the last
              stage's B reads the cotangent the head phase of its F's tick wrote to
              head_write)
    res_write slot F writes what the stage saves for its backward to; res_read: slot B reads
              (res_wread: the slot W reads, the same value)
    cut_write slot B writes what it hands W to (bwsplit's cut); cut_read: slot W reads
  """
  name: str
  P: int
  V: int
  M: int
  task: dict
  slots: dict
  sizes: dict          # buffer -> number of slots ("act", "grad", "res")
  grid: bool = False   # zbh1 built on a grid of one task per device and tick (`_grid`)

  @property
  def split(self) -> bool:
    """Whether the weight gradients are their own W tasks."""
    return "W" in self.task

  @property
  def ticks(self) -> int:
    return self.task["F"].shape[0]

  def busy(self, kind: str) -> np.ndarray:
    return self.task[kind][..., 0] >= 0

  def _phase_costs(self, costs):
    return _phase_costs(self.task, self.P, self.V, costs)

  def time(self, costs=None, per_device: bool = True) -> float:
    """Lockstep time of the schedule (forward-stage units by default; `costs` as in
    idle_fraction). per_device: phases are skipped per device (GPU / TPU), so a tick costs
    its slowest device's sum of phases; False: per tick (CPU, k2jax.parallel.pipeline), so
    a tick costs each phase's slowest device, summed."""
    return _lockstep(self._phase_costs(costs), per_device)

  def idle_fraction(self, costs=None) -> float:
    """1 - (work of every device) / (devices x lockstep time).

    costs: None (every forward 1, every backward 2 (split: B 1, W 1): stages of equal work)
    or {"F": [S], "B": [S], "W": [S], "H": h}, the work of each stage's tasks and of a
    device's head phase (`stage_costs`: padding layers cost nothing, the first stage also
    runs the embedding and dense layers)."""
    work = sum(float(c.sum()) for c in self._phase_costs(costs).values())
    return 1.0 - work / (self.P * self.time(costs))

  def work_ratio(self, costs: dict) -> float:
    """The work of every task the table runs (`stage_costs` units, head phases included)
    over the model's own forward + backward of the same M microbatches without a pipeline
    (3 x every stage's forward, the head's three products once): what running the model
    as this schedule costs beyond the model itself. Idle phases are skipped, so they do
    not count; what the remat policy recomputes is in neither."""
    done = sum(float(c.sum()) for c in self._phase_costs(costs).values())
    plain = self.M * (3.0 * float(np.sum(costs["F"])) + self.P * costs.get("H", 0.0))
    return done / plain

  @property
  def in_flight(self) -> int:
    """Most stage activations a device keeps for backward at once (= residual slots)."""
    return self.sizes["res"]

  def used(self, buffer: str = "res") -> np.ndarray:
    """[P] slots of `buffer` ("res" or "cut") each device's own tasks use. Every device
    allocates sizes[buffer], the most of them: the step is one SPMD program, whose buffers
    have one shape on every device."""
    col = self.slots[f"{buffer}_write"]
    return np.asarray([int(col[:, p].max()) + 1 if (col[:, p] >= 0).any() else 0
                       for p in range(self.P)])


def _phase_costs(task, P, V, costs):
  """{kind: [ticks, P] cost of each device's phase-k task}; costs None = COST per task
  (SPLIT_COST for a table with W tasks), else {kind: [S] cost of that task on stage s}."""
  out = {}
  for k in task:
    v = task[k][..., 0]
    if costs is None:
      out[k] = (v >= 0) * (SPLIT_COST if "W" in task else COST)[k]
    else:
      s = stage_of(np.maximum(v, 0), np.arange(P)[None, :], P)
      out[k] = np.where(v >= 0, np.asarray(costs[k])[s], 0.0)
  if costs is not None and "H" in costs:
    out["H"] = np.outer(_head_ticks(task, P, V), np.full(P, costs["H"]))
  return out


def _lockstep(phase_costs: dict, per_device: bool = True) -> float:
  """Table.time from `_phase_costs`."""
  if per_device:
    return float(sum(phase_costs.values()).max(axis=1).sum())
  return float(sum(c.max(axis=1).sum() for c in phase_costs.values()))


def stage_costs(cfg, split, seq_len: int, w_share: float | None = None) -> dict:
  """{"F": [S], "B": [S], "W": [S], "H": h}: the matmul work of each stage's forward,
  backward and weight-gradient tasks, and of one device's head phase, as the pipeline runs
  them (k2jax.parallel.pipeline), in units of one pipelined layer's forward, from the
  model's FLOPs per token (k2jax.model.layer_flops):

    F[s] = real layers of s   (+ the layers before the stack, on stage 0)
    B[s] = (2 - w) x real layers  (+ the stage-0 prefix's backward: 3x, recomputed first)
    W[s] = w x real layers
    H    = 3 x head / P       (the head's forward and both gradients, 1 / P of its columns
                               on every device, in the ticks of `head_ticks`)

  cfg: the model config; split: k2jax.parallel.layout.Split; w_share: None for a schedule
  without W tasks, else w, the part of a layer's backward (in forwards) its W task takes
  (k2jax.parallel.pipeline.w_share measures it from the split itself)."""
  from k2jax.model import counting, transformer
  S = split.stages * split.virtual
  unit = counting.layer_flops(cfg, split.stack.ffn, seq_len)
  pre = sum(counting.layer_flops(cfg, st.ffn, seq_len) * st.size
            for st in transformer.stacks(cfg) if st != split.stack) / unit
  real = split.real().transpose(1, 0, 2).reshape(S, split.per_stage).sum(1)   # stage v P + p
  w = w_share or 0.0
  F, B, W = real.astype(float), (2.0 - w) * real, w * real
  F[0] += pre
  B[0] += 3 * pre
  return {"F": F, "B": B, "W": W, "H": 3 * counting.head_flops(cfg) / unit / split.stages}


def frozen(costs: dict):
  """`stage_costs` as a hashable argument of `build`."""
  return tuple((k, float(v) if np.ndim(v) == 0 else tuple(float(c) for c in v))
               for k, v in sorted(costs.items()))


def _interleaved(P, V, M):
  """Megatron's interleaved order: microbatches in groups of P, each group through virtual
  stage 0, then 1, ...; backwards in the same groups, virtual stages last to first."""
  f = [(v, g * P + r) for g in range(M // P) for v in range(V) for r in range(P)]
  b = [(V - 1 - v, g * P + r) for g in range(M // P) for v in range(V) for r in range(P)]
  return {"F": f, "B": b}


def _interleaved_warmup(P, V, M, p):
  """Forwards device p may run ahead of its backwards: the 1F1B memory bound (Megatron's
  interleaved warm-up, plus one so a tick's F can pair with the B it enables)."""
  return min(M * V, (P - p - 1) * 2 + (V - 1) * P + 1)


def _gpipe(P, V, M):
  """All forwards (virtual stage by virtual stage), then all backwards."""
  return {"F": [(v, m) for v in range(V) for m in range(M)],
          "B": [(v, m) for v in reversed(range(V)) for m in range(M)]}


class Schedule(NamedTuple):
  """A pipeline schedule as data. `build` simulates any of these into the `Table` the jitted
  loop (k2jax.parallel.executor), `plan` and the tests read, so adding a schedule is adding
  one entry with `register`: nothing in the loop, the layout or the config changes.

  order: (P, V, M) -> {"F": [(v, m), ...], "B": [(v, m), ...]}: every device's task order
    (the same list on each; device p runs virtual stage v's stage v P + p).
  warmup: (P, V, M, p) -> how many forwards device p may run ahead of its backwards (what
    bounds the stage activations it keeps in flight).
  flush: a device starts its backwards only once all its forwards are done (GPipe).
  any_microbatches: M need not be a multiple of P.
  split: the backward's weight gradients run as W tasks of their own (ZB-H1;
    k2jax.parallel.bwsplit cuts the backward), placed by `build`.
  """
  order: object
  warmup: object
  flush: bool = False
  any_microbatches: bool = False
  split: bool = False


# name -> Schedule: mesh.pipeline_schedule picks one
SCHEDULES = {
    "1f1b": Schedule(_interleaved, _interleaved_warmup),
    "gpipe": Schedule(_gpipe, lambda P, V, M, p: M * V, flush=True, any_microbatches=True),
    "zbh1": Schedule(_interleaved, _interleaved_warmup, split=True),
}


def register(name: str, schedule: Schedule) -> None:
  """Make `schedule` available as mesh.pipeline_schedule = name (a new name only: `build`
  caches tables by name)."""
  if name in SCHEDULES:
    raise ValueError(f"pipeline schedule {name!r} exists already")
  SCHEDULES[name] = schedule


def validate(config) -> None:
  """ValueError (one line) for a mesh.pipeline_schedule that is not registered, or
  microbatches (train.grad_accum) its order cannot take on this pipeline."""
  m, M = config.mesh, config.train.grad_accum
  name = m.get("pipeline_schedule", "1f1b")
  if name not in SCHEDULES:
    raise ValueError(f"mesh.pipeline_schedule = {name!r}: must be one of "
                     f"{', '.join(SCHEDULES)}")
  if m.pipeline > 1 and not SCHEDULES[name].any_microbatches and M % m.pipeline:
    raise ValueError(f"train.grad_accum = {M!r}: must be a multiple of mesh.pipeline "
                     f"({m.pipeline}) for the {name} schedule (microbatches go through the "
                     "stages in groups of the pipeline size)")


@functools.lru_cache(maxsize=64)
def build(name: str, P: int, V: int, M: int, costs=None, per_device: bool = True) -> Table:
  """The table of schedule `name` (SCHEDULES) on P devices x V virtual stages x M microbatches
  (M a multiple of P unless the schedule takes any). costs: the stages' task costs
  (`stage_costs`, as a hashable `frozen(...)`), which a split schedule places its W tasks
  by; None: SPLIT_COST. per_device: how the loop skips idle phases (Table.time), which a
  split schedule picks its table by."""
  if name not in SCHEDULES:
    raise ValueError(f"mesh.pipeline_schedule = {name!r}: must be one of {', '.join(SCHEDULES)}")
  sched = SCHEDULES[name]
  if not sched.any_microbatches and M % P:
    raise ValueError(f"{M} microbatches for {P} pipeline devices: the {name} schedule needs a "
                     "multiple of the pipeline size")
  S = P * V
  orders = sched.order(P, V, M)
  kinds = list(orders)
  done = {k: {} for k in kinds}      # kind -> {(s, m): tick}
  nxt = {k: [0] * P for k in kinds}
  rows = {k: [] for k in kinds}
  t = 0
  total = M * V
  limit = 10 * (M * V + S) + 10
  while any(nxt[k][p] < total for k in kinds for p in range(P)):
    if t > limit:
      raise RuntimeError(f"schedule {name} P={P} V={V} M={M} does not finish")
    row = {k: [(-1, -1)] * P for k in kinds}
    for k in kinds:
      for p in range(P):
        i = nxt[k][p]
        if i >= total:
          continue
        v, m = orders[k][i]
        s = stage_of(v, p, P)
        if k == "F":
          ok = s == 0 or done["F"].get((s - 1, m), t) < t
          ok = ok and i - nxt["B"][p] < sched.warmup(P, V, M, p)   # in flight
        else:    # the last stage's B may follow its F in the same tick (the head between)
          ok = (done["F"].get((s, m), t + 1) <= t if s == S - 1
                else done["B"].get((s + 1, m), t) < t)
          # a flush (GPipe): a device starts its backwards once all its forwards are done
          ok = ok and (not sched.flush or nxt["F"][p] >= total)
        if ok:
          row[k][p] = (v, m)
          done[k][(s, m)] = t
          nxt[k][p] += 1
    for k in kinds:
      rows[k].append(row[k])
    t += 1
  task = {k: np.asarray(rows[k], np.int32) for k in kinds}
  on_grid = False
  if sched.split:
    # Two constructions of the same task lists; the one faster under the stages' costs
    # (and how the loop skips idle phases) runs. 1F1B's ticks with the W's placed into
    # them (`_place_w`) keep every F / B where 1F1B has it; the grid (`_grid`) runs one
    # task per device and tick, so B's chain back to stage 0 takes one tick a stage and
    # W's fill both ends: ZB-H1's own bubble, (P - 1) (F + B - W), where tasks cost alike.
    c = costs and dict(costs)
    task["W"] = _place_w(task, P, V, c)
    grid = _grid(P, V, M, c, in_flight=max(sched.warmup(P, V, M, p) for p in range(P)),
                 cuts=P, orders=orders)
    on_grid = (_lockstep(_phase_costs(grid, P, V, c), per_device)
               < _lockstep(_phase_costs(task, P, V, c), per_device) - 1e-9)
    if on_grid:
      task = grid
  slots, sizes = _slots(task, P, V)
  return Table(name, P, V, M, task, slots, sizes, on_grid)


def _place_w(task, P, V, costs=None):
  """W tasks into an F / B table (task["W"]), one per device and tick.

  Each W starts in its B's tick, which costs what 1F1B's unsplit backward costs. Then a W
  on a device that sets its tick's length moves to the first later tick where it fits in
  time that tick's slowest device spends anyway, while the residuals it keeps alive stay
  within the 1F1B peak per device (residual slots as 1F1B; what B hands W waits in cut
  slots on top). No move lengthens a tick, so the table is never slower than 1F1B; the W's
  that move fill the warm-up and cool-down. costs: per-stage task costs (`stage_costs`) or
  None (SPLIT_COST)."""
  ticks = task["F"].shape[0]

  def of(k, v):          # cost of stage-task kind k for virtual stages v [ticks, P]
    if costs is None:
      return (v >= 0) * SPLIT_COST[k]
    s = stage_of(np.maximum(v, 0), np.arange(P), P)
    return np.where(v >= 0, np.asarray(costs[k])[s], 0.0)
  cost = of("F", task["F"][..., 0]) + of("B", task["B"][..., 0])
  if costs is not None and "H" in costs:
    cost = cost + _head_ticks(task, P, V)[:, None] * costs["H"]
  w = task["B"].copy()                                   # each W with its B
  wc = of("W", w[..., 0])
  cost = cost + wc
  fwd = np.cumsum(task["F"][..., 0] >= 0, axis=0)        # forwards issued by tick t
  done = np.cumsum(w[..., 0] >= 0, axis=0)               # W's finished by the end of t
  live = fwd - np.concatenate([np.zeros((1, P), int), done[:-1]])
  bound = live.max()
  eps = 1e-9
  top_of = cost.max(axis=1)        # each tick's length, kept current as W's move
  for t in range(ticks):
    while True:
      top = top_of[t]
      movable = [p for p in range(P) if w[t, p, 0] >= 0 and wc[t, p] > 0
                 and cost[t, p] >= top - eps]
      moved = False
      for p in movable:
        need = wc[t, p]
        # the first later tick where one more live residual would pass the bound, and
        # before it the first tick with no W on p whose length p's W fits in
        over = np.flatnonzero(live[t + 1:, p] + 1 > bound)
        end = t + 1 + (over[0] if over.size else ticks - t - 1)
        fits = np.flatnonzero((w[t + 1:end, p, 0] < 0)
                              & (cost[t + 1:end, p] + need <= top_of[t + 1:end] + eps))
        if not fits.size:
          continue
        t2 = t + 1 + fits[0]
        w[t2, p], w[t, p] = w[t, p], -1
        wc[t2, p], cost[t2, p] = need, cost[t2, p] + need
        top_of[t2] = max(top_of[t2], cost[t2, p])
        cost[t, p] -= need
        wc[t, p] = 0.0
        top_of[t] = cost[t].max()
        live[t + 1:t2 + 1, p] += 1
        moved = True
      if not moved or top_of[t] >= top - eps:
        break
  return w


def _grid(P, V, M, costs=None, in_flight: int = 1, cuts: int = 1, orders=None):
  """A split schedule's task lists (`orders`; None: the interleaved order zbh1 takes) on
  a grid: per tick, every device takes its most urgent ready task (B first: its chain
  back to stage 0 is the critical path; then F; then W) and, where the tick's longest
  first task leaves it time, ready tasks of the other kinds that fit in it (one per kind:
  the loop has one F, B and W phase a tick). A device starts an F only while fewer than
  `in_flight` of its stages wait for their W (they keep their residuals until then: with
  1F1B's peak here, 1F1B's memory bound) and a B only while fewer than `cuts` of them
  wait with a cut (what B hands W). A stage's output, or cotangent, is ready on the next
  device a tick after the task that made it. -> {kind: [ticks, P, 2]}."""
  S, total = P * V, M * V
  orders = orders or _interleaved(P, V, M)

  def cost(k, v, p):
    return SPLIT_COST[k] if costs is None else float(np.asarray(costs[k])[stage_of(v, p, P)])
  nxt = {"F": [0] * P, "B": [0] * P}
  waiting = [[] for _ in range(P)]       # each device's B's whose W has not run, in order
  w_done = [0] * P
  done = {"F": {}, "B": {}}              # (stage, microbatch) -> tick
  rows = {k: [] for k in "FBW"}
  t = 0
  while any(nxt["B"][p] < total or waiting[p] for p in range(P)):
    if t > 10 * (3 * total + S) + 10:
      raise RuntimeError(f"schedule zbh1 (grid) P={P} V={V} M={M} does not finish")
    ready = []
    for p in range(P):
      r = {}
      i = nxt["F"][p]
      if i < total and i - w_done[p] < in_flight:
        v, m = orders["F"][i]
        s = stage_of(v, p, P)
        if s == 0 or done["F"].get((s - 1, m), t) < t:
          r["F"] = (v, m)
      i = nxt["B"][p]
      if i < total and len(waiting[p]) < cuts:
        v, m = orders["B"][i]
        s = stage_of(v, p, P)      # after the next stage's B; the last stage, after its own F
        if (done["F"].get((s, m), t) if s == S - 1 else done["B"].get((s + 1, m), t)) < t:
          r["B"] = (v, m)
      if waiting[p]:
        r["W"] = waiting[p][0]
      ready.append(r)
    first = [next((k for k in "BFW" if k in r), None) for r in ready]
    top = max((cost(k, r[k][0], p) for p, (k, r) in enumerate(zip(first, ready)) if k),
              default=0.0)
    row = {k: [(-1, -1)] * P for k in "FBW"}
    for p, r in enumerate(ready):
      load = 0.0
      for k in "BFW":
        if k not in r or (k != first[p] and load + cost(k, r[k][0], p) > top + 1e-9):
          continue
        v, m = row[k][p] = r[k]
        load += cost(k, v, p)
        if k == "W":
          waiting[p].pop(0)
          w_done[p] += 1
        else:
          done[k][(stage_of(v, p, P), m)] = t
          nxt[k][p] += 1
      if row["B"][p][0] >= 0:       # its W may run from the next tick on
        waiting[p].append(row["B"][p])
    for k in "FBW":
      rows[k].append(row[k])
    t += 1
  return {k: np.asarray(rows[k], np.int32) for k in "FBW"}


def _head_ticks(task, P, V) -> np.ndarray:
  return task["F"][:, P - 1, 0] == V - 1


def head_ticks(tab: Table) -> np.ndarray:
  """[ticks] bool: the ticks with a head phase, those whose F phase runs the last stage
  (device P - 1 on virtual stage V - 1); every device takes part (its vocabulary slice)."""
  return _head_ticks(tab.task, tab.P, tab.V)


def _colour(intervals):
  """Greedy interval colouring: intervals [(start, end, key)] (end inclusive) -> {key: slot},
  slot count. A slot freed at tick e can be reused from tick e + 1."""
  free, busy, out = [], [], {}
  n = 0
  for start, end, key in sorted(intervals):
    busy.sort()
    while busy and busy[0][0] < start:
      free.append(busy.pop(0)[1])
    if free:
      free.sort()
      slot = free.pop(0)
    else:
      slot, n = n, n + 1
    out[key] = slot
    busy.append((end, slot))
  return out, n


def _slots(task, P, V):
  S = P * V
  ticks = task["F"].shape[0]
  when = {k: {} for k in task}                 # kind -> {(p, v, m): tick}
  for k, a in task.items():
    for t in range(ticks):
      for p in range(P):
        v, m = a[t, p]
        if v >= 0:
          when[k][(p, v, m)] = t
  names = ["act_in", "act_read", "grad_in", "grad_read", "head_write", "res_write",
           "res_read"]
  if "W" in task:
    names += ["res_wread", "cut_write", "cut_read"]
  slots = {n: np.full((ticks, P), -1, np.int32) for n in names}
  sizes = {}
  for p in range(P):
    # (start tick, end tick, (v, m), {slot column: tick}) of everything device p keeps
    live = {"act": [], "grad": [], "res": []}
    if "W" in task:
      live["cut"] = []
    for (q, v, m), tf in when["F"].items():
      s = stage_of(v, q, P)
      if s + 1 < S and placed(s + 1, P)[1] == p:     # stage s's output, stored on arrival
        v2 = placed(s + 1, P)[0]
        tr = when["F"][(p, v2, m)]
        live["act"].append((tf + 1, tr, (v2, m), {"act_in": tf + 1, "act_read": tr}))
      if q != p:
        continue
      tb = when["B"][(p, v, m)]
      if "W" in task:     # residuals live until W; B hands W its cut
        tw = when["W"][(p, v, m)]
        live["res"].append((tf, tw, (v, m), {"res_write": tf, "res_read": tb,
                                             "res_wread": tw}))
        live["cut"].append((tb, tw, (v, m), {"cut_write": tb, "cut_read": tw}))
      else:
        live["res"].append((tf, tb, (v, m), {"res_write": tf, "res_read": tb}))
      if s == S - 1:                          # the head's cotangent, from this tick's head
        live["grad"].append((tf, tb, (v, m), {"head_write": tf, "grad_read": tb}))
    for (q, v, m), tb in when["B"].items():
      s = stage_of(v, q, P)
      if s > 0 and placed(s - 1, P)[1] == p:  # stage s's input cotangent, stored on arrival
        v2 = placed(s - 1, P)[0]
        tr = when["B"][(p, v2, m)]
        live["grad"].append((tb + 1, tr, (v2, m), {"grad_in": tb + 1, "grad_read": tr}))
    for name, iv in live.items():
      colour, n = _colour([(a, b, key) for a, b, key, _ in iv])
      sizes[name] = max(sizes.get(name, 0), n)
      for _, _, key, cols in iv:
        for col, tick in cols.items():
          assert slots[col][tick, p] < 0, (col, tick, p)
          slots[col][tick, p] = colour[key]
  return slots, {k: max(1, n) for k, n in sizes.items()}
