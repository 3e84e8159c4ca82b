"""The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM): one family module.

What a family module holds (`families.py` lists the attributes the loaders and the forward
read; the layers themselves are the shared blocks, composed by `decoder.decoder_layer` from
each layer's `LayerSpec`):
  - the names it answers to: HF `architectures` / `model_type` (`ARCHITECTURES`) and GGUF
    `general.architecture` (`GGUF_ARCHITECTURES`, and which of them store q/k rows permuted);
  - its HF config -> `ModelConfig` mapping (`config_from_hf`, and `config_to_hf` back). Every
    Llama-family layer is alike (`ModelConfig.uniform_spec`: a window on every layer or none,
    one rope base), so the model is one layer group;
  - its params pytree (`LlamaParams` / `LayerParams`, flax.struct dataclasses) with
    `param_shapes`, `abstract_params`, `init_random_params`;
  - its loader name tables: params field -> HF safetensors name (`HF_NAMES`,
    `HF_LAYER_NAMES`), GGUF tensor name -> HF name (`GGUF_NAMES`, `GGUF_LAYER_NAMES`) and
    GGUF metadata -> HF config fields (`config_dict_from_gguf`);
  - its tensor-parallel layout per field (`TP_LAYOUT`) and its linear fields (`LINEAR_FIELDS`:
    what quantization and the CPU packing convert).
Linear weights are stored [in, out], stacked over layers on axis 0 (`models/linear.py`).
"""

from __future__ import annotations

from typing import Callable, Mapping

import jax
import jax.numpy as jnp
from flax import struct

from .config import (ConfigError, ModelConfig, eos_ids, hf_int, hf_rope_scaling, hf_rope_theta,
                     opt_token_id, rope_scaling_to_hf)
from .linear import Weight

# HF architecture class -> model_type.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
# GGUF `general.architecture` -> model_type. Only llama-arch files carry llama.cpp's q/k row
# permutation (it exists for llama.cpp's interleaved RoPE); qwen2/qwen3 use NEOX RoPE and are
# stored as in HF.
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
GGUF_PERMUTED = ("llama",)
# key(name, default=None, required=False, kind=int) -> the value of GGUF metadata `{arch}.name`
GGUFKey = Callable[..., object]


@struct.dataclass
class LayerParams:
    """Per-layer weights stacked on a leading layer axis L (scanned)."""

    attn_norm: jax.Array  # f[L, hidden]
    wq: Weight  # f[L, hidden, num_heads * head_dim]
    wk: Weight  # f[L, hidden, num_kv_heads * head_dim]
    wv: Weight  # f[L, hidden, num_kv_heads * head_dim]
    wo: Weight  # f[L, num_heads * head_dim, hidden]
    mlp_norm: jax.Array  # f[L, hidden]
    w_gate: Weight  # f[L, hidden, intermediate]
    w_up: Weight  # f[L, hidden, intermediate]
    w_down: Weight  # f[L, intermediate, hidden]
    bq: jax.Array | None = None  # f[L, num_heads * head_dim]   (attention_bias)
    bk: jax.Array | None = None  # f[L, num_kv_heads * head_dim] (attention_bias)
    bv: jax.Array | None = None  # f[L, num_kv_heads * head_dim] (attention_bias)
    q_norm: jax.Array | None = None  # f[L, head_dim] (qk_norm)
    k_norm: jax.Array | None = None  # f[L, head_dim] (qk_norm)


@struct.dataclass
class LlamaParams:
    """All weights of one model. `lm_head` is None when the embeddings are tied."""

    embed: Weight  # f[vocab, hidden]; packed: its transpose [hidden, vocab] (tied lm_head)
    layers: LayerParams
    final_norm: jax.Array  # f[hidden]
    lm_head: Weight | None = None  # f[hidden, vocab]


Params = LlamaParams  # the family's params class, by the name `families.py` reads

