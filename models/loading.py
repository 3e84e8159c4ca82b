"""One entry point from a user's `--model` value to (config, params, tokenizer), and back.

Data flow: PATH (or None for the bundled SmolLM2 GGUF) -> `detect_format` -> one of
  gguf:  `open_gguf` -> HF-shaped config + lazy HF-named tensors -> `host_params_from_hf`
  hf:    config.json + memory-mapped safetensors -> `host_params_from_hf`
  orbax: jaxserve.json marker + config.json + `params/` -> `orbax_io.restore_params`
and the tokenizer from the same place. The first two give the family's params (`families.py`)
of lazy host leaves; then `quantize_params` turns the dense weights into `QuantizedWeight`s
where `quant` asks (or, by default, where the checkpoint is stored quantized: GGUF Q8_0 /
Q4_0 / Q4_1 / Q4_K / Q6_K blocks and compressed-tensors FP8 / INT8 weights as they are), one
field at a time on the host, before anything is placed:
  no mesh: each leaf read whole onto the first device (the host holds one leaf at a time;
           GGUF tensors are dequantized one at a time);
  mesh:    `placement.place_params`: per leaf, each addressable device's slice is read from the
           host source and copied to that device only (safetensors: just those rows/columns of
           each layer from the memmap; GGUF: just those rows, and the quant blocks covering
           those columns, dequantized); no device holds a full split leaf, the host holds at
           most one leaf's slices at a time, and each process of a multi-host run reads only
           its own devices' slices.
  Orbax with a mesh: `ocp.load` restores every leaf onto its own NamedSharding (each device
           reads its part). When tp exceeds num_kv_heads, K/V projections are saved
           unreplicated, so those few leaves are restored whole onto the first local device
           and each device's repeated head is sliced from that copy, which is then dropped.
With a mesh the params come back in the tensor-parallel layout (`placement.tp_model_config`:
KV heads replicated when needed) while `LoadedModel.config` stays the checkpoint's;
`placement.place_params` leaves such params as they are.
`convert` writes either an Orbax checkpoint directory (loaded directly by jaxserve) or a
standard HF directory (transformers, vLLM).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, SingleDeviceSharding

from .bundled import bundled_model_path
from .config import ModelConfig
from .families import config_from_hf, config_to_hf, family
from .gguf_loader import open_gguf
from .hf_loader import (host_params_from_hf, read_hf_config, read_hf_tensors, save_hf_dir,
                        with_quantized_views)
from .host_arrays import read_all
from .orbax_io import restore_params, save_params
from .paged import MODEL_AXIS
from .placement import kv_head_replication, param_shardings, place_params
from .quant import WeightQuant
from .quantized_params import quantize_params
from .safetensors_io import CheckpointError
from .tokenizer import Tokenizer

Format = Literal["gguf", "hf", "orbax"]
MARKER = "jaxserve.json"
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    config: ModelConfig
    params: Any  # the family's params pytree (`families.family(config).Params`)
    tokenizer: Tokenizer
    source: pathlib.Path
    format: Format


def parse_dtype(name: str) -> jnp.dtype:
    if name not in _DTYPES:
        raise ValueError(f"dtype={name!r} is not supported; choose one of {', '.join(_DTYPES)}")
    return _DTYPES[name]


def resolve_model_path(path: str | pathlib.Path | None) -> pathlib.Path:
    return bundled_model_path() if path is None else pathlib.Path(path).expanduser()


def detect_format(path: pathlib.Path) -> Format:
    if path.is_file():
        with open(path, "rb") as f:
            if f.read(4) == b"GGUF":
                return "gguf"
        raise CheckpointError(f"{path}: a file that is not GGUF; pass a GGUF file, an HF model "
                              "directory or a jaxserve (Orbax) checkpoint directory")
    if path.is_dir():
        if (path / MARKER).exists():
            return "orbax"
        if (path / "config.json").exists():
            return "hf"
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return "gguf"
        raise CheckpointError(f"{path}: no config.json, {MARKER} or single .gguf file inside")
    raise CheckpointError(f"{path}: no such file or directory")


def load_model(path: str | pathlib.Path | None = None, dtype: str = "float32",
               mesh: Mesh | None = None, quant: WeightQuant | None = None,
               expert_parallel: bool = False) -> LoadedModel:
    """Load weights and tokenizer from PATH (None: the bundled SmolLM2-135M-Instruct).

    mesh: a tensor-parallel mesh (axis "model"); the params come back placed on their
    shardings, each device having read only its own slice (see the module docstring).
    quant: how the dense weights are stored (`models/quantized_params.py`); None: "auto" (a
    pre-quantized checkpoint keeps its quantization, a float one stays float).
    expert_parallel: with a mesh, MoE experts split whole over it (`placement.param_specs`).
    """
    quant = quant or WeightQuant()
    jdtype = parse_dtype(dtype)
    path = resolve_model_path(path)
    fmt = detect_format(path)
    if fmt == "gguf":
        gguf_file = path if path.is_file() else sorted(path.glob("*.gguf"))[0]
        ckpt = open_gguf(gguf_file)
        cfg = config_from_hf(ckpt.hf_config, source=str(gguf_file))
        tokenizer = Tokenizer.from_gguf(gguf_file)
        cfg = _with_tokenizer_eos(cfg, tokenizer)
        host = host_params_from_hf(cfg, ckpt.tensors, jdtype, source=str(gguf_file))
        params = _place(quantize_params(host, quant), cfg, mesh, expert_parallel)
    elif fmt == "hf":
        cfg = read_hf_config(path)
        tensors = with_quantized_views(path, read_hf_tensors(path))
        host = host_params_from_hf(cfg, tensors, jdtype, source=str(path))
        params = _place(quantize_params(host, quant), cfg, mesh, expert_parallel)
        tokenizer = Tokenizer.from_hf_dir(path)
    else:
        cfg = read_hf_config(path)
        params = _restore(path / "params", cfg, jdtype, mesh, expert_parallel)
        if quant.quantizes:  # an Orbax checkpoint holds float weights
            params = _place(quantize_params(params, quant), cfg, mesh, expert_parallel)
        tokenizer = Tokenizer.from_hf_dir(path)
    return LoadedModel(config=cfg, params=params, tokenizer=tokenizer, source=path, format=fmt)


def _place(host: Any, cfg: ModelConfig, mesh: Mesh | None, expert_parallel: bool) -> Any:
    if mesh is None:
        if expert_parallel:
            raise ValueError("expert_parallel=True needs a mesh (tensor_parallel_size > 1)")
        return jax.tree.map(lambda leaf: jnp.asarray(read_all(leaf)), host)
    return place_params(host, cfg, mesh, expert_parallel)


def _restore(path: pathlib.Path, cfg: ModelConfig, dtype: jnp.dtype,
             mesh: Mesh | None, expert_parallel: bool) -> Any:
    if mesh is None:
        if expert_parallel:
            raise ValueError("expert_parallel=True needs a mesh (tensor_parallel_size > 1)")
        return restore_params(path, cfg, dtype)
    shardings = param_shardings(cfg, mesh, expert_parallel=expert_parallel)
    rep = kv_head_replication(cfg, mesh.shape[MODEL_AXIS])
    if rep > 1 and jax.process_count() > 1:
        raise CheckpointError(
            f"{path}: an Orbax checkpoint with num_kv_heads={cfg.num_kv_heads} at "
            f"tensor_parallel_size={mesh.shape[MODEL_AXIS]} replicates KV heads, which this "
            f"loader does only within one process ({jax.process_count()} here); load the "
            "HF (safetensors) or GGUF form of the model instead (`jaxserve convert --format hf`)")
    if rep > 1:
        # The saved K/V leaves hold each head once; the mesh wants some heads on several
        # devices, which no sharding of the saved array expresses: restore them whole on one
        # local device, and let placement cut each device's repeated head from that copy.
        first = SingleDeviceSharding(jax.local_devices()[0])
        kv = {f: first for f in family(cfg).KV_FIELDS if getattr(shardings.layers, f)}
        shardings = dataclasses.replace(
            shardings, layers=dataclasses.replace(shardings.layers, **kv))
    return place_params(restore_params(path, cfg, dtype, shardings), cfg, mesh,
                        expert_parallel)


def _with_tokenizer_eos(cfg: ModelConfig, tokenizer: Tokenizer) -> ModelConfig:
    ids = tuple(dict.fromkeys([*cfg.eos_token_ids, *tokenizer.eos_token_ids]))
    return dataclasses.replace(cfg, eos_token_ids=ids)


def convert(src: str | pathlib.Path | None, dst: str | pathlib.Path,
            fmt: Literal["orbax", "hf"] = "orbax", dtype: str = "float32",
            overwrite: bool = False) -> pathlib.Path:
    """Write SRC as a jaxserve Orbax checkpoint or a standard HF directory at DST."""
    dst = pathlib.Path(dst).expanduser()
    if dst.exists():
        if not overwrite:
            raise FileExistsError(f"{dst} exists; pass overwrite=True (--overwrite) to replace it")
        shutil.rmtree(dst)
    model = load_model(src, dtype, quant=WeightQuant("none"))  # both formats hold floats
    dst.mkdir(parents=True)
    model.tokenizer.save(dst)
    if fmt == "hf":
        save_hf_dir(dst, model.config, model.params)
    elif fmt == "orbax":
        cfg_dict = config_to_hf(model.config, dtype)
        (dst / "config.json").write_text(json.dumps(cfg_dict, indent=2))
        gen = {"bos_token_id": model.config.bos_token_id,
               "eos_token_id": list(model.config.eos_token_ids)}
        (dst / "generation_config.json").write_text(json.dumps(gen, indent=2))
        save_params(dst / "params", model.params)
        marker = {"format": "jaxserve-orbax", "version": 1, "dtype": dtype,
                  "source": str(model.source)}
        (dst / MARKER).write_text(json.dumps(marker, indent=2))
    else:
        raise ValueError(f"format={fmt!r} must be 'orbax' or 'hf'")
    return dst
