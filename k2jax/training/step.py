"""One training step and one eval step, as pure functions to jit.

A train step is forward, backward, update, gate:

    grads, loss, stats = mean over microbatches of d(token loss)/d(params)   (forward, backward)
    updates = tx.update(grads, ..., max_logits=stats.max_logits,            (update: MuonClip
                        expert_load=stats.expert_load)                        + balancing)
    keep the new params and optimizer state only if loss and grads are finite (gate)

Skipped (non-finite) steps leave params and optimizer moments as they were but still advance
optax's step counters, so the schedule has one clock: the trainer's step.
"""

from typing import NamedTuple

import functools

import jax
import jax.numpy as jnp
import optax

from k2jax import model, optim, parallel
from k2jax.model import spec
from k2jax.optim import load_imbalance
from k2jax.parallel import layout, pipeline


class TrainState(NamedTuple):
  step: jax.Array          # int32: steps taken (skipped steps included) = optax's counts
  params: dict
  opt_state: optax.OptState
  nan_streak: jax.Array    # int32: consecutive non-finite steps so far
  skipped: jax.Array       # int32: non-finite steps skipped in total


def fresh_state(tx, params) -> TrainState:
  """Step 0 of training `params` with `tx`."""
  zero = jnp.zeros((), jnp.int32)
  return TrainState(zero, params, tx.init(params), zero, zero)


def init_state(cfg, tx, rng) -> TrainState:
  return fresh_state(tx, model.init(cfg.model, rng))


def lm_loss(mcfg, params, batch):
  """Summed next-token cross entropy over unmasked targets, its token count, and stats."""
  logits, aux = model.forward(mcfg, params, batch["inputs"], positions=batch["positions"],
                              segment_ids=batch["segment_ids"])
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
  mask = batch["loss_mask"].astype(jnp.float32)
  return jnp.sum(ce * mask), jnp.sum(mask), aux


