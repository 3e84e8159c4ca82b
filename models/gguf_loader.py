"""GGUF checkpoint reader: one llama.cpp GGUF file -> HF-shaped config dict + float32 HF tensors.

Data flow:
  file --mmap--> `gguf_header.parse_header` (magic, version, metadata key/values, tensor table,
  data offset; bounds-checked) -> `read_gguf_metadata` (plain python metadata: the tokenizer
  reads vocab/merges from here)
  -> `open_gguf`: `general.architecture` -> the family (`families.family_for_gguf`); metadata
     `{arch}.*` keys -> HF `config.json`-shaped dict, validated by the family's mapping
     (`families.config_from_hf`); tensor table -> HF names by the family's GGUF name tables
     (an MoE family's merged `ffn_*_exps` tensors split into one 2-D entry per expert over the
     same bytes, `gguf_tensor.split_experts`, named as its per-expert HF tensors),
     shapes checked against that config before any data is touched (reading no weights) ->
     per tensor a lazy `GGUFTensor` (numpy shape: GGUF lists dims innermost-first, numpy
     outermost-first, so dims are reversed; llama q/k rows un-permuted on read, Gemma's
     1 + w norm weights shifted back to w by the family's `GGUF_NORM_SHIFTS`) that
     dequantizes only the boxes asked of it -> `hf_loader.host_params_from_hf` ->
     `load_model` reads leaves whole, or each device's slice (`placement.place_params`): the
     host then dequantizes per device only that device's rows (and the quant blocks covering
     its columns) of each tensor.
  -> `read_gguf`: every tensor dequantized whole -> float32 `GGUFCheckpoint.tensors`.
Arrays here are numpy (the family module that names the tensors imports jax, this module
computes nothing with it): the loaders convert them to device arrays themselves.
"""

from __future__ import annotations

import dataclasses
import math
import mmap
import os
from types import ModuleType
from typing import Mapping

import numpy as np

from .config import ConfigError, ModelConfig
from .families import config_from_hf, family, family_for_gguf
from .gguf_header import close_gguf, map_gguf, parse_header, read_gguf_metadata
from .gguf_tensor import GGUFTensor, TensorInfo, split_experts
# One error type for every checkpoint format (a ValueError naming the file and key/tensor).
from .safetensors_io import CheckpointError

__all__ = ["CheckpointError", "GGUFCheckpoint", "LazyGGUF", "open_gguf", "read_gguf",
           "read_gguf_metadata"]

_ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's encoding of Llama-3.1-style RoPE scaling


@dataclasses.dataclass(frozen=True)
class GGUFCheckpoint:
    """A dequantized GGUF: HF config dict + float32 tensors in HF names and HF layout."""

    source: str
    hf_config: dict
    tensors: dict[str, np.ndarray]
    tensor_types: dict[str, str]  # HF name -> GGUF storage type name ("Q4_1", "F32", ...)


