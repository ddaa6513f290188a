"""Hugging Face checkpoints in the published K2 / DeepSeek-V3 layout <-> k2jax params.

`load_checkpoint(path) -> (model_cfg, params)` reads config.json and the safetensors files
(one file or an index), tensor by tensor, dequantizing FP8 e4m3 weights that carry a
128x128-block `weight_scale_inv` and INT4 pack-quantized routed experts (k2jax.interop.quant). `save_checkpoint(cfg, params, path)` writes a directory
that `transformers.DeepseekV3ForCausalLM.from_pretrained` loads (per-expert names).

Layout rules (k2-facts "Checkpoint layout"): PyTorch stores Linear weights [out, in]; ours
are [*in, *out] with heads explicit, so a weight maps by transpose + reshape, using the
parameter table's fan-in count. Embeddings map as is.
"""

import json
import math
import os
from collections.abc import Iterator

import jax
import ml_dtypes
import numpy as np
from ml_collections import config_dict

from k2jax.configs import base, validate_model
from k2jax.interop import quant, safetensors_io
from k2jax.model import spec
from k2jax.model.transformer import param_specs, stacks

FP8_BLOCK = 128
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

# Published config.json keys that map one to one onto model config fields.
_HF_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
            "num_hidden_layers", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
            "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
            "num_experts_per_tok", "n_shared_experts", "first_k_dense_replace", "n_group",
            "topk_group", "routed_scaling_factor", "norm_topk_prob", "scoring_func",
            "topk_method", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
            "initializer_range", "bos_token_id", "eos_token_id", "aux_loss_alpha")
_YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
              "mscale_all_dim")


class CheckpointError(ValueError):
  """A checkpoint that does not match the config (names the tensor and the shapes)."""


# --------------------------------------------------------------------------- config.json


def config_from_hf(d: dict) -> config_dict.ConfigDict:
  """Model config from a published (or transformers 5 `rope_parameters`) config.json dict."""
  m = base.model_config()
  for k in _HF_KEYS:
    if d.get(k) is not None:
      m[k] = type(m[k])(d[k]) if m[k] is not None and not isinstance(d[k], bool) else d[k]
  if d.get("n_routed_experts") is None:  # a dense model: every layer dense
    m.first_k_dense_replace = m.num_hidden_layers
  rope = d.get("rope_parameters") or {}
  m.rope_theta = float(d.get("rope_theta") or rope.get("rope_theta") or m.rope_theta)
  scaling = d.get("rope_scaling") or rope
  kind = scaling.get("type") or scaling.get("rope_type") or "default"
  if kind == "yarn":
    m.rope_scaling = base.yarn(**{k: scaling[k] for k in _YARN_KEYS if scaling.get(k) is not None})
  elif kind != "default":
    raise CheckpointError(f"config.json rope scaling type {kind!r} is not supported "
                          "(k2jax implements plain RoPE and YaRN)")
  m.dtype = "float32"
  validate_model(m, group="config.json")
  return m


def config_to_hf(cfg, torch_dtype: str = "float32") -> dict:
  d = {k: cfg[k] for k in _HF_KEYS}
  rs = cfg.rope_scaling
  d.update(
      architectures=["DeepseekV3ForCausalLM"],
      # "deepseek_v3", not K2's "kimi_k2": transformers keys its per-expert conversion on it.
      model_type="deepseek_v3",
      num_key_value_heads=cfg.num_attention_heads,
      hidden_act="silu",
      attention_bias=False,
      num_nextn_predict_layers=0,
      rope_theta=cfg.rope_theta,
      rope_scaling=({"type": "yarn", **{k: rs[k] for k in _YARN_KEYS}}
                    if rs.type == "yarn" else None),
      torch_dtype=torch_dtype,
  )
  return d


# --------------------------------------------------------------------------- name map


def _layer_entries(cfg, stack_specs):
  """(hf suffix, path inside one layer, expert index or None) for one decoder layer."""
  yield "input_layernorm.weight", ("attn_norm",), None
  yield "post_attention_layernorm.weight", ("mlp_norm",), None
  attn = {"q_a": "q_a_proj", "q_a_norm": "q_a_layernorm", "q_b": "q_b_proj", "q_proj": "q_proj",
          "kv_a": "kv_a_proj_with_mqa", "kv_a_norm": "kv_a_layernorm", "kv_b": "kv_b_proj",
          "o": "o_proj"}
  for ours, theirs in attn.items():
    if ours in stack_specs["attn"]:
      yield f"self_attn.{theirs}.weight", ("attn", ours), None
  if "mlp" in stack_specs:
    for w in ("gate", "up", "down"):
      yield f"mlp.{w}_proj.weight", ("mlp", w), None
  else:
    yield "mlp.gate.weight", ("moe", "router"), None
    yield "mlp.gate.e_score_correction_bias", ("moe", "router_bias"), None
    for e in range(cfg.n_routed_experts):
      for w in ("gate", "up", "down"):
        yield f"mlp.experts.{e}.{w}_proj.weight", ("moe", "experts", w), e
    if "shared" in stack_specs["moe"]:
      for w in ("gate", "up", "down"):
        yield f"mlp.shared_experts.{w}_proj.weight", ("moe", "shared", w), None