def microbatches(batch, n: int):
  """[B, ...] arrays -> [n, B / n, ...]: microbatch i takes rows i, i + n, i + 2n, ...

  The batch is sharded over devices in contiguous blocks of rows, so a strided split gives
  every microbatch rows on every device (a contiguous split would leave devices idle); with
  B divisible by n x devices this is a local reshape, no communication.
  """
  return jax.tree.map(lambda x: jnp.swapaxes(x.reshape((x.shape[0] // n, n) + x.shape[1:]), 0, 1),
                      batch)


def _pipelined_grads(mcfg, params, batch, tab, skip=None, reduce_to=None):
  """_grads with the microbatches flowing through pipeline stages as schedule table `tab`
  says (k2jax.parallel.pipeline); params, grads and per-layer statistics in the stored
  layout (k2jax.parallel.layout)."""
  ce_sum, n, _, aux, g = pipeline.loss_and_grads(mcfg, params, microbatches(batch, tab.M), tab,
                                                 skip, reduce_to)
  n = jnp.maximum(n, 1.0)
  return jax.tree.map(lambda x: (x / n).astype(jnp.float32), g), ce_sum / n, aux


def differentiated(config, params):
  """The parameters the step differentiates (`config` the full config): with train.cast_once,
  several microbatches and no pipeline, the leaves the forward reads in model.dtype cast
  once per step (model.spec.cast_once; a no-op where they are stored in model.dtype),
  instead of inside every microbatch's forward and again in its recomputation: the same
  gradients, (grad_accum - 1) x 2 fewer passes over the weights (read float32, write bf16),
  and the per-microbatch weight gradients reach the float32 accumulator in model.dtype.
  Costs one model.dtype copy of those weights for the step; plan counts it from here.
  Else `params` as stored (a pipeline step has its own layout path)."""
  t = config.train
  if _pipelined(config) or not t.get("cast_once", True) or t.grad_accum <= 1:
    return params
  return spec.cast_once(model.param_specs(config.model), params, config.model.dtype)


def _grads(mcfg, params, batch, grad_accum, tab=None, skip=None, reduce_to=None):
  """Gradients of mean token loss (+ aux loss), accumulated over microbatches in float32
  (report 2.4.2's fp32 gradient buffer, whatever the parameters' dtype).

  -> (grads, mean loss, ForwardStats: max_logits maxed and expert_load summed over
  microbatches). Accumulator shapes come from the config, not from a trial forward pass.
  With a pipeline schedule table `tab` the microbatches run through the pipeline instead.
  `params` may hold leaves already cast to model.dtype (`differentiated`); gradients still
  accumulate in float32. reduce_to: the gradients' shardings (parallel.grad_shardings), or
  None.
  """
  if tab is not None:
    return _pipelined_grads(mcfg, params, batch, tab, skip, reduce_to)
  # The objective is  ce_sum / N + aux,  N the batch's loss tokens and aux the mean over
  # its sequences of the sequence-wise balance loss, however the batch is split: each of
  # the A microbatches (equal numbers of sequences) adds its aux, a mean over its own
  # sequences, times N / A (times its own token count would weight sequences by how many
  # loss tokens their microbatch happens to have, and change the router's gradient with A).
  weight = jnp.sum(batch["loss_mask"].astype(jnp.float32)) / grad_accum

  def micro(mb):
    def f(p):
      ce_sum, n, aux = lm_loss(mcfg, p, mb)
      return ce_sum + aux.aux_loss * weight, (ce_sum, n, aux)
    return jax.grad(f, has_aux=True)(params)

  if grad_accum == 1:
    g, (ce_sum, n, aux) = micro(batch)
  else:
    def body(acc, mb):
      g, (ce_sum, n, aux) = micro(mb)
      acc_g, acc_ce, acc_n, acc_stats = acc
      stats = model.ForwardStats(max_logits=jnp.maximum(acc_stats.max_logits, aux.max_logits),
                                 expert_load=acc_stats.expert_load + aux.expert_load,
                                 aux_loss=acc_stats.aux_loss + aux.aux_loss * weight)
      return (jax.tree.map(lambda a, b: a + b.astype(jnp.float32), acc_g, g), acc_ce + ce_sum,
              acc_n + n, stats), None

    n_moe = sum(s.size for s in model.stacks(mcfg) if s.ffn == "moe")
    zero = jnp.zeros((), jnp.float32)
    init = (jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params), zero, zero,
            model.ForwardStats(
                max_logits=jnp.full((mcfg.num_hidden_layers, mcfg.num_attention_heads),
                                    -jnp.inf, jnp.float32),
                expert_load=jnp.zeros((n_moe, mcfg.n_routed_experts), jnp.float32),
                aux_loss=zero))
    (g, ce_sum, n, aux), _ = jax.lax.scan(body, init, microbatches(batch, grad_accum))
    aux = aux._replace(aux_loss=aux.aux_loss / jnp.maximum(n, 1.0))
  n = jnp.maximum(n, 1.0)
  return jax.tree.map(lambda x: (x / n).astype(jnp.float32), g), ce_sum / n, aux


def _is_count(path) -> bool:
  return bool(path) and getattr(path[-1], "name", None) == "count"


def _gate(finite, new_state, old_state):
  """new where the step was finite, else old, except optax's step counters, which always
  advance (one clock for every schedule in the chain, whatever was skipped)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, new, old: new if _is_count(path) else jnp.where(finite, new, old),
      new_state, old_state)


def _pipelined(config) -> bool:
  return config.mesh.pipeline > 1


def _table(config):
  return pipeline.table(config) if _pipelined(config) else None


def on_device(ocfg, opt_state, shardings=None):
  """The optimizer state in device memory, for the update. With `optimizer.host_state` its
  ZeRO-1 leaves live in host memory between steps (parallel.state_shardings) and come to the
  device only here; the step's output shardings send the new ones back.

  shardings: the state's own (`parallel.state_shardings(...).opt_state`): given, each leaf
  arrives split as it is stored (`split_as_stored`)."""
  if not ocfg.get("host_state", False):
    return opt_state
  return split_as_stored(ocfg, jax.device_put(opt_state, jax.memory.Space.Device), shardings)


def split_as_stored(ocfg, opt_state, shardings):
  """With `optimizer.host_state`, `opt_state` (in device memory) constrained to its stored
  `shardings`; otherwise, or with shardings None, unchanged. The step applies it to the old
  states as they arrive (on_device) and to the new ones before they leave.

  With host states, what reshapes a state's split (Muon gathers a matrix that ZeRO-1 split
  over data; the update's result comes out split as the work was) must do it on the device,
  between the host transfers and not across them. Left free, XLA takes the split the
  gather wants back through the transfer (or the one the output wants forward), and
  XLA:TPU then runs the all-gather on the host (its host offloader's "HostExecute": a host
  network collective and a host heap of float32 states; sizes in
  experiments/results/compile/compile_tpu.csv)."""
  if shardings is None or not ocfg.get("host_state", False):
    return opt_state
  return jax.lax.with_sharding_constraint(
      opt_state, jax.tree.map(lambda s: s.with_memory_kind("device"), shardings))


def train_step(config, tx, schedule, state: TrainState, batch, grad_shardings=None,
               opt_shardings=None):
  """-> (new state, metrics). `config` is the full config (model, optimizer, train, mesh);
  with a pipeline, `state` is in the stored layout (k2jax.parallel.layout) and `tx` was
  built for it (`optim.optimizer(layout.stored_config(config))`). grad_shardings: where
  the gradients are reduced to for the update (`parallel.grad_shardings`: ZeRO-1's slices;
  None leaves it to XLA, which all-reduces them whole). opt_shardings: the optimizer
  state's as stored (`parallel.state_shardings(...).opt_state`); with host states the
  update keeps them on the device side of the transfers (`split_as_stored`)."""
  mcfg, ocfg = config.model, config.optimizer
  grads, loss, aux = _grads(mcfg, differentiated(config, state.params), batch,
                            config.train.grad_accum, _table(config), pipeline.skip_of(config),
                            grad_shardings)
  if grad_shardings is not None:
    grads = jax.lax.with_sharding_constraint(grads, grad_shardings)
  grad_norm = optax.global_norm(grads)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  old_opt = on_device(ocfg, state.opt_state, opt_shardings)
  updates, opt_state = tx.update(grads, old_opt, state.params,
                                 max_logits=aux.max_logits, expert_load=aux.expert_load)
  opt_state = split_as_stored(ocfg, _gate(finite, opt_state, old_opt), opt_shardings)
  if isinstance(opt_state, optim.MasterWeightsState):
    # bf16 params are their float32 master's rounding (optim.master: what apply_updates gives
    # up to f32 rounding of p + (w' - p)); a skipped step keeps the old master, whose
    # rounding is the old params as long as params were made from it (init_state, tx.init
    # of loaded params, every step since). Taken from the master, the old params are not
    # read after the gradient loop, and XLA:TPU need not hold a float32 update tree and the
    # old params beside the new ones, which lowers the update's peak (the step with host
    # states: experiments/results/compile/compile_tpu.csv)
    params = jax.tree.map(lambda w, p: w.astype(p.dtype), opt_state.master, state.params)
  else:
    params = _gate(finite, optax.apply_updates(state.params, updates), state.params)
  nan_streak = jnp.where(finite, 0, state.nan_streak + 1)
  new_state = TrainState(
      step=state.step + 1,
      params=params,
      opt_state=opt_state,
      nan_streak=nan_streak,
      skipped=state.skipped + (~finite).astype(jnp.int32))
  sp = layout.of(config)
  max_logits, expert_load = layout.stats_to_logical(sp, aux.max_logits, aux.expert_load)
  ever = optax.tree_utils.tree_get(opt_state, "ever_clipped")  # None without QK-Clip
  if ever is not None and sp is not None:
    ever = layout.layer_rows(sp, ever, layout.to_logical)
  metrics = {
      "loss": loss,
      "grad_norm": grad_norm,
      "learning_rate": schedule(state.step),   # the rate optax applied: its count == step
      "max_logit": jnp.max(max_logits),
      "max_logits_per_layer": jnp.max(max_logits, axis=-1),
      "clipped_heads": (jnp.sum(max_logits > ocfg.tau) if ever is not None
                        else jnp.zeros((), jnp.int32)),
      "clipped_heads_ever_frac": (jnp.mean(ever.astype(jnp.float32)) if ever is not None
                                  else jnp.zeros(())),
      "expert_load_imbalance": (jnp.mean(load_imbalance(expert_load))
                                if expert_load.size else jnp.ones(())),
      "finite": finite,
      "nan_streak": nan_streak,
  }
  return new_state, metrics


def eval_step(config, params, batch):
  """-> (summed cross entropy, token count) of one batch (through the pipeline's forward
  phases when there is one: params in the stored layout never move)."""
  tab = _table(config)
  if tab is not None:
    ce_sum, n, _, _ = pipeline.loss(config.model, params, microbatches(batch, tab.M), tab,
                                    pipeline.skip_of(config))
    return ce_sum, n
  ce_sum, n, _ = lm_loss(config.model, params, batch)
  return ce_sum, n


BATCH_KEYS = {"inputs": jnp.int32, "targets": jnp.int32, "positions": jnp.int32,
              "segment_ids": jnp.int32, "loss_mask": jnp.float32}


class Program(NamedTuple):
  """The jitted train step as `k2jax.train` runs it, with everything needed to call, lower
  or compile it (`k2jax.compile` compiles exactly this for a TPU topology)."""
  step: object             # jax.jit(train_step): (TrainState, batch) -> (TrainState, metrics)
  tx: object               # the optimizer for the stored layout
  schedule: object         # the learning-rate schedule (metrics' learning_rate)
  abstract: TrainState     # ShapeDtypeStructs of the stored train state
  shardings: TrainState    # NamedShardings of it (parallel.state_shardings)
  batch_sharding: object   # NamedSharding of every batch array

  def abstract_args(self, config):
    """(state, batch) as ShapeDtypeStructs with their shardings: what `step` is called
    with, for `step.trace(*args).lower()` on devices that need not exist."""
    t = config.train
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                         self.abstract, self.shardings)
    batch = {k: jax.ShapeDtypeStruct((t.batch_size, t.seq_len), dt,
                                     sharding=self.batch_sharding)
             for k, dt in BATCH_KEYS.items()}
    return state, batch


def program(config, mesh) -> Program:
  """The train step of `config` (a full config) jitted for `mesh`: the state in the stored
  layout with `parallel.state_shardings` in and out (donated), the batch split by
  `parallel.batch_sharding`, metrics replicated. The one place the trainer's jit arguments
  are written, so that a compile for another machine (k2jax.compile) is the trainer's."""
  stored = layout.stored_config(config)
  tx = optim.optimizer(stored)
  schedule = optim.learning_rate_schedule(config)
  # the key is made inside: nothing runs, even where the mesh's devices cannot
  abstract = jax.eval_shape(lambda: init_state(stored, tx, jax.random.key(config.train.seed)))
  specs = model.param_specs(stored.model)
  shardings = parallel.state_shardings(specs, mesh, abstract, tx,
                                       host_state=config.optimizer.host_state)
  grads = parallel.grad_shardings(specs, mesh, abstract.params)
  t = config.train
  batch_sharding = parallel.batch_sharding(mesh, t.batch_size, t.grad_accum)
  step = jax.jit(functools.partial(train_step, config, tx, schedule, grad_shardings=grads,
                                   opt_shardings=shardings.opt_state),
                 donate_argnums=0,
                 in_shardings=(shardings, batch_sharding),
                 out_shardings=(shardings, parallel.replicated(mesh)))
  return Program(step, tx, schedule, abstract, shardings, batch_sharding)
