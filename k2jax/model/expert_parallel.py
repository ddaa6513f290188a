"""Expert parallelism: dropless token dispatch across the `expert` mesh axis (report 2.4.2).

Runs inside `shard_map`, on one device's tokens. Experts are sharded over the axis, E_loc
per shard, so expert e lives on shard e // E_loc. Every token-expert assignment travels to
its expert's shard, is processed there by SwiGLU experts (grouped matmuls over the shard's
local experts), scaled by its combine weight, and travels back:

    sort assignments by expert (hence by destination) -> exchange per-destination counts ->
    send rows and weights -> w_a down_e(silu(x_a gate_e) * (x_a up_e)) per received row a ->
    send results back -> unsort -> sum over each token's k experts

Static shapes and droplessness pull against each other: a device may receive anything from
0 to all ep x A assignments of its group (A = N k local assignments per device). The counts
are exchanged first, and the transport buffers take the smallest of a few static sizes
(`capacities`) that fits the largest count anywhere (a pmax), chosen at run time with
`lax.switch`; the largest size is the worst case, so nothing is ever dropped. Transports:

  ragged    `lax.ragged_all_to_all`: only the real rows move (GPU / TPU; XLA:CPU has no
            kernel for it). Moves 2 A d values per device per layer, the ideal.
  bucketed  `lax.all_to_all` of [ep, C, d] slots, C the smallest capacity >= the largest
            (source, destination) count: ~ep C / A x the ideal (1.25x when balanced).
  padded    every slot sized for the worst case (C = A): ep x the ideal; the reference.

Rounds (ragged). XLA reserves memory for a switch's largest branch whether or not it runs,
and the worst case receives ep x A rows: on K2 (16 shards, A = 32,768) 7.5 GB per [rows, d]
buffer, before its SwiGLU intermediates, outputs and the backward's recompute, for a branch
that almost never runs. So every capacity c above a bound B runs as R = ceil(c / B) rounds
of B received rows each: B = model.ep_round_load x A (2 by default), and the worst case
takes ceil(ep / 2) rounds (8 on K2). The bound sets the largest buffers XLA reserves, so it
is the knob between memory and the rounds a skewed load costs (loads up to B run in one
shot; the compiled memory at each bound is on the docs' memory results page). Device d's
incoming stream is the senders' slices in order,
sender s's starting at land[s, d] = sum_{s' < s} counts[s', d]; round r takes the window
[r B, (r + 1) B) of every stream: s sends rows [lo, hi) of its d-bound slice,

    lo = clip(r B - land[s, d], 0, counts[s, d]),   hi = clip((r + 1) B - land[s, d], 0, ...),

landing at land[s, d] + lo - r B in d's round buffer (`_window`; the one-shot exchange is
the window r = 0 with B >= every stream). d runs its experts on those B rows, and the
results travel back along the same window into the senders' [A, d] output, which
accumulates over the rounds (ragged_all_to_all writes only where it receives; the windows
are disjoint). Every device has the whole counts matrix, so a round exchanges nothing but
rows. The rounds are a `lax.scan` with a checkpointed body: the backward (the recompute
below; such a branch keeps nothing) redoes and differentiates one round at a time. Rounds
that start past the largest load anywhere (agreed by every device, like the branch) are a
`lax.cond` that moves nothing. Bucketed and padded keep their one-shot worst case: they
are CPU reference paths (padded is the tests' reference), not what a chip runs.

The backward pass is written out (`_exchange`, a custom VJP) because autodiff of the switch
cannot keep what it needs at a sensible size: differentiating a switch materializes the
residuals of every branch (here up to ep x A rows each, 8.4 GB per K2 layer and sequence
under selective recomputation on 16 shards), and checkpointed branches instead recompute
the whole exchange (two all-to-alls and three grouped matmuls) in every backward pass. Here
the forward keeps, padded to one static size, what report 2.4.3 keeps of the experts: the
received rows (checkpoint name `moe_input`) and the SwiGLU inputs (`swiglu_input`), in
FP8-E4M3 with `fp8_storage`, for the smallest capacity (1.25x the balanced load). The
remat policy sees those names (k2jax.model.remat): under `full` they are recomputed like
everything else. The backward then runs the six grouped matmuls of the experts' gradients
and one all-to-all each way, and recomputes neither SwiGLU's output in a matmul nor the
down-projection (report 2.4.3 recomputes both): with o = h W_d the down-projection and w_a
the combine weight of row a,

    dh_u = dy_a W_d^T,   d w_a = <dh_u, h_a>  (= <dy_a, o_a>),   dh = w_a dh_u,
    dW_d = (w h)^T dy,   then SwiGLU's and the up-projections' gradients as usual.

A step whose routing needs a larger buffer than the saved size recomputes its exchange in
the backward pass (correct, slower; rare once the router bias balances the load).
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from k2jax.kernels import grouped_matmul, platform
from k2jax.kernels.buckets import capacities, choose
from k2jax.kernels.fp8 import dequantize, quantize
from k2jax.kernels.pallas_utils import cotangent_for, varying_like

TRANSPORTS = ("ragged", "bucketed", "padded")


def auto_transport(backend: str | None = None) -> str:
  return "bucketed" if (backend or platform.backend()) == "cpu" else "ragged"


def runs_in_rounds(ep: int, round_load: float, transport: str, backend: str) -> bool:
  """Whether the exchange's worst case with `transport` (model.ep_transport; auto: as on
  `backend`) runs in rounds: every assignment to one shard, ep x the balanced load, above a
  round's `round_load` x (module docstring; at a few rows the bound's rounding up to 8 rows
  can cover it)."""
  transport = auto_transport(backend) if transport == "auto" else transport
  return transport == "ragged" and ep > round_load


def _exclusive_cumsum(x, axis=-1):
  return jnp.cumsum(x, axis=axis) - x


class _ExchangePlan(NamedTuple):
  """What is static about one exchange (hashable: the custom VJP's non-differentiable
  argument)."""
  transport: str
  axis: str
  caps: tuple          # per branch: slot rows (bucketed, padded) or received rows (ragged)
  saved: int           # rows of the residual buffers; branches receiving more recompute
  fp8: bool
  a2a: object          # lax.ragged_all_to_all or a stand-in (CPU tests)
  bound: int           # ragged: rows a round receives; larger capacities run in rounds

  def received(self, c: int, ep: int) -> int:
    """Rows a device receives into with capacity c."""
    return c if self.transport == "ragged" else ep * c

  def in_rounds(self, c: int) -> bool:
    return self.transport == "ragged" and c > self.bound

  def keeps(self, c: int, ep: int) -> bool:
    """Whether capacity c's forward keeps its residuals (else the backward recomputes)."""
    return self.received(c, ep) <= self.saved and not self.in_rounds(c)


