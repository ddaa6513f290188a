"""Muon for K2's parameter table (report 2.1, Algorithm 1 lines 3-7), built on optax.contrib.

For every Muon matrix W (n x m), with gradient G:

    M_t = mu M_{t-1} + G_t
    O_t = NewtonSchulz5(M_t) * sqrt(max(n, m)) * 0.2        (update RMS matched to AdamW)
    W_t = W_{t-1} - lr (O_t + wd W_{t-1})

`optax.contrib.scale_by_muon` does the momentum and the orthogonalization; its momentum is
the bias-corrected EMA (1 - mu) sum mu^(t-s) G_s, a positive multiple of M_t above, which
Newton-Schulz's Frobenius normalisation removes. `MuonDimensionNumbers` from the parameter
table make stacked `layers` / `experts` axes batch axes: each layer's and each expert's
matrix is orthogonalized on its own, and a per-head tensor such as q_b [q_lora, H, D] is
seen as the published q_lora x (H D) matrix. On a mesh, each device orthogonalizes the
matrices it holds, 1 / data of them per data rank where data divides them (ZeRO-1,
`on_local_matrices`).

Parameters outside Muon follow the Moonlight recipe: AdamW for the embedding, lm_head,
router and norms (norms without weight decay); the router correction bias is not trained by
gradients at all (it follows k2jax.model.balance).
"""

import math

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P
from optax.contrib import MuonDimensionNumbers, scale_by_muon

from k2jax.configs.sharding_rules import muon_work_spec
from k2jax.model import param_specs, spec


def _is_dims(x):
  return x is None or isinstance(x, MuonDimensionNumbers)


def labels(cfg):
  """Optimizer group of every parameter of `cfg` (a model config), from the parameter table:
  "muon" (weight matrices) | "adamw" (embedding, head, router, norms) | "frozen" (router
  bias, moved by balancing only)."""
  return jax.tree.map(lambda s: s.group, param_specs(cfg), is_leaf=spec.is_spec)


def dimension_numbers(cfg):
  """optax MuonDimensionNumbers per parameter of `cfg` (None outside Muon): stacked `layers`
  / `experts` axes are batch axes, the table's `n_in` axes after them the fan-in."""
  return jax.tree.map(spec.muon_dims, param_specs(cfg), is_leaf=spec.is_spec)


def newton_schulz_flops(cfg, ns_steps: int = 5) -> float:
  """FLOPs of one Newton-Schulz orthogonalization of every Muon matrix of `cfg` (a model
  config), from the parameter table: each matrix is an m x n X (m <= n; stacked `layers` /
  `experts` axes are a batch), and each of the `ns_steps` quintic iterations computes
  A = X X^T (2 m^2 n), B = b A + c A A (2 m^3) and X' = a X + B X (2 m^2 n):

      flops = ns_steps * sum over matrices of (4 m^2 n + 2 m^3)

  This is the step's total, not any one device's (experiments/bench_train.py compares it with
  the step's model FLOPs). `on_local_matrices` splits it over the devices that hold the
  matrices (pipeline stages, the expert group's experts) and, where data divides a device's
  layers / experts, over data ranks (ZeRO-1); the rest is repeated: a matrix split over
  `expert` on its model dimension (FSDP) is orthogonalized whole on every device of its
  expert group, and every data rank repeats the matrices data does not divide (at K2's
  widths the routed experts are 98% of these FLOPs; the other 2% are repeated so)."""
  total = 0.0
  for s in jax.tree.leaves(param_specs(cfg), is_leaf=spec.is_spec):
    dims = spec.muon_dims(s)
    if dims is None:
      continue
    a = math.prod(s.shape[i] for i in dims.reduction_axis)
    b = math.prod(s.shape[i] for i in dims.output_axis)
    batch = math.prod(s.shape) // (a * b)
    m, n = min(a, b), max(a, b)
    total += batch * ns_steps * (4.0 * m * m * n + 2.0 * m ** 3)
  return total


