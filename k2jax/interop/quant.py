"""Quantized weights of the published K2 releases, dequantized block by block on load.

Both formats scale a linear weight W [out, in] (PyTorch's orientation) by blocks, so any
rectangle of W dequantizes from the same rectangle of its codes and the scales that cover
it: a loader reads and dequantizes only the slice a device holds.

FP8 (Kimi-K2-Instruct, DeepSeek-V3): float8_e4m3fn codes and a float32 `weight_scale_inv`
of shape [ceil(out / 128), ceil(in / 128)]:

    W[i, j] = q[i, j] * scale_inv[i // 128, j // 128]

INT4 (routed experts of K2-Thinking onward): compressed-tensors "pack-quantized",
symmetric, one scale per `group_size` (32) input columns:

    weight_packed  int32 [out, ceil(in / 8)]: eight 4-bit codes per word along `in`, code j
                   of a word in bits 4j .. 4j + 3, each code = q + 8 for q in [-8, 7]
    weight_scale   [out, ceil(in / group_size)] (bf16)
    weight_shape   [2] = (out, in)

    W[i, j] = (code(i, j) - 8) * weight_scale[i, j // group_size]

Dequantized values are float32 (exact products of the codes and scales), then cast by the
caller to the stored dtype.
"""

import math

import ml_dtypes
import numpy as np

FP8_BLOCK = 128


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


# --------------------------------------------------------------------------- shapes


def fp8_scale_shape(shape, block: int = FP8_BLOCK) -> tuple:
  return tuple(math.ceil(n / block) for n in shape)


def int4_shapes(shape, group_size: int) -> tuple[tuple, tuple]:
  """(weight_packed, weight_scale) shapes of an INT4 weight of `shape` = (out, in)."""
  rows, cols = shape
  return (rows, math.ceil(cols / 8)), (rows, math.ceil(cols / group_size))


def fp8_check(name: str, shape, scale_shape, block: int = FP8_BLOCK) -> None:
  want = fp8_scale_shape(shape, block)
  if tuple(scale_shape) != want:
    raise QuantizationError(f"{name}_scale_inv of shape {list(scale_shape)} does not tile a "
                            f"{list(shape)} weight in {block}x{block} blocks (expected "
                            f"{list(want)})")


def int4_check(name: str, shape, packed_dtype, packed_shape, scale_shape,
               group_size: int) -> None:
  if np.dtype(packed_dtype) != np.int32 or len(packed_shape) != 2:
    raise QuantizationError(f"{name}_packed: expected int32 [out, in / 8], got "
                            f"{np.dtype(packed_dtype)} {list(packed_shape)}")
  want_packed, want_scale = int4_shapes(shape, group_size)
  if tuple(packed_shape) != want_packed:
    raise QuantizationError(f"{name}_packed: {packed_shape[1]} words per row cannot hold "
                            f"{shape[1]} 4-bit columns (or {packed_shape[0]} rows are not "
                            f"{shape[0]})")
  if tuple(scale_shape) != want_scale:
    raise QuantizationError(f"{name}_scale of shape {list(scale_shape)} does not match a "
                            f"{list(shape)} weight in groups of {group_size} (expected "
                            f"{list(want_scale)})")


# --------------------------------------------------------------------------- on the host
# (the loader dequantizes on the devices, k2jax.interop.loader.dequantize; these serve tests
# and tools that hold a whole tensor)


def fp8_block(q: np.ndarray, scale_inv: np.ndarray, rows: slice, cols: slice,
              block: int = FP8_BLOCK) -> np.ndarray:
  """float32 W[rows, cols] from its codes and the scale_inv blocks covering them."""
  r = np.arange(rows.start, rows.stop) // block - rows.start // block
  c = np.arange(cols.start, cols.stop) // block - cols.start // block
  return q.astype(np.float32) * scale_inv.astype(np.float32)[r[:, None], c[None, :]]


# --------------------------------------------------------------------------- whole tensors


def dequantize_fp8(q: np.ndarray, scale_inv: np.ndarray, block: int = FP8_BLOCK) -> np.ndarray:
  """float32 W from a whole FP8 weight and its scale_inv."""
  fp8_check("weight", q.shape, scale_inv.shape, block)
  return fp8_block(q, scale_inv, slice(0, q.shape[0]), slice(0, q.shape[1]), block)


def quantize_fp8(w: np.ndarray, block: int = FP8_BLOCK):
  """Block-wise e4m3 quantization of a float32 [out, in] weight: scale_inv = amax(block) /
  448 per 128x128 block. -> (codes, scale_inv)."""
  rows, cols = w.shape
  br, bc = math.ceil(rows / block), math.ceil(cols / block)
  padded = np.zeros((br * block, bc * block), np.float32)
  padded[:rows, :cols] = w
  blocks = padded.reshape(br, block, bc, block)
  fmax = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)
  scale_inv = np.maximum(np.abs(blocks).max(axis=(1, 3)) / fmax, 1e-12).astype(np.float32)
  q = np.clip(blocks / scale_inv[:, None, :, None], -fmax, fmax).astype(ml_dtypes.float8_e4m3fn)
  return q.reshape(br * block, bc * block)[:rows, :cols], scale_inv


def quantize_int4(w: np.ndarray, group_size: int = 32):
  """Symmetric group-wise INT4 of a float32 [out, in] weight (compressed-tensors pack-
  quantized): scale = amax(group) / 7 per `group_size` input columns, codes q + 8 packed
  eight to an int32 word. -> (weight_packed, weight_scale as bfloat16)."""
  rows, cols = w.shape
  groups = math.ceil(cols / group_size)
  padded = np.zeros((rows, groups * group_size), np.float32)
  padded[:, :cols] = w
  g = padded.reshape(rows, groups, group_size)
  scale = np.maximum(np.abs(g).max(-1) / 7.0, 1e-8).astype(ml_dtypes.bfloat16)
  q = np.clip(np.round(g / scale.astype(np.float32)[..., None]), -8, 7).reshape(rows, -1)
  words = math.ceil(cols / 8)
  codes = np.zeros((rows, words * 8), np.uint32)
  codes[:, :cols] = (q[:, :cols] + 8).astype(np.uint32)
  packed = (codes.reshape(rows, words, 8) << (4 * np.arange(8, dtype=np.uint32))).sum(
      -1, dtype=np.uint32)
  return packed.view(np.int32), scale
