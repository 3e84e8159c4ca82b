"""Qwen3-MoE (`Qwen3MoeForCausalLM`) and Qwen2-MoE (`Qwen2MoeForCausalLM`): one family module.

The attention is the Llama family's Qwen3 (qk-norm, no bias) / Qwen2 (q/k/v bias) block;
the MLP of a sparse layer is the shared MoE block (`models/moe.py`): a float32 router over
`num_experts`, the top `num_experts_per_tok`, renormalised when `norm_topk_prob`, experts of
width `moe_intermediate_size`; Qwen2-MoE adds its shared expert (`shared_expert_intermediate_
size`, gated by sigmoid(`shared_expert_gate`)). Which layers are sparse is per-layer spec
data (`LayerSpec.moe`) from `decoder_sparse_step` / `mlp_only_layers`: a dense layer
(`intermediate_size`) between sparse ones has another spec, so the two kinds scan in
separate groups (`decoder.scan_layers`).

Checkpoints: HF safetensors with one tensor per expert (`mlp.experts.{e}.gate_proj.weight`
...), stacked at load into [E, in, out] (`moe.ExpertStack`) and split back on export.
Refused, with the field named: Qwen2-MoE's `use_sliding_window` (per-layer windows under
`max_window_layers`) and what the Llama family's mapping refuses (hidden_act other than silu,
rope types it does not know). GGUF: llama.cpp's `qwen3moe` / `qwen2moe` files, their merged
expert tensors (`ffn_*_exps`) split per expert at load (`moe_gguf`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from . import llama, moe, moe_gguf
from .config import ConfigError, ModelConfig, MoESpec, hf_int
from .host_arrays import HostArray
from .linear import Weight
from .moe import KV_FIELDS  # noqa: F401  (the family's names)

ARCHITECTURES = {"Qwen3MoeForCausalLM": "qwen3_moe", "Qwen2MoeForCausalLM": "qwen2_moe"}
# GGUF `general.architecture` -> model_type (llama.cpp's Qwen3MoeModel / Qwen2MoeModel
# converters); the names and metadata are `moe_gguf`'s. Stored as in HF (NEOX RoPE, no q/k
# permutation).
GGUF_ARCHITECTURES = {"qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe"}
GGUF_PERMUTED: tuple[str, ...] = ()
GGUF_NAMES = llama.GGUF_NAMES
GGUF_LAYER_NAMES = {**llama.GGUF_LAYER_NAMES, **moe_gguf.QWEN_MOE_LAYER_NAMES}
GGUF_SQUEEZED = moe_gguf.GGUF_SQUEEZED
# The base Llama-family mapping of each (its attention: qk-norm for qwen3, biases for qwen2).
_BASE_TYPE = {"qwen3_moe": "qwen3", "qwen2_moe": "qwen2"}
# transformers' class defaults for the MoE fields a config.json may omit.
_DEFAULTS = {
    "qwen3_moe": dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                      norm_topk_prob=False, shared_expert_intermediate_size=0),
    "qwen2_moe": dict(num_experts=60, num_experts_per_tok=4, moe_intermediate_size=1408,
                      norm_topk_prob=False, shared_expert_intermediate_size=5632),
}


@struct.dataclass
class LayerParams(moe.MixedMoELayerParams):
    """`moe.MixedMoELayerParams` (the family's own class, so `family_of_params` finds it)."""


@struct.dataclass
class Params:
    """All weights of one model. `lm_head` is None when the embeddings are tied."""

    embed: Weight  # f[vocab, hidden]
    layers: LayerParams
    final_norm: jax.Array  # f[hidden]
    lm_head: Weight | None = None  # f[hidden, vocab]


TP_LAYOUT, LINEAR_FIELDS = moe.family_tables(LayerParams)

HF_NAMES = llama.HF_NAMES
# Expert fields are read by `hf_layer_part` from the per-expert names below and are already
# [E, in, out] (no transpose by the loader); the suffix here names the stack in messages.
HF_LAYER_NAMES: dict[str, tuple[str, bool]] = {
    **{f: v for f, v in llama.HF_LAYER_NAMES.items() if f not in moe.DENSE_MLP_FIELDS},
    "router": ("mlp.gate.weight", True),
    "we_gate": ("mlp.experts.*.gate_proj.weight", False),
    "we_up": ("mlp.experts.*.up_proj.weight", False),
    "we_down": ("mlp.experts.*.down_proj.weight", False),
    "w_gate": ("mlp.gate_proj.weight", True),
    "w_up": ("mlp.up_proj.weight", True),
    "w_down": ("mlp.down_proj.weight", True),
    "ws_gate": ("mlp.shared_expert.gate_proj.weight", True),
    "ws_up": ("mlp.shared_expert.up_proj.weight", True),
    "ws_down": ("mlp.shared_expert.down_proj.weight", True),
    "ws_router": ("mlp.shared_expert_gate.weight", True),
}
EXPERT_NAMES = {"we_gate": "mlp.experts.{e}.gate_proj.weight",
                "we_up": "mlp.experts.{e}.up_proj.weight",
                "we_down": "mlp.experts.{e}.down_proj.weight"}
EXPERT_FIELDS = moe.EXPERT_FIELDS
GGUF_EXPERT_NAMES = moe_gguf.expert_names(EXPERT_NAMES)


# ---------------------------------------------------------------- HF config <-> ModelConfig
def config_from_hf(d: Mapping[str, object], model_type: str, source: str) -> ModelConfig:
    """An HF config.json dict of Qwen3-MoE / Qwen2-MoE -> ModelConfig: the Llama family's
    Qwen3 / Qwen2 mapping for the attention, the MoE spec on the sparse layers."""
    if model_type == "qwen2_moe" and d.get("use_sliding_window"):
        raise ConfigError(f"{source}: use_sliding_window=true is not supported for "
                          "qwen2_moe (per-layer windows under max_window_layers); only false")
    defaults = _DEFAULTS[model_type]

    def get(key: str) -> object:
        v = d.get(key)
        return defaults[key] if v is None else v

    base = llama.config_from_hf(d, _BASE_TYPE[model_type], source)
    if model_type == "qwen2_moe":  # Qwen2-MoE says so in qkv_bias (default true)
        base = dataclasses.replace(base, attention_bias=bool(d.get("qkv_bias", True)))
    n = base.num_layers
    num_experts = moe.hf_num_experts(d, defaults["num_experts"], source)  # type: ignore[arg-type]
    norm = get("norm_topk_prob")
    if not isinstance(norm, bool):
        raise ConfigError(f"{source}: norm_topk_prob={norm!r} must be true or false")
    sparse = moe.sparse_layers(d, n, source) if num_experts > 0 else [False] * n
    spec = MoESpec(num_experts=num_experts,
                   top_k=hf_int(get("num_experts_per_tok"), "num_experts_per_tok", source),
                   intermediate_size=hf_int(get("moe_intermediate_size"),
                                            "moe_intermediate_size", source),
                   norm_topk_prob=norm,
                   shared_intermediate_size=(
                       hf_int(get("shared_expert_intermediate_size"),
                              "shared_expert_intermediate_size", source)
                       if model_type == "qwen2_moe" else 0))
    uniform = base.uniform_spec()
    try:
        return dataclasses.replace(
            base, model_type=model_type,
            per_layer=tuple(moe.with_moe(uniform, spec if s else None) for s in sparse))
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def config_to_hf(cfg: ModelConfig, torch_dtype: str = "float32") -> dict[str, object]:
    """An HF config.json dict that transformers loads (the Qwen3 / Qwen2 fields of the Llama
    family's mapping, then the MoE ones)."""
    attn = dataclasses.replace(cfg, model_type=_BASE_TYPE[cfg.model_type], per_layer=())
    d = llama.config_to_hf(attn, torch_dtype)
    spec = moe.moe_spec_of(cfg)
    arch = {t: a for a, t in ARCHITECTURES.items()}[cfg.model_type]
    d.update(architectures=[arch], model_type=cfg.model_type, decoder_sparse_step=1,
             mlp_only_layers=[i for i, s in enumerate(cfg.layer_specs) if s.moe is None],
             num_experts=spec.num_experts if spec else 0,
             num_experts_per_tok=spec.top_k if spec else 1,
             moe_intermediate_size=spec.intermediate_size if spec else cfg.intermediate_size,
             norm_topk_prob=spec.norm_topk_prob if spec else False)
    if cfg.model_type == "qwen2_moe":
        d.pop("attention_bias", None)
        d["qkv_bias"] = cfg.attention_bias
        d["shared_expert_intermediate_size"] = spec.shared_intermediate_size if spec else 0
    return d


def config_dict_from_gguf(key: moe_gguf.GGUFKey, tensor_names: set[str], model_type: str
                          ) -> dict[str, object]:
    """The HF config.json fields of a qwen3moe / qwen2moe GGUF (`moe_gguf.config_dict`)."""
    return moe_gguf.config_dict(key, tensor_names, model_type,
                                llama.gguf_attention_fields(key, tensor_names))


# --------------------------------------------------- checkpoint tensors <-> stacked params
def hf_layer_part(cfg: ModelConfig, field: str, i: int, suffix: str,
                  fetch: Callable[[str, tuple[int, ...]], HostArray]) -> HostArray:
    return moe.hf_layer_part(cfg, HF_LAYER_NAMES, EXPERT_NAMES, field, i, suffix, fetch)


def hf_layer_export(cfg: ModelConfig, field: str, i: int, t: np.ndarray
                    ) -> np.ndarray | dict[str, np.ndarray] | None:
    return moe.hf_layer_export(cfg, EXPERT_NAMES, field, i, t)


# -------------------------------------------------------------------------------- params
def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Expected shape of every Params/LayerParams field for `cfg` (absent: not used)."""
    base = {k: v for k, v in llama.param_shapes(cfg).items()
            if k.removeprefix("layers.") not in moe.DENSE_MLP_FIELDS}
    return moe.moe_param_shapes(cfg, base)


def abstract_params(cfg: ModelConfig, dtype: jnp.dtype) -> Params:
    """A Params of jax.ShapeDtypeStruct leaves (restore targets, memory estimates)."""
    shapes = param_shapes(cfg)

    def leaf(name: str) -> jax.ShapeDtypeStruct | None:
        return jax.ShapeDtypeStruct(shapes[name], dtype) if name in shapes else None

    layer_fields = {f: leaf(f"layers.{f}") for f in LayerParams.__dataclass_fields__}
    return Params(embed=leaf("embed"), layers=LayerParams(**layer_fields),
                  final_norm=leaf("final_norm"), lm_head=leaf("lm_head"))


def init_random_params(cfg: ModelConfig, key: jax.Array, dtype: jnp.dtype = jnp.float32,
                       scale: float = 0.02) -> Params:
    """Random weights (tests, benchmarks); norms start near 1 so activations stay sane."""
    return moe.random_params(abstract_params(cfg, dtype), key, dtype, scale)
