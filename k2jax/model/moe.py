"""Ultra-sparse MoE (report 2.3: 384 experts, 8 active + 1 shared) with DeepSeek-V3 routing.

Router (noaux_tc): scores s = sigmoid(x Wg) in float32. Experts are SELECTED by the biased
score s + b (b: per-expert correction bias, updated by the balancing rule in
`k2jax.model.balance`, never by gradients), optionally limited to the `topk_group` best
groups when n_group > 1. The chosen experts are COMBINED with the unbiased scores,
normalised to sum to one, times routed_scaling_factor:

    y = sum_{i in topk(s + b)} (s_i / sum_j s_j) * rsf * expert_i(x) + shared(x)

Dispatch is dropless: `k2jax.kernels.routed_experts` (model.moe_impl: fused Pallas kernels on
GPU, padded expert blocks (the CPU default), sorted grouped matmuls, capacity buffers, or the dense reference that
runs every expert on every token); with expert parallelism the rows travel to their expert's shard
first (k2jax.model.expert_parallel).
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from k2jax.configs import sharding_rules as rules
from k2jax.kernels import moe as moe_kernels, routed_experts
from k2jax.model import context, spec
from k2jax.model.expert_parallel import sharded_routed_experts
from k2jax.model.layers import mlp, mlp_specs


def moe_specs(cfg):
  d, E, f = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
  s = {
      # The router is small and trained with AdamW (Moonlight recipe); "router" is its own
      # logical axis so expert sharding does not split it. Both are read in float32 (route).
      "router": spec.ParamSpec(shape=(d, E), axes=("embed", "router"), group="adamw",
                               cast=False),
      "router_bias": spec.ParamSpec(shape=(E,), axes=("router",), init="zeros", group="frozen",
                                    n_in=0, decay=False, cast=False),
      "experts": {"gate": spec.matrix((E, d, f), ("experts", "embed", "mlp")),
                  "up": spec.matrix((E, d, f), ("experts", "embed", "mlp")),
                  "down": spec.matrix((E, f, d), ("experts", "mlp", "embed"))},
  }
  if cfg.get("moe_impl", "auto") in moe_kernels.SUM_BEFORE_CAST:   # see there
    s["experts"] = {k: v._replace(cast=False) for k, v in s["experts"].items()}
  if cfg.n_shared_experts:
    s["shared"] = mlp_specs(d, f * cfg.n_shared_experts)
  return s


def route(cfg, p, x):
  """x [N, d] -> (combine weights [N, k] f32, expert ids [N, k] int32, scores [N, E] f32)."""
  logits = x.astype(jnp.float32) @ p["router"].astype(jnp.float32)
  scores = jax.nn.sigmoid(logits)
  biased = scores + jax.lax.stop_gradient(p["router_bias"].astype(jnp.float32))
  G = cfg.n_group
  if G > 1:  # group-limited routing: keep the topk_group groups with the best top-2 sums
    grouped = biased.reshape(biased.shape[0], G, -1)
    group_score = jax.lax.top_k(grouped, 2)[0].sum(-1)                   # [N, G]
    _, keep = jax.lax.top_k(group_score, cfg.topk_group)
    group_mask = jnp.zeros_like(group_score, bool).at[
        jnp.arange(keep.shape[0])[:, None], keep].set(True)
    biased = jnp.where(group_mask[:, :, None], grouped, -jnp.inf).reshape(biased.shape)
  _, idx = jax.lax.top_k(biased, cfg.num_experts_per_tok)
  w = jnp.take_along_axis(scores, idx, axis=-1)
  if cfg.norm_topk_prob:
    w = w / (w.sum(-1, keepdims=True) + 1e-20)
  return w * cfg.routed_scaling_factor, idx, scores


def balance_loss(scores, idx, num_experts, batch, valid=None, context_axes=()):
  """DeepSeek-V3's complementary sequence-wise balance loss (without its alpha).

  Per sequence over its T' valid (non-padding) tokens: f_i = E / (k T') * #tokens routed to i,
  P_i = mean_t s_{i,t} / sum_j s_{j,t}; loss = mean over sequences of sum_i f_i P_i (1 when
  perfectly balanced). scores [N, E] and idx [N, k] hold `batch` rows of N / batch tokens;
  valid [N] bool (None = all tokens count). Inside a shard_map whose `context_axes` split each
  sequence's tokens (k2jax.model.context), the per-sequence sums are summed over them first:
  a sequence's loss is its whole one, whatever the split.
  """
  N, k = idx.shape
  v = (jnp.ones((N,), jnp.float32) if valid is None else valid.astype(jnp.float32))
  v = v.reshape(batch, -1, 1)                                           # [B, T, 1]
  whole = (lambda a: jax.lax.psum(a, context_axes)) if context_axes else (lambda a: a)
  n = jnp.maximum(whole(v.sum(1)), 1.0)                                 # [B, 1]
  counts = jax.nn.one_hot(idx, num_experts, dtype=jnp.float32).sum(1).reshape(batch, -1,
                                                                           num_experts)
  f = whole((counts * v).sum(1)) * num_experts / (k * n)                # [B, E]
  probs = (scores / scores.sum(-1, keepdims=True)).reshape(batch, -1, num_experts)
  P = whole((probs * v).sum(1)) / n                                     # [B, E]
  return jnp.mean(jnp.sum(jax.lax.stop_gradient(f) * P, -1))


class MoEStats(NamedTuple):
  expert_load: jax.Array  # f32 [E]: valid (non-padding) tokens routed to each expert
  aux_loss: jax.Array     # f32 scalar: aux_loss_alpha * balance_loss (0 when alpha = 0)


def _routed(cfg, batch_axes: tuple, ep_axis, sync_axes: tuple, p, x, valid,
            context_axes: tuple = ()):
  """Router + routed experts on (this shard's) tokens x [B, T, d] -> (y, MoEStats).
  sync_axes: the other mesh axes whose devices take the exchange's branch together;
  context_axes: those splitting each sequence's tokens (also among batch_axes)."""
  B, T, d = x.shape
  x2d = x.reshape(B * T, d)
  w, idx, scores = route(cfg, p, x2d)
  if ep_axis:
    y = sharded_routed_experts(p["experts"], x2d, idx, w, ep_axis, sync_axes=sync_axes,
                           transport=cfg.ep_transport,
                           fp8_storage=cfg.activation_storage == "fp8",
                           round_load=cfg.get("ep_round_load", 2.0), valid=valid.reshape(-1))
  else:
    e = p["experts"]
    y = routed_experts(x2d, idx, w, e["gate"], e["up"], e["down"], impl=cfg.moe_impl,
                       fp8_storage=cfg.activation_storage == "fp8")
  k = cfg.num_experts_per_tok
  weights = jnp.repeat(valid.reshape(-1), k).astype(jnp.float32)
  load = jnp.zeros((cfg.n_routed_experts,), jnp.float32).at[idx.reshape(-1)].add(weights)
  aux = (cfg.aux_loss_alpha * balance_loss(scores, idx, cfg.n_routed_experts, B,
                                           valid.reshape(-1), context_axes)
         if cfg.aux_loss_alpha else jnp.zeros((), jnp.float32))
  if batch_axes:
    # After the dispatch's collectives (a barrier on y), not concurrently with them: XLA:CPU
    # may order independent collectives differently per device and deadlock.
    y, load, aux = jax.lax.optimization_barrier((y, load, aux))
    load, aux = jax.lax.psum(load, batch_axes), jax.lax.pmean(aux, batch_axes)
  return y.reshape(B, T, d), MoEStats(load, aux)


def moe(cfg, p, x, valid=None):
  """x [B, T, d], valid [B, T] bool (None = all tokens) -> (y [B, T, d], MoEStats).

  Under a mesh (`jax.set_mesh`) whose axes the logical `batch` axis maps to (see
  k2jax.configs.sharding_rules) are larger than 1, the router and routed experts run per
  shard in `shard_map` (each shard sorts only its own tokens) and, when the `experts` axis
  is split too, tokens reach the shard holding their expert through all-to-all
  (k2jax.model.expert_parallel). Inside a shard_map that already holds the expert axis
  manual (the pipeline's: x is this device's tokens, p["experts"] its shard) the exchange
  runs there directly, and the statistics stay this device's for that shard_map to sum.
  Without a mesh everything is local.
  """
  if valid is None:
    valid = jnp.ones(x.shape[:2], bool)
  routed = {k: p[k] for k in ("router", "router_bias", "experts")}
  mesh = jax.sharding.get_abstract_mesh()
  batch_axes = rules.active_mesh_axes("batch", mesh)
  # a sequence's tokens split over context devices are tokens like any other here; those
  # an enclosing shard_map (the pipeline's) holds manual still sum the balance loss's
  # per-sequence counts
  length_axes = rules.active_mesh_axes("length", mesh) if context.engaged(x.shape[1]) else ()
  held = getattr(mesh, "manual_axes", ())
  length_all = rules.active_mesh_axes("length", mesh, manual=True)
  length_held = tuple(a for a in length_all if a in held)
  ep = rules.active_mesh_axes("experts", mesh, manual=True)
  ep_axis = ep[0] if ep else None
  # every device of the batch agrees on the exchange's branch, those of an enclosing
  # shard_map's manual axes too
  sync = tuple(a for a in rules.active_mesh_axes("batch", mesh, manual=True) + length_all
               if a != ep_axis)
  if ep_axis and ep_axis in held:
    # An enclosing shard_map (the pipeline's) already holds the expert axis manual: x is
    # this device's tokens, p["experts"] its shard of the experts and the rest whole. The
    # exchange runs here; the statistics and the router's gradient stay this device's
    # share, which that shard_map sums over its axes once.
    y, stats = _routed(cfg, (), ep_axis, sync, routed, x, valid, context_axes=length_held)
  elif batch_axes or length_axes:
    # Specs of one layer's routed params (the scan removed the `layers` axis): split over the
    # expert axis on `experts` only; the router (stored split over `expert` on its model
    # dimension, sharding_rules) is gathered whole into every shard.
    specs = jax.tree.map(
        lambda s: P(*[ep_axis if a == "experts" else None for a in s.axes]) if ep_axis else P(),
        moe_specs(cfg), is_leaf=spec.is_spec)
    specs = {k: specs[k] for k in routed}
    tok = P(batch_axes or None, length_axes or None)
    fn = jax.shard_map(functools.partial(_routed, cfg, batch_axes + length_axes, ep_axis, sync,
                                         context_axes=length_axes),
                       in_specs=(specs, tok, tok), out_specs=(tok, MoEStats(P(), P())),
                       axis_names=set(batch_axes + length_axes))
    y, stats = fn(routed, x, valid)
  else:
    y, stats = _routed(cfg, (), None, (), routed, x, valid, context_axes=length_held)
  if "shared" in p:
    y = y + mlp(p["shared"], x, cfg.activation_storage == "fp8")
  return y, stats