def _align(full_tree):
  """A callable giving `full_tree` restricted to the leaves an optax.partition keeps.

  Inside a partition, masked-out leaves arrive as MaskedNode; optax's Muon needs its
  dimension-number tree to have the same structure as the updates it sees.
  """
  def fn(updates):
    return jax.tree.map(lambda d, u: optax.MaskedNode() if isinstance(u, optax.MaskedNode)
                        else d, full_tree, updates, is_leaf=_is_dims)
  return fn


def scale_by_rms_match(weight_dimension_numbers, rms: float = 0.2):
  """u <- u * sqrt(max(fan_in, fan_out)) * rms, per matrix (Moonlight's consistent RMS).

  An orthogonal n x m matrix has RMS 1/sqrt(max(n, m)); this gives every Muon update the RMS
  `rms`, close to AdamW's typical 0.2-0.4, so AdamW learning rates and weight decay carry
  over (report 2.1, Algorithm 1 line 6). optax implements this only as a private helper of
  contrib.muon, not as a public transform, hence our own.

  Args:
    weight_dimension_numbers: a tree of MuonDimensionNumbers (None = leave the leaf alone),
      or a callable giving it from the updates (inside optax.partition).
    rms: the target update RMS.
  Returns:
    A stateless optax.GradientTransformation.
  """
  def update_fn(updates, state, params=None):
    del params
    dims = weight_dimension_numbers(updates) if callable(weight_dimension_numbers) \
        else weight_dimension_numbers

    def scale(u, d):
      if d is None or isinstance(u, optax.MaskedNode):
        return u
      ndim = u.ndim
      fan_in = math.prod(u.shape[a % ndim] for a in _as_tuple(d.reduction_axis))
      fan_out = math.prod(u.shape[a % ndim] for a in _as_tuple(d.output_axis))
      return u * (math.sqrt(max(fan_in, fan_out)) * rms)

    return jax.tree.map(scale, updates, dims, is_leaf=_is_dims), state

  return optax.GradientTransformation(optax.init_empty_state, update_fn)


def on_local_matrices(inner: optax.GradientTransformation, cfg) -> optax.GradientTransformation:
  """Run `inner` (optax's scale_by_muon) on the matrices each device holds, their work split
  over data ranks (ZeRO-1, report 2.4.2).

  A Muon stack W [L, E, n, m] (layers, experts, then the matrix) is split over the mesh on
  its batch dimensions: device d holds layers L_d (pipeline) and experts E_d (expert). Each
  update depends on its own matrix's gradient and momentum only,

      M[l, e] = mu M[l, e] + G[l, e],   O[l, e] = NewtonSchulz5(M[l, e]),

  so device d computes O[L_d, E_d] alone, and where data divides those |L_d| |E_d| matrices
  each data rank computes 1 / data of them: the share whose momentum ZeRO-1 keeps there
  (sharding_rules.opt_state_spec), so no momentum moves. The updates leave split so, and XLA
  all-gathers them over data where the parameters need them (ZeRO-1's gather of the step's
  result). Matrix dimensions split only to save memory (FSDP over `expert`) are gathered per
  local matrix, never the stack; where data divides no batch dimension, every data rank
  orthogonalizes all of its device's matrices.

  Why shard_map (`inner` per device on its local blocks, specs from
  sharding_rules.muon_work_spec) and not sharding constraints: optax's
  orthogonalize_via_newton_schulz merges the batch dimensions [L, E] into one before its
  vmap. A merged dimension keeps the split of its minor part (E over expert) only when the
  major part (L) is not held several to a device, as it is on a pipeline stage or without a
  pipeline; otherwise XLA's partitioner replicates the whole stack on every device
  ("Involuntary full rematerialization": a Newton-Schulz batch of every layer's and expert's
  matrices on each device). Inside shard_map the merge is of the local block, and optax's
  math runs unchanged.

  Without a mesh, or on one whose axes all have size 1, `inner` runs as it is: the
  single-device update, bit for bit.

  Args:
    inner: a transformation acting on each Muon matrix alone that ignores params, with a
      state whose `mu` mirrors the updates and whose other leaves are replicated
      (optax.contrib.scale_by_muon, scale_by_muon_in).
    cfg: the model config (the parameter table and the sharding rules place the work).
  Returns:
    `inner`, run where the matrices are.
  """
  masked = lambda x: isinstance(x, optax.MaskedNode)

  def update_fn(updates, state, params=None):
    del params
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or all(n == 1 for n in mesh.shape.values()):
      return inner.update(updates, state)
    work = jax.tree.map(lambda s: muon_work_spec(s.axes, s.shape, mesh, spec.muon_batch(s)),
                        param_specs(cfg), is_leaf=spec.is_spec)
    u_specs = jax.tree.map(lambda u, w: u if masked(u) else w, updates, work, is_leaf=masked)
    s_specs = jax.tree.map(lambda _: P(), state)._replace(mu=u_specs)
    run = jax.shard_map(lambda u, s: inner.update(u, s), mesh=mesh, in_specs=(u_specs, s_specs),
                        out_specs=(u_specs, s_specs))
    return run(updates, state)

  return optax.GradientTransformation(inner.init, update_fn)


