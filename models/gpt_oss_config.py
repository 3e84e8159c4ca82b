"""gpt-oss's HF config.json <-> ModelConfig (the family module is `models/gpt_oss.py`).

Fields a config.json omits take transformers' `GptOssConfig` defaults. Every layer gets
attention sinks, q/k/v/o biases (`attention_bias`), the model's RoPE (YaRN in the releases)
and the MoE spec (router bias, expert biases, clamped SwiGLU); `layer_types` decides which
layers have the window `sliding_window` (default: even layers sliding, odd full).
Refused, naming the field: `layer_types` entries other than sliding / full attention, a
`layer_types` list of the wrong length, a non-positive `swiglu_limit`.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from . import llama, moe
from .config import (ConfigError, ModelConfig, MoESpec, hf_int, hf_rope_theta,
                     rope_scaling_to_hf)

ARCHITECTURES = {"GptOssForCausalLM": "gpt_oss"}
# transformers' GptOssConfig defaults for the fields a config.json may omit.
_DEFAULTS: dict[str, object] = dict(
    num_local_experts=128, num_experts_per_tok=4, head_dim=64, sliding_window=128,
    swiglu_limit=7.0, swiglu_alpha=1.702, attention_bias=True, rms_norm_eps=1e-5,
    max_position_embeddings=131072, num_key_value_heads=8, tie_word_embeddings=False)
_DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                 "truncate": False, "original_max_position_embeddings": 4096}
_LAYER_TYPES = ("sliding_attention", "full_attention")


def config_from_hf(d: Mapping[str, object], model_type: str, source: str) -> ModelConfig:
    """An HF config.json dict of gpt-oss -> ModelConfig (per-layer specs, see module doc);
    errors name the family as well as the field."""
    try:
        return _config_from_hf(d, model_type, source)
    except ConfigError as e:
        raise ConfigError(f"gpt-oss: {e}") from None


def _config_from_hf(d: Mapping[str, object], model_type: str, source: str) -> ModelConfig:
    full = {**_DEFAULTS, **{k: v for k, v in d.items() if v is not None}}
    if d.get("rope_scaling") is None and not isinstance(d.get("rope_parameters"), Mapping):
        full["rope_scaling"] = _DEFAULT_ROPE
    full["rope_theta"] = hf_rope_theta({"rope_theta": 150000.0, **d})
    # The window is per layer here (layer_types): the base config has none.
    base = llama.config_from_hf({**full, "sliding_window": None}, "mistral", source)
    window = full.get("sliding_window")
    window = hf_int(window, "sliding_window", source) if window else None
    n = base.num_layers
    types = d.get("layer_types")
    if types is None:
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    if (not isinstance(types, list) or len(types) != n
            or any(t not in _LAYER_TYPES for t in types)):
        raise ConfigError(f"{source}: layer_types={types!r} must list {n} entries, each one of "
                          f"{', '.join(_LAYER_TYPES)}")
    limit, alpha = float(full["swiglu_limit"]), float(full["swiglu_alpha"])  # type: ignore[arg-type]
    if not limit > 0:
        raise ConfigError(f"{source}: swiglu_limit={limit!r} must be positive")
    spec = MoESpec(num_experts=moe.hf_num_experts(full, 128, source),
                   top_k=hf_int(full["num_experts_per_tok"], "num_experts_per_tok", source),
                   intermediate_size=base.intermediate_size, norm_topk_prob=True,
                   activation="swiglu_clamped", swiglu_alpha=alpha, swiglu_limit=limit,
                   router_bias=True, expert_bias=True)
    uniform = dataclasses.replace(base.uniform_spec(), attention_sinks=True, moe=spec)
    per_layer = tuple(dataclasses.replace(
        uniform, sliding_window=window if t == "sliding_attention" else None) for t in types)
    try:
        return dataclasses.replace(base, model_type=model_type, per_layer=per_layer)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def config_to_hf(cfg: ModelConfig, torch_dtype: str = "float32") -> dict[str, object]:
    """An HF config.json dict that transformers loads as GptOssConfig."""
    specs = cfg.layer_specs
    spec = moe.moe_spec_of(cfg)
    windows = {s.sliding_window for s in specs} - {None}
    d = llama.config_to_hf(dataclasses.replace(cfg, model_type="mistral", per_layer=(),
                                               rope_scaling=specs[0].rope_scaling), torch_dtype)
    d.pop("rope_scaling", None)
    d.update(architectures=["GptOssForCausalLM"], model_type="gpt_oss",
             num_local_experts=spec.num_experts, num_experts_per_tok=spec.top_k,
             swiglu_limit=spec.swiglu_limit, swiglu_alpha=spec.swiglu_alpha,
             sliding_window=windows.pop() if windows else None,
             layer_types=[s.attention_type for s in specs],
             rope_parameters={"rope_theta": cfg.rope_theta,
                              **(rope_scaling_to_hf(specs[0].rope_scaling)
                                 or {"rope_type": "default"})})
    return d


def config_dict_from_gguf(key: object, tensor_names: set[str], model_type: str
                          ) -> dict[str, object]:
    # Unreachable: gpt-oss GGUF files are refused by name (`gpt_oss.GGUF_REFUSED`).
    raise ConfigError("gpt-oss GGUF files are not supported")