def _hf_config(md: Mapping[str, object], names: set[str], path: str) -> dict[str, object]:
    """GGUF metadata + tensor names -> an HF config.json-shaped dict: the family (from
    `general.architecture`) maps its `{arch}.*` keys, read through `key` (bounds and types
    checked); the vocabulary, special token ids and rope scaling are read alike for all."""
    arch = md.get("general.architecture")
    try:
        fam, model_type = family_for_gguf(arch, path)
    except ConfigError as e:  # one error type for a file's contents
        raise CheckpointError(str(e)) from None

    def key(name: str, default: object = None, required: bool = False, kind: type = int) -> object:
        if required and f"{arch}.{name}" not in md:
            raise CheckpointError(f"{path}: required GGUF metadata key '{arch}.{name}' is missing")
        value = md.get(f"{arch}.{name}", default)
        if kind is bool:
            if value is not None and not isinstance(value, bool):
                raise CheckpointError(f"{path}: GGUF metadata {arch}.{name}={value!r} must be "
                                      "a boolean")
            return value
        if kind is list:  # a per-layer array, or one integer for every layer: as stored
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, list))):
                raise CheckpointError(f"{path}: GGUF metadata {arch}.{name}={value!r} must be "
                                      "an integer or an array")
            return value
        if isinstance(value, list) and kind is int and value and all(v == value[0] for v in value):
            value = value[0]  # a per-layer list in some files; we need one value
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
              and (kind is float or isinstance(value, int)))
        if value is not None and not ok:
            raise CheckpointError(f"{path}: GGUF metadata {arch}.{name}={value!r} must be "
                                  f"{'an integer' if kind is int else 'a number'}")
        return value

    try:  # the family's own checks (a pattern of the wrong length, ...) name the key
        arch_fields = fam.config_dict_from_gguf(key, names, model_type)
    except ConfigError as e:
        raise CheckpointError(f"{path}: {e}") from None
    vocab = key("vocab_size")
    if vocab is None:  # older files: the token list (or the embedding) is the vocabulary
        tokens = md.get("tokenizer.ggml.tokens")
        vocab = len(tokens) if isinstance(tokens, list) else None
    cfg: dict[str, object] = {
        "model_type": model_type,
        "vocab_size": vocab,
        # The architecture's own keys (shape, norms, rope base, ...): the family's table.
        **arch_fields,
        "bos_token_id": _token_id(md, "bos"),
        "pad_token_id": _token_id(md, "padding"),
    }
    # End-of-turn ids (Llama-3 <|eot_id|>, ...) stop generation too, as llama.cpp treats them.
    eos = list(dict.fromkeys(i for i in (_token_id(md, k) for k in ("eos", "eot", "eom"))
                             if i is not None))
    cfg["eos_token_id"] = eos[0] if len(eos) == 1 else (eos or None)
    scaling = md.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none") and not getattr(fam, "GGUF_ROPE_SCALING", True):
        raise CheckpointError(f"{path}: GGUF metadata {arch}.rope.scaling.type={scaling!r}: "
                              f"model-wide rope scaling is not supported for {arch} files")
    if scaling not in (None, "none"):  # config.py rejects the types we cannot run (yarn, ...)
        cfg["rope_scaling"] = {
            "rope_type": scaling, "factor": key("rope.scaling.factor", 1.0, kind=float),
            "original_max_position_embeddings": key("rope.scaling.original_context_length", 8192),
        }
    if vocab is None:
        cfg.pop("vocab_size")
    return cfg


def _token_id(md: Mapping[str, object], name: str) -> int | None:
    value = md.get(f"tokenizer.ggml.{name}_token_id")
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _llama3_rope_scaling(freqs: np.ndarray, cfg: Mapping[str, object], path: str) -> dict:
    """Recover HF llama3 rope_scaling from llama.cpp's per-frequency factors, or refuse.

    llama.cpp's converter bakes (factor, low/high_freq_factor, original context) into one factor
    per rotary frequency; every released Llama 3.x uses low=1, high=4, original=8192, so we check
    that those parameters, with factor = the largest stored factor, reproduce the tensor exactly.
    """
    head_dim, theta = int(cfg["head_dim"]), float(cfg["rope_theta"])  # type: ignore[call-overload,arg-type]
    if not freqs.size or freqs.size * 2 != head_dim or not np.isfinite(freqs).all():
        raise CheckpointError(f"{path}: tensor {_ROPE_FREQS!r} has {freqs.size} entries; "
                              f"head_dim={head_dim} needs {head_dim // 2}")
    factor, low, high, orig = float(freqs.max()), 1.0, 4.0, 8192
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv
    smooth = np.clip((orig / wavelen - low) / (high - low), 0.0, 1.0)
    expected = 1.0 / ((1 - smooth) / factor + smooth)
    if not np.allclose(freqs, expected, rtol=1e-4, atol=1e-5):
        raise CheckpointError(f"{path}: tensor {_ROPE_FREQS!r} holds RoPE factors that match no "
                              "supported rope scaling (llama3 with low=1, high=4, original=8192)")
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
            "high_freq_factor": high, "original_max_position_embeddings": orig}


def _hf_name(gguf_name: str, fam: ModuleType, num_layers: int, path: str) -> str:
    """A GGUF tensor name -> its HF name, by the family's GGUF name tables."""
    if gguf_name in fam.GGUF_NAMES:
        return fam.GGUF_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    layer_names = fam.GGUF_LAYER_NAMES
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer_names:
        layer = int(parts[1])
        if layer >= num_layers:
            raise CheckpointError(f"{path}: tensor {gguf_name!r} is for layer {layer} but "
                                  f"block_count is {num_layers}")
        return f"model.layers.{layer}.{layer_names[parts[2]]}"
    raise CheckpointError(f"{path}: unexpected tensor {gguf_name!r} (not a "
                          f"{fam.__name__.rsplit('.', 1)[-1]}-family weight)")


