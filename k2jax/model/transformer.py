"""The K2 / DeepSeek-V3 decoder, top to bottom.

    x = embed[tokens]
    for each layer:  x += mla(norm(x));  x += mlp_or_moe(norm(x))
    logits = norm(x) @ lm_head                      (untied head)

The first `first_k_dense_replace` layers use a dense SwiGLU MLP, the rest MoE. Each kind is
one stack of parameters with a leading `layers` axis run by `jax.lax.scan`, so compile
time does not grow with depth. Public face: pure `init(cfg, rng)` and
`forward(cfg, params, tokens)`, where `cfg` is the `model` group of a k2jax config.
"""

from typing import NamedTuple

import jax
import jax.extend
import jax.numpy as jnp

from k2jax.model import context, spec
from k2jax.model.attention import attention_specs, mla
from k2jax.model.embedding import embed
from k2jax.model.layers import mlp, mlp_specs, rms_norm
from k2jax.model.moe import MoEStats, moe, moe_specs
from k2jax.model.remat import remat_policy


class Stack(NamedTuple):
  """One scanned stack of identical layers: params[name] has a leading `layers` axis."""
  name: str        # params key: "dense_layers" | "moe_layers"
  ffn: str         # the layer's feed-forward: "mlp" (dense SwiGLU) | "moe"
  first: int       # global index of its first layer
  size: int        # layers in the stack

  @property
  def rows(self) -> slice:
    """Its rows in per-layer arrays of all layers ([num_hidden_layers, ...], e.g. max_logits)."""
    return slice(self.first, self.first + self.size)


def stacks(cfg) -> tuple[Stack, ...]:
  """The model's non-empty layer stacks in layer order: the first `first_k_dense_replace`
  layers are dense, the rest MoE. Everything that maps per-layer rows to parameters (QK-Clip,
  HF interop, balancing, pipeline stages) goes through this one function."""
  n_dense = cfg.first_k_dense_replace
  all_stacks = (Stack("dense_layers", "mlp", 0, n_dense),
                Stack("moe_layers", "moe", n_dense, cfg.num_hidden_layers - n_dense))
  return tuple(s for s in all_stacks if s.size)


class ForwardStats(NamedTuple):
  """Statistics of one forward pass, reduced over the batch (and across devices)."""
  max_logits: jax.Array   # f32 [num_hidden_layers, heads]: max scaled pre-softmax logit over
                          # valid (causal, same-document, non-padding) pairs; QK-Clip's S_max
  expert_load: jax.Array  # f32 [moe_layers, n_routed_experts]: non-padding tokens per expert
  aux_loss: jax.Array     # f32 scalar: aux_loss_alpha * sequence-wise balance loss, all layers


def num_layers(cfg):
  """(dense, moe) layer counts."""
  return cfg.first_k_dense_replace, cfg.num_hidden_layers - cfg.first_k_dense_replace


def param_specs(cfg):
  d, V = cfg.hidden_size, cfg.vocab_size

  def layer(kind, ffn):
    return {"attn_norm": spec.vector(d, "embed"), "attn": attention_specs(cfg),
            "mlp_norm": spec.vector(d, "embed"), kind: ffn}

  ffn = {"mlp": lambda: mlp_specs(d, cfg.intermediate_size), "moe": lambda: moe_specs(cfg)}
  # the embedding's gradient scatter-adds repeated tokens' rows: kept in the stored dtype
  s = {"embed": spec.ParamSpec(shape=(V, d), axes=("vocab", "embed"), group="adamw",
                               cast=False)}
  for st in stacks(cfg):
    s[st.name] = spec.stack(layer(st.ffn, ffn[st.ffn]()), st.size)
  s["final_norm"] = spec.vector(d, "embed")
  s["lm_head"] = spec.ParamSpec(shape=(d, V), axes=("embed", "head_vocab"), group="adamw")
  return s


def init(cfg, rng):
  """Random parameters (normal(0, initializer_range) matrices, unit norms, zero router bias)."""
  return spec.init_params(param_specs(cfg), rng, cfg.initializer_range,
                          jnp.dtype(cfg.param_dtype))


