"""HF compressed-tensors checkpoints (llm-compressor's format, served by vLLM): 8-bit weights
with per-channel or per-tensor scales, read as they are stored.

Data flow: config.json's `quantization_config` (quant_method "compressed-tensors") ->
`parse_config` -> `CompressedConfig` (every variant this loader cannot take exactly is a
CheckpointError naming the config key and its value) -> `wrap_tensors` over the checkpoint's
{name: memmap}: each quantized linear's tensors
  `X.weight`        F8_E4M3 / I8 [out, in]        (float-quantized, int-quantized, naive)
  `X.weight_packed` I32 [out, ceil(in / 4)]       (pack-quantized, 8 bits: value + 128 in byte
                                                   j of each little-endian int32 = column 4i + j)
  `X.weight_shape`  I32 [2] = [out, in]           (pack-quantized)
  `X.weight_scale`  F32 / BF16 / F16 [out, 1] (channel) or [1] / [] (tensor)
become one `CompressedTensor` under `X.weight` (W = q * scale per output row). It is two
things at once:
  - to `hf_loader.host_params_from_hf` and the float path (quantization "none", or another
    scheme than the stored one), a float32 [out, in] `HostArray`: a box reads the values it
    covers and multiplies them by their rows' scales, so placement still reads per device;
  - to `quantized_params`, `.values` (an int8 / fp8 [out, in] view of the file) and `.scale`
    (f32 [out], a per-tensor scale repeated): `quantized_weight` makes the layers' values one
    transposed, stacked `LazyLeaf` ([L, in, out], read per device box like any leaf) and the
    scales one f32 [L, 1, out] array: a per-column `QuantizedWeight`, no float round trip.
The tensors say which linears are quantized (a weight_scale beside them): those the checkpoint
leaves float (`ignore`, e.g. the lm_head) have none and stay as they are, so `targets` and
`ignore` need no interpreting here. Activations: the checkpoint's dynamic per-token fp8 activations (W8A8) are kept
where the platform has fp8 matmuls (`quantized_params` decides); int8 activations run
weight-only.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

import ml_dtypes
import numpy as np

from .host_arrays import HostArray, LazyLeaf, normalize_box
from .quant import QuantizedWeight
from .safetensors_io import CheckpointError

_FORMATS = {"float-quantized": "float", "int-quantized": "int", "naive-quantized": None,
            "pack-quantized": "int"}
_VALUE_DTYPES = {"fp8": np.dtype(ml_dtypes.float8_e4m3fn), "int8": np.dtype(np.int8)}
_SCALE_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))
# Tensors of variants not taken here (asymmetric, group order, static activation scales, NVFP4
# global scales, KV cache scales): their presence contradicts a config that passed the checks.
_UNSUPPORTED_SUFFIXES = ("weight_zero_point", "weight_g_idx", "weight_global_scale",
                         "input_scale", "input_zero_point", "output_scale", "k_scale", "v_scale")


@dataclasses.dataclass(frozen=True)
class CompressedConfig:
    """What a compressed-tensors checkpoint stores (one scheme for every quantized linear)."""

    scheme: str  # "fp8" | "int8": the stored values
    strategy: str  # "channel" | "tensor": one scale per output row, or one per tensor
    packed: bool  # pack-quantized: 8-bit values four to an int32 (`weight_packed`)
    activations: str | None  # "fp8" | "int8": made for dynamic activations; None: weight-only
    source: str = "config.json"


def _bad(source: str, key: str, value: object, why: str) -> CheckpointError:
    return CheckpointError(f"{source}: quantization_config.{key}={value!r} {why}")


def _args(d: object, key: str, source: str, activations: bool) -> tuple[str, str]:
    """One QuantizationArgs object checked -> (type "float" | "int", strategy)."""
    if not isinstance(d, dict):
        raise _bad(source, key, d, "must be an object of quantization arguments")
    num_bits, kind = d.get("num_bits", 8), d.get("type", "int")
    kind = kind.lower() if isinstance(kind, str) else kind  # the format's own parser lowercases
    strategy = d.get("strategy") or "tensor"
    if num_bits != 8:
        raise _bad(source, f"{key}.num_bits", num_bits, "is not supported (only 8-bit)")
    if kind not in ("float", "int"):
        raise _bad(source, f"{key}.type", kind, "is not supported ('float' or 'int')")
    if d.get("symmetric", True) is not True:
        raise _bad(source, f"{key}.symmetric", d.get("symmetric"),
                   "is not supported (asymmetric: zero points)")
    dynamic = d.get("dynamic", False)
    if activations:
        if dynamic is not True:
            raise _bad(source, f"{key}.dynamic", dynamic, "is not supported: static activation "
                       "scales (only dynamic per-token activations)")
        if strategy not in ("token", "tensor"):
            raise _bad(source, f"{key}.strategy", strategy, "is not supported (token or tensor)")
        return kind, strategy
    if dynamic is not False:
        raise _bad(source, f"{key}.dynamic", dynamic, "is not supported for weights")
    if strategy not in ("channel", "tensor"):
        raise _bad(source, f"{key}.strategy", strategy,
                   "is not supported (channel or tensor; group / block scales are not loaded)")
    for extra in ("block_structure", "actorder"):
        if d.get(extra) not in (None, False):
            raise _bad(source, f"{key}.{extra}", d[extra], "is not supported")
    return kind, strategy


def parse_config(qc: object, source: str = "config.json") -> CompressedConfig:
    """config.json's `quantization_config` -> CompressedConfig, or CheckpointError."""
    if not isinstance(qc, dict):
        raise CheckpointError(f"{source}: quantization_config must be an object, got {qc!r}")
    method = qc.get("quant_method")
    if method != "compressed-tensors":
        raise _bad(source, "quant_method", method,
                   "is not supported (only 'compressed-tensors' checkpoints are loaded)")
    for key in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if qc.get(key) not in (None, {}):
            raise _bad(source, key, qc[key], "is not supported")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise _bad(source, "config_groups", groups, "must be a non-empty object of schemes")
    found = set()
    for name, g in groups.items():
        key = f"config_groups.{name}"
        if not isinstance(g, dict):
            raise _bad(source, key, g, "is not supported (a preset name, not a scheme object)")
        fmt = g.get("format") or qc.get("format")
        if fmt not in _FORMATS:
            raise _bad(source, "format" if not g.get("format") else f"{key}.format", fmt,
                       f"is not supported ({', '.join(_FORMATS)})")
        kind, strategy = _args(g.get("weights"), f"{key}.weights", source, False)
        if _FORMATS[fmt] not in (None, kind):
            raise _bad(source, "format", fmt, f"does not hold {kind} weights")
        if g.get("output_activations") is not None:
            raise _bad(source, f"{key}.output_activations", g["output_activations"],
                       "is not supported")
        act = g.get("input_activations")
        act_kind = None if act is None else _args(act, f"{key}.input_activations", source,
                                                   True)[0]
        found.add((kind, strategy, fmt == "pack-quantized", act_kind))
    if len(found) != 1:
        raise _bad(source, "config_groups", sorted(groups), "hold different schemes; one "
                   "scheme for every quantized layer is supported")
    kind, strategy, packed, act_kind = found.pop()
    scheme = {"float": "fp8", "int": "int8"}
    return CompressedConfig(scheme[kind], strategy, packed,
                            None if act_kind is None else scheme[act_kind], source)


