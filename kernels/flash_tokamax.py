"""tokamax's attention kernels behind our signature (`impl="tokamax"`), S_max included.

tokamax (openxla's JAX kernel library; optional: `pip install k2jax[gpu]` / `[tpu]`) has
Mosaic GPU (wgmma + TMA), Triton and Mosaic TPU flash attention that take a V width other
than Q / K's (MLA's 192 / 128). We call it for the output and take QK-Clip's S_max from the
softmax residuals its kernels keep anyway, so no second Q K^T pass is needed:

    residuals = (row max m [B, H, T], softmax denominator l [B, H, T])
    max_logits[h] = RESIDUAL_MAX[name] * max over b and counted rows i of m[b, h, i]

S_max must be the SCALED logit over valid pairs in natural units (kernels/flash.py). A
kernel may keep its row max in other units (Triton's multiplies the logits by log2 e before
exp2), so RESIDUAL_MAX lists only implementations whose factor was checked against float64:
`residual_check(name)` measures it (tests/test_attention.py for "xla" on CPU;
experiments/gpu_check.py --only tokamax for the GPU ones). An implementation not in the
table is refused with that fix rather than guessed.

Documents: tokamax's mask is a per-row key range (`Mask(k_start, k_end, is_causal)`), so a
packed row's segment ids become each query's [start, end) of its run of equal ids. Rows
packed by k2jax.data hold each document once, in one run; a repeated id after another
document would count as a new document here (kernels/flash.py treats equal ids as one).

The public `tokamax.dot_product_attention` returns the output only, so this calls the op
objects behind it (`tokamax._src.ops.attention.api.IMPLEMENTATIONS`), which also return the
residuals; pinned by the version range in pyproject.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

from k2jax.kernels import platform

# Which tokamax implementation `impl="tokamax"` uses per backend, best first (tokamax's own
# default order on each); the first one installed is taken.
PREFERENCE = {"gpu": ("mosaic_gpu", "triton"), "tpu": ("mosaic_tpu",), "cpu": ("xla",)}

# residual row max x factor = scaled natural-unit logit; entries measured by residual_check:
# xla by tests/test_attention.py (CPU), the GPU ones on an H100 and an H200 (bf16, and f32
# where the kernel has it: experiments/results/attention/tokamax_residuals*.csv);
# gpu_check.py --only tokamax re-measures.
RESIDUAL_MAX = {"xla": 1.0, "mosaic_gpu": 1.0, "triton": 1.0}

# Implementations that cannot run our contract at all, with the reason and what to use.
# mosaic_tpu: its mask check (pallas_mosaic_tpu_common.py) raises
# NotImplementedError for Mask.k_start, which is how packed documents reach tokamax here.
REFUSED = {"mosaic_tpu": "tokamax's Mosaic TPU attention raises NotImplementedError for "
                         "Mask.k_start, the per-row key start packed documents need; use "
                         "attention_impl=auto on TPU (pallas_tpu, which takes segment ids)"}


def _ops():
  platform.tokamax()
  from tokamax._src.ops.attention import api, base   # private: see the module docstring
  return api.IMPLEMENTATIONS, base.Mask


# tokamax's tiles per (GPU device kind, implementation, q / k head dim, v head dim):
# (forward config, backward config) as keyword dicts of its config classes (`_CONFIGS`).
# Where no entry matches, tokamax chooses (its autotuning cache for the device kind, else its
# heuristics). Entries come from tokamax's own candidate sets timed at MLA's training shape
# (experiments/bench_attention.py `tokamax_tune`, `gpu_check.py --only attention_tune`).
# None yet: on an H100 and an H200 no candidate beat the tiles its heuristics pick
# (experiments/results/attention/tokamax_tune_{h100,h200}.csv).
TILES = {}

# Where each implementation's config classes live (forward, backward), by tokamax module.
_CONFIGS = {"mosaic_gpu": (("pallas_mosaic_gpu_kernel_sm90", "Config"),
                           ("pallas_mosaic_gpu_vjp_common", "Config"))}


def configured(op, name: str, q, v, kind: str | None = None):
  """tokamax op `name` with the TILES entry for this GPU and head dims applied (`kind`:
  the device kind, default this machine's GPU), or `op` unchanged without one."""
  entry = TILES.get((kind or platform.gpu_kind(), name, q.shape[-1], v.shape[-1]))
  if entry is None:
    return op
  import importlib
  fwd_cls, bwd_cls = (getattr(importlib.import_module(f"tokamax._src.ops.attention.{m}"), c)
                      for m, c in _CONFIGS[name])
  return op.replace(config=fwd_cls(**entry[0]), vjp=op.vjp.replace(config=bwd_cls(**entry[1])))


# Implementations without a kernel for some input dtypes (measured: the Mosaic GPU flash
# attention refuses float32 with "Unsupported precision: TF32_TF32_F32").
UNSUPPORTED = {"mosaic_gpu": ("float32", "float64")}


def implementation(backend: str | None = None, dtype=None) -> str:
  """The tokamax implementation used on `backend` (default: the one kernels target) for
  inputs of `dtype` (None: any)."""
  available, _ = _ops()
  names = PREFERENCE.get(backend or platform.backend(), ("xla",))
  for name in names:
    if name in available and (dtype is None or
                              jnp.dtype(dtype).name not in UNSUPPORTED.get(name, ())):
      return name
  raise ValueError(f"attention impl = 'tokamax': none of tokamax's {', '.join(names)} "
                   "attention is available here; use attention_impl=auto")


def _run_bounds(segment_ids):
  """[B, T] ids -> (start, end) [B, T]: the [start, end) of each position's run of equal ids."""
  T = segment_ids.shape[1]
  pos = jnp.arange(T)
  new = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool),
                         segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
  start = jax.lax.cummax(jnp.where(new, pos, 0), axis=1)
  last = jnp.concatenate([new[:, 1:], jnp.ones_like(new[:, :1])], axis=1)
  end = jax.lax.cummin(jnp.where(last, pos + 1, T), axis=1, reverse=True)
  return start, end


