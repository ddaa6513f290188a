"""A backward pass cut into its input-gradient (B) and weight-gradient (W) halves (report 2.4.2).

Zero-bubble pipeline schedules run a stage's backward as two tasks: B, the chain that
carries the cotangent back to the stage's input (what the previous stage waits for), and W,
the weight gradients, which nothing waits for and which can fill the ticks a device would
otherwise idle in. For y = x w, B computes dx = dy w^T and W computes dw = x^T dy: W needs
the cotangent dy of every weight op's output, which only exists inside B's chain.

JAX has no such split, so this one works on the backward's jaxpr, like a compiler pass:

  1. trace the backward (w, residuals, dy) -> (dw, dx) to a jaxpr, inlining nested calls
     (jit, the remat of jax.checkpoint) so the ops of one layer are one flat list;
  2. B = every op dx depends on;
  3. W = every op a weight gradient depends on that B does not already run; a weight
     gradient B computes anyway (one produced inside an op the chain needs, e.g. a
     lax.switch or a kernel) is taken in B ("early"), so W never waits on a weight-sized
     value;
  4. the cut: values W reads that B produces (the cotangents at the weight ops' outputs,
     and the activations B recomputed under the remat policy) are B's extra outputs,
     except a value that W can recompute cheaply from what it keeps (weights, stored
     residuals) with ops that do no matmul (the normalised inputs of the projections):
     W recomputes it rather than keep it alive between the two tasks.

A shard_map (the MoE's, over the batch and expert axes) is opened: B needs some of its
outputs, W others (the experts' weight gradients), so its body is cut by steps 2-4 into two
shard_maps, the second reading what the first hands it per device (`_open_shard_map`).
Other ops that hold a sub-program (scan, cond, switch, custom kernels) are atoms: an atom
that dx needs runs in B whole, so the weight gradients it makes are early; the expert
exchange therefore runs its backward as two switches (k2jax.model.expert_parallel).
`Split.flops` says what share of the matmul work ended up in W.

B(dy) + W(cut) equal the backward exactly: the same ops, bound in the same order.
"""

import math
from typing import Callable, NamedTuple

import jax
from jax.extend import core as jcore

from k2jax.kernels.pallas_utils import type_vma

# Calls whose body is inlined: their ops join the flat list (a remat's body in a backward
# is recomputation plus the transposed layer, both ordinary ops once inlined).
_INLINE = ("jit", "pjit", "closed_call", "core_call", "remat", "remat2", "checkpoint")


class _Const(NamedTuple):
  value: object


class _Op(NamedTuple):
  eqn: object     # a jaxpr equation; None for an op this pass made (`fn`)
  ins: tuple      # int keys or _Const
  outs: tuple     # int keys (None for dropped outputs)
  fn: Callable | None = None    # made ops: fn(*ins) -> outs (a half of a shard_map)
  avals: tuple = ()             # made ops: the outputs' avals
  flops: float = 0.0            # made ops: their matmul FLOPs


def _flatten(jaxpr, consts, in_keys, ops, counter):
  env = {}
  for v, k in zip(jaxpr.invars, in_keys):
    env[v] = k
  for v, c in zip(jaxpr.constvars, consts):
    env[v] = _Const(c)

  def read(a):
    return _Const(a.val) if isinstance(a, jcore.Literal) else env[a]

  for eqn in jaxpr.eqns:
    ins = tuple(read(a) for a in eqn.invars)
    body = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    if eqn.primitive.name in _INLINE and body is not None:
      sub = body
      if isinstance(sub, jcore.ClosedJaxpr):
        outs = _flatten(sub.jaxpr, sub.consts, ins, ops, counter)
      else:
        outs = _flatten(sub, (), ins, ops, counter)
    else:
      outs = []
      for v in eqn.outvars:
        counter[0] += 1
        outs.append(None if isinstance(v, jcore.DropVar) else counter[0])
      ops.append(_Op(eqn, ins, tuple(outs)))
    for v, k in zip(eqn.outvars, outs):
      if not isinstance(v, jcore.DropVar):
        env[v] = k
  return [read(a) for a in jaxpr.outvars]


def _flat(jaxpr, consts, counter):
  """A jaxpr's flat op list (`_flatten`) with fresh keys for its inputs -> (ops, input
  keys, output keys)."""
  ops, in_keys = [], []
  for _ in jaxpr.invars:
    counter[0] += 1
    in_keys.append(counter[0])
  return ops, in_keys, _flatten(jaxpr, consts, in_keys, ops, counter)


def _producers(ops) -> dict:
  """key -> index of the op that makes it."""
  return {k: i for i, op in enumerate(ops) for k in op.outs if k is not None}


