"""Gemma 4 (text): one family module on the shared blocks, beside Gemma 2 / 3 (`gemma.py`).

Data flow: an HF `config.json` of `Gemma4ForCausalLM` (model_type gemma4_text) ->
`config_from_hf` -> a `ModelConfig` whose `per_layer` spells each layer out from
`layer_types` (default: five sliding layers, then one full; the last layer is always full, as
transformers forces it). What Gemma 4's text decoder has beyond Gemma 3, and where it lives:

- RMSNorm scaled by w, not (1 + w) (`norm_offset` 0), on every norm incl. qk-norm;
- a scale-free RMSNorm on each value head (`LayerSpec.v_norm`);
- query scale 1 (no `query_pre_attn_scalar`: the qk-norms set the logits' scale);
- global layers of their own head size and KV-head count (`global_head_dim` /
  `num_global_key_value_heads`, or the explicit `per_layer_config` transformers 5 writes):
  `LayerSpec.head_dim` / `num_kv_heads`. The model-wide `head_dim` / `num_kv_heads` are the
  widest; a narrower layer's weights are zero-padded per head and its KV heads repeated to
  them by `hf_layer_part` (`host_arrays.PaddedHeads`), so the layers stack and share one KV
  page layout. Cost: those layers' q/k/v/o and KV pages at the widest shape;
- `attention_k_eq_v`: on full layers V is the raw key projection (no `v_proj`;
  `LayerSpec.v_from_k`);
- proportional RoPE on the global layers (`rope_type` "proportional", `partial_rotary_factor`):
  `RopeScaling`, `blocks.rope_inv_freq`;
- a per-layer `layer_scalar` weight multiplying the layer's output (`LayerSpec.layer_scalar`);
- per-layer embeddings (`hidden_size_per_layer_input` P > 0, Gemma 4 E2B / E4B): a token
  table [vocab_size_per_layer_input, L * P] and a projection of the embeddings give each
  layer a P-vector per token (`blocks.per_layer_inputs`), added through a gated projection
  after the MLP (`blocks.per_layer_input_block`);
- KV shared across layers (`num_kv_shared_layers`): the last layers reuse the K/V of the last
  earlier layer of their type (`LayerSpec.kv_store` / `kv_reuse`, carried through the scan;
  each reusing layer still writes them into its own pages: memory for their pages is spent
  as if they had their own, and nothing in paging / prefix caching / preemption changes);
  those layers' double-wide MLPs (`use_double_wide_mlp`) are the model's intermediate size,
  the other layers' zero-padded to it (`LayerSpec.intermediate_size`);
- the sandwich norms, GeGLU, embeddings times sqrt(hidden), tied embeddings, the optional
  final logit soft-cap and per-kind rope bases / windows, as Gemma 3.

Refused with the config field named (`_REFUSED_FIELDS`): the MoE block (`enable_moe_block`,
26B-A4B: its MoE layer is not mapped onto the shared MoE block, `models/moe.py`, yet) and
bidirectional attention
(`use_bidirectional_attention`). The multimodal `Gemma4ForConditionalGeneration` is refused
(text weights under `model.language_model.*` beside vision / audio towers), as Gemma 3's
is. GGUF: llama.cpp's `gemma4` text files load through `gemma4_gguf.py` (its docstring
lists the layout and what it refuses).
"""

from __future__ import annotations

import math
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from . import gemma4_gguf
from .config import (ConfigError, LayerSpec, ModelConfig, RopeScaling, eos_ids, hf_int,
                     hf_rope_scaling, opt_token_id, rope_scaling_to_hf)
from .gemma import HF_LAYER_NAMES as _GEMMA_HF_LAYER_NAMES
from .gemma import HF_NAMES, KV_FIELDS, LINEAR_FIELDS  # noqa: F401  (the same names)
from .gemma import TP_LAYOUT as _GEMMA_TP_LAYOUT
from .gemma4_gguf import (GGUF_ARCHITECTURES, GGUF_LAYER_NAMES, GGUF_NAMES,  # noqa: F401
                          GGUF_PERMUTED, GGUF_ROPE_SCALING, GGUF_SHAPE_FIELDS)
