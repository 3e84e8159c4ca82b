"""HF-format checkpoints <-> a family's params pytree (`LlamaParams` for the Llama family).

Data flow (load): directory -> `config.json` -> ModelConfig (`families.config_from_hf`);
`model.safetensors` or the shards named by `model.safetensors.index.json` -> {HF tensor name:
read-only memmap} (`with_quantized_views`: with a compressed-tensors `quantization_config`,
each quantized linear's values and scale as one lazy `compressed_tensors.CompressedTensor`;
with an "mxfp4" one, gpt-oss's MXFP4 expert stacks as float `mxfp4.Mxfp4Stack`s) ->
`host_params_from_hf` (checks every name, shape and dtype against the family's `param_shapes`
and HF name tables; reads nothing) -> the family's params of `LazyLeaf`s that transpose
linears to [in, out], stack layers and cast only the boxes asked of them. Then either
`params_from_hf` reads each leaf whole onto the default device (the host holds one stacked
leaf at a time), or `placement.place_params` reads each device's slice from the
memmaps (the host holds one leaf's slices at a time; pages the OS maps in are the file cache).
The GGUF loader offers the same HF-named mapping (lazy dequantizing tensors), so both formats
share this path.
Data flow (save): params -> `hf_tensors_from_params` (the same name tables) -> safetensors +
config.json, a directory that transformers and vLLM load.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from .compressed_tensors import parse_config, wrap_tensors
from .config import ConfigError, ModelConfig
from .families import config_from_hf, config_to_hf, family
from .host_arrays import HostArray, LazyLeaf, read_all
from .mxfp4 import wrap_mxfp4
from .safetensors_io import CheckpointError, read_safetensors, write_safetensors

_FLOAT_DTYPES = {np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.float64),
                 np.dtype(jnp.bfloat16)}
# Tensors HF checkpoints may carry that the model does not use.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_hf_config(model_dir: pathlib.Path) -> ModelConfig:
    path = model_dir / "config.json"
    if not path.exists():
        raise CheckpointError(f"{model_dir}: no config.json (not an HF model directory)")
    cfg = config_from_hf(_read_json_object(path), source=str(path))
    gen = model_dir / "generation_config.json"
    if gen.exists():
        # generation_config may add stop ids (e.g. Llama 3's <|eot_id|>) to config's eos.
        eos = _read_json_object(gen).get("eos_token_id")
        extra = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in extra):
            raise CheckpointError(f"{gen}: eos_token_id={eos!r} must be a token id or a list "
                                  "of token ids")
        ids = tuple(dict.fromkeys([*cfg.eos_token_ids, *extra]))
        if ids != cfg.eos_token_ids:
            cfg = dataclasses.replace(cfg, eos_token_ids=ids)
    return cfg


def _read_json_object(path: pathlib.Path) -> dict:
    """A JSON file holding an object, or CheckpointError naming the file and what is wrong."""
    try:
        d = json.loads(path.read_bytes())
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
    # ValueError: not UTF-8 or not JSON; RecursionError: nested deeper than the parser's stack.
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return d


def _weight_map(index: pathlib.Path) -> dict[str, str]:
    """An index's tensor -> shard map; shards are plain file names beside it (no paths out)."""
    weight_map = _read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) and v and pathlib.PurePath(v).name == v and v not in (".", "..")
            for v in weight_map.values()):
        raise CheckpointError(f"{index}: malformed index: 'weight_map' must map tensor names to "
                              "shard file names in the same folder")
    return weight_map


