"""Gemma 4 (text)'s GGUF side: llama.cpp's `gemma4` files -> the HF config fields and HF
tensor names that `gemma4.py` maps on (imported there; `gguf_loader` reads them as the family's
`GGUF_*` tables, `config_dict_from_gguf`, `gguf_rope_freqs` and `GGUF_SHAPE_FIELDS`).

The layout, as llama.cpp's converter (`Gemma4Model`, over `Gemma3Model` / `TextModel`) writes
it and gguf's tables (`MODEL_TENSORS[GEMMA4]`, `tensor_mapping`) name it:

- norms stored as they are (the converter's `norm_shift` is 0 for Gemma 4, whose RMSNorm
  scales by w): no `GGUF_NORM_SHIFTS`, unlike Gemma 2 / 3;
- per-layer shapes in metadata: `attention.key_length` / `value_length` are the global
  (full-attention) layers' head size, `key_length_swa` / `value_length_swa` the sliding
  layers'; `attention.head_count_kv` one count, or an array per layer (the global layers'
  `num_global_key_value_heads`); `attention.sliding_window_pattern` an array of booleans
  (true: sliding); `feed_forward_length` one width, or an array (the double-wide MLPs of the
  KV-shared layers); `attention.shared_kv_layers`; `embedding_length_per_layer_input`;
- RoPE: `rope.freq_base` (global) / `rope.freq_base_swa` (sliding); the global layers'
  proportional RoPE as a `rope_freqs` tensor of head_dim / 2 factors, 1 on the rotated pairs
  and 1e30 on the others (ggml's NEOX rope rotates a prefix of pairs; a huge factor stops a
  pair) over `rope.dimension_count` = the global head size;
- K = V (`attention_k_eq_v`): the global layers have no `attn_v` (llama.cpp uses K), so the
  config is read from the tensor table; KV-shared layers have neither `attn_k` nor `attn_v`;
- tensors named by gguf's map: `layer_scalar` -> `blk.N.layer_output_scale.weight` (the
  converter appends `.weight`), per-layer embeddings -> `per_layer_token_embd`,
  `per_layer_model_proj`, `per_layer_proj_norm`, `blk.N.inp_gate`, `blk.N.proj`,
  `blk.N.post_norm`.

Refused, naming the key: `rope.scaling.type`, the MoE block (`expert_count`), an attention soft-cap
(`attn_logit_softcapping`), partial RoPE on the sliding layers (`rope.dimension_count_swa`
below their head size), a global rope dimension other than the global head size, value
sizes that differ from key sizes, K = V on only some global layers, a `feed_forward_length`
array that is not the double-wide pattern, and `rope_freqs` factors that are not the
proportional pattern.
"""

from __future__ import annotations

from typing import Callable, Mapping

import numpy as np

from .config import ConfigError
from .gemma_gguf import GGUF_LAYER_NAMES as _GEMMA_LAYER_NAMES
from .gemma_gguf import _gguf_layer_types

GGUFKey = Callable[..., object]
GGUF_ARCHITECTURES = {"gemma4": "gemma4_text"}
GGUF_PERMUTED: tuple[str, ...] = ()  # NEOX RoPE: q/k rows as in HF
GGUF_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
              "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight",
              "per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
              "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
              "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight"}
GGUF_LAYER_NAMES = dict(
    _GEMMA_LAYER_NAMES,
    **{"layer_output_scale.weight": "layer_scalar",
       "inp_gate.weight": "per_layer_input_gate.weight",
       "proj.weight": "per_layer_projection.weight",
       "post_norm.weight": "post_per_layer_input_norm.weight",
       # attention_bias: the converter maps `*.bias` by the same names
       "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
       "attn_v.bias": "self_attn.v_proj.bias", "attn_output.bias": "self_attn.o_proj.bias"})
# No `rope.scaling.*`: Gemma 4's RoPE is per layer type (the proportional global RoPE is
# `rope_freqs`'); a model-wide scaling key would have no HF field to land in, so it is refused.
GGUF_ROPE_SCALING = False
# HF config fields GGUF metadata does not hold but a tensor's shape does:
# GGUF tensor name -> (HF field, numpy axis of the tensor).
GGUF_SHAPE_FIELDS = {"per_layer_token_embd.weight": ("vocab_size_per_layer_input", 0)}
# rope_freqs entries at or above this stop their pair (the converter writes 1e30; a rotation
# angle of position / (theta^x * 1e30) is 0 at any context llama.cpp runs).
_UNROTATED = 1e29


def _per_layer(value: object, n: int, name: str) -> list[int]:
    """A per-layer int key: one integer for every layer, or an array of n."""
    if isinstance(value, list):
        if len(value) != n or not all(isinstance(v, int) and not isinstance(v, bool)
                                      for v in value):
            raise ConfigError(f"GGUF metadata {name}={value!r} must hold one integer for "
                              f"each of the {n} layers")
        return list(value)
    return [int(value)] * n  # type: ignore[call-overload]