def scale_by_muon_in(ns_dtype, *, ns_steps: int = 5, weight_dimension_numbers=None,
                     eps: float = 1e-8, **kwargs) -> optax.GradientTransformation:
  """optax.contrib.scale_by_muon with its Newton-Schulz iterations run in `ns_dtype`.

      U = M / (|M|_F + eps)                       (float32: momentum, bias correction)
      X_0 = U in ns_dtype;  X_{k+1} = a X_k + (b A + c A^2) X_k,  A = X_k X_k^T
      O = X_ns_steps in float32

  Moonlight's Muon, which K2's MuonClip builds on, runs the quintic iteration in bfloat16:
  on GPUs and TPUs its matmuls then run at the bf16 rate instead of float32's (TF32 on
  NVIDIA), and the iteration, which only has to bring singular values near 1, tolerates the
  rounding. optax iterates in its input's dtype and exposes no Newton-Schulz function, so
  this chains two of its scale_by_muon: one with ns_steps=0 (momentum, bias correction,
  normalisation; its state is the state, so checkpoints do not depend on ns_dtype), then,
  on the cast update, one with beta=0 and a fresh state, which is exactly Newton-Schulz of
  its input.

  Args:
    ns_dtype: the iteration's dtype (None or float32: scale_by_muon unchanged).
    ns_steps: optax.contrib.scale_by_muon's.
    weight_dimension_numbers: optax.contrib.scale_by_muon's.
    eps: optax.contrib.scale_by_muon's.
    **kwargs: passed to optax.contrib.scale_by_muon.
  """
  if ns_dtype is None or jnp.dtype(ns_dtype) == jnp.float32:
    return scale_by_muon(ns_steps=ns_steps, weight_dimension_numbers=weight_dimension_numbers,
                         eps=eps, **kwargs)
  inner = scale_by_muon(ns_steps=0, weight_dimension_numbers=weight_dimension_numbers,
                        eps=eps, **kwargs)
  orthogonalize = scale_by_muon(ns_steps=ns_steps, beta=0.0, nesterov=False, eps=eps,
                                weight_dimension_numbers=weight_dimension_numbers)

  def update_fn(updates, state, params=None):
    updates, state = inner.update(updates, state, params)
    low = jax.tree.map(lambda u: u.astype(ns_dtype), updates)
    out, _ = orthogonalize.update(low, orthogonalize.init(low))
    return jax.tree.map(lambda o, u: o.astype(u.dtype), out, updates), state

  return optax.GradientTransformation(inner.init, update_fn)


def _as_tuple(a):
  return (a,) if isinstance(a, int) else tuple(a)


