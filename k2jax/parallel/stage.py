"""One pipeline stage, one layer at a time: what each phase of the pipeline's tick loop
(k2jax.parallel.executor) runs on a device.

  forward / backward     a virtual stage's layers in order / in reverse, each layer's
                         weights read from the device's rows as it runs (`layer_at`) and its
                         weight gradients added to the float32 sums in place (`add_at`)
  layer_fn, Saved        one layer under the remat policy, and the vjp residuals a slot
                         keeps between its F and its B (the weights left out)
  split_layer            the layer's backward cut into B and W (zbh1; k2jax.parallel.bwsplit)
  pre, head              the embedding and dense layers stage 0 runs first, and the final
                         norm, vocabulary-parallel head and loss every device shares
  if_real                padding layers and idle phases skipped (or computed and dropped)

All of it runs inside the pipeline's shard_map (k2jax.parallel.pipeline), on this device's
rows [V, L, ...] of the stored stack (k2jax.parallel.layout).
"""

import math

import jax
import jax.numpy as jnp

from k2jax.configs.sharding_rules import constrain
from k2jax.model import transformer
from k2jax.model.embedding import embed
from k2jax.model.layers import rms_norm
from k2jax.model.remat import remat_policy
from k2jax.parallel import bwsplit
from k2jax.parallel.layout import Split

AXIS = "pipeline"   # the mesh axis the stages are spread over (the rule table's `stages`)


def layer_at(params, v, l):
  """Layer l of virtual stage v from a device's rows [V, L, ...]: a dynamic slice of the
  stack, which XLA fuses into its consumers or copies one layer at a time. Slicing the whole
  stage first (and scanning over the slice) made XLA:TPU copy the stage's weights in every
  phase and stack the stage's weight gradients in a bf16 buffer of the stage's size before
  adding them to the float32 sums: a quarter of the K2 step's peak."""
  return jax.tree.map(lambda a: a[v, l], params)


def add_at(g, v, l, grads, valid, idx=None):
  """The float32 sums g [V, L, ...] (a list of leaves, or a tree with `idx` None) with
  grads added at [v, l] where `valid` (leaves `idx` of g, in order, when given)."""
  add = lambda a, b: a.at[v, l].add(jnp.where(valid, b.astype(a.dtype), 0.0))
  if idx is None:
    return jax.tree.map(add, g, grads)
  g = list(g)
  for i, b in zip(idx, grads):
    g[i] = add(g[i], b)
  return g


def forward(layer, saved, res_avals, params, v, on, x, positions, segment_ids, weight,
                   skip_padding: bool, stats):
  """The F phase of virtual stage v: its layers one at a time (`layer_at`), padding rows
  (on [V, L] False) skipped (`skip_padding`) or computed and discarded. With `saved` (a
  Saved) each layer's vjp residuals are kept, stacked [L, ...] (one layer's: `res_avals`,
  traced here where None).
  stats: (heads, expert-load width) of the padding rows' statistics.
  -> ((y, weighted aux-loss sum), (max logits [L, H], expert load [L, E]), residuals)."""
  H, n_load = stats
  if saved is not None and res_avals is None:
    res_avals = layer_residuals(layer, Saved(), layer_at(params, 0, 0), x, positions,
                                 segment_ids, weight)

  def body(x, l):
    pl = layer_at(params, v, l)

    def real(x):
      if saved is None:
        (y, aux), (ml, load) = layer(pl, x, positions, segment_ids, weight)
        return y, aux, ml, load, []
      (y, aux), (ml, load), res = saved.vjp(
          lambda a, b: layer(a, b, positions, segment_ids, weight), pl, x, has_aux=True)
      return y, aux, ml, load, res

    def pad(x):
      return (x, jnp.zeros((), jnp.float32), jnp.full((H,), -jnp.inf, jnp.float32),
              jnp.zeros((n_load,), jnp.float32), zeros(res_avals) if saved else [])
    y, aux, ml, load, res = if_real(on[v, l], real, pad, skip_padding, x)
    return y, (aux, ml, load, res)
  y, (aux, ml, load, res) = jax.lax.scan(body, x, jnp.arange(on.shape[1]))
  return (y, jnp.sum(aux)), (ml, load), res