class PackedInt8:
    """pack-quantized 8-bit values, i32 [out, ceil(in / 4)] -> an i8 [out, in] HostArray (a box
    reads only the int32 columns that cover it)."""

    dtype = np.dtype(np.int8)

    def __init__(self, packed: HostArray, in_features: int) -> None:
        self.packed, self.shape = packed, (packed.shape[0], in_features)

    @property
    def ndim(self) -> int:
        return 2

    def __getitem__(self, index: object) -> np.ndarray:
        rows, cols = normalize_box(index, self.shape, "pack-quantized weight")
        w0, w1 = cols.start // 4, -(-cols.stop // 4)
        words = np.ascontiguousarray(np.asarray(self.packed[rows, w0:w1]), dtype="<i4")
        # Byte 4 i + j of a row of little-endian int32s is column 4 i + j, stored as q + 128.
        raw = words.view(np.uint8).reshape(words.shape[0], 4 * (w1 - w0))
        return (raw[:, cols.start - 4 * w0:cols.stop - 4 * w0] ^ np.uint8(0x80)).view(np.int8)


class CompressedTensor:
    """One quantized linear weight [out, in]: float32 to the float path (`__getitem__`),
    values and scales to `quantized_weight`."""

    dtype = np.dtype(np.float32)

    def __init__(self, name: str, values: HostArray, scale: np.ndarray, cfg: CompressedConfig,
                 source: str) -> None:
        self.name, self.values, self.scale, self.source = name, values, scale, source
        self.scheme, self.activations = cfg.scheme, cfg.activations
        self.shape = tuple(values.shape)
        self.type_name = f"compressed-tensors {cfg.scheme} ({cfg.strategy})"

    @property
    def ndim(self) -> int:
        return 2

    def __getitem__(self, index: object) -> np.ndarray:
        box = normalize_box(index, self.shape, f"{self.source}: tensor {self.name!r}")
        return np.asarray(self.values[box], np.float32) * self.scale[box[0], None]

    def __repr__(self) -> str:
        return f"CompressedTensor({self.name}, {self.type_name}, shape={self.shape})"