def muon(cfg, learning_rate, *, weight_decay=0.1, momentum=0.95, nesterov=False,
         rms_scale=0.2, ns_steps=5, adam_b1=0.9, adam_b2=0.95, adam_eps=1e-8,
         adam_learning_rate=None, mu_dtype=None, ns_dtype=None) -> optax.GradientTransformation:
  """Muon on matrices + AdamW elsewhere + nothing for the router bias (report 2.1).

  For every Muon matrix W (each layer's and each expert's separately) with gradient G:

      M = mu M + G;  O = NewtonSchulz5(M) sqrt(max(n, m)) rms_scale;  W -= lr (O + wd W)

  AdamW (Moonlight recipe) trains the embedding, lm_head, router and norms (norms without
  weight decay); the router bias gets a zero update (it follows router_bias_balancing).

  Args:
    cfg: the model config.
    learning_rate: a float or an optax schedule, shared by both groups unless
      `adam_learning_rate` is given.
    weight_decay: decoupled and scaled by the learning rate, as in Algorithm 1.
    momentum: Muon's mu (optax.contrib.scale_by_muon).
    nesterov: Nesterov momentum.
    ns_steps: Newton-Schulz iterations.
    mu_dtype: the momentum's dtype.
    ns_dtype: the dtype Newton-Schulz iterates in (`scale_by_muon_in`; None: float32).
    rms_scale: update RMS after matching (scale_by_rms_match).
    adam_b1: the AdamW group's first-moment decay.
    adam_b2: its second-moment decay.
    adam_eps: its epsilon.
    adam_learning_rate: its learning rate (None: Muon's).
  Returns:
    An optax.GradientTransformation over the whole parameter tree.
  """
  dims = _align(dimension_numbers(cfg))
  muon_chain = optax.chain(
      on_local_matrices(
          scale_by_muon_in(ns_dtype, ns_steps=ns_steps, beta=momentum, nesterov=nesterov,
                           mu_dtype=mu_dtype, weight_dimension_numbers=dims), cfg),
      scale_by_rms_match(dims, rms_scale),
      optax.add_decayed_weights(weight_decay),
      optax.scale_by_learning_rate(learning_rate),
  )
  adam = _adamw(cfg, adam_learning_rate if adam_learning_rate is not None else learning_rate,
                adam_b1, adam_b2, adam_eps, weight_decay, mu_dtype)
  return optax.partition({"muon": muon_chain, "adamw": adam, "frozen": optax.set_to_zero()},
                         labels(cfg))


def _adamw(cfg, learning_rate, b1, b2, eps, weight_decay, mu_dtype):
  decay = jax.tree.map(lambda s: s.decay, param_specs(cfg), is_leaf=spec.is_spec)
  return optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay,
                     mu_dtype=mu_dtype, mask=_align(decay))


def adamw(cfg, learning_rate, *, weight_decay=0.1, b1=0.9, b2=0.95, eps=1e-8,
          mu_dtype=None) -> optax.GradientTransformation:
  """AdamW on every trained parameter of `cfg` (the baseline of report Fig. 2 / 3).

  Same treatment as `muon` of weight decay (none on norms) and of the router bias (zero
  update: it follows router_bias_balancing).

  Args:
    cfg: the model config.
    learning_rate: a float or an optax schedule.
    weight_decay: optax.adamw's.
    b1: optax.adamw's.
    b2: optax.adamw's.
    eps: optax.adamw's.
    mu_dtype: optax.adamw's.
  Returns:
    An optax.GradientTransformation over the whole parameter tree.
  """
  return _trained_only(cfg, _adamw(cfg, learning_rate, b1, b2, eps, weight_decay, mu_dtype))


def _trained_only(cfg, tx) -> optax.GradientTransformation:
  """tx on every trained parameter of `cfg`, a zero update on the frozen ones (the router
  bias, which follows router_bias_balancing)."""
  groups = jax.tree.map(lambda g: "frozen" if g == "frozen" else "train", labels(cfg))
  return optax.partition({"train": tx, "frozen": optax.set_to_zero()}, groups)


def sgd(cfg, learning_rate, *, momentum=None) -> optax.GradientTransformation:
  """Plain gradient descent on every trained parameter of `cfg`: u = -lr g (optax.sgd).

  The step is as large as the gradient. Muon (orthogonalized) and Adam (per-coordinate
  normalized) take a step of set size along whatever direction the gradient has; on a
  policy gradient from a few dozen samples, mostly noise, that is a full step of noise. The
  RL ablation (experiments/rl_arithmetic.py) compares them. The router bias gets a zero
  update, as in `muon` and `adamw`.

  Args:
    cfg: the model config.
    learning_rate: a float or an optax schedule.
    momentum: optax.sgd's (None: none).
  Returns:
    An optax.GradientTransformation over the whole parameter tree.
  """
  return _trained_only(cfg, optax.sgd(learning_rate, momentum))