def feed_forward(cfg, ffn, p, h, valid=None):
  """The layer's MLP half on normed h: (y, MoEStats or None for a dense layer)."""
  if ffn == "mlp":
    return mlp(p["mlp"], h, cfg.activation_storage == "fp8"), None
  return moe(cfg, p["moe"], h, valid)


def _block(cfg, ffn, x, p, positions, segment_ids, return_latents=False):
  """One pre-norm layer -> (x, (max_logits [H], MoEStats or None[, Latents]))."""
  eps = cfg.rms_norm_eps
  attn = mla(cfg, p["attn"], rms_norm(x, p["attn_norm"], eps), positions, segment_ids,
             return_latents=return_latents)
  x = x + attn[0]
  if not jax.sharding.get_abstract_mesh().empty:
    # The max-logit reduction over a sharded batch is a collective independent of the
    # MoE's; XLA:CPU may issue independent collectives in a different order on different
    # devices and deadlock (simulated devices). Finish it before the MoE starts.
    x, max_logits = jax.lax.optimization_barrier((x, attn[1]))
    attn = (attn[0], max_logits) + tuple(attn[2:])
  valid = None if segment_ids is None else segment_ids > 0   # segment 0 = padding
  y, moe_stats = feed_forward(cfg, ffn, p, rms_norm(x, p["mlp_norm"], eps), valid)
  return x + y, (attn[1], moe_stats) + tuple(attn[2:])


def _run_stack(cfg, ffn, stacked, x, positions, segment_ids, return_latents=False):
  def body(x, p):
    return _block(cfg, ffn, x, p, positions, segment_ids, return_latents)
  policy = remat_policy(cfg.remat, cfg.offload)
  if policy is not None:
    body = jax.checkpoint(body, policy=policy, prevent_cse=False)
  return jax.lax.scan(body, x, stacked)


def layer_residual_bytes(cfg, ffn: str, seq_len: int, batch: int = 1, data: int = 1,
                         expert: int = 1, *, memory: str = "all", context: int = 1) -> int:
  """Bytes one `ffn` layer ("mlp" | "moe") keeps for its backward pass, for `batch`
  sequences of `seq_len` tokens on each device of a data x expert mesh (each sequence split
  over `context` devices more: k2jax.model.context): what jax.vjp of the
  layer under the `model.remat` policy closes over besides its weights (what a scan of
  layers, or a pipeline stage, holds per layer until the backward pass).

  Measured, not modelled: the layer is traced at abstract shapes (nothing is computed or
  allocated) with the kernels `impl="auto"` picks for the backend kernels target
  (`k2jax.kernels.platform.target`), on an abstract data x expert mesh when it has more than
  one device (the MoE then takes its expert-parallel path, as training on that mesh does),
  so it follows the policy, the attention and MoE implementations and FP8 activation
  storage exactly.

  memory: "all" counts every residual under the policy without offload (what a pipeline
  stage's layers keep: the pipeline offloads whole stages, k2jax.parallel.pipeline);
  "device" / "host" trace the layer as `model.offload` runs it (remat.remat_policy's
  offloading policy when cfg.offload) and count the residuals the trace places in that
  memory space (each traced residual's aval carries it).
  """
  if memory not in ("all", "device", "host"):
    raise ValueError(f"memory={memory!r}: expected all, device or host")
  if data * expert * context > 1:
    # Traced in a thread of its own: a caller inside `jax.set_mesh` (the trainer) cannot
    # enter an abstract mesh of another size, and the mesh context is per thread.
    import concurrent.futures
    mesh = jax.sharding.AbstractMesh((data, context, expert), ("data", "context", "expert"))

    def on_mesh():
      with jax.sharding.use_abstract_mesh(mesh):
        return layer_residual_bytes(cfg, ffn, seq_len, batch * data * expert,
                                    memory=memory) // (data * expert * context)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
      return pool.submit(on_mesh).result()
  st = next(s for s in stacks(cfg) if s.ffn == ffn)
  specs = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape[1:], jnp.dtype(cfg.param_dtype)),
                       param_specs(cfg)[st.name], is_leaf=spec.is_spec)
  x = jax.ShapeDtypeStruct((batch, seq_len, cfg.hidden_size), jnp.dtype(cfg.dtype))
  positions = jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), (batch, seq_len))
  segments = jnp.ones((batch, seq_len), jnp.int32)

  def body(p, x):
    return _block(cfg, ffn, x, p, positions, segments)
  policy = remat_policy(cfg.remat, memory != "all" and bool(cfg.offload))
  if policy is not None:
    body = jax.checkpoint(body, policy=policy, prevent_cse=False)

  def residuals(p, x):
    _, vjp = jax.vjp(body, p, x)
    return [a for a in jax.tree.leaves(vjp) if hasattr(a, "dtype")]
  # make_jaxpr, not eval_shape: the jaxpr's avals keep their memory space (an offloading
  # policy's residuals are device_put to host inside the trace).
  jaxpr = jax.make_jaxpr(residuals)(specs, x).jaxpr
  weights = set(jaxpr.invars[:len(jax.tree.leaves(specs))])
  host = jax.memory.Space.Host
  total = 0
  for v in jaxpr.outvars:
    if isinstance(v, jax.extend.core.Var) and v in weights:
      continue
    on_host = getattr(v.aval, "memory_space", None) == host
    if memory == "all" or on_host == (memory == "host"):
      total += v.aval.size * v.aval.dtype.itemsize
  return total


