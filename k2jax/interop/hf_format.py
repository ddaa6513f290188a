"""The published K2 / DeepSeek-V3 checkpoint format: config.json's fields, every tensor's
name, shape and how it is stored (plain, FP8 block-scaled, INT4 pack-quantized).

Layout rules (k2-facts "Checkpoint layout"): PyTorch stores Linear weights [out, in]; ours
are [*in, *out] with heads explicit, so a weight maps by transpose + reshape, using the
parameter table's fan-in count (spec.n_in). The embedding maps as is. Each parameter leaf
stacks the published tensors of its leading `layers` (and `experts`) dims (`leaves`).
"""

import json
import math
import os
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np
from ml_collections import config_dict

from k2jax.configs import base, validate_model
from k2jax.interop import quant
from k2jax.model import spec
from k2jax.model.transformer import param_specs, stacks

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
EMBED = "model.embed_tokens.weight"

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
  """A checkpoint that does not match the config (names the tensor, the file, the shapes)."""


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


def _read_json(path: str) -> dict:
  cfg_path = os.path.join(path, "config.json")
  if not os.path.isfile(cfg_path):
    raise CheckpointError(f"{path}: no config.json: point at a Hugging Face model directory")
  with open(cfg_path) as f:
    return json.load(f)


def read_config(path: str) -> config_dict.ConfigDict:
  """The model config of a Hugging Face directory, from its config.json alone."""
  return config_from_hf(_read_json(path))


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
  """Yield (hf name, our param path, index into our array, ParamSpec) for every tensor, in
  the published order."""
  specs = param_specs(cfg)
  yield EMBED, ("embed",), (), specs["embed"]
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


def hf_shape(hf_name: str, s: spec.ParamSpec, lead: int) -> tuple:
  """The published shape of one tensor of leaf `s` (its first `lead` dims index tensors)."""
  shape = s.shape[lead:]
  if len(shape) == 1 or hf_name == EMBED:
    return tuple(shape)
  fan_in, fan_out = math.prod(shape[:s.n_in]), math.prod(shape[s.n_in:])
  return (fan_out, fan_in)


def _fp8_quantizable(hf_name: str) -> bool:
  """Decoder-layer linear weights; embeddings, head, norms and router stay high precision."""
  return hf_name.startswith("model.layers.") and hf_name.endswith("_proj.weight")


def _int4_quantizable(hf_name: str) -> bool:
  """Routed experts: what K2-Thinking onward ships in INT4."""
  return ".mlp.experts." in hf_name and hf_name.endswith("_proj.weight")


def published_layout(cfg, dtype="bfloat16", *, fp8: bool = False, int4: bool = False,
                     group_size: int = 32) -> list[tuple]:
  """[(tensor name, dtype, shape)] of a checkpoint of `cfg` as published: FP8 decoder
  linears with their scale_inv (Kimi-K2-Instruct, DeepSeek-V3), INT4 routed experts (K2-
  Thinking onward), the router bias float32, the rest in `dtype`. What save_checkpoint
  writes, and the files plan sizes the reads of."""
  out = []
  for name, _, index, s in tensor_map(cfg):
    shape = hf_shape(name, s, len(index))
    if int4 and _int4_quantizable(name):
      packed, scale = quant.int4_shapes(shape, group_size)
      out += [(name + "_packed", np.int32, packed), (name + "_scale", dtype, scale),
              (name + "_shape", np.int64, (2,))]
    elif fp8 and _fp8_quantizable(name):
      out += [(name, "float8_e4m3fn", shape),
              (name + "_scale_inv", np.float32, quant.fp8_scale_shape(shape))]
    elif name.endswith("e_score_correction_bias"):
      out.append((name, np.float32, shape))      # kept in float32 by the reference
    else:
      out.append((name, dtype, shape))
  return [(n, np.dtype(d), tuple(s)) for n, d, s in out]


# --------------------------------------------------------------------------- sources


