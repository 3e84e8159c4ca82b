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

ARCHITECTURES = {"Gemma4ForCausalLM": "gemma4_text"}
REFUSED_ARCHITECTURES = {
    "Gemma4ForConditionalGeneration": "is the multimodal Gemma 4 (vision / audio towers, "
    "text weights under model.language_model.*); only its text-only form Gemma4ForCausalLM "
    "(model_type gemma4_text) is supported",
    "gemma4": "is the multimodal Gemma 4 (Gemma4ForConditionalGeneration); only "
    "Gemma4ForCausalLM (model_type gemma4_text) is supported",
}
# GGUF: llama.cpp's gemma4 files (text): the tables are `gemma4_gguf`'s (imported above).

# transformers' Gemma4TextConfig defaults for fields a config.json may omit.
_DEFAULT_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                 "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                    "rope_theta": 1e6}}
_PATTERN = 6  # every 6th layer full when `layer_types` is absent
# field -> (the value that is served, why another is not)
_REFUSED_FIELDS = {
    "enable_moe_block": (False, "the Gemma 4 mixture-of-experts block (26B-A4B) is not "
                         "supported; only false is"),
    "use_bidirectional_attention": (None, "bidirectional attention (an encoder / vision "
                                    "tokens) is not supported; only null is"),
}
# The class default of each: a config.json that omits one means the default.
_FIELD_DEFAULTS = {"enable_moe_block": False, "use_bidirectional_attention": None}
_PER_LAYER_KEYS = ("head_dim", "num_key_value_heads")


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


# ---------------------------------------------------------------- HF config <-> ModelConfig
def _layer_types(d: Mapping[str, object], n: int, source: str) -> list[str]:
    types = d.get("layer_types")
    if types is None:
        types = ["sliding_attention" if (i + 1) % _PATTERN else "full_attention"
                 for i in range(n)]
    if (not isinstance(types, list) or len(types) != n
            or not set(types) <= {"sliding_attention", "full_attention"}):
        raise ConfigError(f"{source}: layer_types={types!r} must list 'sliding_attention' / "
                          f"'full_attention' for each of the {n} layers")
    # transformers forces the last layer to full attention (with a warning): the model the
    # checkpoint is run as.
    return [*types[:-1], "full_attention"]


def _layer_shapes(d: Mapping[str, object], types: list[str], head_dim: int, kv_heads: int,
                  source: str) -> list[tuple[int, int]]:
    """(head_dim, num_kv_heads) of each layer: `per_layer_config` {index: overrides} when the
    file has it (transformers 5 writes it), else the full layers get `global_head_dim`
    (default 512) and, under `attention_k_eq_v`, `num_global_key_value_heads`."""
    n = len(types)
    out = [(head_dim, kv_heads)] * n
    plc = d.get("per_layer_config")
    if plc is not None:
        if not isinstance(plc, Mapping):
            raise ConfigError(f"{source}: per_layer_config={plc!r} must be an object")
        for idx, over in plc.items():
            i = hf_int(int(idx) if isinstance(idx, str) and idx.isdigit() else idx,
                       "per_layer_config key", source)
            if not 0 <= i < n or not isinstance(over, Mapping):
                raise ConfigError(f"{source}: per_layer_config[{idx!r}] must be the "
                                  f"overrides of one of the {n} layers")
            extra = sorted(set(over) - set(_PER_LAYER_KEYS))
            if extra:
                raise ConfigError(f"{source}: per_layer_config[{idx!r}].{extra[0]} is not "
                                  f"supported; a layer may override {', '.join(_PER_LAYER_KEYS)}")
            out[i] = (hf_int(over.get("head_dim", head_dim), "head_dim", source),
                      hf_int(over.get("num_key_value_heads", kv_heads),
                             "num_key_value_heads", source))
        return out
    g_dim = hf_int(d.get("global_head_dim", 512), "global_head_dim", source)
    g_kv = d.get("num_global_key_value_heads") if d.get("attention_k_eq_v") else None
    g_kv = kv_heads if g_kv is None else hf_int(g_kv, "num_global_key_value_heads", source)
    return [(g_dim, g_kv) if t == "full_attention" else s for t, s in zip(types, out)]


def _kv_sharing(types: list[str], shared: int, source: str
                ) -> list[tuple[int | None, int | None]]:
    """(kv_store slot, kv_reuse slot) of each layer, as transformers' `kv_sharing_modes`:
    the last `shared` layers reuse the K/V of the last earlier layer of their type, which
    stores them; one slot per layer type."""
    n = len(types)
    if not shared:
        return [(None, None)] * n
    if not 0 < shared < n:
        raise ConfigError(f"{source}: num_kv_shared_layers={shared} must be below "
                          f"num_hidden_layers={n}: the shared layers reuse an earlier one's KV")
    first = n - shared
    slots = {t: i for i, t in enumerate(sorted(set(types)))}
    if set(types[:first]) != set(types):
        raise ConfigError(f"{source}: num_kv_shared_layers={shared}: a layer type among the "
                          "shared layers has no earlier layer of its type to take KV from")
    out: list[tuple[int | None, int | None]] = [(None, None)] * first + [
        (None, slots[t]) for t in types[first:]]
    for t in set(types):
        last = max(i for i in range(first) if types[i] == t)
        out[last] = (slots[t], None)
    return out


