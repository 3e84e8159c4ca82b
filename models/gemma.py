"""The Gemma family (Gemma 2, Gemma 3 text): one family module on the shared blocks.

Data flow: an HF `config.json` of `Gemma2ForCausalLM` (model_type gemma2) or
`Gemma3ForCausalLM` (gemma3_text) -> `config_from_hf` -> a `ModelConfig` whose `per_layer`
spells each layer out from `layer_types` (or the older alternation / `sliding_window_pattern`):
a sliding layer gets the window and the local rope base, a full layer none and the global base
(Gemma 3: `rope_local_base_freq` / `rope_parameters.sliding_attention` vs `rope_theta` +
rope scaling / `rope_parameters.full_attention`; Gemma 2: one base for both). Every layer is
GeGLU, RMSNorm with (1 + w) (`norm_offset` 1, computed in float32 by `blocks.rms_norm`), the
sandwich norms (`post_norms`), query scale `query_pre_attn_scalar ** -0.5`, and on Gemma 2 the
attention logit soft-cap; Gemma 3 adds qk-norm. The model-wide fields carry the embedding
scale sqrt(hidden) and Gemma 2's final logit soft-cap. The decoder (`decoder.py`,
`paged.py`) then runs the layer groups this gives; nothing here branches at run time.

Names: HF's Gemma `post_attention_layernorm` is the norm *after* attention (not the
pre-MLP norm it is in Llama): `mlp_norm` is `pre_feedforward_layernorm`.

GGUF: gemma2 / gemma3 files (llama.cpp's converter) -> `config_dict_from_gguf` reads the
`{arch}.*` metadata as llama.cpp does (the window, the local / global pattern, rope bases,
Gemma 2's soft-caps, the 27B query scale) into the same HF config fields, and the norm
weights, which the converter stores as 1 + w, are shifted back to w on read
(`GGUF_NORM_SHIFTS`, applied by `gguf_tensor.GGUFTensor` on every read path; the GGUF tables and
mapping live in `gemma_gguf.py`). No q/k row
permutation (llama.cpp runs Gemma with NEOX RoPE). Gemma 1, 3n, 4, EmbeddingGemma and the
mmproj (clip) vision files beside Gemma 3 GGUFs are refused with a reason (`GGUF_REFUSED`).
"""

from __future__ import annotations

import math
from typing import Mapping

import jax
import jax.numpy as jnp
from flax import struct

from .config import (ConfigError, LayerSpec, ModelConfig, RopeScaling, eos_ids, hf_int,
                     hf_rope_scaling, hf_rope_theta, opt_token_id, rope_scaling_to_hf)
from .linear import Weight
from . import gemma_gguf
from .gemma_gguf import (GGUF_ARCHITECTURES, GGUF_LAYER_NAMES, GGUF_NAMES,  # noqa: F401
                         GGUF_NORM_SHIFTS, GGUF_PERMUTED, GGUF_REFUSED, GGUFKey)

ARCHITECTURES = {"Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3_text"}
# Names that are Gemma but not served: `families.family_for_hf` says why instead of
# "unsupported". The multimodal checkpoint nests the text model under `text_config` and its
# weights under `model.language_model.*` beside a vision tower.
REFUSED_ARCHITECTURES = {
    "Gemma3ForConditionalGeneration": "is the multimodal Gemma 3 (vision tower, text weights "
    "under model.language_model.*); only its text-only form Gemma3ForCausalLM "
    "(model_type gemma3_text) is supported",
    "gemma3": "is the multimodal Gemma 3 (Gemma3ForConditionalGeneration); only "
    "Gemma3ForCausalLM (model_type gemma3_text) is supported",
}
# HF class defaults a config.json may omit (transformers' Gemma2Config / Gemma3TextConfig).
_DEFAULTS = {"gemma2": dict(attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                            pattern=2, global_theta=10000.0),
             "gemma3_text": dict(attn_logit_softcapping=None, final_logit_softcapping=None,
                                 pattern=6, global_theta=1e6)}