def _aval(op, j):
  """The type of op's j-th output."""
  return op.avals[j] if op.eqn is None else op.eqn.outvars[j].aval


def _slice(ops, producer, wanted):
  """Indices of the ops the keys `wanted` depend on."""
  need, stack = set(), [k for k in wanted if isinstance(k, int) and k in producer]
  while stack:
    i = producer[stack.pop()]
    if i in need:
      continue
    need.add(i)
    stack.extend(k for k in ops[i].ins if isinstance(k, int) and k in producer)
  return need


def _run(ops, order, env):
  for i in order:
    op = ops[i]
    args = [k.value if isinstance(k, _Const) else env[k] for k in op.ins]
    if op.fn is not None:
      for k, o in zip(op.outs, op.fn(*args)):
        env[k] = o
      continue
    params = op.eqn.primitive.get_bind_params(op.eqn.params)
    subfuns = ()
    if isinstance(params, tuple):     # older jax: (sub-functions, params)
      subfuns, params = params
    with op.eqn.ctx.manager:          # the op's own context (e.g. its compute type)
      out = op.eqn.primitive.bind(*subfuns, *args, **params)
    if not op.eqn.primitive.multiple_results:
      out = [out]
    for k, o in zip(op.outs, out):
      if k is not None:
        env[k] = o


def _read(env, k):
  return k.value if isinstance(k, _Const) else env[k]


def _matmul_flops(eqn) -> float:
  """2 x multiply-adds of the matmuls in one op, nested programs included: only the ops
  whose outputs are used (a vjp taken for one of its halves leaves the other dead, and XLA
  drops it), and of a cond or switch its first branch (the expert exchange's smallest
  capacity, the one a balanced router takes; k2jax.model.expert_parallel)."""
  name = eqn.primitive.name
  total = 0.0
  if name == "dot_general":
    (lc, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval.shape
    total += 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in lc)
  elif name.startswith("ragged_dot"):
    lhs, rhs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
    total += 2.0 * math.prod(lhs) * rhs[-1]
  elif name == "pallas_call":   # a kernel's own estimate, where it gives one (ours do)
    return float(getattr(eqn.params.get("cost_estimate"), "flops", 0) or 0)
  subs = list(jcore.jaxprs_in_params(eqn.params))
  if name == "cond":
    subs = subs[:1]
  return total + _devices(eqn) * sum(_live_flops(sub) for sub in subs)


def _devices(eqn) -> int:
  """How many copies of an op's body run: a shard_map's body runs on every device of its
  manual axes, on a shard of the data (the ops outside it count the whole array)."""
  if eqn.primitive.name != "shard_map":
    return 1
  mesh = eqn.params["mesh"]
  return math.prod(mesh.shape[a] for a in _manual(eqn.params))


def _manual(params) -> frozenset:
  return frozenset(params.get("newly_manual_axes", params.get("manual_axes", ())))


def _live_flops(jaxpr) -> float:
  used = {v for v in jaxpr.outvars if not isinstance(v, jcore.Literal)}
  total = 0.0
  for e in reversed(jaxpr.eqns):
    if e.effects or any(v in used for v in e.outvars):
      total += _matmul_flops(e)
      used.update(v for v in e.invars if not isinstance(v, jcore.Literal))
  return total


def _op_flops(op) -> float:
  return op.flops if op.eqn is None else _matmul_flops(op.eqn)


# Ops W never repeats to save memory (matmuls, kernels, collectives, control flow); any
# other op (elementwise, norms, casts, reshapes) W recomputes rather than keep its output.
_COSTLY = ("dot_general", "ragged_dot", "ragged_dot_general", "pallas_call", "custom_call",
           "conv_general_dilated", "all_to_all", "all_gather", "psum", "ppermute", "pmax",
           "reduce_scatter", "ragged_all_to_all", "shard_map", "scan", "while", "cond",
           "custom_vjp_call", "custom_jvp_call")


def _cheap(op) -> bool:
  if op.eqn is None:
    return False
  eqn = op.eqn
  return eqn.primitive.name not in _COSTLY and not list(jcore.jaxprs_in_params(eqn.params))


class Split(NamedTuple):
  """The two halves of one backward (`split`).

  b(*ins) -> (dx leaves, early weight-gradient leaves (None where W makes it), cut)
  w(kept ins, cut) -> weight-gradient leaves (None where B made it)
  ins: the backward's flat inputs. flops: {"B": ..., "W": ...} matmul FLOPs of each half.
  cut_avals: shapes of the values B hands W."""
  b: Callable
  w: Callable
  flops: dict
  cut_avals: list
  late: tuple          # indices of the weight gradients W makes


