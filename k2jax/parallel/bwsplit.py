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
     shard_map or a lax.switch holding the expert-parallel MoE) is taken in B ("early"),
     so W never waits on a weight-sized value;
  4. the cut: values W reads that B produces (the cotangents at the weight ops' outputs,
     and the activations B recomputed under the remat policy) are B's extra outputs,
     except a value that W can recompute cheaply from what it keeps (weights, stored
     residuals) with ops that do no matmul (the normalised inputs of the projections):
     W recomputes it rather than keep it alive between the two tasks.

Ops that hold a sub-program the pass does not open (scan, cond, switch, shard_map, custom
kernels) are atoms: an atom that dx needs runs in B whole, so the weight gradients it makes
are early. `Split.flops` says what share of the matmul work ended up in W.

B(dy) + W(cut) equal the backward exactly: the same ops, bound in the same order.
"""

import math
from typing import Callable, NamedTuple

import jax
from jax.extend import core as jcore

# Calls whose body is inlined: their ops join the flat list (a remat's body in a backward
# is recomputation plus the transposed layer, both ordinary ops once inlined).
_INLINE = ("jit", "pjit", "closed_call", "core_call", "remat", "remat2", "checkpoint")


class _Const(NamedTuple):
  value: object


class _Op(NamedTuple):
  eqn: object
  ins: tuple      # int keys or _Const
  outs: tuple     # int keys (None for dropped outputs)


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
    if eqn.primitive.name in _INLINE and "jaxpr" in eqn.params:
      sub = eqn.params["jaxpr"]
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
  """2 x multiply-adds of the matmuls in one op, nested programs included (both branches of
  a cond counted: an upper bound)."""
  name = eqn.primitive.name
  total = 0.0
  if name == "dot_general":
    (lc, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval.shape
    total += 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in lc)
  elif name.startswith("ragged_dot"):
    lhs, rhs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
    total += 2.0 * math.prod(lhs) * rhs[-1]
  for sub in jcore.jaxprs_in_params(eqn.params):
    total += sum(_matmul_flops(e) for e in sub.eqns)
  return total


# Ops W never repeats to save memory (matmuls, kernels, collectives, control flow); any
# other op (elementwise, norms, casts, reshapes) W recomputes rather than keep its output.
_COSTLY = ("dot_general", "ragged_dot", "ragged_dot_general", "pallas_call", "custom_call",
           "conv_general_dilated", "all_to_all", "all_gather", "psum", "ppermute", "pmax",
           "reduce_scatter", "ragged_all_to_all", "shard_map", "scan", "while", "cond",
           "custom_vjp_call", "custom_jvp_call")


def _cheap(eqn) -> bool:
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


def split(bwd, n_weights: int, n_kept: int, *avals) -> Split:
  """Cut `bwd(*ins) -> (dw leaves [n_weights], then dx leaves)`, traced at `avals`
  (ShapeDtypeStructs or arrays of its flat inputs), into B and W (module docstring).
  The first `n_kept` inputs (weights, stored residuals) are still there when W runs; the
  rest (the output cotangent) reach W through the cut if it needs them."""
  closed = jax.make_jaxpr(bwd)(*avals)
  ops, counter = [], [0]
  in_keys = []
  for _ in closed.jaxpr.invars:
    counter[0] += 1
    in_keys.append(counter[0])
  outs = _flatten(closed.jaxpr, closed.consts, in_keys, ops, counter)
  producer = {k: i for i, op in enumerate(ops) for k in op.outs if k is not None}
  dw_keys, dx_keys = outs[:n_weights], outs[n_weights:]
  b_ops = _slice(ops, producer, dx_keys)
  late = tuple(i for i, k in enumerate(dw_keys)
               if isinstance(k, int) and k in producer and producer[k] not in b_ops)
  w_ops = _slice(ops, producer, [dw_keys[i] for i in late]) - b_ops
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
    if k in tainted or not _cheap(ops[producer[k]].eqn):
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
              | {dw_keys[i] for i in late if dw_keys[i] in made_by_b})
    again = set()
    for k in wanted:
      cone = redo(k)
      if cone:
        again |= cone - w_ops
    if not again:
      break
    w_ops |= again
  cut = sorted(k for k in wanted if not redo(k))
  b_order, w_order = sorted(b_ops), sorted(w_ops)
  aval_of = {k: a.aval for k, a in zip(in_keys, closed.jaxpr.invars)}
  aval_of.update({k: op.eqn.outvars[j].aval for op in ops for j, k in enumerate(op.outs)
                  if k in cut})

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

  flops = {"B": sum(_matmul_flops(ops[i].eqn) for i in b_order),
           "W": sum(_matmul_flops(ops[i].eqn) for i in w_order)}
  return Split(b, w, flops, [aval_of[k] for k in cut], late)