@struct.dataclass
class LayerParams:
    """Per-layer weights stacked on a leading layer axis L (scanned). Norms are Gemma's
    offsets: the scale is (1 + w)."""

    attn_norm: jax.Array  # f[L, hidden] (input_layernorm)
    wq: Weight  # f[L, hidden, num_heads * head_dim]
    wk: Weight  # f[L, hidden, num_kv_heads * head_dim]
    wv: Weight  # f[L, hidden, num_kv_heads * head_dim]
    wo: Weight  # f[L, num_heads * head_dim, hidden]
    post_attn_norm: jax.Array  # f[L, hidden] (post_attention_layernorm)
    mlp_norm: jax.Array  # f[L, hidden] (pre_feedforward_layernorm)
    w_gate: Weight  # f[L, hidden, intermediate]
    w_up: Weight  # f[L, hidden, intermediate]
    w_down: Weight  # f[L, intermediate, hidden]
    post_mlp_norm: jax.Array  # f[L, hidden] (post_feedforward_layernorm)
    bq: jax.Array | None = None  # f[L, num_heads * head_dim]   (attention_bias)
    bk: jax.Array | None = None  # f[L, num_kv_heads * head_dim] (attention_bias)
    bv: jax.Array | None = None  # f[L, num_kv_heads * head_dim] (attention_bias)
    q_norm: jax.Array | None = None  # f[L, head_dim] (Gemma 3)
    k_norm: jax.Array | None = None  # f[L, head_dim] (Gemma 3)


@struct.dataclass
class GemmaParams:
    """All weights of one model. `lm_head` is None when the embeddings are tied (Gemma's
    default)."""

    embed: Weight  # f[vocab, hidden]; packed: its transpose [hidden, vocab] (tied lm_head)
    layers: LayerParams
    final_norm: jax.Array  # f[hidden]
    lm_head: Weight | None = None  # f[hidden, vocab]


Params = GemmaParams

HF_NAMES: dict[str, tuple[str, bool]] = {
    "embed": ("model.embed_tokens.weight", False),
    "final_norm": ("model.norm.weight", False),
    "lm_head": ("lm_head.weight", True),
}
HF_LAYER_NAMES: dict[str, tuple[str, bool]] = {
    "attn_norm": ("input_layernorm.weight", False),
    "wq": ("self_attn.q_proj.weight", True),
    "wk": ("self_attn.k_proj.weight", True),
    "wv": ("self_attn.v_proj.weight", True),
    "wo": ("self_attn.o_proj.weight", True),
    "bq": ("self_attn.q_proj.bias", False),
    "bk": ("self_attn.k_proj.bias", False),
    "bv": ("self_attn.v_proj.bias", False),
    "q_norm": ("self_attn.q_norm.weight", False),
    "k_norm": ("self_attn.k_norm.weight", False),
    "post_attn_norm": ("post_attention_layernorm.weight", False),
    "mlp_norm": ("pre_feedforward_layernorm.weight", False),
    "post_mlp_norm": ("post_feedforward_layernorm.weight", False),
    "w_gate": ("mlp.gate_proj.weight", True),
    "w_up": ("mlp.up_proj.weight", True),
    "w_down": ("mlp.down_proj.weight", True),
}
LINEAR_FIELDS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
# As the Llama family's (`llama.TP_LAYOUT`), plus the sandwich norms, replicated.
TP_LAYOUT = {"attn_norm": "rep", "wq": "col", "wk": "col", "wv": "col", "wo": "row",
             "post_attn_norm": "rep", "mlp_norm": "rep", "w_gate": "col", "w_up": "col",
             "w_down": "row", "post_mlp_norm": "rep", "bq": "vec", "bk": "vec", "bv": "vec",
             "q_norm": "rep", "k_norm": "rep"}
KV_FIELDS = ("wk", "wv", "bk", "bv")


# ---------------------------------------------------------------- HF config <-> ModelConfig
def _layer_types(d: Mapping[str, object], n: int, pattern: int, source: str) -> list[str]:
    types = d.get("layer_types")
    if types is None:
        # Older config.json: every `pattern`-th layer is global (transformers' own default).
        pattern = hf_int(d.get("sliding_window_pattern", pattern), "sliding_window_pattern",
                         source)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                 for i in range(n)]
    if (not isinstance(types, list) or len(types) != n
            or not set(types) <= {"sliding_attention", "full_attention"}):
        raise ConfigError(f"{source}: layer_types={types!r} must list 'sliding_attention' / "
                          f"'full_attention' for each of the {n} layers")
    return types


def _ropes(d: Mapping[str, object], model_type: str, source: str
           ) -> dict[str, tuple[float, RopeScaling]]:
    """layer type -> (rope base, scaling). Gemma 3's `rope_parameters` is keyed by layer
    type (transformers 5); older files say `rope_theta` + `rope_scaling` (global layers) and
    `rope_local_base_freq` (local layers)."""
    rp = d.get("rope_parameters")
    glob = (hf_rope_theta(d) if "rope_theta" in d or isinstance(rp, Mapping) and "rope_theta"
            in rp else _DEFAULTS[model_type]["global_theta"])
    if model_type == "gemma2" or not (isinstance(rp, Mapping) and "full_attention" in rp):
        scaling = hf_rope_scaling(d, source)
        local = float(d.get("rope_local_base_freq", 10000.0)) if model_type != "gemma2" else glob
        return {"full_attention": (float(glob), scaling),
                "sliding_attention": (local, RopeScaling() if model_type != "gemma2"
                                      else scaling)}
    out = {}
    for kind, theta in (("full_attention", 1e6), ("sliding_attention", 10000.0)):
        sub = rp.get(kind) or {}
        out[kind] = (float(sub.get("rope_theta", theta)),
                     hf_rope_scaling({"rope_scaling": sub}, source))
    return out