def _ropes(d: Mapping[str, object], source: str) -> dict[str, tuple[float, RopeScaling]]:
    rp = d.get("rope_parameters")
    if rp is not None and not (isinstance(rp, Mapping) and set(rp) <= set(_DEFAULT_ROPE)):
        raise ConfigError(f"{source}: rope_parameters={rp!r} must be keyed by layer type "
                          "('sliding_attention', 'full_attention')")
    out = {}
    for kind, default in _DEFAULT_ROPE.items():
        sub = (rp or {}).get(kind) or default
        if not isinstance(sub, Mapping):
            raise ConfigError(f"{source}: rope_parameters.{kind}={sub!r} must be an object")
        out[kind] = (float(sub.get("rope_theta", default["rope_theta"])),  # type: ignore[arg-type]
                     hf_rope_scaling({"rope_scaling": sub}, source))
    return out


def config_from_hf(d: Mapping[str, object], model_type: str, source: str) -> ModelConfig:
    """An HF config.json dict of `Gemma4ForCausalLM` (gemma4_text) -> ModelConfig."""

    def req(key: str) -> object:
        if key not in d or d[key] is None:
            raise ConfigError(f"{source}: required field {key!r} is missing")
        return d[key]

    for field, (served, why) in _REFUSED_FIELDS.items():
        value = d.get(field, _FIELD_DEFAULTS[field])
        if value != served:
            raise ConfigError(f"{source}: {field}={value!r}: {why}")
    act = d.get("hidden_activation") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ConfigError(f"{source}: hidden_activation={act!r} is not supported "
                          "(Gemma's is 'gelu_pytorch_tanh')")
    try:
        hidden = hf_int(req("hidden_size"), "hidden_size", source)
        num_heads = hf_int(req("num_attention_heads"), "num_attention_heads", source)
        num_layers = hf_int(req("num_hidden_layers"), "num_hidden_layers", source)
        types = _layer_types(d, num_layers, source)
        shapes = _layer_shapes(d, types, hf_int(d.get("head_dim") or 256, "head_dim", source),
                               hf_int(d.get("num_key_value_heads") or 4, "num_key_value_heads",
                                      source), source)
        widest = max(s[0] for s in shapes)
        kv_heads = math.lcm(*(s[1] for s in shapes))
        if num_heads % kv_heads:
            raise ConfigError(f"{source}: num_attention_heads={num_heads} is not a multiple of "
                              f"every layer's num_key_value_heads {sorted({s[1] for s in shapes})}")
        window = hf_int(d.get("sliding_window", 512), "sliding_window", source)
        ropes = _ropes(d, source)
        bias = bool(d.get("attention_bias", False))
        k_eq_v = bool(d.get("attention_k_eq_v", False))
        final_cap = d.get("final_logit_softcapping")
        sharing = _kv_sharing(types, hf_int(d.get("num_kv_shared_layers") or 0,
                                            "num_kv_shared_layers", source), source)
        inter = hf_int(req("intermediate_size"), "intermediate_size", source)
        # The double-wide MLP is on the KV-reusing layers only; the others are then the
        # narrow ones (padded to the model's width).
        wide = bool(d.get("use_double_wide_mlp")) and any(r is not None for _, r in sharing)
        ple = hf_int(d.get("hidden_size_per_layer_input", 256) or 0,
                     "hidden_size_per_layer_input", source)
        ple_vocab = hf_int(d.get("vocab_size_per_layer_input", 262144),
                           "vocab_size_per_layer_input", source) if ple else 0
        specs = tuple(LayerSpec(
            sliding_window=window if t == "sliding_attention" else None,
            rope_theta=ropes[t][0], rope_scaling=ropes[t][1], query_scale=1.0,
            attention_bias=bias, qk_norm=True, mlp_activation="gelu_pytorch_tanh",
            norm_offset=0.0, post_norms=True,
            head_dim=hd if hd != widest else None, num_kv_heads=kv if kv != kv_heads else None,
            v_norm=True, v_from_k=k_eq_v and t == "full_attention", layer_scalar=True,
            kv_store=store, kv_reuse=reuse,
            intermediate_size=inter if wide and reuse is None else None)
            for t, (hd, kv), (store, reuse) in zip(types, shapes, sharing))
        return ModelConfig(
            model_type=model_type,
            vocab_size=int(req("vocab_size")),  # type: ignore[arg-type]
            hidden_size=hidden,
            intermediate_size=2 * inter if wide else inter,
            num_layers=num_layers, num_heads=num_heads, num_kv_heads=kv_heads, head_dim=widest,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),  # type: ignore[arg-type]
            rope_theta=ropes["full_attention"][0], rope_scaling=ropes["full_attention"][1],
            max_position_embeddings=hf_int(d.get("max_position_embeddings", 131072),
                                           "max_position_embeddings", source),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
            attention_bias=bias, qk_norm=True, sliding_window=None,
            bos_token_id=opt_token_id(d.get("bos_token_id", 2)),
            eos_token_ids=eos_ids(d.get("eos_token_id", 1)),
            pad_token_id=opt_token_id(d.get("pad_token_id", 0)),
            embed_scale=math.sqrt(hidden),
            final_soft_cap=float(final_cap) if final_cap else None,  # type: ignore[arg-type]
            norm_offset=0.0, per_layer=specs,
            per_layer_input_size=ple, per_layer_vocab_size=ple_vocab)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}" if not str(e).startswith(source) else str(e)) from None
    except (TypeError, ValueError, OverflowError, AttributeError) as e:
        raise ConfigError(f"{source}: a field has a value of the wrong type ({e}); "
                          "numeric fields must be numbers") from None