# Params field -> (HF name, is a linear weight stored [out, in] to transpose).
HF_NAMES: dict[str, tuple[str, bool]] = {
    "embed": ("model.embed_tokens.weight", False),
    "final_norm": ("model.norm.weight", False),
    "lm_head": ("lm_head.weight", True),
}
# LayerParams field -> (HF name inside `model.layers.{i}.`, is a linear weight to transpose).
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
    "mlp_norm": ("post_attention_layernorm.weight", False),
    "w_gate": ("mlp.gate_proj.weight", True),
    "w_up": ("mlp.up_proj.weight", True),
    "w_down": ("mlp.down_proj.weight", True),
}
# GGUF tensor name -> HF name; per layer: suffix after `blk.{i}.` -> after `model.layers.{i}.`.
GGUF_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
              "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias", "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight", "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight",
}
LINEAR_FIELDS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
# LayerParams field -> how tensor parallelism splits it (`placement.py`, Megatron style):
# "col" outputs split, "row" inputs split (each block ends in one all-reduce), "vec" a bias of
# split outputs, "rep" replicated. K/V fields ("wk", "wv", "bk", "bv") are the ones whose heads
# placement replicates when tp exceeds num_kv_heads.
TP_LAYOUT = {"attn_norm": "rep", "wq": "col", "wk": "col", "wv": "col", "wo": "row",
             "mlp_norm": "rep", "w_gate": "col", "w_up": "col", "w_down": "row",
             "bq": "vec", "bk": "vec", "bv": "vec", "q_norm": "rep", "k_norm": "rep"}
KV_FIELDS = ("wk", "wv", "bk", "bv")


# ---------------------------------------------------------------- HF config <-> ModelConfig
def config_from_hf(d: Mapping[str, object], model_type: str, source: str) -> ModelConfig:
    """An HF `config.json` dict of `model_type` (one of ARCHITECTURES' values) -> ModelConfig;
    errors name `source` and the bad field."""

    def req(key: str) -> object:
        if key not in d or d[key] is None:
            raise ConfigError(f"{source}: required field {key!r} is missing")
        return d[key]

    hidden = hf_int(req("hidden_size"), "hidden_size", source)
    num_heads = hf_int(req("num_attention_heads"), "num_attention_heads", source)
    num_kv_heads = hf_int(d.get("num_key_value_heads") or num_heads, "num_key_value_heads",
                          source)
    head_dim = d.get("head_dim") or hidden // max(num_heads, 1)
    # Qwen2's q/k/v always carry a bias; the others say so in `attention_bias`.
    attention_bias = model_type == "qwen2" or bool(d.get("attention_bias", False))
    if model_type == "llama" and d.get("mlp_bias"):
        raise ConfigError(f"{source}: mlp_bias=true is not supported")
    act = d.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ConfigError(f"{source}: hidden_act={act!r} is not supported (only 'silu')")
    sliding_window = d.get("sliding_window")
    if model_type in ("qwen2", "qwen3") and not d.get("use_sliding_window", False):
        sliding_window = None
    try:
        return ModelConfig(
            model_type=model_type,
            vocab_size=int(req("vocab_size")),  # type: ignore[arg-type]
            hidden_size=hidden,
            intermediate_size=int(req("intermediate_size")),  # type: ignore[arg-type]
            num_layers=int(req("num_hidden_layers")),  # type: ignore[arg-type]
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=int(head_dim),  # type: ignore[arg-type]
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),  # type: ignore[arg-type]
            rope_theta=float(hf_rope_theta(d)),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),  # type: ignore[arg-type]
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            qk_norm=model_type == "qwen3",
            sliding_window=int(sliding_window) if sliding_window else None,  # type: ignore[arg-type]
            rope_scaling=hf_rope_scaling(d, source),
            bos_token_id=opt_token_id(d.get("bos_token_id")),
            eos_token_ids=eos_ids(d.get("eos_token_id")),
            pad_token_id=opt_token_id(d.get("pad_token_id")),
        )
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    # OverflowError: int() of an infinite float (JSON allows 1e999).
    except (TypeError, ValueError, OverflowError) as e:
        raise ConfigError(f"{source}: a field has a value of the wrong type ({e}); "
                          "numeric fields must be numbers") from None


def config_to_hf(cfg: ModelConfig, torch_dtype: str = "float32") -> dict[str, object]:
    """An HF `config.json` dict that transformers and vLLM load."""
    if set(cfg.layer_specs) != {cfg.uniform_spec()}:
        # A Llama-family config.json says one window and one rope base for every layer.
        raise ConfigError(f"model_type={cfg.model_type!r} with per-layer specs that differ "
                          "from its model-wide fields has no HF config.json form")
    arch = {t: a for a, t in ARCHITECTURES.items()}[cfg.model_type]
    d: dict[str, object] = {
        "architectures": [arch],
        "model_type": cfg.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.attention_bias,
        "torch_dtype": torch_dtype,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": (list(cfg.eos_token_ids) if len(cfg.eos_token_ids) > 1
                         else (cfg.eos_token_ids[0] if cfg.eos_token_ids else None)),
        "pad_token_id": cfg.pad_token_id,
    }
    if cfg.model_type in ("qwen2", "qwen3"):
        d["use_sliding_window"] = cfg.sliding_window is not None
    d["sliding_window"] = cfg.sliding_window
    rs = rope_scaling_to_hf(cfg.rope_scaling)
    if rs is not None:
        d["rope_scaling"] = rs
    return d


