"""Quantized weights of the published K2 releases, dequantized on load.

FP8 (Kimi-K2-Instruct, DeepSeek-V3) lives in hf.py. INT4 is the later releases' format for
routed experts (K2-Thinking onward): compressed-tensors "pack-quantized", symmetric, one
scale per `group_size` (32) input columns. Per linear weight W [out, in]:

    weight_packed  int32 [out, in / 8]: eight 4-bit codes per word along `in`, code j of a
                   word in bits 4j .. 4j + 3, each code = q + 8 for q in [-8, 7]
    weight_scale   [out, in / group_size] (bf16)
    weight_shape   [2] = (out, in)

    W[i, j] = (code(i, j) - 8) * weight_scale[i, j // group_size]
"""

import numpy as np


class QuantizationError(ValueError):
  """A quantized tensor whose parts do not fit together (names the tensor and shapes)."""


def int4_group_size(hf_config: dict, default: int = 32) -> int:
  """group_size of the compressed-tensors quantization_config (default 32)."""
  q = hf_config.get("quantization_config") or {}
  for group in (q.get("config_groups") or {}).values():
    w = group.get("weights") or {}
    if w.get("num_bits") == 4 and w.get("group_size"):
      return int(w["group_size"])
  return default


def dequantize_int4(name: str, packed: np.ndarray, scale: np.ndarray, shape=None,
                    group_size: int = 32) -> np.ndarray:
  """float32 W [out, in] from pack-quantized parts (see the module docstring)."""
  packed = np.asarray(packed)
  if packed.dtype != np.int32 or packed.ndim != 2:
    raise QuantizationError(f"{name}_packed: expected int32 [out, in / 8], got "
                            f"{packed.dtype} {list(packed.shape)}")
  rows = packed.shape[0]
  cols = int(np.asarray(shape).reshape(-1)[1]) if shape is not None else packed.shape[1] * 8
  if -(-cols // 8) != packed.shape[1]:
    raise QuantizationError(f"{name}_packed: {packed.shape[1]} words per row cannot hold {cols} "
                            "4-bit columns")
  words = packed.view(np.uint32)[:, :, None] >> (4 * np.arange(8, dtype=np.uint32))
  q = ((words & 0xF).astype(np.int8) - 8).reshape(rows, -1)[:, :cols]
  groups = -(-cols // group_size)
  scale = np.asarray(scale, np.float32)
  if scale.shape != (rows, groups):
    raise QuantizationError(f"{name}_scale of shape {list(scale.shape)} does not match a "
                            f"{[rows, cols]} weight in groups of {group_size} (expected "
                            f"{[rows, groups]})")
  return q.astype(np.float32) * np.repeat(scale, group_size, axis=1)[:, :cols]
