"""MXFP4 expert weights (gpt-oss's released checkpoints), dequantized at load.

Layout (transformers' integrations/mxfp4.py, the checkpoints' own): an expert stack `X`
[E, in, out] in float is stored as `X_blocks` uint8 [E, out, in / 32, 16] and `X_scales`
uint8 [E, out, in / 32]: per (expert, output row) groups of 32 inputs, each group 16 bytes of
two FP4 (e2m1) codes -- the low nibble is the even element, the high nibble the odd one --
and one e8m0 scale, a power of two biased by 127. Value = FP4[code] * 2^(scale - 127), with
FP4 codes 0-7 = +0, 0.5, 1, 1.5, 2, 3, 4, 6 and 8-15 their negatives.

Data flow: config.json's quantization_config {"quant_method": "mxfp4"} ->
`wrap_mxfp4(tensors)` replaces every `X_blocks` / `X_scales` pair by one lazy `Mxfp4Stack`
named `X`, a float32 [E, in, out] HostArray (the float stack transformers' dequantization
gives, transposed as the family expects), so the family's loader reads it like a bf16
checkpoint's: a box decodes only the experts, output rows and 32-input groups it covers.
The experts are then served as float weights of the load dtype (4x-8x the MXFP4 bytes);
serving MXFP4 itself is not implemented.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from .host_arrays import HostArray, normalize_box
from .safetensors_io import CheckpointError

# FP4 e2m1 code -> value (sign bit 3, two exponent bits, one mantissa bit).
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
GROUP = 32  # inputs per scale (16 bytes of two codes)


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks u8[..., G, 16] and scales u8[..., G] -> f32[..., G * 32] (checkpoint order:
    the last axis is the input axis)."""
    blocks, scales = np.asarray(blocks, np.uint8), np.asarray(scales, np.uint8)
    vals = np.empty((*blocks.shape[:-1], 2 * blocks.shape[-1]), np.float32)
    vals[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    vals[..., 1::2] = FP4_VALUES[blocks >> 4]
    vals = np.ldexp(vals, scales.astype(np.int32)[..., None] - 127)
    return vals.reshape(*vals.shape[:-2], -1)


class Mxfp4Stack:
    """`X_blocks` / `X_scales` seen as the float32 stack [E, in, out] (module docstring)."""

    def __init__(self, name: str, blocks: HostArray, scales: HostArray) -> None:
        b, s = tuple(blocks.shape), tuple(scales.shape)
        if len(b) != 4 or b[-1] != 16 or b[:3] != s:
            raise CheckpointError(f"{name}_blocks {list(b)} / {name}_scales {list(s)}: expected "
                                  "[E, out, in/32, 16] and [E, out, in/32] (MXFP4)")
        if np.dtype(blocks.dtype) != np.uint8 or np.dtype(scales.dtype) != np.uint8:
            raise CheckpointError(f"{name}_blocks / _scales must be uint8, got {blocks.dtype} / "
                                  f"{scales.dtype}")
        self.name, self.blocks, self.scales = name, blocks, scales
        self.shape = (b[0], b[2] * GROUP, b[1])
        self.dtype = np.dtype(np.float32)

    @property
    def ndim(self) -> int:
        return 3

    def __getitem__(self, index: object) -> np.ndarray:
        e, i, o = normalize_box(index, self.shape, f"MXFP4 stack {self.name}")
        g0, g1 = i.start // GROUP, -(-i.stop // GROUP)
        vals = dequantize(self.blocks[e, o, g0:g1], self.scales[e, o, g0:g1])  # [e, o, in']
        vals = vals[..., i.start - g0 * GROUP:i.stop - g0 * GROUP]
        return np.ascontiguousarray(vals.transpose(0, 2, 1))

    def __repr__(self) -> str:
        return f"Mxfp4Stack({self.name}, {list(self.shape)})"


def wrap_mxfp4(tensors: Mapping[str, HostArray], qc: Mapping[str, object],
               source: str) -> dict[str, HostArray]:
    """The checkpoint's tensors with each MXFP4 pair made one `Mxfp4Stack` (module doc)."""
    out = dict(tensors)
    for name in [n for n in tensors if n.endswith("_blocks")]:
        stem = name[:-len("_blocks")]
        if stem + "_scales" not in tensors:
            raise CheckpointError(f"{source}: {name} has no {stem}_scales beside it (MXFP4)")
        out[stem] = Mxfp4Stack(stem, out.pop(name), out.pop(stem + "_scales"))
    if not any(isinstance(v, Mxfp4Stack) for v in out.values()):
        raise CheckpointError(f"{source}: quantization_config quant_method 'mxfp4' but no "
                              "*_blocks / *_scales tensor pairs were found")
    return out
