"""GGUF quant blocks taken as they are: one 2-D GGUF tensor -> a `QuantizedWeight`, no floats.

Data flow: a `GGUFTensor` (HF layout [out, in], blocks of 32 or 256 along `in`) of a type in
`_SCHEMES` -> its stored bytes (rows reordered as the float path reorders them: llama.cpp's q/k
head permutation undone) -> the block fields split with numpy views -> transposed to the
models' [in, out] layout, one scale (and zero) per group of G input rows:
  Q8_0: w = d * q, q int8                     -> int8, G 32, scales d
  Q4_0: w = d * (q - 8), q 4-bit              -> int4, G 32, scales d, zeros -8 d
  Q4_1: w = d * q + m, q 4-bit                -> int4, G 32, scales d, zeros m
  Q4_K: 256-blocks of 8 sub-blocks of 32, 6-bit sub-scales sc and sub-mins m:
        w = d * sc * q - dmin * m, q 4-bit    -> int4, G 32, scales d sc, zeros -dmin m
  Q6_K: 256-blocks of 16 sub-blocks of 16, int8 sub-scales sc:
        w = d * sc * (q - 32), q 6-bit        -> int8, G 16, scales d sc, values q - 32
The scale and zero products are exact in f32 (an f16 times an integer of at most 8 bits), and
so is q * scale, so `QuantizedWeight.dequantize` gives gguf-py's dequantization bit for bit.
Every other type (Q5_0 / Q5_1 / Q5_K / Q2_K / Q3_K / IQ*...) has no exact mapping onto an int4
or int8 layout here (5- and 3-bit values, or a non-affine code book): `block_scheme` says None
and the loader dequantizes it and quantizes the float (with a log line).
"""

from __future__ import annotations

import numpy as np

from .gguf_tensor import GGUFTensor
from .quant import QuantizedWeight, pack_int4

# type -> (scheme, input rows per group)
_SCHEMES = {"Q8_0": ("int8", 32), "Q4_0": ("int4", 32), "Q4_1": ("int4", 32),
            "Q4_K": ("int4", 32), "Q6_K": ("int8", 16)}


def block_scheme(tensor: object) -> str | None:
    """The scheme a tensor's blocks map onto exactly, or None (float, Q5 / Q2 / Q3 ...)."""
    if not isinstance(tensor, GGUFTensor) or tensor.ndim != 2 or tensor.shift:
        return None  # a shifted tensor's stored blocks are not its values
    return _SCHEMES.get(tensor.type_name, (None, 0))[0]


def block_group(tensor: GGUFTensor) -> int:
    """The input rows per scale of the exact mapping (`block_scheme` not None)."""
    return _SCHEMES[tensor.type_name][1]


def _f16(raw: np.ndarray, at: int) -> np.ndarray:
    """The f16 field at byte `at` of every block -> f32 [rows, blocks]."""
    return np.ascontiguousarray(raw[..., at:at + 2]).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray, axis: int) -> np.ndarray:
    """u8 [..., n, ...] -> [..., 2, n, ...] at `axis`: the low nibbles, then the high ones."""
    return np.stack([qs & 15, qs >> 4], axis=axis)


def _q4_k(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K blocks u8 [out, nb, 144] -> (q u8 [out, nb * 256], scales, zeros f32 [out, nb * 8]).

    Bytes: d f16, dmin f16, 12 bytes of eight 6-bit (sc, m) pairs, 128 bytes of quants. Sub-
    block j < 4: sc = b[j] & 63, m = b[j + 4] & 63; j >= 4: the low 4 bits from b[j + 4]'s low
    (sc) / high (m) nibble, the top 2 from the top 2 bits of b[j - 4] (sc) / b[j] (m). Quant
    byte 32 c + i holds element i of sub-block 2 c (low nibble) and of 2 c + 1 (high)."""
    out_f, nb, _ = raw.shape
    d, dmin = _f16(raw, 0)[..., None], _f16(raw, 2)[..., None]
    b = raw[..., 4:16]
    lo, mid, hi = b[..., 0:4], b[..., 4:8], b[..., 8:12]
    sc = np.concatenate([lo & 63, (hi & 15) | ((lo >> 6) << 4)], axis=-1)
    m = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=-1)
    q = _nibbles(raw[..., 16:].reshape(out_f, nb, 4, 32), 3)  # [out, nb, 4, 2, 32]
    scales = (d * sc.astype(np.float32)).reshape(out_f, nb * 8)
    zeros = -(dmin * m.astype(np.float32)).reshape(out_f, nb * 8)
    return q.reshape(out_f, nb * 256), scales, zeros


def _q6_k(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q6_K blocks u8 [out, nb, 210] -> (q - 32 as i8 [out, nb * 256], scales f32 [out, nb * 16]).

    Bytes: 128 of low 4 bits, 64 of high 2 bits, 16 int8 sub-scales, d f16. Element
    128 h + 64 n + i takes nibble n of low byte 64 h + i; element 128 h + 32 s + i takes bits
    2 s, 2 s + 1 of high byte 32 h + i."""
    out_f, nb, _ = raw.shape
    low = _nibbles(raw[..., 0:128].reshape(out_f, nb, 2, 64), 3).reshape(out_f, nb, 2, 128)
    qh = raw[..., 128:192].reshape(out_f, nb, 2, 1, 32)
    shifts = np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
    high = ((qh >> shifts) & 3).reshape(out_f, nb, 2, 128)
    q = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8)
    sc = np.ascontiguousarray(raw[..., 192:208]).view(np.int8).astype(np.float32)
    scales = (_f16(raw, 208)[..., None] * sc).reshape(out_f, nb * 16)
    return q.reshape(out_f, nb * 256), scales


def quantized_blocks(tensor: GGUFTensor) -> QuantizedWeight:
    """The tensor's weight [in, out] (HF's [out, in] transposed) as a QuantizedWeight of numpy
    arrays, straight from its blocks."""
    scheme = block_scheme(tensor)
    if scheme is None:
        raise ValueError(f"{tensor.path}: tensor {tensor.info.name!r} ({tensor.type_name}) has "
                         "no exact int8 / int4 block mapping")
    out_f, in_f = tensor.shape
    rows = tensor._stored_rows(np.arange(out_f))
    raw = tensor._raw()[rows].reshape(out_f, in_f // tensor.block, tensor.type_size)

    def t(a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a.T)

    if tensor.type_name == "Q4_K":
        q, scales, zeros = _q4_k(raw)
        return QuantizedWeight(pack_int4(t(q)), t(scales), t(zeros), "int4")
    if tensor.type_name == "Q6_K":
        q6, scales = _q6_k(raw)
        return QuantizedWeight(t(q6), t(scales), None, "int8")
    d = _f16(raw, 0)  # [out, blocks]
    if tensor.type_name == "Q8_0":
        q8 = np.ascontiguousarray(raw[..., 2:]).view(np.int8).reshape(out_f, in_f)
        return QuantizedWeight(t(q8), t(d), None, "int8")
    if tensor.type_name == "Q4_1":
        zeros, qs = _f16(raw, 2), raw[..., 4:]
    else:
        zeros, qs = -8.0 * d, raw[..., 2:]
    # Byte j of a block holds quant j (low nibble) and quant j + 16 (high nibble).
    q = _nibbles(qs, -2).reshape(out_f, in_f)
    return QuantizedWeight(pack_int4(t(q)), t(d), t(zeros), "int4")