def backward(saved, params, v, on, res, dy, g, valid, skip_padding: bool, active=None):
  """The B phase of virtual stage v (schedules that do not split W): layer by layer from
  the last, each one's vjp from its weights (`layer_at`) and stored residuals (res [L,
  ...]); its weight gradients go into the float32 sums g [V, L, ...] at [v, l] where
  `valid`, in the loop, so no stage-sized gradient exists. `active`: whether the phase
  runs (`if_real`): each layer's work is its own cond and the sums stay outside every
  cond (a cond's output is a buffer of its own on XLA:TPU: the sums passed through the
  phase's cond would be a second copy of them). -> (dx, g)."""
  def body(carry, xs):
    dy, g = carry
    l, r = xs
    pl = layer_at(params, v, l)

    def real(dy):
      gp, dx = saved.vjp_of(pl, r)((dy, jnp.ones((), jnp.float32)))
      return dx.astype(dy.dtype), gp

    def pad(dy):
      return dy, jax.tree.map(jnp.zeros_like, pl)
    dx, gp = if_real(on[v, l], real, pad, skip_padding, dy, active=active)
    return (dx, add_at(g, v, l, gp, valid)), None
  (dx, g), _ = jax.lax.scan(body, (dy, g), (jnp.arange(on.shape[1]), res), reverse=True)
  return dx, g


def layer_residuals(layer, saved, weights, x, positions, segment_ids, weight):
  """The avals of what one layer's F keeps for its backward (`saved`'s stored leaves)."""
  return jax.eval_shape(lambda pl, x: saved.vjp(
      lambda a, b: layer(a, b, positions, segment_ids, weight), pl, x, has_aux=True)[2],
      weights, x)


def layer_fn(cfg, ffn):
  """One real layer of a stage, the unit every phase works on (its vjp; zbh1 cuts its
  backward with k2jax.parallel.bwsplit): (p, x, positions, segment_ids, aux weight) ->
  ((y, weighted aux loss), (max logits [H], expert load [E])), under the remat policy."""
  def layer(p, x, positions, segment_ids, weight):
    y, (ml, ms) = transformer._block(cfg, ffn, x, p, positions, segment_ids)
    if ffn != "moe":
      return (y, jnp.zeros((), jnp.float32)), (ml, jnp.zeros((0,), jnp.float32))
    return (y, ms.aux_loss * weight), (ml, ms.expert_load)
  policy = remat_policy(cfg.remat, cfg.offload)
  if policy is not None:
    layer = jax.checkpoint(layer, policy=policy, prevent_cse=False)
  return layer


class Saved:
  """jax.vjp for a schedule that stores the residuals between a stage's F and its B / W.

  A vjp function is a pytree whose leaves are its residuals. Those that are the weights
  being differentiated are not copied into the schedule's buffers: `vjp` returns the others
  and remembers where each leaf came from, `vjp_of` puts the weights back. One instance per
  differentiated function (the tree is the same for every microbatch)."""

  def __init__(self):
    self.tree, self.source = None, None

  def vjp(self, fn, weights, *args, has_aux=False):
    """jax.vjp(fn, weights, *args) -> (out, stored leaves), or (out, aux, stored leaves)."""
    out, fun, *aux = jax.vjp(fn, weights, *args, has_aux=has_aux)
    leaves, self.tree = jax.tree.flatten(fun)
    ids = {id(w): i for i, w in enumerate(jax.tree.leaves(weights))}
    self.source = [ids.get(id(a)) for a in leaves]      # index into the weights, or None
    return (out, *aux, [a for a in leaves if id(a) not in ids])

  def vjp_of(self, weights, stored):
    """The vjp function again, from the weights and what `vjp` returned to store."""
    it, w = iter(stored), jax.tree.leaves(weights)
    return jax.tree.unflatten(self.tree, [next(it) if s is None else w[s] for s in self.source])


def nbytes(a) -> int:
  return math.prod(a.shape) * jnp.dtype(a.dtype).itemsize


