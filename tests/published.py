"""Checkpoints in the published layout for the loading tests, and the whole-model reference
they are loaded against, by code that shares nothing with k2jax.interop's reading: files
written and read by safetensors' own torch frontend, FP8 and INT4 quantized as
tests/hf_reference does it, dequantized here by the formulas of the formats' descriptions,
every tensor whole in float32, then cast to the leaf's dtype (what the loader promises)."""

import glob
import json
import math
import os

import jax
import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from k2jax.interop import hf, hf_format
from tests import hf_reference as ref


def arch(**kw) -> dict:
  """A DeepSeek-V3-shaped architecture (the parity tests' with other sizes), small, with
  sizes that cut FP8's 128-blocks and INT4's 32-groups unevenly and split over 2, 4 and 8
  devices."""
  from tests.test_hf_parity import arch as parity
  return parity(**{**dict(vocab_size=136, hidden_size=160, intermediate_size=224,
                          moe_intermediate_size=96, q_lora_rank=144, kv_lora_rank=40,
                          v_head_dim=16, n_group=2, routed_scaling_factor=2.5), **kw})


INT4_CONFIG = {"quant_method": "compressed-tensors", "format": "pack-quantized",
               "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                   "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                   "group_size": 32}}}}


def write(path, a: dict, kind: str = "bf16", seed: int = 0, files: int = 3) -> dict:
  """A random checkpoint of architecture `a` in `files` safetensors files + index: kind bf16
  (bf16 tensors, the router bias float32), fp8 (decoder linears FP8 + scale_inv, as
  Kimi-K2-Instruct), int4 (routed experts INT4 pack-quantized, the rest bf16, as
  K2-Thinking). Returns config.json's dict."""
  cj = ref.hf_config_dict(a, None, 10000.0)
  cfg = hf.config_from_hf(cj)
  g = torch.Generator().manual_seed(seed)
  tensors = {}
  for name, _, index, s in hf.tensor_map(cfg):
    shape = hf_format.hf_shape(name, s, len(index))
    tensors[name] = torch.randn(shape, generator=g) / math.sqrt(shape[-1])
  if kind == "fp8":
    tensors, _ = ref.fp8_quantize(tensors)
    cj["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                 "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
  elif kind == "int4":
    tensors, _ = ref.int4_quantize(tensors)
    cj["quantization_config"] = INT4_CONFIG
  for k, v in tensors.items():
    if v.dtype == torch.float32 and not k.endswith(("_scale_inv", "e_score_correction_bias")):
      tensors[k] = v.to(torch.bfloat16)
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(cj, f)
  names = list(tensors)
  groups = [names[i::files] for i in range(files)]
  weight_map = {}
  for i, group in enumerate(groups):
    fname = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
    save_file({n: tensors[n].contiguous() for n in group}, os.path.join(path, fname),
              metadata={"format": "pt"})
    weight_map.update({n: fname for n in group})
  with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {}, "weight_map": weight_map}, f)
  return cj


def tensor_bytes(path, skip: tuple = ("weight_shape",)) -> int:
  """Bytes of the tensors in the directory's files (their data, not the headers), but those
  named `skip` (INT4's weight_shape: the loader takes shapes from the config, checked
  against the packed words' and scales' shapes)."""
  total = 0
  for f in glob.glob(os.path.join(path, "*.safetensors")):
    with safe_open(f, "pt") as h:
      for k in h.keys():
        if k.endswith(skip):
          continue
        t = h.get_slice(k)
        total += math.prod(t.get_shape()) * {"F32": 4, "BF16": 2, "F8_E4M3": 1, "I32": 4,
                                             "I64": 8}[t.get_dtype()]
  return total


def _dequantized(tensors: dict, name: str, group: int = 32) -> np.ndarray:
  """float32 published tensor `name`, dequantized by the formats' formulas."""
  if name + "_scale_inv" in tensors:                                          # FP8
    q, s = tensors[name].float(), tensors[name + "_scale_inv"].float()
    rows, cols = q.shape
    s = s.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
    return (q * s).numpy()
  if name + "_packed" in tensors:                                              # INT4
    words = tensors[name + "_packed"].numpy().astype(np.int64) & 0xFFFFFFFF
    rows, cols = (int(x) for x in tensors[name + "_shape"])
    codes = np.stack([(words >> (4 * j)) & 0xF for j in range(8)], -1).reshape(rows, -1)
    q = codes[:, :cols].astype(np.float32) - 8
    s = tensors[name + "_scale"].float().numpy()
    return q * np.repeat(s, group, axis=1)[:, :cols]
  return tensors[name].float().numpy()


def load_whole(path, cfg) -> dict:
  """{param path: whole numpy array in the leaf's stored dtype} (see the module docstring)."""
  tensors = {}
  for f in glob.glob(os.path.join(path, "*.safetensors")):
    with safe_open(f, "pt") as h:
      for k in h.keys():
        tensors[k] = h.get_tensor(k)
  dtypes = {tuple(k.key for k in p): np.dtype(a.dtype) for p, a in
            jax.tree_util.tree_flatten_with_path(hf.stored_dtypes(cfg))[0]}
  out = {}
  for name, path_, index, s in hf.tensor_map(cfg):
    w = _dequantized(tensors, name)
    shape = s.shape[len(index):]
    if w.ndim == 2 and name != hf_format.EMBED:
      w = w.T          # published [out, in] -> ours [*in, *out]
    if path_ not in out:
      out[path_] = np.zeros(s.shape, np.float32)
    out[path_][index] = w.reshape(shape)
  return {p: a.astype(dtypes[p]) if dtypes[p] != np.float32 else a for p, a in out.items()}


def bits(a) -> np.ndarray:
  """An array's bits, for exact comparisons that NaN or -0.0 cannot fool."""
  a = np.asarray(a)
  return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])