def tensor_map(cfg) -> Iterator[tuple]:
  """Yield (hf name, our param path, index into our array, ParamSpec) for every tensor."""
  specs = param_specs(cfg)
  yield "model.embed_tokens.weight", ("embed",), (), specs["embed"]
  yield "model.norm.weight", ("final_norm",), (), specs["final_norm"]
  yield "lm_head.weight", ("lm_head",), (), specs["lm_head"]
  for st in stacks(cfg):
    for j, i in enumerate(range(st.rows.start, st.rows.stop)):
      for suffix, path, e in _layer_entries(cfg, specs[st.name]):
        s = specs[st.name]
        for k in path:
          s = s[k]
        index = (j,) if e is None else (j, e)
        yield f"model.layers.{i}.{suffix}", (st.name,) + path, index, s


def _slice_shape(s: spec.ParamSpec, index):
  return s.shape[len(index):]


def _to_ours(hf_name, w: np.ndarray, s: spec.ParamSpec, index):
  """HF [out, in] -> our [*in, *out] slice (vectors and the embedding map as is)."""
  shape = _slice_shape(s, index)
  if w.ndim == 2 and hf_name != "model.embed_tokens.weight":
    w = w.T
  if w.size != math.prod(shape):
    raise CheckpointError(f"tensor {hf_name}: expected {_hf_shape(hf_name, s, index)} for this "
                          f"config, found {list(w.shape if w.ndim < 2 else w.T.shape)}")
  return w.reshape(shape)


def _hf_shape(hf_name, s: spec.ParamSpec, index):
  shape = _slice_shape(s, index)
  if len(shape) == 1:
    return list(shape)
  n_in = s.n_in
  fan_in, fan_out = math.prod(shape[:n_in]), math.prod(shape[n_in:])
  return [fan_in, fan_out] if hf_name == "model.embed_tokens.weight" else [fan_out, fan_in]


def _to_hf(hf_name, w: np.ndarray, s: spec.ParamSpec, index):
  shape = _hf_shape(hf_name, s, index)
  if len(shape) == 1 or hf_name == "model.embed_tokens.weight":
    return w.reshape(shape)
  return w.reshape(shape[::-1]).T


# --------------------------------------------------------------------------- FP8 blocks


def dequantize_fp8(q: np.ndarray, scale_inv: np.ndarray, block: int = FP8_BLOCK) -> np.ndarray:
  """W[i, j] = q[i, j] * scale_inv[i // block, j // block] (DeepSeek-V3 / K2 FP8 release)."""
  rows, cols = q.shape
  expected = (math.ceil(rows / block), math.ceil(cols / block))
  if scale_inv.shape != expected:
    raise CheckpointError(f"weight_scale_inv of shape {list(scale_inv.shape)} does not tile a "
                          f"{list(q.shape)} weight in {block}x{block} blocks (expected "
                          f"{list(expected)})")
  s = np.repeat(np.repeat(scale_inv.astype(np.float32), block, 0), block, 1)[:rows, :cols]
  return q.astype(np.float32) * s


def quantize_fp8(w: np.ndarray, block: int = FP8_BLOCK):
  """Block-wise e4m3 quantization: scale_inv = amax(block) / 448 per 128x128 block."""
  rows, cols = w.shape
  br, bc = math.ceil(rows / block), math.ceil(cols / block)
  padded = np.zeros((br * block, bc * block), np.float32)
  padded[:rows, :cols] = w
  blocks = padded.reshape(br, block, bc, block)
  fmax = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)
  scale_inv = np.maximum(np.abs(blocks).max(axis=(1, 3)) / fmax, 1e-12).astype(np.float32)
  q = np.clip(blocks / scale_inv[:, None, :, None], -fmax, fmax).astype(ml_dtypes.float8_e4m3fn)
  return q.reshape(br * block, bc * block)[:rows, :cols], scale_inv