from .host_arrays import HostArray, PaddedHeads
from .linear import Weight
from .gemma4_config import (  # noqa: F401  (the family's interface, defined there)
    _layer_dims, config_dict_from_gguf, config_from_hf, config_to_hf, gguf_rope_freqs)

ARCHITECTURES = {"Gemma4ForCausalLM": "gemma4_text"}
REFUSED_ARCHITECTURES = {
    "Gemma4ForConditionalGeneration": "is the multimodal Gemma 4 (vision / audio towers, "
    "text weights under model.language_model.*); only its text-only form Gemma4ForCausalLM "
    "(model_type gemma4_text) is supported",
    "gemma4": "is the multimodal Gemma 4 (Gemma4ForConditionalGeneration); only "
    "Gemma4ForCausalLM (model_type gemma4_text) is supported",
}
# GGUF: llama.cpp's gemma4 files (text): the tables are `gemma4_gguf`'s (imported above).



@struct.dataclass
class LayerParams:
    """Per-layer weights stacked on a leading layer axis L. Norms scale by w (no offset).
    Attention fields are at the model-wide (widest) head size / KV-head count; a narrower
    layer's are zero-padded per head, its KV heads repeated (`hf_layer_part`)."""

    attn_norm: jax.Array  # f[L, hidden] (input_layernorm)
    wq: Weight  # f[L, hidden, num_heads * head_dim]
    wk: Weight  # f[L, hidden, num_kv_heads * head_dim]
    wv: Weight  # f[L, hidden, num_kv_heads * head_dim] (v_from_k layers: k_proj's, unused)
    wo: Weight  # f[L, num_heads * head_dim, hidden]
    post_attn_norm: jax.Array  # f[L, hidden]
    mlp_norm: jax.Array  # f[L, hidden] (pre_feedforward_layernorm)
    w_gate: Weight  # f[L, hidden, intermediate]
    w_up: Weight  # f[L, hidden, intermediate]
    w_down: Weight  # f[L, intermediate, hidden]
    post_mlp_norm: jax.Array  # f[L, hidden]
    q_norm: jax.Array  # f[L, head_dim]
    k_norm: jax.Array  # f[L, head_dim]
    layer_scalar: jax.Array  # f[L, 1]
    bq: jax.Array | None = None  # f[L, num_heads * head_dim]   (attention_bias)
    bk: jax.Array | None = None  # f[L, num_kv_heads * head_dim] (attention_bias)
    bv: jax.Array | None = None  # f[L, num_kv_heads * head_dim] (attention_bias)
    bo: jax.Array | None = None  # f[L, hidden] (attention_bias: o_proj has one too)
    # per-layer embeddings (hidden_size_per_layer_input = P > 0)
    ple_gate: jax.Array | None = None  # f[L, hidden, P] (per_layer_input_gate)
    ple_proj: jax.Array | None = None  # f[L, P, hidden] (per_layer_projection)
    ple_post_norm: jax.Array | None = None  # f[L, hidden] (post_per_layer_input_norm)


@struct.dataclass
class Gemma4Params:
    """All weights of one model. `lm_head` is None when the embeddings are tied."""

    embed: Weight  # f[vocab, hidden]
    layers: LayerParams
    final_norm: jax.Array  # f[hidden]
    lm_head: Weight | None = None  # f[hidden, vocab]
    # per-layer embeddings (`blocks.per_layer_inputs`)
    embed_per_layer: jax.Array | None = None  # f[vocab_size_per_layer_input, L * P]
    per_layer_proj: jax.Array | None = None  # f[hidden, L * P] (per_layer_model_projection)
    per_layer_proj_norm: jax.Array | None = None  # f[P] (per_layer_projection_norm)


Params = Gemma4Params
HF_NAMES = dict(HF_NAMES, embed_per_layer=("model.embed_tokens_per_layer.weight", False),
                per_layer_proj=("model.per_layer_model_projection.weight", True),
                per_layer_proj_norm=("model.per_layer_projection_norm.weight", False))
HF_LAYER_NAMES = dict(_GEMMA_HF_LAYER_NAMES, layer_scalar=("layer_scalar", False),
                      bo=("self_attn.o_proj.bias", False),
                      ple_gate=("per_layer_input_gate.weight", True),
                      ple_proj=("per_layer_projection.weight", True),
                      ple_post_norm=("post_per_layer_input_norm.weight", False))