def config_dict_from_gguf(key: GGUFKey, tensor_names: set[str], model_type: str
                          ) -> dict[str, object]:
    """The HF config.json fields of this family from a GGUF file's `{arch}.*` metadata, read
    through `key(name, default, required, kind)` (`gguf_loader`: checked, a CheckpointError
    naming the key), and its tensor names; `model_type` is the one its architecture maps to
    (one mapping serves all three here). A `llama` file with experts is llama.cpp's Mixtral:
    its fields are the Mixtral family's (`moe_gguf`), model_type "mixtral" (which the loader
    then maps the tensors by)."""
    experts = key("expert_count")
    if experts or any("_exps." in n for n in tensor_names):
        if model_type != "llama":
            raise ConfigError(f"GGUF metadata '{model_type}.expert_count'={experts!r}: a "
                              f"{model_type} file with experts is not a known architecture")
        from . import moe_gguf  # the MoE families' GGUF side (it builds on this module)

        return moe_gguf.config_dict(key, tensor_names, "mixtral",
                                    gguf_attention_fields(key, tensor_names))
    return gguf_attention_fields(key, tensor_names)


def gguf_attention_fields(key: GGUFKey, tensor_names: set[str]) -> dict[str, object]:
    """The HF config fields of a llama / qwen2 / qwen3 GGUF (and the attention of their MoE
    variants): shape, norms, rope base, tying, q/k/v bias."""
    hidden = int(key("embedding_length", required=True))  # type: ignore[call-overload]
    heads = int(key("attention.head_count", required=True))  # type: ignore[call-overload]
    head_dim = (key("attention.key_length") or key("rope.dimension_count")
                or hidden // max(heads, 1))
    return {
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length", required=True),
        "num_hidden_layers": key("block_count", required=True),
        "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", required=True, kind=float),
        "rope_theta": key("rope.freq_base", 10000.0, kind=float),
        "max_position_embeddings": key("context_length", required=True),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
    }


# -------------------------------------------------------------------------------- params
def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Expected shape of every LlamaParams/LayerParams field for `cfg` (absent: not used)."""
    L, H, I = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "embed": (cfg.vocab_size, H),
        "final_norm": (H,),
        "layers.attn_norm": (L, H),
        "layers.wq": (L, H, cfg.q_size),
        "layers.wk": (L, H, cfg.kv_size),
        "layers.wv": (L, H, cfg.kv_size),
        "layers.wo": (L, cfg.q_size, H),
        "layers.mlp_norm": (L, H),
        "layers.w_gate": (L, H, I),
        "layers.w_up": (L, H, I),
        "layers.w_down": (L, I, H),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (H, cfg.vocab_size)
    if cfg.attention_bias:
        shapes.update({"layers.bq": (L, cfg.q_size), "layers.bk": (L, cfg.kv_size),
                       "layers.bv": (L, cfg.kv_size)})
    if cfg.qk_norm:
        shapes.update({"layers.q_norm": (L, cfg.head_dim), "layers.k_norm": (L, cfg.head_dim)})
    return shapes


def abstract_params(cfg: ModelConfig, dtype: jnp.dtype) -> LlamaParams:
    """A LlamaParams of jax.ShapeDtypeStruct leaves (restore targets, memory estimates)."""
    shapes = param_shapes(cfg)

    def leaf(name: str) -> jax.ShapeDtypeStruct | None:
        return jax.ShapeDtypeStruct(shapes[name], dtype) if name in shapes else None

    layer_fields = {f: leaf(f"layers.{f}") for f in LayerParams.__dataclass_fields__}
    return LlamaParams(embed=leaf("embed"), layers=LayerParams(**layer_fields),
                       final_norm=leaf("final_norm"), lm_head=leaf("lm_head"))


def init_random_params(cfg: ModelConfig, key: jax.Array, dtype: jnp.dtype = jnp.float32,
                       scale: float = 0.02) -> LlamaParams:
    """Random weights (tests, benchmarks); norms start near 1 so activations stay sane."""
    template = abstract_params(cfg, dtype)
    leaves, treedef = jax.tree_util.tree_flatten(template)
    keys = jax.random.split(key, len(leaves))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(template)[0]]
    out = []
    for k, leaf, path in zip(keys, leaves, paths):
        noise = jax.random.normal(k, leaf.shape, jnp.float32)
        if "norm" in path:
            out.append((1.0 + 0.1 * noise).astype(dtype))
        else:
            out.append((scale * noise).astype(dtype))
    return jax.tree_util.tree_unflatten(treedef, out)