def _fp8_quantizable(hf_name: str) -> bool:
  """Decoder-layer linear weights; embeddings, head, norms and router stay high precision."""
  return hf_name.startswith("model.layers.") and hf_name.endswith("_proj.weight")


# --------------------------------------------------------------------------- load / save


def load_checkpoint(path: str, dtype=np.float32):
  """Read a Hugging Face K2 / DeepSeek-V3 directory -> (model config, params as jax arrays).

  Reads tensor by tensor (memory-mapped safetensors, never pickle); FP8 weights with a
  `weight_scale_inv` are dequantized. Multi-token-prediction layers (index >=
  num_hidden_layers) and rotary `inv_freq` buffers are skipped.
  """
  cfg_path = os.path.join(path, "config.json")
  if not os.path.isfile(cfg_path):
    raise CheckpointError(f"{path}: no config.json: point at a Hugging Face model directory")
  with open(cfg_path) as f:
    hf_cfg = json.load(f)
  cfg = config_from_hf(hf_cfg)
  group_size = quant.int4_group_size(hf_cfg)
  with safetensors_io.Reader(path) as reader:
    specs = param_specs(cfg)
    out = jax.tree.map(lambda s: np.empty(s.shape, dtype), specs, is_leaf=spec.is_spec)
    used = set()
    for hf_name, ppath, index, s in tensor_map(cfg):
      if hf_name not in reader and hf_name + "_packed" in reader:   # INT4 (compressed-tensors)
        parts = [hf_name + x for x in ("_packed", "_scale", "_shape")]
        try:
          w = quant.dequantize_int4(hf_name, reader.get(parts[0]), reader.get(parts[1]),
                                    reader.get(parts[2]) if parts[2] in reader else None,
                                    group_size)
        except quant.QuantizationError as e:
          raise CheckpointError(str(e)) from None
        used.update(p for p in parts if p in reader)
      elif hf_name not in reader:
        raise CheckpointError(f"tensor {hf_name} is missing from {path} (expected shape "
                              f"{_hf_shape(hf_name, s, index)})")
      else:
        w = reader.get(hf_name)
        used.add(hf_name)
      if (scale := hf_name + "_scale_inv") in reader:
        w = dequantize_fp8(w, reader.get(scale))
        used.add(scale)
      target = out
      for k in ppath:
        target = target[k]
      target[index] = _to_ours(hf_name, w.astype(np.float32), s, index).astype(dtype)
    extra = [n for n in reader.names() if n not in used and not _ignorable(n, cfg)]
    if extra:
      raise CheckpointError(f"tensor {extra[0]} (and {len(extra) - 1} more) in {path} has no "
                            "place in this config: is config.json the one for these weights?")
  return cfg, jax.tree.map(jax.numpy.asarray, out)


def _ignorable(name: str, cfg) -> bool:
  if name.endswith(_IGNORED_SUFFIXES):
    return True
  parts = name.split(".")
  # DeepSeek-V3's multi-token-prediction module lives in extra layers past the last one.
  return (len(parts) > 2 and parts[1] == "layers" and parts[2].isdigit()
          and int(parts[2]) >= cfg.num_hidden_layers)


def save_checkpoint(cfg, params, path: str, *, dtype: str = "float32", fp8: bool = False,
                    max_shard_bytes: int = 4 << 30) -> None:
  """Write `params` as a Hugging Face directory (config.json + safetensors, published names).

  dtype: float32 | bfloat16 for every tensor; fp8=True additionally stores decoder-layer
  linear weights as float8_e4m3fn with 128x128-block `weight_scale_inv` (as released).
  """
  np_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}[dtype]
  os.makedirs(path, exist_ok=True)
  hf_cfg = config_to_hf(cfg, torch_dtype=dtype)
  if fp8:
    hf_cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic",
                                     "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(hf_cfg, f, indent=2)

  def tensors():
    for hf_name, ppath, index, s in tensor_map(cfg):
      w = params
      for k in ppath:
        w = w[k]
      w = _to_hf(hf_name, np.asarray(w[index], np.float32), s, index)
      if fp8 and _fp8_quantizable(hf_name):
        q, scale_inv = quantize_fp8(w)
        yield hf_name, q
        yield hf_name + "_scale_inv", scale_inv
      elif hf_name.endswith("e_score_correction_bias"):
        yield hf_name, w.astype(np.float32)  # kept in float32 by the reference
      else:
        yield hf_name, w.astype(np_dtype)

  safetensors_io.write_sharded(tensors(), path, max_shard_bytes)
