"""The PyTorch reference: transformers' DeepseekV3ForCausalLM with random weights, saved in the
published K2 / DeepSeek-V3 layout (per-expert names, optional FP8 blocks) by code that
shares nothing with k2jax.interop, plus a hook that records the reference's own per-head
max scaled attention logit."""

import json
import math
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.torch import save_file  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_mod  # noqa: E402


def hf_config_dict(arch: dict, yarn: dict | None, rope_theta: float) -> dict:
  """config.json in the published style: top-level rope_theta + rope_scaling (or null)."""
  return {**arch, "rope_theta": rope_theta, "rope_scaling": yarn,
          "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
          "num_key_value_heads": arch["num_attention_heads"], "hidden_act": "silu",
          "tie_word_embeddings": False, "attention_bias": False, "torch_dtype": "float32",
          "topk_method": "noaux_tc", "scoring_func": "sigmoid", "num_nextn_predict_layers": 0,
          "max_position_embeddings": arch.get("max_position_embeddings", 4096)}


def make_model(config_json: dict, seed: int):
  kw = {k: v for k, v in config_json.items() if k not in ("architectures", "torch_dtype")}
  cfg = transformers.DeepseekV3Config(**kw)
  torch.manual_seed(seed)
  model = hf_mod.DeepseekV3ForCausalLM._from_config(cfg, attn_implementation="eager",
                                                    dtype=torch.float32).eval()
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():  # random everything, incl. norms and the router correction bias
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
      if "inv_freq" in name:
        continue
      if name.endswith("norm.weight"):
        p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
      elif name.endswith("e_score_correction_bias"):
        p.copy_(0.3 * torch.randn(p.shape, generator=g))
      else:
        p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
  return model


def published_tensors(model) -> dict:
  """In-memory (fused experts) state dict -> published per-expert tensor names."""
  ff = model.config.moe_intermediate_size
  out = {}
  for k, v in model.state_dict().items():
    if "rotary_emb" in k:
      continue
    if k.endswith("mlp.experts.gate_up_proj"):          # [E, 2 ff, d]: gate rows then up rows
      pre = k[:-len("gate_up_proj")]
      for e in range(v.shape[0]):
        out[f"{pre}{e}.gate_proj.weight"] = v[e, :ff].contiguous()
        out[f"{pre}{e}.up_proj.weight"] = v[e, ff:].contiguous()
    elif k.endswith("mlp.experts.down_proj"):           # [E, d, ff]
      pre = k[:-len("down_proj")]
      for e in range(v.shape[0]):
        out[f"{pre}{e}.down_proj.weight"] = v[e].contiguous()
    else:
      out[k] = v.contiguous()
  return out


def fp8_quantize(tensors: dict, block: int = 128):
  """Decoder-layer *_proj weights -> float8_e4m3fn + weight_scale_inv (amax / 448 per block).

  Returns (quantized tensors, dequantized float32 tensors for the reference model)."""
  fmax = torch.finfo(torch.float8_e4m3fn).max
  q_out, deq = {}, {}
  for name, w in tensors.items():
    if not (name.startswith("model.layers.") and name.endswith("_proj.weight")):
      q_out[name], deq[name] = w, w
      continue
    rows, cols = w.shape
    br, bc = math.ceil(rows / block), math.ceil(cols / block)
    scale = torch.empty(br, bc)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(br):
      for j in range(bc):
        blk = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
        scale[i, j] = max(blk.abs().max().item() / fmax, 1e-12)
        q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (blk / scale[i, j]).to(
            torch.float8_e4m3fn)
    q_out[name], q_out[name + "_scale_inv"] = q, scale
    deq[name] = q.float() * scale.repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
  return q_out, deq


def write_dir(path, config_json, tensors, fp8=False):
  os.makedirs(path, exist_ok=True)
  cj = dict(config_json)
  if fp8:
    cj["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                 "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(cj, f)
  save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


def reference_forward(model, tokens: np.ndarray, monkeypatch):
  """float32 logits [B, T, V] and the reference's own max scaled logits [layers, heads]."""
  maxima = []
  eager = hf_mod.eager_attention_forward

  def recording(module, query, key, value, attention_mask, scaling, **kw):
    logits = torch.matmul(query, key.transpose(2, 3)) * scaling        # [B, H, T, S]
    T, S = logits.shape[-2:]
    causal = torch.ones(T, S, dtype=torch.bool).tril(S - T)
    maxima.append(logits.masked_fill(~causal, float("-inf")).amax(dim=(0, 2, 3)))
    return eager(module, query, key, value, attention_mask, scaling=scaling, **kw)

  monkeypatch.setattr(hf_mod, "eager_attention_forward", recording)
  with torch.no_grad():
    out = model(input_ids=torch.as_tensor(tokens, dtype=torch.long), use_cache=False)
  return out.logits.float().numpy(), torch.stack(maxima).numpy()


def int4_quantize(tensors: dict, group: int = 32):
  """Routed experts -> compressed-tensors pack-quantized INT4 (symmetric, `group` columns per
  scale), written from the format's description: code = q + 8 in [0, 15], eight codes per
  int32 along the input dim, code j in bits 4j..4j+3; scale = amax(group) / 7.

  Returns (tensors with weight_packed / weight_scale / weight_shape for expert weights,
  dequantized float32 tensors for the reference model)."""
  q_out, deq = {}, {}
  for name, w in tensors.items():
    if ".mlp.experts." not in name or not name.endswith("_proj.weight"):
      q_out[name], deq[name] = w, w
      continue
    w = w.float().numpy()
    rows, cols = w.shape
    g = w.reshape(rows, cols // group, group)
    scale = np.maximum(np.abs(g).max(-1) / 7.0, 1e-8).astype(np.float32)
    q = np.clip(np.round(g / scale[..., None]), -8, 7).astype(np.int64).reshape(rows, cols)
    codes = (q + 8).reshape(rows, cols // 8, 8)
    words = np.zeros((rows, cols // 8), np.int64)
    for j in range(8):
      words |= codes[:, :, j] << (4 * j)
    packed = words.astype(np.uint32).view(np.int32)
    base = name[:-len("weight")]
    q_out[base + "weight_packed"] = torch.from_numpy(packed.copy())
    q_out[base + "weight_scale"] = torch.from_numpy(scale).to(torch.bfloat16)
    q_out[base + "weight_shape"] = torch.tensor([rows, cols], dtype=torch.int64)
    s = q_out[base + "weight_scale"].float().numpy()
    deq[name] = torch.from_numpy((q.reshape(rows, -1, group) * s[..., None]).reshape(rows, cols)
                                 .astype(np.float32))
  return q_out, deq