def _entries(by_name: Mapping[str, TensorInfo], fam: ModuleType, num_layers: int, path: str
             ) -> list[tuple[str, TensorInfo]]:
    """(name, entry) per tensor of the file; a merged expert tensor (the family's
    `GGUF_EXPERT_NAMES`) as one entry per expert named by its HF per-expert name."""
    experts = getattr(fam, "GGUF_EXPERT_NAMES", {})
    out: list[tuple[str, TensorInfo]] = []
    for name, info in by_name.items():
        parts = name.split(".", 2)
        if len(parts) == 3 and parts[0] == "blk" and parts[2] in experts:
            layer = _hf_layer(name, parts, num_layers, path)
            out += [(f"model.layers.{layer}.{experts[parts[2]].format(e=e)}", view)
                    for e, view in enumerate(split_experts(info, path))]
        else:
            out.append((name, info))
    return out


def _hf_layer(gguf_name: str, parts: list[str], num_layers: int, path: str) -> int:
    if not parts[1].isdigit() or int(parts[1]) >= num_layers:
        raise CheckpointError(f"{path}: tensor {gguf_name!r} is for layer {parts[1]} but "
                              f"block_count is {num_layers}")
    return int(parts[1])


def _expected_shapes(c: ModelConfig, fam: ModuleType
                     ) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """HF name -> HF shape for every tensor this config may have, and the required names:
    the family's params in HF names and layout; a tied model may still carry its lm_head."""
    params = fam.param_shapes(c)
    shapes: dict[str, tuple[int, ...]] = {}
    required: set[str] = set()
    for field, (name, transpose) in fam.HF_NAMES.items():
        if field in params:
            shapes[name] = params[field][::-1] if transpose else params[field]
            required.add(name)
    if "lm_head" not in params and "lm_head" in fam.HF_NAMES:
        shapes[fam.HF_NAMES["lm_head"][0]] = (c.vocab_size, c.hidden_size)
    # A family whose layers differ in shape (Gemma 4) says per layer which tensors it reads
    # at which shape (`hf_layer_part`, as `hf_loader` calls it): a narrower layer's own
    # shape, none for what it does not have (K = V, KV-shared layers).
    layer_part = getattr(fam, "hf_layer_part", None)
    for field, (suffix, transpose) in fam.HF_LAYER_NAMES.items():
        if f"layers.{field}" not in params:
            continue
        one = params[f"layers.{field}"][1:]
        for layer in range(c.num_layers):
            asked: list[tuple[str, tuple[int, ...]]] = []
            if layer_part is None:
                asked.append((suffix, one))
            else:
                def fetch(sfx: str, shape: tuple[int, ...], t: bool = transpose) -> np.ndarray:
                    asked.append((sfx, shape))
                    return np.broadcast_to(np.float32(0), shape[::-1] if t else shape)
                layer_part(c, field, layer, suffix, fetch)
            for sfx, shape in asked:
                name = f"model.layers.{layer}.{sfx}"
                shapes[name] = shape[::-1] if transpose else shape
                required.add(name)
    return shapes, required


@dataclasses.dataclass(frozen=True)
class LazyGGUF:
    """An opened GGUF: HF config dict + lazy float32 tensors in HF names and HF layout.

    The tensors dequantize only the boxes asked of them (`models/gguf_tensor.py`); they keep
    the file mapped while they live.
    """

    source: str
    hf_config: dict
    tensors: dict[str, GGUFTensor]
    tensor_types: dict[str, str]  # HF name -> GGUF storage type name ("Q4_1", "F32", ...)


def read_gguf(path: str | os.PathLike) -> GGUFCheckpoint:
    """Read and dequantize a llama/qwen2/qwen3/gemma2/gemma3/gemma4/qwen3moe/qwen2moe GGUF into
    HF names, HF layout, float32."""
    lazy = open_gguf(path)
    try:
        tensors = {hf: t[...] for hf, t in lazy.tensors.items()}
        return GGUFCheckpoint(lazy.source, lazy.hf_config, tensors, lazy.tensor_types)
    finally:
        buf = next(iter(lazy.tensors.values())).buf if lazy.tensors else None
        del lazy
        if buf is not None:
            close_gguf(buf)


def open_gguf(path: str | os.PathLike) -> LazyGGUF:
    """Open a llama/qwen2/qwen3/gemma2/gemma3/gemma4 GGUF: config and tensor table checked,
    no weights read.

    Only `rope_freqs` (needed for the config) is dequantized here.
    """
    spath, buf = map_gguf(path)
    try:
        return _open_tensors(buf, spath)
    except BaseException:
        close_gguf(buf)
        raise