class _Route(NamedTuple):
  """Where each of this device's A sorted assignments goes (int arrays), and the branch."""
  token: jax.Array     # [A] token of each assignment, in sorted (by expert) order
  dest: jax.Array      # [A] destination shard
  rank: jax.Array      # [A] row within the destination's slot (bucketed, padded)
  local: jax.Array     # [A] expert id on the destination shard
  counts: jax.Array    # [ep_src, ep_dst] assignments of the group
  branch: jax.Array    # index into _ExchangePlan.caps
  need: jax.Array      # the largest load anywhere (agreed by every device): rounds past it idle


def _round_count(c: int, bound: int) -> int:
  """Rounds of `bound` received rows that cover a capacity of c (the tests shorten it)."""
  return -(-c // bound)


def _window(counts, start, c):
  """The part of every (sender s, receiver d) slice that falls in rows [start, start + c) of
  d's incoming stream (the senders' slices in order: s's starts at sum_{s' < s}
  counts[s', d]) -> (first row in s's sorted assignments, rows, row in d's buffer), each
  [ep_src, ep_dst]. start = 0 with c >= every stream is the whole exchange at once."""
  land = _exclusive_cumsum(counts, axis=0)
  lo = jnp.clip(start - land, 0, counts)
  n = jnp.clip(start + c - land, 0, counts) - lo
  # an empty slice gets offset 0: in bounds whatever the window
  return _exclusive_cumsum(counts, axis=1) + lo, n, jnp.where(n > 0, land + lo - start, 0)


def _send(plan, route, c, a, fill, start=0):
  """a [A, ...] (sorted by destination) -> what this device receives, [received(c), ...];
  rows not received hold `fill`. Ragged: rows [start, start + c) of this device's incoming
  stream (one round; the whole stream by default)."""
  ep = route.counts.shape[0]
  rest = a.shape[1:]
  if plan.transport != "ragged":
    slots = jnp.full((ep, c) + rest, fill, a.dtype).at[route.dest, route.rank].set(
        a, mode="drop")
    return jax.lax.all_to_all(slots, plan.axis, 0, 0, tiled=True).reshape((ep * c,) + rest)
  me = jax.lax.axis_index(plan.axis)
  first, n, at = _window(route.counts, start, c)
  # ragged_all_to_all's result takes the `output` operand's type: varying where `a` is, so
  # no cast to varying (whose transpose is a psum) comes after it
  out = varying_like(jnp.full((c,) + rest, fill, a.dtype), a)
  return plan.a2a(a, out, first[me], n[me], at[me], n[:, me], axis_name=plan.axis)


def _back(plan, route, c, a, start=0):
  """The inverse route: received rows [received(c), ...] -> their senders' [A, ...] order.
  Ragged: the rows of window [start, start + c), zeros elsewhere."""
  ep = route.counts.shape[0]
  rest = a.shape[1:]
  if plan.transport != "ragged":
    back = jax.lax.all_to_all(a.reshape((ep, c) + rest), plan.axis, 0, 0, tiled=True)
    # an invalid token's assignments (destination ep: sent nowhere) get zeros
    return back.at[route.dest, route.rank].get(mode="fill", fill_value=0)
  me = jax.lax.axis_index(plan.axis)
  first, n, at = _window(route.counts, start, c)
  out = varying_like(jnp.zeros((route.token.shape[0],) + rest, a.dtype), a)
  return plan.a2a(a, out, at[:, me], n[:, me], first[:, me], n[me], axis_name=plan.axis)


# Row permutations (argsort results) marked as such: a scatter whose indices may repeat is
# made deterministic on TPU through an index buffer the size of its output (u32 [rows, d])
# and a gather back, two buffers the size of the received rows per (un)sort.
def _permute(a, perm):
  return a.at[perm].get(unique_indices=True)


def _unpermute(a, perm):
  return jnp.zeros_like(a).at[perm].set(a, unique_indices=True)


def _swiglu(g, u):
  return jax.nn.silu(g) * u


# The combine weight applied in float32 and rounded once. Checkpointed: autodiff (the rounds'
# backward differentiates this) would otherwise keep the float32 copy of o as the multiply's
# residual, twice o's bytes: 28 GiB per device in the 32k preset's stage recompute on v5p
# (bf16[1048576, 7168] rows at 4x the balanced load), where o itself is 14.
_weighted = jax.checkpoint(
    lambda ws, o: (ws[:, None] * o.astype(jnp.float32)).astype(o.dtype))


def _experts(p, xs, ws, sizes):
  """Weighted SwiGLU experts on rows sorted by local expert -> (out, (g, u))."""
  dt = xs.dtype
  mm = lambda a, w: grouped_matmul(a, w.astype(dt), sizes)
  g, u = mm(xs, p["gate"]), mm(xs, p["up"])
  o = mm(_swiglu(g, u), p["down"])
  return _weighted(ws, o), (g, u)


def _dispatch(plan, route, c, p, rows, wf, start=0):
  """Send rows [A, d] and combine weights wf [A] (sorted by destination), run the experts on
  what arrives (rows [start, start + c) of the incoming stream when ragged) -> (results in
  arrival order [received(c), d], what the backward keeps of them)."""
  e_loc = p["gate"].shape[0]
  recv = _send(plan, route, c, rows, 0, start)
  recv_e = _send(plan, route, c, route.local, e_loc, start)   # padding rows: id e_loc, last
  recv_w = _send(plan, route, c, wf, 0, start)
  by_expert = jnp.argsort(recv_e, stable=True)
  sizes = jnp.bincount(recv_e, length=e_loc + 1)[:e_loc].astype(jnp.int32)
  xs, ws = _permute(recv, by_expert), _permute(recv_w, by_expert)
  out, (g, u) = _experts(p, xs, ws, sizes)
  return _unpermute(out, by_expert), (xs, g, u, ws, by_expert, sizes)


def _rounds(plan, c, p, rows, wf, route):
  """The ragged exchange of capacity c > plan.bound as rounds of plan.bound received rows:
  round r sends, runs and returns window [r bound, (r + 1) bound) of every device's incoming
  stream, its results written into their senders' rows of y [A, d] (each row belongs to one
  window). Rounds starting past the largest load (route.need, the same on every device)
  move nothing and are skipped. The body is checkpointed: differentiated (the backward's
  recompute), the scan keeps a round index per round and redoes one round at a time."""
  C = plan.bound

  # No CSE across the scan's iterations to prevent: without the barriers XLA fuses more.
  @functools.partial(jax.checkpoint, prevent_cse=False)
  def step(y, r):
    def run(y):
      out, _ = _dispatch(plan, route, C, p, rows, wf, r * C)
      # Added, not written into y as ragged_all_to_all's `output`: jax's transpose of that
      # operand masks the received rows by offsets, and an empty slice's offset (which may
      # coincide with a real slice's) cancels that slice's mark.
      return y + _back(plan, route, C, out, r * C)
    return jax.lax.cond(r * C < route.need, run, lambda y: y, y), None

  y = varying_like(jnp.zeros_like(rows), rows)
  return jax.lax.scan(step, y, jnp.arange(_round_count(c, C), dtype=jnp.int32))[0]


def _branch(plan, c, p, x, w, route, save: bool):
  """The exchange with capacity c -> (y_sorted [A, d], residuals padded to plan.saved rows
  or None). y_sorted[a] = w_a expert(x[token_a]) for this device's sorted assignments."""
  ep = route.counts.shape[0]
  rows, wf = x[route.token], w.astype(jnp.float32)
  if plan.in_rounds(c):
    y, kept = _rounds(plan, c, p, rows, wf, route), None
  else:
    out, kept = _dispatch(plan, route, c, p, rows, wf)
    y = _back(plan, route, c, out)
  # typed as varying where x is, so dy is too
  y = varying_like(y, x)
  if not save:
    return y, None
  n = plan.received(c, ep)
  if not plan.keeps(c, ep):     # too large to keep: the backward recomputes this branch
    res = _zeros(_residual_shapes(plan, p, x))
  else:
    xs, g, u, ws, by_expert, sizes = kept
    pad = lambda a: jnp.pad(a, [(0, plan.saved - n)] + [(0, 0)] * (a.ndim - 1))
    res = _store(plan, pad(xs), pad(g), pad(u), pad(ws), pad(by_expert), sizes)
  # every branch's residuals of one type (under shard_map: varying over the token shards)
  return y, jax.tree.map(lambda a: varying_like(a, x), res)


def _store(plan, xs, g, u, ws, by_expert, sizes):
  """The saved residuals, FP8 where asked (report 2.4.3: up-projection and SwiGLU inputs)."""
  keep = (lambda a: quantize(a)) if plan.fp8 else (lambda a: a)
  return dict(xs=keep(xs), g=keep(g), u=keep(u), ws=ws, by_expert=by_expert, sizes=sizes)


def _load(plan, res, dt):
  get = (lambda a: dequantize(*a, dt)) if plan.fp8 else (lambda a: a)
  return get(res["xs"]), get(res["g"]), get(res["u"])


def _residual_shapes(plan, p, x):
  f, d = p["gate"].shape[-1], x.shape[-1]
  S = plan.saved
  z = lambda *shape, dt=x.dtype: jax.ShapeDtypeStruct(shape, dt)
  return jax.eval_shape(functools.partial(_store, plan), z(S, d), z(S, f), z(S, f),
                        z(S, dt=jnp.float32), z(S, dt=jnp.int32),
                        z(p["gate"].shape[0], dt=jnp.int32))


def _zeros(shapes):
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def _cotangents(cts, primals):
  """Each cotangent in its primal's dtype and with its primal's manual-axis type (under
  shard_map): summed over the shards the primal does not vary over (the expert weights are
  the same on every data shard: their gradient is the sum of the shards'), and marked
  varying where the primal is, so every branch of the backward returns one type."""
  return jax.tree.map(lambda c, p: cotangent_for(varying_like(c.astype(p.dtype), p), p),
                      cts, primals)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _exchange(plan, p, x, w, route):
  """y_sorted [A, d] for x [N, d] (this device's tokens), w [A] (combine weights of the
  sorted assignments), p this shard's experts; the capacity is route.branch's."""
  branches = [functools.partial(_branch, plan, c, save=False) for c in plan.caps]
  return jax.lax.switch(route.branch, [lambda *a, b=b: b(*a)[0] for b in branches],
                        p, x, w, route)


def _exchange_fwd(plan, p, x, w, route):
  y, res = jax.lax.switch(
      route.branch, [functools.partial(_branch, plan, c, save=True) for c in plan.caps],
      p, x, w, route)
  # Named for the remat policy (k2jax.model.remat): the received rows and the routing (a few
  # integers per row) as `moe_input`, the up-projection outputs as `swiglu_input`.
  res = {k: jax.tree.map(functools.partial(
      checkpoint_name, name="swiglu_input" if k in ("g", "u") else "moe_input"), v)
         for k, v in res.items()}
  # Saved as uint32, a copy: saved as the very arrays the switch above reads, XLA:TPU
  # (libtpu 0.0.42.1) aborts in memory-space assignment ("Aliased use") once they leave a
  # pipeline layer's cond as its residuals with no shard_map boundary in between.
  route = jax.tree.map(lambda a: checkpoint_name(a.astype(jnp.uint32), "moe_input"), route)
  return y, (p, x, w, route, res)


class _Saved(NamedTuple):
  """What the exchange's backward reads: the forward's inputs and residuals, routing back in
  int32, and where W's recompute finds dy (`in_rows`: in the rows' first buffer, which
  holds plan.saved >= A rows, else passed as itself)."""
  p: dict
  x: jax.Array
  w: jax.Array
  route: _Route
  res: dict
  in_rows: bool


def _exchange_bwd(plan, saved, dy):
  """The exchange's backward as two switches on the same branch: the input gradients (what
  the layers below wait for, `_input_grads`), then the experts' weight gradients
  (`_weight_grads`). Two switches, not one, so a pipeline schedule that splits a backward
  into its input- and weight-gradient halves (k2jax.parallel.bwsplit, report 2.4.2) can run
  the second later: the first hands it the per-row cotangents of the down-projection's
  output and input, [plan.saved, d + f]."""
  p, x, w, route, res = saved
  route = jax.tree.map(lambda a: a.astype(jnp.int32), route)
  # Where W recomputes, it needs dy [A, d]: it travels in the rows' first buffer when that
  # is large enough (keeping the smallest capacity's residuals, 1.25 A rows), else as itself.
  sv = _Saved(p, x, w, route, res, in_rows=plan.saved >= dy.shape[0])
  dx, dw, rows = jax.lax.switch(
      route.branch, [functools.partial(_input_grads, plan, c, sv) for c in plan.caps], dy)
  dp = jax.lax.switch(
      route.branch, [functools.partial(_weight_grads, plan, c, sv) for c in plan.caps], rows,
      *(() if sv.in_rows else (dy,)))
  return dp, dx, dw, None


def _mm_vjp(a, wt, ct, sizes):
  """(d a, d wt) of grouped_matmul(a, wt, sizes) for the cotangent ct; a switch that uses
  one half lets XLA drop the other."""
  return jax.vjp(lambda a, wt: grouped_matmul(a, wt, sizes), a, wt.astype(a.dtype))[1](ct)


def _loaded(plan, c, sv: _Saved):
  """The kept residuals of capacity c's branch, cut to its n received rows."""
  n = plan.received(c, sv.route.counts.shape[0])
  xs, g, u = (a[:n] for a in _load(plan, sv.res, sv.x.dtype))
  return n, xs, g, u, sv.res["ws"][:n], sv.res["by_expert"][:n], sv.res["sizes"]


def _recomputed(plan, c, sv: _Saved, wrt: tuple, dy):
  """Cotangents of the primals named in wrt ("p", "x", "w") by running capacity c's branch
  again under autodiff: its buffers were too large to keep."""
  primals = dict(p=sv.p, x=sv.x, w=sv.w)

  def branch(*args):
    a = dict(primals, **dict(zip(wrt, args)))
    return _branch(plan, c, a["p"], a["x"], a["w"], sv.route, False)[0]
  _, f_vjp = jax.vjp(branch, *(primals[k] for k in wrt))
  return _cotangents(f_vjp(dy), tuple(primals[k] for k in wrt))


def _input_grads(plan, c, sv: _Saved, dy):
  """Capacity c's (d x, d w, rows `_weight_grads` reads: d of the down-projection's output
  and input per received row, padded to plan.saved)."""
  x, p, route, dt = sv.x, sv.p, sv.route, sv.x.dtype
  S, A, d, f = plan.saved, dy.shape[0], x.shape[-1], p["gate"].shape[-1]
  if not plan.keeps(c, route.counts.shape[0]):
    d_x, d_w = _recomputed(plan, c, sv, ("x", "w"), dy)
    first = jnp.pad(dy, [(0, S - A), (0, 0)]) if sv.in_rows else jnp.zeros((S, d), dt)
    rows = (first, jnp.zeros((S, f), dt))
    return d_x, d_w, jax.tree.map(lambda a: varying_like(a, x), rows)
  n, xs, g, u, ws, by_expert, sizes = _loaded(plan, c, sv)
  # _send and _back move rows along the same routes in opposite directions, so each is the
  # other's transpose (padding rows carry nothing either way).
  d_o = _permute(_send(plan, route, c, dy, 0), by_expert)
  h = _swiglu(g, u)
  dh_u = _mm_vjp((ws[:, None] * h.astype(jnp.float32)).astype(dt), p["down"], d_o, sizes)[0]
  d_ws = jnp.sum(dh_u.astype(jnp.float32) * h.astype(jnp.float32), axis=-1)
  dh = (ws[:, None] * dh_u.astype(jnp.float32)).astype(dt)
  dg, du = jax.vjp(_swiglu, g, u)[1](dh)
  dxs = _mm_vjp(xs, p["gate"], dg, sizes)[0] + _mm_vjp(xs, p["up"], du, sizes)[0]
  unsort = functools.partial(_unpermute, perm=by_expert)
  d_x = _back(plan, route, c, unsort(dxs))
  d_w = _back(plan, route, c, unsort(d_ws))
  d_x = jnp.zeros_like(x).at[route.token].add(d_x)
  pad = lambda a: jnp.pad(a, [(0, S - n), (0, 0)])
  return (*_cotangents((d_x, d_w), (x, sv.w)),
          jax.tree.map(lambda a: varying_like(a, x), (pad(d_o), pad(dh_u))))


def _weight_grads(plan, c, sv: _Saved, rows, *dy):
  """Capacity c's expert weight gradients {"gate", "up", "down"} from `_input_grads`' rows
  (or, where the branch recomputes, from dy)."""
  p, dt = sv.p, sv.x.dtype
  if not plan.keeps(c, sv.route.counts.shape[0]):
    A = sv.w.shape[0]
    return _recomputed(plan, c, sv, ("p",), rows[0][:A] if sv.in_rows else dy[0])[0]
  n, xs, g, u, ws, by_expert, sizes = _loaded(plan, c, sv)
  d_o, dh_u = (a[:n] for a in rows)
  h = _swiglu(g, u)
  # each switch takes one half of a grouped matmul's vjp; XLA drops the other half
  d_down = _mm_vjp((ws[:, None] * h.astype(jnp.float32)).astype(dt), p["down"], d_o,
                   sizes)[1]
  dg, du = jax.vjp(_swiglu, g, u)[1]((ws[:, None] * dh_u.astype(jnp.float32)).astype(dt))
  d_gate = _mm_vjp(xs, p["gate"], dg, sizes)[1]
  d_up = _mm_vjp(xs, p["up"], du, sizes)[1]
  return _cotangents({"gate": d_gate, "up": d_up, "down": d_down}, p)


_exchange.defvjp(_exchange_fwd, _exchange_bwd)


def sort_assignments(idx, valid, ep: int, e_loc: int):
  """This device's assignments idx [N, k] sorted by expert, hence by destination shard ->
  (order [A]: the flat assignment at each sorted place, dest [A], rank [A]: row within the
  destination's slice, local [A]: expert id on the destination shard, count [ep]: rows for
  each shard). valid [N] bool (None: every token): an invalid token's assignments (padding)
  take destination ep, sorted after every real one and sent nowhere (like
  embedding._routes' sentinel): padding rows share one embedding, hence one top-k, and would
  otherwise all land on the few shards holding it."""
  N, k = idx.shape
  A = N * k
  flat = idx.reshape(-1)
  if valid is not None:
    flat = jnp.where(jnp.repeat(valid.reshape(-1), k), flat, ep * e_loc)
  order = jnp.argsort(flat, stable=True)                 # grouped by expert, hence by shard
  expert = flat[order]
  dest = expert // e_loc
  count = jnp.bincount(dest, length=ep).astype(jnp.int32)   # (ep itself not counted)
  start = _exclusive_cumsum(count).at[dest].get(mode="fill", fill_value=0)
  rank = jnp.arange(A) - start                             # row within the destination slot
  return order, dest, rank, (expert % e_loc).astype(jnp.int32), count


def sharded_routed_experts(p_local, x, idx, w, axis: str, *, sync_axes=(),
                           transport: str = "auto", fp8_storage: bool = False,
                           keep: bool = True, ragged_all_to_all=None, round_load: float = 2.0,
                           round_rows: int | None = None, valid=None):
  """Routed-expert output for local tokens x [N, d] with global expert ids idx [N, k].

  Args:
    p_local: this shard's E_loc SwiGLU experts {"gate", "up": [E_loc, d, f], "down":
      [E_loc, f, d]}.
    x: local tokens [N, d].
    idx: their expert ids [N, k].
    w: their combine weights [N, k].
    axis: the mesh axis experts are split over.
    sync_axes: every other manual mesh axis of the enclosing shard_map: all devices agree on
      the buffer size, so they all take the same compiled branch.
    transport: "ragged" | "bucketed" | "padded" | "auto" (ragged off CPU).
    fp8_storage: keep the saved expert inputs and SwiGLU inputs in FP8-E4M3 (report 2.4.3).
    keep: keep the smallest capacity's residuals for the backward pass; False: every
      backward pass recomputes its exchange (the least memory, the most work).
    ragged_all_to_all: override for lax.ragged_all_to_all (a CPU emulation in tests).
    round_load: ragged: the most rows one round receives, in multiples of the balanced load
      A (model.ep_round_load); a larger capacity runs in rounds of that many.
    round_rows: the same in rows, overriding round_load (tests shrink it).
    valid: [N] bool, the tokens that count (None: all). The others (padding) are not sent:
      they take no buffer rows, and their output and gradients are zero.
  Returns:
    [N, d]: sum_k w[n, k] * expert_{idx[n, k]}(x[n]) for valid tokens, 0 for the others.
  """
  transport = auto_transport() if transport == "auto" else transport
  if transport not in TRANSPORTS:
    raise ValueError(f"transport = {transport!r}: must be one of {', '.join(TRANSPORTS)}, auto")
  N, k = idx.shape
  ep = jax.lax.axis_size(axis)
  e_loc = p_local["gate"].shape[0]
  A = N * k
  order, dest, rank, local, count = sort_assignments(idx, valid, ep, e_loc)
  counts = jax.lax.all_gather(count, axis)               # [ep_src, ep_dst], ep^2 integers
  agree = lambda v: jax.lax.pmax(v, (axis, *sync_axes))
  if transport == "padded":
    caps, need = (A,), jnp.int32(A)
  elif transport == "bucketed":
    caps, need = capacities(A, ep), jnp.max(counts)      # largest (source, dest) slice
  else:
    caps, need = capacities(ep * A, ep), jnp.max(jnp.sum(counts, 0))  # most rows received
  if transport != "ragged":
    bound = caps[-1]            # no rounds: CPU reference paths (the module docstring)
  else:
    bound = round_rows or capacities(ep * A, ep, (round_load,))[0]
  plan = _ExchangePlan(transport, axis, caps, 0, fp8_storage, ragged_all_to_all
               or jax.lax.ragged_all_to_all, bound)
  # The smallest capacity keeps its residuals (kernels/buckets.py: 1.25x the balanced load,
  # what a balanced router needs); the larger ones recompute.
  plan = plan._replace(saved=plan.received(caps[0], ep) if keep else 0)
  need = agree(need)
  route = _Route(order // k, dest, rank, local, counts, choose(need, caps), need)
  y_sorted = _exchange(plan, p_local, x, w.reshape(-1)[order], route)
  # back to token order; the k weighted expert outputs of a token summed in float32
  y = y_sorted[jnp.argsort(order)].reshape(N, k, -1)
  return jnp.sum(y.astype(jnp.float32), axis=1).astype(x.dtype)


def experts_all_to_all(*args, **kwargs):
  """Deprecated name of `sharded_routed_experts` (the exchange is mostly ragged, not an
  all-to-all)."""
  import warnings
  warnings.warn("expert_parallel.experts_all_to_all is now sharded_routed_experts",
                DeprecationWarning, stacklevel=2)
  return sharded_routed_experts(*args, **kwargs)


def bytes_moved(counts, d: int, itemsize: int, transport: str) -> int:
  """Bytes one device sends per layer (there and back) given the group's counts matrix
  [ep_src, ep_dst] (numpy), for the benchmark's bytes-vs-ideal table."""
  import numpy as np
  counts = np.asarray(counts)
  ep = counts.shape[0]
  A = int(counts.sum(1).max())
  if transport == "padded":
    rows = ep * A
  elif transport == "bucketed":
    caps = capacities(A, ep)
    rows = ep * next(c for c in caps if c >= counts.max())
  else:
    rows = A
  return 2 * rows * d * itemsize