def _partition(ops, in_keys, n_kept: int, b_keys, w_keys):
  """Steps 2-4 of the module docstring on a flat op list -> (B's ops, the indices of
  `w_keys` W makes (`late`), W's ops, the cut: the keys B hands W)."""
  producer = _producers(ops)
  b_ops = _slice(ops, producer, b_keys)
  late = tuple(i for i, k in enumerate(w_keys)
               if isinstance(k, int) and k in producer and producer[k] not in b_ops)
  w_ops = _slice(ops, producer, [w_keys[i] for i in late]) - b_ops
  made_by_b = ({k for i in b_ops for k in ops[i].outs if k is not None}
               | set(in_keys[n_kept:]))
  # Values that do not depend on the output cotangent, computed by cheap ops from what W
  # keeps: W recomputes them (their ops join W) instead of receiving them.
  tainted = set(in_keys[n_kept:])
  for op in ops:
    if any(k in tainted for k in op.ins if isinstance(k, int)):
      tainted.update(k for k in op.outs if k is not None)
  kept = set(in_keys[:n_kept])
  memo = {}

  def redo(k):
    """The cheap ops recomputing key k from kept inputs, or None."""
    if k in kept or k not in producer:
      return set()
    if k in tainted or not _cheap(ops[producer[k]]):
      return None
    if k not in memo:
      memo[k] = set()       # (a DAG: no cycles; the placeholder only bounds the recursion)
      cone = {producer[k]}
      for j in ops[producer[k]].ins:
        if isinstance(j, int):
          sub = redo(j)
          if sub is None:
            memo[k] = None
            return None
          cone |= sub
      memo[k] = cone
    return memo[k]
  while True:
    wanted = ({k for i in w_ops for k in ops[i].ins if isinstance(k, int) and k in made_by_b}
              | {w_keys[i] for i in late if w_keys[i] in made_by_b})
    again = set()
    for k in wanted:
      cone = redo(k)
      if cone:
        again |= cone - w_ops
    if not again:
      break
    w_ops |= again
  return b_ops, late, w_ops, sorted(k for k in wanted if not redo(k))


def _open_shard_map(op, b_out, w_out, counter):
  """A shard_map op whose outputs `b_out` B needs and `w_out` only W: its body cut like a
  backward (`_partition`, every body input kept: the outer cut decides how each reaches
  W) into two shard_maps -> [B's half, W's half], or None when W's half would be empty.

  B's half also returns the body values W's half reads, each per device under a new
  leading axis of size 1 laid out over the manual axes it varies over, so W's half gets
  back exactly the value its device made."""
  from jax.sharding import PartitionSpec
  params = op.eqn.params
  body, consts = params["jaxpr"], ()
  if isinstance(body, jcore.ClosedJaxpr):
    body, consts = body.jaxpr, body.consts
  sub, keys, outs = _flat(body, consts, [0])
  producer = _producers(sub)
  while True:
    b_ops, late, w_ops, cut = _partition(sub, keys, len(keys), [outs[j] for j in b_out],
                                         [outs[j] for j in w_out])
    # An output whose W part does no matmul (a psum of a gradient B made, inside a kernel's
    # backward) stays B's: moving it would only hand W a weight-sized value.
    idle = [i for i in late if not sum(_op_flops(sub[n]) for n in
                                       _slice(sub, producer, [outs[w_out[i]]]) - b_ops)]
    b_out = list(b_out) + [j for i, j in enumerate(w_out) if i not in late or i in idle]
    w_out = [w_out[i] for i in late if i not in idle]
    if not idle:
      break
  if not w_out:
    return None
  mesh, check = params["mesh"], params["check_vma"]
  manual = _manual(params)
  aval_of = {k: _aval(e, j) for e in sub for j, k in enumerate(e.outs) if k in cut}
  cut_axes = [tuple(a for a in mesh.axis_names
                    if a in manual and (a in type_vma(aval_of[k]) or not check)) for k in cut]
  cut_specs = tuple(PartitionSpec(ax or None) for ax in cut_axes)
  cut_avals = tuple(jax.ShapeDtypeStruct((math.prod(mesh.shape[a] for a in ax),)
                                      + aval_of[k].shape, aval_of[k].dtype)
                    for ax, k in zip(cut_axes, cut))
  reads = lambda idx: {k for i in idx for k in sub[i].ins if isinstance(k, int)}
  b_in = [j for j, k in enumerate(keys) if k in reads(b_ops) or k in {outs[i] for i in b_out}]
  w_in = [j for j, k in enumerate(keys) if k in reads(w_ops)]
  in_specs, out_specs = params["in_specs"], params["out_specs"]
  smap = lambda f, i_specs, o_specs: jax.shard_map(
      f, mesh=mesh, in_specs=tuple(i_specs), out_specs=tuple(o_specs), axis_names=manual,
      check_vma=check)

  def b_fn(*args):
    def body_b(*vals):
      env = dict(zip([keys[j] for j in b_in], vals))
      _run(sub, sorted(b_ops), env)
      return tuple(_read(env, outs[j]) for j in b_out) + tuple(env[k][None] for k in cut)
    return smap(body_b, [in_specs[j] for j in b_in],
                [out_specs[j] for j in b_out] + list(cut_specs))(*args)

  def w_fn(*args):
    def body_w(*vals):
      env = dict(zip([keys[j] for j in w_in], vals[:len(w_in)]))
      env.update(zip(cut, (v[0] for v in vals[len(w_in):])))
      _run(sub, sorted(w_ops), env)
      return tuple(_read(env, outs[j]) for j in w_out)
    return smap(body_w, [in_specs[j] for j in w_in] + list(cut_specs),
                [out_specs[j] for j in w_out])(*args)

  new_keys = []
  for _ in cut:
    counter[0] += 1
    new_keys.append(counter[0])
  avals = [_aval(op, j) for j in range(len(op.outs))]
  flops = lambda idx: _devices(op.eqn) * sum(_op_flops(sub[i]) for i in idx)
  b_op = _Op(None, tuple(op.ins[j] for j in b_in), tuple(op.outs[j] for j in b_out) +
             tuple(new_keys), b_fn, tuple(avals[j] for j in b_out) + cut_avals, flops(b_ops))
  w_op = _Op(None, tuple(op.ins[j] for j in w_in) + tuple(new_keys),
             tuple(op.outs[j] for j in w_out), w_fn, tuple(avals[j] for j in w_out),
             flops(w_ops))
  return [b_op, w_op]