def config_from_hf(d: Mapping[str, object], model_type: str, source: str) -> ModelConfig:
    """An HF config.json dict of `model_type` (gemma2 / gemma3_text) -> ModelConfig."""

    def req(key: str) -> object:
        if key not in d or d[key] is None:
            raise ConfigError(f"{source}: required field {key!r} is missing")
        return d[key]

    defaults = _DEFAULTS[model_type]
    act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ConfigError(f"{source}: hidden_activation={act!r} is not supported "
                          "(Gemma's is 'gelu_pytorch_tanh')")
    if d.get("use_bidirectional_attention"):
        raise ConfigError(f"{source}: use_bidirectional_attention=true (an encoder) is not "
                          "supported")
    try:
        hidden = hf_int(req("hidden_size"), "hidden_size", source)
        num_heads = hf_int(req("num_attention_heads"), "num_attention_heads", source)
        num_layers = hf_int(req("num_hidden_layers"), "num_hidden_layers", source)
        head_dim = hf_int(d.get("head_dim") or 256, "head_dim", source)
        window = d.get("sliding_window", 4096)
        window = hf_int(window, "sliding_window", source) if window is not None else None
        scalar = float(d.get("query_pre_attn_scalar", 256))  # type: ignore[arg-type]
        attn_cap = d.get("attn_logit_softcapping", defaults["attn_logit_softcapping"])
        final_cap = d.get("final_logit_softcapping", defaults["final_logit_softcapping"])
        ropes = _ropes(d, model_type, source)
        bias = bool(d.get("attention_bias", False))
        qk_norm = model_type == "gemma3_text"
        specs = tuple(LayerSpec(
            sliding_window=window if t == "sliding_attention" else None,
            rope_theta=ropes[t][0], rope_scaling=ropes[t][1], query_scale=scalar ** -0.5,
            soft_cap=float(attn_cap) if attn_cap else None,  # type: ignore[arg-type]
            attention_bias=bias, qk_norm=qk_norm, mlp_activation="gelu_pytorch_tanh",
            norm_offset=1.0, post_norms=True)
            for t in _layer_types(d, num_layers, defaults["pattern"], source))
        return ModelConfig(
            model_type=model_type,
            vocab_size=int(req("vocab_size")),  # type: ignore[arg-type]
            hidden_size=hidden,
            intermediate_size=int(req("intermediate_size")),  # type: ignore[arg-type]
            num_layers=num_layers, num_heads=num_heads,
            num_kv_heads=hf_int(d.get("num_key_value_heads") or num_heads,
                                "num_key_value_heads", source),
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),  # type: ignore[arg-type]
            # The model-wide rope / window fields describe the global layers; `per_layer`
            # is what the decoder reads.
            rope_theta=ropes["full_attention"][0], rope_scaling=ropes["full_attention"][1],
            max_position_embeddings=int(d.get("max_position_embeddings", 8192)),  # type: ignore[arg-type]
            tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
            attention_bias=bias, qk_norm=qk_norm, sliding_window=None,
            bos_token_id=opt_token_id(d.get("bos_token_id")),
            eos_token_ids=eos_ids(d.get("eos_token_id")),
            pad_token_id=opt_token_id(d.get("pad_token_id")),
            embed_scale=math.sqrt(hidden),
            final_soft_cap=float(final_cap) if final_cap else None,  # type: ignore[arg-type]
            norm_offset=1.0, per_layer=specs)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}" if not str(e).startswith(source) else str(e)) from None
    except (TypeError, ValueError, OverflowError, AttributeError) as e:
        raise ConfigError(f"{source}: a field has a value of the wrong type ({e}); "
                          "numeric fields must be numbers") from None


def _rope_params_to_hf(theta: float, rs: RopeScaling) -> dict[str, object]:
    return {"rope_type": "default", **(rope_scaling_to_hf(rs) or {}), "rope_theta": theta}