def _split_fn(saved: Saved, weights, n_res: int, n_ct: int):
  """The backward of a `saved` vjp as bwsplit.split wants it: flat (weights, stored
  residuals, output cotangents) -> weight-gradient leaves + input-gradient leaves."""
  n_w = len(jax.tree.leaves(weights))
  tree = jax.tree.structure(weights)

  def bwd(*ins):
    w, r, ct = ins[:n_w], ins[n_w:n_w + n_res], ins[n_w + n_res:]
    g_w, *g_in = saved.vjp_of(jax.tree.unflatten(tree, w), r)(ct[0] if n_ct == 1 else tuple(ct))
    return jax.tree.leaves(g_w) + jax.tree.leaves(g_in)
  return bwd


def split_layer(cfg, ffn, weights, x, positions, segment_ids, weight):
  """One pipelined layer (`layer_fn`) with its backward cut by k2jax.parallel.bwsplit,
  traced at the shapes of `weights` and `x` -> (the layer, the Saved its forward uses,
  its stored residuals' shapes, the Split). The cotangents are (dy, d aux loss)."""
  layer, saved = layer_fn(cfg, ffn), Saved()
  res = layer_residuals(layer, saved, weights, x, positions, segment_ids, weight)
  w = jax.tree.leaves(weights)
  one = jax.ShapeDtypeStruct((), jnp.float32)
  cut = bwsplit.split(_split_fn(saved, weights, len(res), 2), len(w), len(w) + len(res),
                      *w, *res, x, one)
  return layer, saved, res, cut


def head(cfg, hp, y, targets, loss_mask, grads: bool):
  """Final norm, head and summed cross entropy of one microbatch, the vocabulary split over
  the pipeline devices (inside shard_map; Megatron's vocabulary-parallel cross entropy, on
  the pipeline axis). Device p holds columns `[p V_p, (p + 1) V_p)` of the head (`hp["lm_head"]`
  `[D, V_p]`; columns past the vocabulary, padding, are masked) and every device gets the last
  stage's output y. With z = h W_p (f32) and t the target:

      lse = m + log psum_p sum_j exp(z_j - m),   m = pmax_p max_j z_j
      ce  = sum over tokens of mask (lse - psum_p z_t)
      dz  = mask (softmax(z) - onehot(t))        on the device's own columns
      dh  = psum_p dz W_p^T,   dW_p = h^T dz     (the head's weight gradient stays local)

  so a device does 1 / P of the head's matmuls, the lockstep tick that runs the head no
  longer waits on one device doing all of them (idle at K2 16 x 2 x 32: 21.9% -> 19.8% by
  stage FLOPs), and its weights and their gradient are split, not summed over the pipeline.
  The gradient is written out, not taken with jax.grad through the psums (whose transpose
  under shard_map without replication checking is not what this needs). dz is cast to the
  compute dtype for the two backward matmuls (f32 accumulation; dh summed in f32), as a
  bf16 head's backward does.

  dh is wanted only by the last stage's B, and the final norm's backward works token by
  token: so the psum of dh is a reduce-scatter over the tokens (f32), each device runs the
  norm's backward on its 1 / P of them (the norm's gain gradient: this device's tokens'
  share, summed over the pipeline with the other gradients), and the stage's cotangent dy
  is all-gathered in the compute dtype: 6 bytes a value cross the ring where the f32
  all-reduce of dh moved 8 (K2: 4,096 tokens a microbatch, P 16, 220 -> 165 MB a device a
  head tick, beside the 110 of y's bf16 psum). Where P does not divide the microbatch's
  tokens, dh is all-reduced as before.
  -> ce, or (ce, dy, {"final_norm": g, "lm_head": g_p}) with `grads` (g: this device's
  tokens' share where `scatters_dh`, else the whole: then only one device's may count)."""
  dt, f32 = jnp.dtype(cfg.dtype), jnp.float32
  w = hp["lm_head"].astype(dt)
  vp = w.shape[1]
  lo = jax.lax.axis_index(AXIS) * vp
  Pn, (b, t, d) = jax.lax.axis_size(AXIS), y.shape
  norm = lambda y, g: rms_norm(y, g, cfg.rms_norm_eps)
  if grads and not scatters_dh(b * t, Pn):
    h, norm_vjp = jax.vjp(norm, y, hp["final_norm"])
  else:     # the norm's backward, if any, runs on this device's tokens only (below)
    h = norm(y, hp["final_norm"])
  z = jnp.einsum("btd,dv->btv", h, w, preferred_element_type=f32)
  col = lo + jnp.arange(vp)
  z = jnp.where(col < cfg.vocab_size, z, -jnp.inf)
  m = jax.lax.pmax(jnp.max(z, axis=-1), AXIS)
  lse = m + jnp.log(jax.lax.psum(jnp.sum(jnp.exp(z - m[..., None]), axis=-1), AXIS))
  local = targets - lo
  mine = (local >= 0) & (local < vp)
  zt = jnp.take_along_axis(z, jnp.clip(local, 0, vp - 1)[..., None], axis=-1)[..., 0]
  zt = jax.lax.psum(jnp.where(mine, zt, 0.0), AXIS)
  mask = loss_mask.astype(f32)
  ce = jnp.sum((lse - zt) * mask)
  if not grads:
    return ce
  onehot = jax.nn.one_hot(jnp.where(mine, local, -1), vp, dtype=f32)
  dz = ((jnp.exp(z - lse[..., None]) - onehot) * mask[..., None]).astype(dt)
  dh = jnp.einsum("btv,dv->btd", dz, w, preferred_element_type=f32)   # this device's columns'
  g_w = jnp.einsum("btd,btv->dv", h, dz, preferred_element_type=f32)
  if not scatters_dh(b * t, Pn):
    dy, g_norm = norm_vjp(jax.lax.psum(dh, AXIS).astype(h.dtype))
    return ce, dy, {"final_norm": g_norm.astype(f32), "lm_head": g_w}
  n = b * t // Pn
  dh = jax.lax.psum_scatter(dh.reshape(b * t, d), AXIS, scatter_dimension=0, tiled=True)
  y_mine = jax.lax.dynamic_slice_in_dim(y.reshape(b * t, d), jax.lax.axis_index(AXIS) * n, n)
  _, norm_vjp = jax.vjp(norm, y_mine, hp["final_norm"])
  dy, g_norm = norm_vjp(dh.astype(h.dtype))
  dy = jax.lax.all_gather(dy.astype(dt), AXIS, axis=0, tiled=True).reshape(b, t, d)
  return ce, dy, {"final_norm": g_norm.astype(f32), "lm_head": g_w}