def _scale(tensors: Mapping[str, HostArray], name: str, out: int, cfg: CompressedConfig,
           source: str) -> np.ndarray:
    """`name` (a weight_scale) as f32 [out], checked against the strategy."""
    s = tensors[name]
    if np.dtype(s.dtype) not in _SCALE_DTYPES:
        raise CheckpointError(f"{source}: tensor {name!r} has dtype {s.dtype}; a scale is "
                              "float32, float16 or bfloat16")
    shape = tuple(s.shape)
    ok = shape in ((out, 1), (out,)) if cfg.strategy == "channel" else math.prod(shape) == 1
    if not ok or len(shape) > 2:
        want = f"[{out}, 1]" if cfg.strategy == "channel" else "[1] or []"
        raise CheckpointError(f"{source}: tensor {name!r} has shape {list(shape)}, expected "
                              f"{want} for strategy {cfg.strategy!r}")
    flat = np.asarray(s[...], np.float32).reshape(-1)
    return np.ascontiguousarray(np.broadcast_to(flat, (out,)))


def _values(tensors: Mapping[str, HostArray], prefix: str, cfg: CompressedConfig,
            source: str) -> tuple[HostArray, list[str]]:
    """The stored values of `prefix` (a module) as an [out, in] HostArray, and the names used."""
    if cfg.packed:
        name, shape_name = f"{prefix}.weight_packed", f"{prefix}.weight_shape"
        if name not in tensors or shape_name not in tensors:
            raise CheckpointError(f"{source}: pack-quantized module {prefix!r} needs tensors "
                                  f"{name!r} and {shape_name!r}")
        packed, shape = tensors[name], np.asarray(tensors[shape_name][...]).reshape(-1)
        if np.dtype(packed.dtype) != np.int32 or len(packed.shape) != 2:
            raise CheckpointError(f"{source}: tensor {name!r} has dtype {packed.dtype} and shape "
                                  f"{list(packed.shape)}; expected 2-D int32")
        if (shape.size != 2 or not np.issubdtype(shape.dtype, np.integer)
                or int(shape[0]) != packed.shape[0] or -(-int(shape[1]) // 4) != packed.shape[1]):
            raise CheckpointError(f"{source}: tensor {shape_name!r} = {shape.tolist()} does not "
                                  f"match {name!r} of shape {list(packed.shape)} (4 values "
                                  "per int32)")
        return PackedInt8(packed, int(shape[1])), [name, shape_name]
    name = f"{prefix}.weight"
    if name not in tensors:
        raise CheckpointError(f"{source}: tensor {prefix}.weight_scale has no {name!r}")
    w, want = tensors[name], _VALUE_DTYPES[cfg.scheme]
    if np.dtype(w.dtype) != want or len(w.shape) != 2:
        raise CheckpointError(
            f"{source}: tensor {name!r} has dtype {w.dtype} and shape {list(w.shape)}; the "
            f"quantization_config ({cfg.scheme} weights) stores 2-D {want} values")
    return w, [name]


def wrap_tensors(tensors: Mapping[str, HostArray], cfg: CompressedConfig,
                 source: str) -> dict[str, HostArray]:
    """The checkpoint's tensors with each quantized linear's values and scale made one
    `CompressedTensor` under `<module>.weight` (float tensors pass through)."""
    for name in tensors:
        if name.endswith(_UNSUPPORTED_SUFFIXES):
            raise CheckpointError(f"{source}: tensor {name!r} belongs to a quantization variant "
                                  "that is not supported (zero points, group order, static "
                                  "activation or KV cache scales)")
    out = dict(tensors)
    for scale_name in [n for n in tensors if n.endswith(".weight_scale")]:
        prefix = scale_name[:-len(".weight_scale")]
        values, used = _values(tensors, prefix, cfg, source)
        scale = _scale(tensors, scale_name, values.shape[0], cfg, source)
        for n in (*used, scale_name):
            del out[n]
        out[f"{prefix}.weight"] = CompressedTensor(f"{prefix}.weight", values, scale, cfg,
                                                   source)
    return out


def quantized_weight(parts: list[CompressedTensor], stacked: bool, name: str,
                     act_fp8: bool) -> QuantizedWeight:
    """A field's layers (or its one tensor) as a per-column QuantizedWeight whose values are
    a lazy [(L,) in, out] view of the file (placement reads each device's box of it)."""
    out_f, in_f = parts[0].shape
    dtype = np.dtype(parts[0].values.dtype)
    shape = (len(parts), in_f, out_f) if stacked else (in_f, out_f)
    values = LazyLeaf(name, [p.values for p in parts], shape, dtype, True, stacked)
    scales = np.stack([p.scale[None, :] for p in parts])  # f32 [L, 1, out]
    return QuantizedWeight(values, scales if stacked else scales[0], None, parts[0].scheme,
                           act_fp8)