def read_hf_tensors(model_dir: pathlib.Path) -> dict[str, np.ndarray]:
    """{name: array} from `model.safetensors` or an index of shards."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = _weight_map(index)
        tensors: dict[str, np.ndarray] = {}
        for shard in sorted(set(weight_map.values())):
            shard_path = model_dir / shard
            if not shard_path.exists():
                raise CheckpointError(f"{index}: shard {shard!r} is missing")
            part = read_safetensors(shard_path)
            twice = sorted(part.keys() & tensors.keys())
            if twice:
                raise CheckpointError(f"{shard_path}: tensors also found in another shard: "
                                      f"{twice[:5]}")
            tensors.update(part)
        missing = sorted(set(weight_map) - set(tensors))
        if missing:
            raise CheckpointError(f"{index}: tensors listed but not found in shards: {missing[:5]}")
        return tensors
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"{model_dir}: no *.safetensors weights (pickled .bin checkpoints are not loaded: "
            "they can execute code)")
    tensors = {}
    for f in files:
        tensors.update(read_safetensors(f))
    return tensors


def with_quantized_views(model_dir: pathlib.Path,
                         tensors: Mapping[str, HostArray]) -> dict[str, HostArray]:
    """`tensors` (`read_hf_tensors`) with a pre-quantized checkpoint's linears (config.json's
    `quantization_config`) wrapped as `CompressedTensor`s (float32 to the float path)."""
    config = model_dir / "config.json"
    qc = _read_json_object(config).get("quantization_config")
    if qc is None:
        return dict(tensors)
    if isinstance(qc, dict) and qc.get("quant_method") == "mxfp4":  # gpt-oss's experts
        return wrap_mxfp4(tensors, qc, str(config))
    return wrap_tensors(tensors, parse_config(qc, str(config)), str(model_dir))


def params_from_hf(cfg: ModelConfig, tensors: Mapping[str, HostArray],
                   dtype: jnp.dtype = jnp.float32, source: str = "checkpoint") -> Any:
    """Map HF-named tensors onto the family's params, checking names and shapes; arrays on
    device."""
    host = host_params_from_hf(cfg, tensors, dtype, source)
    return jax.tree.map(lambda leaf: jnp.asarray(read_all(leaf)), host)


def host_params_from_hf(cfg: ModelConfig, tensors: Mapping[str, HostArray],
                        dtype: jnp.dtype = jnp.float32,
                        source: str = "checkpoint") -> Any:
    """The family's params of `LazyLeaf`s over HF-named tensors; names, shapes and dtypes
    checked now.

    No data is read here: each leaf reads (transposing, stacking and casting) only the boxes
    later asked of it, so over memory-mapped safetensors a per-device placement touches only
    that device's rows/columns of each layer's tensor.
    """
    fam = family(cfg)
    shapes = fam.param_shapes(cfg)
    np_dtype = np.dtype(dtype)
    used: set[str] = set()

    def get(name: str, shape: tuple[int, ...], transpose: bool) -> HostArray:
        if name not in tensors:
            raise CheckpointError(f"{source}: tensor {name!r} is missing")
        a = tensors[name]
        want = shape[::-1] if transpose else shape
        if tuple(a.shape) != want:
            raise CheckpointError(
                f"{source}: tensor {name!r} has shape {list(a.shape)}, expected {list(want)} "
                f"for this config")
        if np.dtype(a.dtype) not in _FLOAT_DTYPES:
            raise CheckpointError(f"{source}: tensor {name!r} has non-float dtype {a.dtype}")
        used.add(name)
        return a

    def single(field: str, name: str, transpose: bool) -> LazyLeaf:
        shape = shapes[field]
        return LazyLeaf(name, [get(name, shape, transpose)], shape, np_dtype, transpose, False)

    # A family whose layers differ in shape (Gemma 4) maps a layer's checkpoint tensor onto
    # the stacked shape itself: `hf_layer_part(cfg, field, i, suffix, fetch)` -> a HostArray
    # in checkpoint layout, fetch(suffix, shape) giving the checked tensor of that name.
    layer_part = getattr(fam, "hf_layer_part", None)

    def part(field: str, i: int, suffix: str, per_layer: tuple[int, ...],
             transpose: bool) -> HostArray:
        if layer_part is None:
            return get(f"model.layers.{i}.{suffix}", per_layer, transpose)
        return layer_part(cfg, field, i, suffix, lambda sfx, shape: get(
            f"model.layers.{i}.{sfx}", shape, transpose))

    layers: dict[str, LazyLeaf | None] = {}
    for field, (suffix, transpose) in fam.HF_LAYER_NAMES.items():
        key = f"layers.{field}"
        if key not in shapes:
            layers[field] = None
            continue
        per_layer = shapes[key][1:]
        parts = [part(field, i, suffix, per_layer, transpose) for i in range(cfg.num_layers)]
        layers[field] = LazyLeaf(f"model.layers.*.{suffix}", parts, shapes[key], np_dtype,
                                 transpose, True)
    top: dict[str, LazyLeaf | None] = {}
    for field, (name, transpose) in fam.HF_NAMES.items():
        if field in shapes:
            top[field] = single(field, name, transpose)
        else:
            top[field] = None
            used.add(name)  # tied checkpoints sometimes still ship the lm_head's copy
    unexpected = sorted(n for n in tensors if n not in used and not n.endswith(_IGNORED_SUFFIXES))
    if unexpected:
        raise CheckpointError(
            f"{source}: unexpected tensors for model_type={cfg.model_type!r}: {unexpected[:5]}"
            f"{' ...' if len(unexpected) > 5 else ''}")
    return fam.Params(layers=fam.LayerParams(**layers), **top)


def hf_tensors_from_params(cfg: ModelConfig, params: Any) -> dict[str, np.ndarray]:
    """Params -> HF-named numpy tensors ([out, in] linears), in the params' dtype."""
    fam = family(cfg)
    export = getattr(fam, "hf_layer_export", None)  # the inverse of `hf_layer_part`
    out: dict[str, np.ndarray] = {}
    for field, (name, transpose) in fam.HF_NAMES.items():
        leaf = getattr(params, field)
        if leaf is not None:
            out[name] = np.asarray(leaf).T if transpose else np.asarray(leaf)
    for field, (suffix, transpose) in fam.HF_LAYER_NAMES.items():
        stacked = getattr(params.layers, field)
        if stacked is None:
            continue
        host = np.asarray(stacked)
        for i in range(cfg.num_layers):
            t = host[i].T if transpose else host[i]
            if export is not None:  # the layer's own shape back (None: not in the checkpoint;
                t = export(cfg, field, i, t)  # a dict: several tensors, MoE experts)
            if isinstance(t, dict):
                out.update({f"model.layers.{i}.{sfx}": part for sfx, part in t.items()})
            elif t is not None:
                out[f"model.layers.{i}.{suffix}"] = t
    # A family whose checkpoint joins several fields into one tensor (gpt-oss's interleaved
    # gate / up stacks) joins the parts its `hf_layer_export` tagged.
    finish = getattr(fam, "hf_export_finish", None)
    return out if finish is None else finish(out)


def save_hf_dir(out_dir: pathlib.Path, cfg: ModelConfig, params: Any,
                max_shard_bytes: int = 4 << 30) -> None:
    """Write config.json + safetensors (sharded with an index above `max_shard_bytes`)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = hf_tensors_from_params(cfg, params)
    dtype_name = {np.dtype(np.float32): "float32", np.dtype(jnp.bfloat16): "bfloat16",
                  np.dtype(np.float16): "float16"}.get(params.embed.dtype, "float32")
    (out_dir / "config.json").write_text(json.dumps(config_to_hf(cfg, dtype_name), indent=2))
    gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": list(cfg.eos_token_ids)}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2))
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].nbytes
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    if len(shards) == 1:
        write_safetensors(out_dir / "model.safetensors", shards[0], {"format": "pt"})
        return
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(out_dir / fname, shard, {"format": "pt"})
        weight_map.update({n: fname for n in shard})
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
             "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


__all__ = ["ConfigError", "CheckpointError", "read_hf_config", "read_hf_tensors",
           "with_quantized_views", "params_from_hf", "host_params_from_hf", "hf_tensors_from_params",
           "save_hf_dir"]
