"""GGUF quant blocks taken as they are: one 2-D GGUF tensor -> a `QuantizedWeight`, no floats.

Data flow: a `GGUFTensor` (HF layout [out, in], blocks of 32 along `in`) of type Q8_0, Q4_0 or
Q4_1 -> its stored bytes (rows reordered as the float path reorders them: llama.cpp's q/k
head permutation undone) -> the block fields split with numpy views (f16 scale, f16 min, the
32 quants) -> transposed to the models' [in, out] layout:
  Q8_0: w = d * q, q int8                     -> int8, groups of 32 rows, scales d
  Q4_0: w = d * (q - 8), q 4-bit              -> int4, groups of 32, scales d, zeros -8 d
  Q4_1: w = d * q + m, q 4-bit                -> int4, groups of 32, scales d, zeros m
Every other type has no such exact mapping here: `block_scheme` says None and the loader
dequantizes it and quantizes the float (with a log line).
"""

from __future__ import annotations

import numpy as np

from .gguf_tensor import GGUFTensor
from .quant import QuantizedWeight, pack_int4

BLOCK = 32
_SCHEMES = {"Q8_0": "int8", "Q4_0": "int4", "Q4_1": "int4"}


def block_scheme(tensor: object) -> str | None:
    """The scheme a tensor's blocks map onto exactly, or None (float, K-quants, ...)."""
    if not isinstance(tensor, GGUFTensor) or tensor.ndim != 2:
        return None
    return _SCHEMES.get(tensor.type_name)


def _f16(raw: np.ndarray, at: int) -> np.ndarray:
    """The f16 field at byte `at` of every block -> f32 [rows, blocks]."""
    return np.ascontiguousarray(raw[..., at:at + 2]).view(np.float16)[..., 0].astype(np.float32)


def quantized_blocks(tensor: GGUFTensor) -> QuantizedWeight:
    """The tensor's weight [in, out] (HF's [out, in] transposed) as a QuantizedWeight of numpy
    arrays, straight from its blocks."""
    scheme = block_scheme(tensor)
    if scheme is None:
        raise ValueError(f"{tensor.path}: tensor {tensor.info.name!r} ({tensor.type_name}) has "
                         "no exact int8 / int4 block mapping")
    out_f, in_f = tensor.shape
    rows = tensor._stored_rows(np.arange(out_f))
    raw = tensor._raw()[rows].reshape(out_f, in_f // BLOCK, tensor.type_size)
    d = _f16(raw, 0)  # [out, blocks]
    if tensor.type_name == "Q8_0":
        q = np.ascontiguousarray(raw[..., 2:]).view(np.int8).reshape(out_f, in_f)
        return QuantizedWeight(np.ascontiguousarray(q.T), np.ascontiguousarray(d.T),
                               None, "int8")
    if tensor.type_name == "Q4_1":
        zeros, qs = _f16(raw, 2), raw[..., 4:]
    else:
        zeros, qs = -8.0 * d, raw[..., 2:]
    # Byte j of a block holds quant j (low nibble) and quant j + 16 (high nibble).
    q = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(out_f, in_f)
    return QuantizedWeight(pack_int4(np.ascontiguousarray(q.T)), np.ascontiguousarray(d.T),
                           np.ascontiguousarray(zeros.T), "int4")