# bo is added after the row-parallel o_proj's reduction: replicated. The per-layer-embedding
# linears are small (hidden x P): replicated.
TP_LAYOUT = dict(_GEMMA_TP_LAYOUT, layer_scalar="rep", bo="rep", ple_gate="rep",
                 ple_proj="rep", ple_post_norm="rep")
# Top-level fields beyond embed / final_norm / lm_head (`placement.param_specs`): the
# per-layer token table split by rows as the embedding is, the rest replicated.
TOP_TP_LAYOUT = {"embed_per_layer": "vocab_rows", "per_layer_proj": "rep",
                 "per_layer_proj_norm": "rep"}


# --------------------------------------------------- checkpoint tensors <-> stacked params
# field -> (axis of the heads in the checkpoint (HF) layout, which heads: q / kv / one norm)
_HEAD_AXES = {"wq": (0, "q"), "wk": (0, "kv"), "wv": (0, "kv"), "wo": (1, "q"),
              "bq": (0, "q"), "bk": (0, "kv"), "bv": (0, "kv"),
              "q_norm": (0, "norm"), "k_norm": (0, "norm")}
_V_FROM_K = {"wv": ("wk", "self_attn.k_proj.weight"), "bv": ("bk", "self_attn.k_proj.bias")}
# What a KV-reusing layer does not have (transformers builds none of it): zeros, never read.
_KV_OWN = ("wk", "wv", "bk", "bv", "k_norm")
# field -> the axis of the MLP's intermediate size in the checkpoint layout
_MLP_AXES = {"w_gate": 0, "w_up": 0, "w_down": 1}


def _head_layout(cfg: ModelConfig, field: str, i: int) -> tuple[int, int, int]:
    """(heads in the checkpoint, repeats, own head size) of layer i's `field`."""
    d, kv = _layer_dims(cfg, i)
    kind = _HEAD_AXES[field][1]
    if kind == "q":
        return cfg.num_heads, 1, d
    if kind == "kv":
        return kv, cfg.num_kv_heads // kv, d
    return 1, 1, d


def hf_layer_part(cfg: ModelConfig, field: str, i: int, suffix: str,
                  fetch: Callable[[str, tuple[int, ...]], HostArray]) -> HostArray:
    """Layer i's checkpoint tensor of `field` as the stacked per-layer shape (`hf_loader`):
    as it is, or (a layer narrower than the model) its heads zero-padded to the widest head
    and its KV heads repeated (`PaddedHeads`); a `v_from_k` layer's value weights, which the
    checkpoint does not have, are its key weights (never read: the block uses k)."""
    spec = cfg.layer_specs[i]
    stacked = param_shapes(cfg)[f"layers.{field}"][1:]
    transpose = HF_LAYER_NAMES[field][1]
    if spec.kv_reuse is not None and field in _KV_OWN:
        return np.broadcast_to(np.float32(0), stacked[::-1] if transpose else stacked)
    if spec.v_from_k and field in _V_FROM_K:
        field, suffix = _V_FROM_K[field]
    if field in _MLP_AXES and spec.intermediate_size is not None:
        width = cfg.intermediate_size
        own = list(stacked)
        own[1 - _MLP_AXES[field]] = spec.intermediate_size  # [in, out]: HF's axes swapped
        return PaddedHeads(fetch(suffix, tuple(own)), _MLP_AXES[field], 1, 1, width)
    if field not in _HEAD_AXES:
        return fetch(suffix, stacked)
    heads, rep, d = _head_layout(cfg, field, i)
    axis_stacked = len(stacked) - 1  # the heads' axis in the stacked [in, out] / [n] layout
    own = list(stacked)
    own[axis_stacked] = heads * d
    if field == "wo":  # [q_size, hidden]: heads on the input axis
        own = [heads * d, stacked[1]]
    tensor = fetch(suffix, tuple(own))
    if rep == 1 and d == cfg.head_dim:
        return tensor
    return PaddedHeads(tensor, _HEAD_AXES[field][0], heads, rep, cfg.head_dim)


