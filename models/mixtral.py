"""Mixtral (`MixtralForCausalLM`): one family module on the shared blocks.

The attention is the Llama family's Mistral block (no bias, no qk-norm, an optional window on
every layer); every layer's MLP is the shared MoE block (`models/moe.py`): top
`num_experts_per_tok` of `num_local_experts` SwiGLU experts of width `intermediate_size`,
weighted by the softmax over the selected router logits (transformers: softmax over all, then
the top-k renormalised: the same numbers, `MoESpec.norm_topk_prob`).

Checkpoints: HF safetensors with one tensor per expert
(`block_sparse_moe.experts.{e}.w1 / w3 / w2.weight`: gate / up / down), stacked at load into
[E, in, out] (`moe.ExpertStack`) and split back on export. GGUF: llama.cpp writes Mixtral as
architecture `llama` with `llama.expert_count` > 0 and merged expert tensors, which the Llama
family's GGUF mapping hands to this family (`moe_gguf`).
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
from .moe import EXPERT_FIELDS, KV_FIELDS  # noqa: F401  (the family's names)

ARCHITECTURES = {"MixtralForCausalLM": "mixtral"}
# llama.cpp writes Mixtral as architecture `llama` (q/k rows permuted as for Llama) with
# experts: the Llama family's GGUF mapping hands such a file to this family (model_type
# "mixtral", `llama.config_dict_from_gguf`), so no GGUF architecture names it directly.
GGUF_ARCHITECTURES: dict[str, str] = {}
GGUF_PERMUTED = ("llama",)
GGUF_NAMES = llama.GGUF_NAMES
GGUF_LAYER_NAMES = {**{k: v for k, v in llama.GGUF_LAYER_NAMES.items()
                       if not k.startswith("ffn_") or k == "ffn_norm.weight"},
                    **moe_gguf.MIXTRAL_LAYER_NAMES}


@struct.dataclass
class LayerParams(moe.MoELayerParams):
    """`moe.MoELayerParams` (the family's own class, so `family_of_params` finds it)."""


@struct.dataclass
class Params:
    """All weights of one model. `lm_head` is None when the embeddings are tied."""

    embed: Weight  # f[vocab, hidden]
    layers: LayerParams
    final_norm: jax.Array  # f[hidden]
    lm_head: Weight | None = None  # f[hidden, vocab]


TP_LAYOUT, LINEAR_FIELDS = moe.family_tables(LayerParams)

HF_NAMES = llama.HF_NAMES
HF_LAYER_NAMES: dict[str, tuple[str, bool]] = {
    **{f: v for f, v in llama.HF_LAYER_NAMES.items() if f not in moe.DENSE_MLP_FIELDS},
    "router": ("block_sparse_moe.gate.weight", True),
    "we_gate": ("block_sparse_moe.experts.*.w1.weight", False),
    "we_up": ("block_sparse_moe.experts.*.w3.weight", False),
    "we_down": ("block_sparse_moe.experts.*.w2.weight", False),
}
EXPERT_NAMES = {"we_gate": "block_sparse_moe.experts.{e}.w1.weight",
                "we_up": "block_sparse_moe.experts.{e}.w3.weight",
                "we_down": "block_sparse_moe.experts.{e}.w2.weight"}
GGUF_EXPERT_NAMES = moe_gguf.expert_names(EXPERT_NAMES)


# ---------------------------------------------------------------- HF config <-> ModelConfig
def config_from_hf(d: Mapping[str, object], model_type: str, source: str) -> ModelConfig:
    """An HF config.json dict of Mixtral -> ModelConfig: the Llama family's Mistral mapping
    for the attention, the MoE spec on every layer."""
    base = llama.config_from_hf(d, "mistral", source)
    num_experts = moe.hf_num_experts(d, 8, source)
    spec = MoESpec(num_experts=num_experts,
                   top_k=hf_int(d.get("num_experts_per_tok") or 2, "num_experts_per_tok",
                                source),
                   intermediate_size=base.intermediate_size, norm_topk_prob=True)
    try:
        return dataclasses.replace(base, model_type=model_type,
                                   per_layer=(moe.with_moe(base.uniform_spec(), spec),)
                                   * base.num_layers)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def config_to_hf(cfg: ModelConfig, torch_dtype: str = "float32") -> dict[str, object]:
    """An HF config.json dict that transformers loads."""
    d = llama.config_to_hf(dataclasses.replace(cfg, model_type="mistral", per_layer=()),
                           torch_dtype)
    spec = moe.moe_spec_of(cfg)
    d.update(architectures=["MixtralForCausalLM"], model_type="mixtral",
             num_local_experts=spec.num_experts, num_experts_per_tok=spec.top_k)
    return d


def config_dict_from_gguf(key: moe_gguf.GGUFKey, tensor_names: set[str], model_type: str
                          ) -> dict[str, object]:
    """Not reached through GGUF_ARCHITECTURES (empty): `llama.config_dict_from_gguf` maps a
    `llama` file with experts (`moe_gguf.config_dict`)."""
    return llama.config_dict_from_gguf(key, tensor_names, "llama")


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
