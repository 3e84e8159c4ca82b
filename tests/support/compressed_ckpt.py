"""Writes small compressed-tensors checkpoints (the format llm-compressor saves and vLLM serves)
from a float HF directory, for tests/models/test_compressed_tensors.py and the TP worker.

Independent of the loader: the values are quantized here with numpy (fp8 by ml_dtypes' cast,
int8 by rounding), pack-quantized int32s are built arithmetically (q + 128 shifted by 8 j), and
the float checkpoint of the dequantized weights (q * scale in f32: the model the quantized one
must reproduce) is written beside it.
"""

from __future__ import annotations

import json
import pathlib
import shutil

import ml_dtypes
import numpy as np

from jaxserve.models.safetensors_io import read_safetensors, write_safetensors

FP8 = ml_dtypes.float8_e4m3fn


def quantization_config(scheme: str, strategy: str, packed: bool = False,
                        acts: str | None = None, ignore: tuple[str, ...] = ("lm_head",)) -> dict:
    """config.json's `quantization_config` as llm-compressor writes it (one group)."""
    kind = "float" if scheme == "fp8" else "int"
    weights = {"num_bits": 8, "type": kind, "strategy": strategy, "symmetric": True,
               "dynamic": False, "group_size": None, "block_structure": None,
               "actorder": None, "observer": "minmax", "observer_kwargs": {}}
    act = None if acts is None else {
        "num_bits": 8, "type": "float" if acts == "fp8" else "int", "strategy": "token",
        "symmetric": True, "dynamic": True, "group_size": None, "observer": None}
    fmt = "pack-quantized" if packed else f"{kind}-quantized"
    return {"quant_method": "compressed-tensors", "format": fmt,
            "quantization_status": "compressed", "global_compression_ratio": None,
            "kv_cache_scheme": None, "sparsity_config": {}, "ignore": list(ignore),
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": act,
                                          "output_activations": None, "format": fmt}}}


def pack_int8(q: np.ndarray) -> np.ndarray:
    """i8 [out, in] -> i32 [out, ceil(in / 4)]: column 4 i + j's q + 128 in bits 8 j .. 8 j + 7."""
    out_f, in_f = q.shape
    u = np.zeros((out_f, -(-in_f // 4) * 4), np.uint64)
    u[:, :in_f] = q.astype(np.int64) + 128
    packed = sum(u[:, j::4] << np.uint64(8 * j) for j in range(4))
    return packed.astype(np.uint32).view(np.int32)


def quantize(w: np.ndarray, scheme: str, strategy: str) -> tuple[np.ndarray, np.ndarray]:
    """A float [out, in] weight -> (q [out, in], scale f32 [out, 1] or [1])."""
    w = w.astype(np.float32)
    amax = np.abs(w).max(axis=1, keepdims=True) if strategy == "channel" else \
        np.abs(w).max().reshape(1)
    scale = (amax / (448.0 if scheme == "fp8" else 127.0)).astype(np.float32)
    scaled = w / (scale if strategy == "channel" else scale[0])
    if scheme == "fp8":
        return scaled.astype(FP8), scale
    q = np.clip(np.rint(scaled), -128, 127).astype(np.int8)
    q[0, 0] = -128  # the format's full int8 range (compressed-tensors clamps to [-128, 127])
    return q, scale


def write_compressed(src: pathlib.Path, dst: pathlib.Path, scheme: str, strategy: str,
                     packed: bool = False, acts: str | None = None,
                     ignore: tuple[str, ...] = ("lm_head",)) -> pathlib.Path:
    """`src` (a float HF dir) with every linear not in `ignore` stored compressed at `dst`, and
    the float checkpoint of the dequantized weights at `dst`-float. Returns that float dir.

    `dst/stored.npz` keeps each quantized module's q and scale, as written."""
    ref = pathlib.Path(f"{dst}-float")
    for d in (dst, ref):
        shutil.copytree(src, d)
        (d / "model.safetensors").unlink()
    tensors = {k: np.array(v) for k, v in read_safetensors(src / "model.safetensors").items()}
    out, deq, stored = {}, {}, {}
    for name, w in tensors.items():
        module = name.removesuffix(".weight")
        linear = name.endswith("_proj.weight") or name == "lm_head.weight"
        if not linear or module in ignore or module.rsplit(".", 1)[-1] in ignore:
            out[name] = deq[name] = w
            continue
        q, scale = quantize(w, scheme, strategy)
        deq[name] = q.astype(np.float32) * scale
        stored[module + ".q"], stored[module + ".scale"] = q.view(np.uint8), scale
        if packed:
            out[module + ".weight_packed"] = pack_int8(q)
            out[module + ".weight_shape"] = np.array(q.shape, np.int32)
        else:
            out[module + ".weight"] = q
        out[module + ".weight_scale"] = scale
    write_safetensors(dst / "model.safetensors", out, {"format": "pt"})
    write_safetensors(ref / "model.safetensors", deq, {"format": "pt"})
    np.savez(dst / "stored.npz", **stored)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = quantization_config(scheme, strategy, packed, acts, ignore)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return ref