def config_dict(key: GGUFKey, tensor_names: set[str], model_type: str) -> dict[str, object]:
    """The HF config.json fields (transformers 5 form: `layer_types`, an explicit
    `per_layer_config`, `rope_parameters` keyed by layer type) of a gemma4 GGUF from its
    `{arch}.*` metadata and tensor names. What the file does not say is the HF class
    default: rope bases 1e6 / 1e4, sliding heads as the global ones, no soft-cap."""
    if key("expert_count"):
        raise ConfigError("GGUF metadata expert_count: the Gemma 4 mixture-of-experts block "
                          "(26B-A4B) is not supported")
    if key("attn_logit_softcapping", kind=float):
        raise ConfigError("GGUF metadata attn_logit_softcapping: Gemma 4 has no attention "
                          "soft-cap; a file with one is not supported")
    hidden = int(key("embedding_length", required=True))  # type: ignore[call-overload]
    heads = int(key("attention.head_count", required=True))  # type: ignore[call-overload]
    n = int(key("block_count", required=True))  # type: ignore[call-overload]
    if heads <= 0 or n <= 0:
        raise ConfigError("GGUF metadata attention.head_count and block_count must be positive")
    d_full = int(key("attention.key_length", required=True))  # type: ignore[call-overload]
    d_swa = int(key("attention.key_length_swa", d_full))  # type: ignore[call-overload]
    for vname, v, k in (("value_length", key("attention.value_length"), d_full),
                        ("value_length_swa", key("attention.value_length_swa"), d_swa)):
        if v is not None and v != k:
            raise ConfigError(f"GGUF metadata attention.{vname}={v} differs from the key "
                              f"length {k}; Gemma 4's heads have one size")
    rot = key("rope.dimension_count", d_full)
    if rot != d_full:
        raise ConfigError(f"GGUF metadata rope.dimension_count={rot} must be the global head "
                          f"size {d_full} (partial RoPE is the rope_freqs tensor's)")
    rot_swa = key("rope.dimension_count_swa", d_swa)
    if rot_swa != d_swa:
        raise ConfigError(f"GGUF metadata rope.dimension_count_swa={rot_swa}: partial RoPE "
                          f"on the sliding layers (head size {d_swa}) is not supported")
    window = key("attention.sliding_window")
    window = int(window) if window else None  # type: ignore[call-overload]
    types = _gguf_layer_types(key("attention.sliding_window_pattern", kind=list), n, window, 6)
    kv = _per_layer(key("attention.head_count_kv", heads, kind=list), n,
                    "attention.head_count_kv")
    shared = int(key("attention.shared_kv_layers", 0))  # type: ignore[call-overload]
    first_shared = n - shared
    ff = _per_layer(key("feed_forward_length", required=True, kind=list), n,
                    "feed_forward_length")
    inter, wide = ff[0], len(set(ff)) > 1
    if wide and (not 0 < shared < n
                 or ff != [inter] * first_shared + [2 * inter] * shared):
        raise ConfigError(f"GGUF metadata feed_forward_length={ff}: only one width, or the "
                          f"double-wide MLP on the {shared} KV-shared last layers, is supported")
    # K = V: a global layer with its own KV but no attn_v.
    own_full = [i for i in range(first_shared) if types[i] == "full_attention"]
    no_v = [i for i in own_full if f"blk.{i}.attn_v.weight" not in tensor_names]
    if no_v and no_v != own_full:
        raise ConfigError(f"tensor blk.{no_v[0]}.attn_v.weight is missing but other global "
                          "layers have theirs: K = V on only some layers is not supported")
    shapes = [(d_swa if t == "sliding_attention" else d_full, k) for t, k in zip(types, kv)]
    cap = key("final_logit_softcapping", kind=float)
    return {
        "hidden_size": hidden, "num_hidden_layers": n, "num_attention_heads": heads,
        "intermediate_size": inter, "use_double_wide_mlp": wide,
        "head_dim": shapes[0][0], "num_key_value_heads": shapes[0][1],
        "per_layer_config": {str(i): {"head_dim": hd, "num_key_value_heads": k}
                             for i, (hd, k) in enumerate(shapes)},
        "layer_types": types, "sliding_window": window or 512,
        "num_kv_shared_layers": shared, "attention_k_eq_v": bool(no_v),
        "hidden_size_per_layer_input": key("embedding_length_per_layer_input", 0),
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", required=True, kind=float),
        "max_position_embeddings": key("context_length", required=True),
        "final_logit_softcapping": cap or None,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        # the full layers' rope: plain until a rope_freqs tensor says proportional
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default",
                                  "rope_theta": key("rope.freq_base_swa", 1e4, kind=float)},
            "full_attention": {"rope_type": "default",
                               "rope_theta": key("rope.freq_base", 1e6, kind=float)}},
    }


def rope_freqs(freqs: np.ndarray, cfg: dict[str, object], path: str) -> None:
    """llama.cpp's encoding of the global layers' proportional RoPE -> `rope_parameters`
    (in place): head_dim / 2 factors, 1 on the first rotated pairs, >= 1e29 on the rest;
    partial_rotary_factor = 2 * rotated / head_dim, as transformers' proportional RoPE
    computes its angles over the whole head (`blocks.rope_inv_freq`)."""
    plc: Mapping[str, Mapping[str, int]] = cfg["per_layer_config"]  # type: ignore[assignment]
    types: list[str] = cfg["layer_types"]  # type: ignore[assignment]
    full = [plc[str(i)]["head_dim"] for i, t in enumerate(types) if t == "full_attention"]
    d = full[0] if full else int(cfg["head_dim"])  # type: ignore[call-overload]
    f = np.asarray(freqs, np.float64).ravel()
    rotated = int(np.sum(f == 1.0))
    if f.size * 2 != d or not (f[:rotated] == 1.0).all() or not (f[rotated:] >= _UNROTATED).all():
        raise ConfigError(f"{path}: tensor 'rope_freqs.weight' ({f.size} factors) is not "
                          f"llama.cpp's proportional RoPE of a global head of {d} (factors 1 "
                          "on the rotated pairs, then 1e30)")
    rope: dict = cfg["rope_parameters"]  # type: ignore[assignment]
    rope["full_attention"] = {"rope_type": "proportional", "partial_rotary_factor": 2 * rotated / d,
                              "rope_theta": rope["full_attention"]["rope_theta"]}
