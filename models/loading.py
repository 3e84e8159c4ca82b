"""One entry point from a user's `--model` value to (config, params, tokenizer), and back.

Data flow: PATH (or None for the bundled SmolLM2 GGUF) -> `detect_format` -> one of
  gguf:  `read_gguf` -> HF-named tensors + HF-shaped config -> `params_from_hf`
  hf:    config.json + safetensors -> `params_from_hf`
  orbax: jaxserve.json marker + config.json + `params/` -> `orbax_io.restore_params`
and the tokenizer from the same place. `convert` writes either an Orbax checkpoint directory
(loaded directly by jaxserve) or a standard HF directory (transformers, vLLM).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
from typing import Literal

import jax.numpy as jnp

from .bundled import bundled_model_path
from .config import ModelConfig
from .gguf_loader import read_gguf
from .hf_loader import params_from_hf, read_hf_config, read_hf_tensors, save_hf_dir
from .llama import LlamaParams
from .orbax_io import restore_params, save_params
from .safetensors_io import CheckpointError
from .tokenizer import Tokenizer

Format = Literal["gguf", "hf", "orbax"]
MARKER = "jaxserve.json"
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    config: ModelConfig
    params: LlamaParams
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


def load_model(path: str | pathlib.Path | None = None, dtype: str = "float32") -> LoadedModel:
    """Load weights and tokenizer from PATH (None: the bundled SmolLM2-135M-Instruct)."""
    jdtype = parse_dtype(dtype)
    path = resolve_model_path(path)
    fmt = detect_format(path)
    if fmt == "gguf":
        gguf_file = path if path.is_file() else sorted(path.glob("*.gguf"))[0]
        ckpt = read_gguf(gguf_file)
        cfg = ModelConfig.from_hf_dict(ckpt.hf_config, source=str(gguf_file))
        tokenizer = Tokenizer.from_gguf(gguf_file)
        cfg = _with_tokenizer_eos(cfg, tokenizer)
        params = params_from_hf(cfg, ckpt.tensors, jdtype, source=str(gguf_file))
    elif fmt == "hf":
        cfg = read_hf_config(path)
        params = params_from_hf(cfg, read_hf_tensors(path), jdtype, source=str(path))
        tokenizer = Tokenizer.from_hf_dir(path)
    else:
        cfg = read_hf_config(path)
        params = restore_params(path / "params", cfg, jdtype)
        tokenizer = Tokenizer.from_hf_dir(path)
    return LoadedModel(config=cfg, params=params, tokenizer=tokenizer, source=path, format=fmt)


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
    model = load_model(src, dtype)
    dst.mkdir(parents=True)
    model.tokenizer.save(dst)
    if fmt == "hf":
        save_hf_dir(dst, model.config, model.params)
    elif fmt == "orbax":
        cfg_dict = model.config.to_hf_dict(dtype)
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
