"""The model families jaxserve serves, and the names each answers to: the one registry.

Data flow: an HF config dict's `model_type` (else its first `architectures` entry) or a GGUF
file's `general.architecture` -> the family module (`family_for_hf`, `family_for_gguf`); a
`ModelConfig`'s `model_type` -> its family (`family`), whose params pytree, shapes and loader
name tables the loaders, placement and quantization read. Unknown names are a `ConfigError`
that lists what is supported.

A family module has (see `models/llama.py`): ARCHITECTURES {HF class: model_type},
GGUF_ARCHITECTURES {GGUF arch: model_type}, GGUF_PERMUTED, config_from_hf(d, model_type,
source), config_to_hf(cfg, torch_dtype), config_dict_from_gguf(key, tensor_names, model_type),
Params,
LayerParams, param_shapes(cfg), abstract_params(cfg, dtype), init_random_params(cfg, key,
dtype, scale), HF_NAMES, HF_LAYER_NAMES, GGUF_NAMES, GGUF_LAYER_NAMES, LINEAR_FIELDS,
TP_LAYOUT, KV_FIELDS; optionally `hf_layer_part` / `hf_layer_export` (a family whose layers
differ in shape maps each layer's checkpoint tensor onto the stacked shape and back,
`hf_loader`), REFUSED_ARCHITECTURES / GGUF_REFUSED {name: why}, names
the family knows but does not serve (the error says why instead of "unsupported"), and
GGUF_NORM_SHIFTS {GGUF tensor name or per-layer suffix: constant the file adds}, subtracted
on read (`gguf_tensor.GGUFTensor`), GGUF_EXPERT_NAMES {merged expert tensor suffix: per-expert
HF name with `{e}`} (an MoE family: split per expert at load, `moe_gguf`) and GGUF_SQUEEZED
(per-layer suffixes some files store without their unit axis). The layers are the shared blocks (`decoder.decoder_layer`), chosen by
the `LayerSpec`s the family's config mapping gives.
Adding a family is that module, its import here and its entry in FAMILIES.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Mapping

from . import gemma, gemma4, gpt_oss, llama, mixtral, qwen3_moe
from .config import ConfigError, ModelConfig

FAMILIES: tuple[ModuleType, ...] = (llama, gemma, gemma4, qwen3_moe, mixtral, gpt_oss)
ModelParams = Any  # any family's params pytree (a flax.struct dataclass: `fam.Params`)


def _model_types() -> dict[str, ModuleType]:
    return {t: fam for fam in FAMILIES for t in fam.ARCHITECTURES.values()}


def supported_model_types() -> tuple[str, ...]:
    return tuple(_model_types())


def family(cfg: ModelConfig | str) -> ModuleType:
    """The family module of a config (or of a model_type)."""
    model_type = cfg if isinstance(cfg, str) else cfg.model_type
    fam = _model_types().get(model_type)
    if fam is None:
        raise ConfigError(f"model_type={model_type!r} is not supported; "
                          f"supported: {', '.join(supported_model_types())}")
    return fam


def family_for_hf(d: Mapping[str, object], source: str = "config.json"
                  ) -> tuple[ModuleType, str]:
    """(family, model_type) of an HF config: its `model_type`, else its first `architectures`
    entry."""
    model_type = d.get("model_type")
    if model_type is None:
        archs = d.get("architectures")
        arch = archs[0] if isinstance(archs, list) and archs else None
        by_arch = {a: t for fam in FAMILIES for a, t in fam.ARCHITECTURES.items()}
        model_type = by_arch.get(arch) if isinstance(arch, str) else None
    if not isinstance(model_type, str) or model_type not in _model_types():
        archs = d.get("architectures")
        names = [model_type, *(archs if isinstance(archs, list) else [])]
        for fam in FAMILIES:
            refused = getattr(fam, "REFUSED_ARCHITECTURES", {})
            why = next((refused[n] for n in names if isinstance(n, str) and n in refused), None)
            if why is not None:
                raise ConfigError(f"{source}: model_type={model_type!r} (architectures="
                                  f"{archs!r}) {why}")
        raise ConfigError(
            f"{source}: model_type={model_type!r} (architectures={d.get('architectures')!r}) "
            f"is not supported; supported: {', '.join(supported_model_types())}")
    return _model_types()[model_type], model_type


def family_for_gguf(arch: object, source: str) -> tuple[ModuleType, str]:
    """(family, model_type) of a GGUF `general.architecture`."""
    for fam in FAMILIES:
        if isinstance(arch, str) and arch in fam.GGUF_ARCHITECTURES:
            return fam, fam.GGUF_ARCHITECTURES[arch]
        if isinstance(arch, str) and arch in getattr(fam, "GGUF_REFUSED", {}):
            raise ConfigError(f"{source}: GGUF architecture {arch!r}: {fam.GGUF_REFUSED[arch]}")
    names = [a for fam in FAMILIES for a in fam.GGUF_ARCHITECTURES]
    raise ConfigError(f"{source}: GGUF metadata 'general.architecture'={arch!r} is not "
                      f"supported; supported: {', '.join(names)}")


def config_from_hf(d: Mapping[str, object], source: str = "config.json") -> ModelConfig:
    """An HF `config.json` dict -> ModelConfig, by its family's mapping."""
    fam, model_type = family_for_hf(d, source)
    return fam.config_from_hf(d, model_type, source)


def config_to_hf(cfg: ModelConfig, torch_dtype: str = "float32") -> dict[str, object]:
    """ModelConfig -> an HF `config.json` dict that transformers and vLLM load."""
    return family(cfg).config_to_hf(cfg, torch_dtype)


def family_of_params(params: object) -> ModuleType:
    """The family whose params pytree `params` is (code that holds params but no config:
    quantization, the CPU packing)."""
    for fam in FAMILIES:
        if isinstance(params, fam.Params):
            return fam
    raise TypeError(f"{type(params).__name__} is the params pytree of no registered family")