class Leaf(NamedTuple):
  """One parameter leaf and the published tensors it stacks."""
  path: tuple
  spec: spec.ParamSpec
  lead: int           # leading dims that index tensors (0 top level, 1 layers, 2 experts)
  names: np.ndarray   # [*spec.shape[:lead]] of hf names (None: a padding row)
  embedding: bool     # the embedding: published as ours, not transposed


def leaves(cfg, layout=None) -> dict[tuple, Leaf]:
  """{param path: Leaf} in the params tree's order; with `layout` (a
  k2jax.parallel.layout.Split) the pipelined stack as the trainer stores it: padded, its
  rows in the schedule's order."""
  out = {}
  for hf_name, path, index, s in tensor_map(cfg):
    if path not in out:
      out[path] = Leaf(path, s, len(index), np.empty(s.shape[:len(index)], object),
                       hf_name == EMBED)
    out[path].names[index] = hf_name
  if layout is not None:
    rows = layout.logical_rows().reshape(-1)
    for path, leaf in out.items():
      if path[0] == layout.stack.name:
        names = np.empty((len(rows),) + leaf.names.shape[1:], object)
        names[rows >= 0] = leaf.names[rows[rows >= 0]]
        shape = (len(rows),) + leaf.spec.shape[1:]
        out[path] = leaf._replace(spec=leaf.spec._replace(shape=shape), names=names)
  return out


def kinds(cfg, infos: dict, where: str, group_size: int = 32) -> dict[str, str]:
  """{hf name: how it is stored, plain | fp8 | int4} for every tensor `cfg` needs, checked
  against the files' headers (`infos`: {name: safetensors_io.Info}): CheckpointError (one
  line naming the tensor, its file and the shapes) for a tensor missing, shaped wrongly,
  quantized with parts that do not fit, or a tensor the config has no place for."""
  out, used = {}, set()

  def file_of(name):
    return os.path.basename(infos[name].file) if infos[name].file else where

  for name, _, index, s in tensor_map(cfg):
    want = hf_shape(name, s, len(index))
    if name not in infos and name + "_packed" in infos:
      parts = [name + x for x in ("_packed", "_scale", "_shape")]
      if parts[1] not in infos:
        raise CheckpointError(f"tensor {parts[1]} is missing from {where} (INT4 weight "
                              f"{name} has its codes but no scales)")
      packed, scale = infos[parts[0]], infos[parts[1]]
      try:
        quant.int4_check(name, want, packed.dtype, packed.shape, scale.shape, group_size)
      except quant.QuantizationError as e:
        raise CheckpointError(f"{e}, in {file_of(parts[0])}") from None
      out[name] = "int4"
      used.update(p for p in parts if p in infos)
      continue
    if name not in infos:
      raise CheckpointError(f"tensor {name} is missing from {where} (expected shape "
                            f"{list(want)})")
    got = infos[name].shape
    if math.prod(got) != math.prod(want) or len(got) != len(want) or (
        len(got) == 2 and tuple(got) != tuple(want)):
      raise CheckpointError(f"tensor {name} in {file_of(name)}: expected {list(want)} for "
                            f"this config, found {list(got)}")
    used.add(name)
    out[name] = "plain"
    if (scale := name + "_scale_inv") in infos:
      try:
        quant.fp8_check(name, want, infos[scale].shape)
      except quant.QuantizationError as e:
        raise CheckpointError(f"{e}, in {file_of(scale)}") from None
      used.add(scale)
      out[name] = "fp8"
  extra = [n for n in infos if n not in used and not _ignorable(n, cfg)]
  if extra:
    raise CheckpointError(f"tensor {extra[0]} (and {len(extra) - 1} more) in {where} has no "
                          "place in this config: is config.json the one for these weights?")
  return out


def _ignorable(name: str, cfg) -> bool:
  if name.endswith(_IGNORED_SUFFIXES):
    return True
  parts = name.split(".")
  # DeepSeek-V3's multi-token-prediction module lives in extra layers past the last one.
  return (len(parts) > 2 and parts[1] == "layers" and parts[2].isdigit()
          and int(parts[2]) >= cfg.num_hidden_layers)