def hf_layer_export(cfg: ModelConfig, field: str, i: int, t: np.ndarray) -> np.ndarray | None:
    """The inverse of `hf_layer_part` on one layer's tensor in checkpoint layout: the first
    copy of each repeated head, its own width; None for a tensor the layer does not have."""
    spec = cfg.layer_specs[i]
    if (spec.v_from_k and field in _V_FROM_K) or (spec.kv_reuse is not None
                                                 and field in _KV_OWN):
        return None
    if field in _MLP_AXES and spec.intermediate_size is not None:
        return np.ascontiguousarray(np.take(t, np.arange(spec.intermediate_size),
                                            axis=_MLP_AXES[field]))
    if field not in _HEAD_AXES:
        return t
    heads, rep, d = _head_layout(cfg, field, i)
    if rep == 1 and d == cfg.head_dim:
        return t
    keep = np.concatenate([g * rep * cfg.head_dim + np.arange(d) for g in range(heads)])
    return np.ascontiguousarray(np.take(t, keep, axis=_HEAD_AXES[field][0]))


# -------------------------------------------------------------------------------- params
def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Expected shape of every Gemma4Params/LayerParams field for `cfg` (absent: not used)."""
    L, H, I = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "embed": (cfg.vocab_size, H), "final_norm": (H,),
        "layers.attn_norm": (L, H), "layers.post_attn_norm": (L, H),
        "layers.mlp_norm": (L, H), "layers.post_mlp_norm": (L, H),
        "layers.wq": (L, H, cfg.q_size), "layers.wk": (L, H, cfg.kv_size),
        "layers.wv": (L, H, cfg.kv_size), "layers.wo": (L, cfg.q_size, H),
        "layers.w_gate": (L, H, I), "layers.w_up": (L, H, I), "layers.w_down": (L, I, H),
        "layers.q_norm": (L, cfg.head_dim), "layers.k_norm": (L, cfg.head_dim),
        "layers.layer_scalar": (L, 1),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (H, cfg.vocab_size)
    if cfg.attention_bias:
        shapes.update({"layers.bq": (L, cfg.q_size), "layers.bk": (L, cfg.kv_size),
                       "layers.bv": (L, cfg.kv_size), "layers.bo": (L, H)})
    P = cfg.per_layer_input_size
    if P:
        shapes.update({"embed_per_layer": (cfg.per_layer_vocab_size, L * P),
                       "per_layer_proj": (H, L * P), "per_layer_proj_norm": (P,),
                       "layers.ple_gate": (L, H, P), "layers.ple_proj": (L, P, H),
                       "layers.ple_post_norm": (L, H)})
    return shapes


def abstract_params(cfg: ModelConfig, dtype: jnp.dtype) -> Gemma4Params:
    """A Gemma4Params of jax.ShapeDtypeStruct leaves (restore targets, memory estimates)."""
    shapes = param_shapes(cfg)

    def leaf(name: str) -> jax.ShapeDtypeStruct | None:
        return jax.ShapeDtypeStruct(shapes[name], dtype) if name in shapes else None

    layer_fields = {f: leaf(f"layers.{f}") for f in LayerParams.__dataclass_fields__}
    top = {f: leaf(f) for f in Gemma4Params.__dataclass_fields__ if f != "layers"}
    return Gemma4Params(layers=LayerParams(**layer_fields), **top)


def init_random_params(cfg: ModelConfig, key: jax.Array, dtype: jnp.dtype = jnp.float32,
                       scale: float = 0.02) -> Gemma4Params:
    """Random weights (tests, benchmarks). Norm weights and layer scalars scale by w itself
    here: they start near 1. Narrower layers' padded head entries are random too: a random
    model is its own (valid) model, not one of a checkpoint's shape."""
    template = abstract_params(cfg, dtype)
    flat, treedef = jax.tree_util.tree_flatten_with_path(template)
    keys = jax.random.split(key, len(flat))
    out = []
    for k, (path, leaf) in zip(keys, flat):
        noise = jax.random.normal(k, leaf.shape, jnp.float32)
        name = jax.tree_util.keystr(path)
        one = "norm" in name or "layer_scalar" in name
        out.append(((1.0 + 0.1 * noise) if one else scale * noise).astype(dtype))
    return jax.tree_util.tree_unflatten(treedef, out)