def forward(cfg, params, tokens, *, positions=None, segment_ids=None, return_latents=False,
            head_at=None):
  """tokens [B, T] int -> (logits [B, T, vocab] float32, ForwardStats).

  positions [B, T] (default 0..T-1) and segment_ids [B, T] are optional. segment_ids mark
  packed documents (attention stays within a document) and padding (id 0: such tokens count
  for nothing in max_logits, expert_load and the balance loss); None = one document per row.
  return_latents=True also returns {stack name: Latents [layers, B, T, ...]}, the MLA cache
  entries of every token (prefill; k2jax.model.decode).
  head_at [B] int: the head runs at that position of each row only, logits [B, vocab] (a
  prefill's next-token logits: every position's are T times their memory, 21 GB a 32k-token
  row at K2's vocabulary).
  """
  dt = jnp.dtype(cfg.dtype)
  B, T = tokens.shape
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  # context parallelism: the tokens in the order the context devices hold them, and back
  # before the head (k2jax.model.context); positions and segment ids travel with them
  C = context.size() if context.engaged(T) else 1
  chunk = context.chunk_size(cfg, T, C) if C > 1 else 1
  place = lambda a, axis=1: context.to_placement(a, C, chunk, axis)
  tokens, positions = place(tokens), place(positions)
  segment_ids = None if segment_ids is None else place(segment_ids)
  x = embed(params["embed"], tokens, dt)
  max_logits, moe_stats, cache = [], None, {}
  for st in stacks(cfg):
    x, (layer_max, layer_moe, *lat) = _run_stack(cfg, st.ffn, params[st.name], x, positions,
                                                 segment_ids, return_latents)
    max_logits.append(layer_max)
    moe_stats = layer_moe if layer_moe is not None else moe_stats
    if lat:
      cache[st.name] = jax.tree.map(lambda a: context.from_placement(a, C, chunk, 2), lat[0])
  x = context.from_placement(x, C, chunk)
  if head_at is not None:
    x = jnp.take_along_axis(x, head_at[:, None, None], axis=1)            # [B, 1, d]
  x = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
  logits = jnp.einsum("btd,dv->btv", x, params["lm_head"].astype(dt),
                      preferred_element_type=jnp.float32)
  if head_at is not None:
    logits = logits[:, 0]
  if moe_stats is None:  # an all-dense model
    moe_stats = MoEStats(jnp.zeros((0, cfg.n_routed_experts), jnp.float32),
                         jnp.zeros((0,), jnp.float32))
  stats = ForwardStats(max_logits=jnp.concatenate(max_logits, axis=0),
                       expert_load=moe_stats.expert_load, aux_loss=moe_stats.aux_loss.sum())
  return (logits, stats, cache) if return_latents else (logits, stats)