def config_to_hf(cfg: ModelConfig, torch_dtype: str = "float32") -> dict[str, object]:
    """An HF config.json dict (transformers 5 form: `layer_types`, `rope_parameters`)."""
    specs = cfg.layer_specs
    local = next((s for s in specs if s.sliding_window is not None), None)
    glob = next((s for s in specs if s.sliding_window is None), specs[0])
    scalar = specs[0].query_scale ** -2
    if cfg.model_type == "gemma2":
        rope: dict[str, object] = _rope_params_to_hf(glob.rope_theta, glob.rope_scaling)
    else:
        rope = {"full_attention": _rope_params_to_hf(glob.rope_theta, glob.rope_scaling)}
        if local is not None:
            rope["sliding_attention"] = _rope_params_to_hf(local.rope_theta, local.rope_scaling)
    arch = {t: a for a, t in ARCHITECTURES.items()}[cfg.model_type]
    return {
        "architectures": [arch], "model_type": cfg.model_type,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings, "attention_bias": cfg.attention_bias,
        # A float that is whole (256.0) back as the int HF writes.
        "query_pre_attn_scalar": round(scalar) if abs(scalar - round(scalar)) < 1e-6 else scalar,
        "sliding_window": local.sliding_window if local else None,
        "layer_types": [s.attention_type for s in specs],
        "attn_logit_softcapping": specs[0].soft_cap,
        "final_logit_softcapping": cfg.final_soft_cap,
        "rope_parameters": rope, "torch_dtype": torch_dtype,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": (list(cfg.eos_token_ids) if len(cfg.eos_token_ids) > 1
                         else (cfg.eos_token_ids[0] if cfg.eos_token_ids else None)),
        "pad_token_id": cfg.pad_token_id,
    }




def config_dict_from_gguf(key: GGUFKey, tensor_names: set[str], model_type: str
                          ) -> dict[str, object]:
    """The HF config.json fields of a gemma2 / gemma3 GGUF (`gemma_gguf.config_dict`), with
    this family's default local/global period for files that do not state one."""
    return gemma_gguf.config_dict(key, tensor_names, model_type,
                                  _DEFAULTS[model_type]["pattern"])  # type: ignore[arg-type]


# -------------------------------------------------------------------------------- params
def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Expected shape of every GemmaParams/LayerParams field for `cfg` (absent: not used)."""
    L, H, I = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "embed": (cfg.vocab_size, H), "final_norm": (H,),
        "layers.attn_norm": (L, H), "layers.post_attn_norm": (L, H),
        "layers.mlp_norm": (L, H), "layers.post_mlp_norm": (L, H),
        "layers.wq": (L, H, cfg.q_size), "layers.wk": (L, H, cfg.kv_size),
        "layers.wv": (L, H, cfg.kv_size), "layers.wo": (L, cfg.q_size, H),
        "layers.w_gate": (L, H, I), "layers.w_up": (L, H, I), "layers.w_down": (L, I, H),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (H, cfg.vocab_size)
    if cfg.attention_bias:
        shapes.update({"layers.bq": (L, cfg.q_size), "layers.bk": (L, cfg.kv_size),
                       "layers.bv": (L, cfg.kv_size)})
    if cfg.qk_norm:
        shapes.update({"layers.q_norm": (L, cfg.head_dim), "layers.k_norm": (L, cfg.head_dim)})
    return shapes


def abstract_params(cfg: ModelConfig, dtype: jnp.dtype) -> GemmaParams:
    """A GemmaParams of jax.ShapeDtypeStruct leaves (restore targets, memory estimates)."""
    shapes = param_shapes(cfg)

    def leaf(name: str) -> jax.ShapeDtypeStruct | None:
        return jax.ShapeDtypeStruct(shapes[name], dtype) if name in shapes else None

    layer_fields = {f: leaf(f"layers.{f}") for f in LayerParams.__dataclass_fields__}
    return GemmaParams(embed=leaf("embed"), layers=LayerParams(**layer_fields),
                       final_norm=leaf("final_norm"), lm_head=leaf("lm_head"))


def init_random_params(cfg: ModelConfig, key: jax.Array, dtype: jnp.dtype = jnp.float32,
                       scale: float = 0.02) -> GemmaParams:
    """Random weights (tests, benchmarks); norm offsets start near 0 (scale (1 + w) near 1)."""
    template = abstract_params(cfg, dtype)
    flat, treedef = jax.tree_util.tree_flatten_with_path(template)
    keys = jax.random.split(key, len(flat))
    out = []
    for k, (path, leaf) in zip(keys, flat):
        noise = jax.random.normal(k, leaf.shape, jnp.float32)
        std = 0.1 if "norm" in jax.tree_util.keystr(path) else scale
        out.append((std * noise).astype(dtype))
    return jax.tree_util.tree_unflatten(treedef, out)
