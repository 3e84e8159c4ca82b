"""Gemma 4 (text): the HF config <-> `ModelConfig` mapping of `gemma4.py`'s family (and its
GGUF metadata, through `gemma4_gguf`), in a module of its own: `config_from_hf` spells each
layer out from `layer_types`, per-layer shapes, KV sharing and the rope of each attention
kind; `config_to_hf` writes them back. `gemma4.py` re-exports these names (the family's
interface)."""

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