def _layer_dims(cfg: ModelConfig, i: int) -> tuple[int, int]:
    spec = cfg.layer_specs[i]
    return spec.head_dim or cfg.head_dim, spec.num_kv_heads or cfg.num_kv_heads


def _rope_params_to_hf(theta: float, rs: RopeScaling) -> dict[str, object]:
    return {"rope_type": "default", **(rope_scaling_to_hf(rs) or {}), "rope_theta": theta}


def config_to_hf(cfg: ModelConfig, torch_dtype: str = "float32") -> dict[str, object]:
    """An HF config.json dict (transformers 5 form: `layer_types`, `rope_parameters` keyed
    by layer type, the layers that differ from layer 0's shape in `per_layer_config`)."""
    specs = cfg.layer_specs
    local = next((s for s in specs if s.sliding_window is not None), None)
    glob = next(s for s in specs if s.sliding_window is None)
    rope = {"full_attention": _rope_params_to_hf(glob.rope_theta, glob.rope_scaling)}
    if local is not None:
        rope["sliding_attention"] = _rope_params_to_hf(local.rope_theta, local.rope_scaling)
    base = _layer_dims(cfg, 0)
    narrow = next((s.intermediate_size for s in specs if s.intermediate_size is not None), None)
    per_layer = {str(i): {"head_dim": _layer_dims(cfg, i)[0],
                          "num_key_value_heads": _layer_dims(cfg, i)[1]}
                 for i in range(cfg.num_layers) if _layer_dims(cfg, i) != base}
    return {
        "architectures": ["Gemma4ForCausalLM"], "model_type": cfg.model_type,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size if narrow is None else narrow,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": base[1],
        "head_dim": base[0], "per_layer_config": per_layer,
        "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings, "attention_bias": cfg.attention_bias,
        "sliding_window": local.sliding_window if local else 512,
        "layer_types": [s.attention_type for s in specs],
        "final_logit_softcapping": cfg.final_soft_cap,
        "attention_k_eq_v": any(s.v_from_k for s in specs),
        "hidden_size_per_layer_input": cfg.per_layer_input_size,
        "vocab_size_per_layer_input": cfg.per_layer_vocab_size or cfg.vocab_size,
        "num_kv_shared_layers": sum(s.kv_reuse is not None for s in specs),
        "enable_moe_block": False, "use_double_wide_mlp": narrow is not None,
        "rope_parameters": rope, "torch_dtype": torch_dtype,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": (list(cfg.eos_token_ids) if len(cfg.eos_token_ids) > 1
                         else (cfg.eos_token_ids[0] if cfg.eos_token_ids else None)),
        "pad_token_id": cfg.pad_token_id,
    }


def config_dict_from_gguf(key: gemma4_gguf.GGUFKey, tensor_names: set[str], model_type: str
                          ) -> dict[str, object]:
    """The HF config.json fields of a llama.cpp gemma4 GGUF (`gemma4_gguf.config_dict`)."""
    return gemma4_gguf.config_dict(key, tensor_names, model_type)


def gguf_rope_freqs(freqs: np.ndarray, hf_config: dict[str, object], path: str) -> None:
    """A gemma4 GGUF's `rope_freqs` tensor -> the global layers' proportional RoPE."""
    gemma4_gguf.rope_freqs(freqs, hf_config, path)


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