def _op(q, v, name):
  """tokamax's op `name` (default `implementation()`), refused unless its S_max units are
  checked (module docstring); -> (op, Mask)."""
  name = name or implementation(dtype=q.dtype)
  if name in REFUSED:
    raise ValueError(f"attention impl = 'tokamax' ({name}): {REFUSED[name]}")
  if name not in RESIDUAL_MAX:
    raise ValueError(
        f"attention impl = 'tokamax' ({name}): the units of its softmax-residual row max are "
        "not checked against float64 yet, so QK-Clip's S_max cannot be read from it; run "
        f"`python experiments/gpu_check.py --only tokamax` and add the factor to "
        "kernels/flash_tokamax.RESIDUAL_MAX, or use attention_impl=auto")
  ops, Mask = _ops()
  return configured(ops[name], name, q, v), name, Mask


def _run(op, name, q, k, v, scale, mask, q_segment_ids):
  out, (row_max, _) = op(q, k, v, logits_scale=scale, mask=mask, return_residuals=True)
  row_max = jax.lax.stop_gradient(row_max).astype(jnp.float32) * RESIDUAL_MAX[name]
  if q_segment_ids is not None:      # padding rows (id 0) are not counted
    row_max = jnp.where((q_segment_ids > 0)[:, None, :], row_max, -jnp.inf)
  return out.astype(v.dtype), jnp.max(row_max, axis=(0, 2))


def attention(q, k, v, *, scale: float, segment_ids=None, causal: bool = True,
              name: str | None = None):
  """-> (out [B, T, H, Dv] in v's dtype, max_logits [H] f32): kernels/flash.py's contract.

  name: a tokamax implementation ("xla", "triton", "mosaic_gpu", "mosaic_tpu"); default
  `implementation()`. Only names in RESIDUAL_MAX are accepted (module docstring)."""
  op, name, Mask = _op(q, v, name)
  if segment_ids is None:
    mask = Mask(is_causal=causal)
  else:
    start, end = _run_bounds(segment_ids)
    # [B, 1, T]: one key range per query row, shared by the heads
    mask = Mask(k_start=start[:, None], k_end=None if causal else end[:, None],
                is_causal=causal)
  return _run(op, name, q, k, v, scale, mask, segment_ids)


def attention_blocks(q, k, v, *, scale: float, q_positions, q_segment_ids, k_segment_ids,
                     causal: bool = True, name: str | None = None):
  """Rows of a sequence against all of its keys (k2jax.kernels.flash.attention_blocks with
  impl="tokamax"): q [B, Tq, H, D] at places q_positions (int [Tq]) of k / v [B, Tk, ...].

  tokamax's causal flag compares row and key indices, which differ here, so both bounds of
  each row's key range are given instead: from the start of its document's run to its own
  place (causal) or the run's end."""
  op, name, Mask = _op(q, v, name)
  start, end = _run_bounds(k_segment_ids.astype(jnp.int32))      # [B, Tk]
  pos = jnp.asarray(q_positions, jnp.int32)
  k_end = (jnp.broadcast_to(pos + 1, (q.shape[0], pos.shape[0])) if causal
           else end[:, pos])
  mask = Mask(k_start=start[:, pos][:, None], k_end=k_end[:, None], is_causal=False)
  return _run(op, name, q, k, v, scale, mask, q_segment_ids)


def residual_check(name: str, B=2, T=256, H=4, D=192, Dv=128, dtype="float32",
                   seed=0) -> dict:
  """Run tokamax's `name` on random causal inputs (in `dtype`) with two documents per row and
  compare its residual row max with float64 scaled logits of the same (rounded) inputs:
  {"factor": the least-squares ratio, "rel": the worst relative error after it, "natural":
  1.0 fits, "base2": log2 e fits (within 1e-3, bf16 1e-2)}."""
  ops, Mask = _ops()
  rng = np.random.default_rng(seed)
  args = [jnp.asarray(rng.standard_normal((B, T, H, d)), dtype) for d in (D, D, Dv)]
  q, k = (np.asarray(a.astype(jnp.float32), np.float64) for a in args[:2])
  seg = np.where(np.arange(T) < T // 3, 1, 2)[None].repeat(B, 0)
  scale = D ** -0.5
  start, _ = _run_bounds(jnp.asarray(seg))
  _, (m, _) = ops[name](*args, logits_scale=scale, return_residuals=True,
                        mask=Mask(k_start=start[:, None], is_causal=True))
  s = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
  i = np.arange(T)
  valid = (i[:, None] >= i[None, :]) & (seg[:, :, None] == seg[:, None, :])[:, None]
  want = np.where(valid, s, -np.inf).max(-1)
  got = np.asarray(m, np.float64)
  factor = float((got * want).sum() / (want * want).sum())
  rel = float(np.abs(got / factor - want).max() / np.abs(want).max())
  tol = 1e-3 if dtype == "float32" else 1e-2
  return dict(name=name, dtype=dtype, factor=factor, rel=rel, natural=abs(factor - 1) < tol,
              base2=abs(factor - math.log2(math.e)) < tol)