def scatters_dh(tokens: int, P: int) -> bool:
  """Whether `head` reduce-scatters the head's dh over a microbatch's `tokens` (P divides
  them: each device's norm gradient is then its tokens' share) or all-reduces it (each
  device's is the whole)."""
  return tokens % P == 0


def pre(cfg, sp: Split, params, inputs, positions, segment_ids):
  """Embedding and the leading (dense) stacks of one microbatch -> (stage-0 input, their
  max logits [dense layers, H])."""
  # each row read on, and its gradient sent to, the expert shard holding it (embedding.py: XLA
  # gathered the whole table for the forward and the whole microbatch's cotangents for the
  # backward on every device)
  x = embed(params["embed"], inputs, cfg.dtype, vocab=cfg.vocab_size)
  x = constrain(x, ("batch", "length", "embed"))
  pre_max = [jnp.full((0, cfg.num_attention_heads), -jnp.inf, jnp.float32)]
  for st in transformer.stacks(cfg):
    if st == sp.stack:
      break
    x, (ml, _) = transformer._run_stack(cfg, st.ffn, params[st.name], x, positions,
                                        segment_ids)
    pre_max.append(ml)
  return x, jnp.concatenate(pre_max, axis=0)


def where(c, a, b):
  return jax.tree.map(lambda u, w: jnp.where(c, u, w), a, b)


def if_real(on, real, pad, skip_padding: bool, *operands, active=None):
  """real(*operands) for a real layer of a phase that runs, pad(*operands) for a padding row
  or an idle phase (`active` False; None: always active): skipped with a lax.cond
  (`skip_padding`, per device: `active` is the device's own) or both computed and one kept
  inside a cond on the tick's `active` (CPU's per-tick mode, module docstring)."""
  if skip_padding:
    return jax.lax.cond(on if active is None else on & active, real, pad, *operands)
  both = lambda *o: where(on, real(*o), pad(*o))
  return both(*operands) if active is None else jax.lax.cond(active, both, pad, *operands)


def zeros(avals):
  """Zeros shaped like a tree of arrays / ShapeDtypeStructs."""
  return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), avals)