def _open(ops, dx_keys, dw_keys, counter):
  """Opens, one at a time, every shard_map B needs some outputs of and W others
  (`_open_shard_map`): e.g. the MoE's, whose experts' weight gradients would otherwise
  be made in B."""
  while True:
    producer = _producers(ops)
    b_ops = _slice(ops, producer, dx_keys)
    by_b = {k for i in b_ops for k in ops[i].ins if isinstance(k, int)} | set(dx_keys)
    used = {k for op in ops for k in op.ins if isinstance(k, int)} | set(dw_keys)
    for i in sorted(b_ops):
      op = ops[i]
      if op.eqn is None or op.eqn.primitive.name != "shard_map":
        continue
      b_out = [j for j, k in enumerate(op.outs) if k in by_b]
      w_out = [j for j, k in enumerate(op.outs) if k is not None and k not in by_b and k in used]
      halves = _open_shard_map(op, b_out, w_out, counter) if w_out else None
      if halves:
        ops[i:i + 1] = halves
        break
    else:
      return ops


def split(bwd, n_weights: int, n_kept: int, *avals) -> Split:
  """Cut `bwd(*ins) -> (dw leaves [n_weights], then dx leaves)`, traced at `avals`
  (ShapeDtypeStructs or arrays of its flat inputs), into B and W (module docstring).
  The first `n_kept` inputs (weights, stored residuals) are still there when W runs; the
  rest (the output cotangent) reach W through the cut if it needs them."""
  closed = jax.make_jaxpr(bwd)(*avals)
  counter = [0]
  ops, in_keys, outs = _flat(closed.jaxpr, closed.consts, counter)
  dw_keys, dx_keys = outs[:n_weights], outs[n_weights:]
  ops = _open(ops, dx_keys, dw_keys, counter)
  b_ops, late, w_ops, cut = _partition(ops, in_keys, n_kept, dx_keys, dw_keys)
  b_order, w_order = sorted(b_ops), sorted(w_ops)
  aval_of = {k: a.aval for k, a in zip(in_keys, closed.jaxpr.invars)}
  aval_of.update({k: _aval(op, j) for op in ops for j, k in enumerate(op.outs) if k in cut})

  def b(*ins):
    env = dict(zip(in_keys, ins))
    _run(ops, b_order, env)
    early = [None if i in late else _read(env, k) for i, k in enumerate(dw_keys)]
    return [_read(env, k) for k in dx_keys], early, [env[k] for k in cut]

  def w(kept, cut_vals):
    env = dict(zip(in_keys[:n_kept], kept))
    env.update(zip(cut, cut_vals))
    _run(ops, w_order, env)
    return [_read(env, dw_keys[i]) if i in late else None for i in range(len(dw_keys))]

  flops = {"B": sum(_op_flops(ops[i]) for i in b_order),
           "W": sum(_op_flops(ops[i]) for i in w_order)}
  return Split(b, w, flops, [aval_of[k] for k in cut], late)