def _open_tensors(buf: mmap.mmap, spath: str) -> LazyGGUF:
    header = parse_header(buf, spath)
    by_name: dict[str, TensorInfo] = {}
    for t in header.tensors:
        if t.name in by_name:
            raise CheckpointError(f"{spath}: tensor {t.name!r} appears twice")
        by_name[t.name] = t
    hf_config = _hf_config(header.metadata, set(by_name), spath)
    if "vocab_size" not in hf_config and "token_embd.weight" in by_name:
        hf_config["vocab_size"] = by_name["token_embd.weight"].shape[0]
    arch_fam, _ = family_for_gguf(header.metadata["general.architecture"], spath)
    # config fields only a tensor's shape holds (Gemma 4's per-layer-embedding vocabulary)
    for name, (field, axis) in getattr(arch_fam, "GGUF_SHAPE_FIELDS", {}).items():
        if name in by_name:
            hf_config[field] = by_name[name].shape[axis]
    rope_freqs = by_name.pop(_ROPE_FREQS, None)
    if rope_freqs is not None:
        freqs = GGUFTensor(buf, rope_freqs, header.data_start, spath)[...]
        # a family's own encoding (Gemma 4: proportional RoPE), else llama 3's scaling
        own = getattr(arch_fam, "gguf_rope_freqs", None)
        if own is not None:
            try:
                own(freqs.ravel(), hf_config, spath)
            except ConfigError as e:
                raise CheckpointError(str(e)) from None
        else:
            hf_config["rope_scaling"] = _llama3_rope_scaling(freqs.ravel(), hf_config, spath)
    config = config_from_hf(hf_config, source=spath)  # ConfigError names the field
    fam = family(config)
    if config.num_layers * 9 > len(by_name):  # bound the work before planning per layer
        raise CheckpointError(f"{spath}: {header.metadata['general.architecture']}.block_count="
                              f"{config.num_layers} but the file holds only {len(by_name)} tensors")
    shapes, required = _expected_shapes(config, fam)
    plan: dict[str, TensorInfo] = {}
    shifts: dict[str, float] = {}
    norm_shifts = getattr(fam, "GGUF_NORM_SHIFTS", {})
    for name, info in _entries(by_name, fam, config.num_layers, spath):
        hf = _hf_name(name, fam, config.num_layers, spath) if info.name == name else name
        if hf not in shapes:
            raise CheckpointError(f"{spath}: tensor {info.name!r} ({hf}) is not used by a "
                                  f"{config.model_type} model with this config")
        squeezed = getattr(fam, "GGUF_SQUEEZED", ())
        if (info.shape != shapes[hf] and name.split(".", 2)[-1] in squeezed
                and [d for d in info.shape if d != 1] == [d for d in shapes[hf] if d != 1]):
            info = info._replace(shape=shapes[hf])  # the same bytes at the HF shape
        if info.shape != shapes[hf]:
            raise CheckpointError(
                f"{spath}: tensor {info.name!r} ({hf}) has shape {list(info.shape)} but the "
                f"config implies {list(shapes[hf])}")
        plan[hf] = info
        # by the GGUF name: a top-level one, else its suffix after `blk.{i}.`
        shift = norm_shifts.get(name, norm_shifts.get(name.split(".", 2)[-1], 0.0))
        if shift:
            shifts[hf] = shift
    missing = sorted(required - plan.keys())
    if missing:
        raise CheckpointError(f"{spath}: {len(missing)} required tensor(s) missing, e.g. "
                              f"{', '.join(missing[:5])}")
    permute = header.metadata["general.architecture"] in fam.GGUF_PERMUTED
    tensors: dict[str, GGUFTensor] = {}
    for hf, info in plan.items():
        heads = None
        if permute and (".q_proj." in hf or ".k_proj." in hf):
            heads = config.num_heads if ".q_proj." in hf else config.num_kv_heads
        tensors[hf] = GGUFTensor(buf, info, header.data_start, spath, heads, shifts.get(hf, 0.0))
    _check_disjoint(tensors, spath)
    return LazyGGUF(spath, hf_config, tensors, {hf: t.type_name for hf, t in tensors.items()})


def _check_disjoint(tensors: Mapping[str, GGUFTensor], path: str) -> None:
    """No two tensors share bytes of the data section (a corrupt offset would alias weights)."""
    spans = sorted((t.start, t.start + t.rows * t.row_bytes, t.info.name) for t in tensors.values())
    for (_, end0, name0), (start1, _, name1) in zip(spans, spans[1:]):
        if start1 < end0:
            raise CheckpointError(f"{path}: the data of tensors {name0!r} and {name1!r} overlap "
                                  f"(byte {start1} < {end0})")
