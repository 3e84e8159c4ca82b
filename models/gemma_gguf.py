"""The Gemma family's GGUF side: llama.cpp's gemma2 / gemma3 files -> the HF config fields
and HF tensor names that `gemma.py` maps on (imported there; `gguf_loader` reads them as the
family's `GGUF_*` tables and `config_dict_from_gguf`).

Data flow: a file's `{arch}.*` metadata, through the loader's checked `key(name, default,
required, kind)` -> `config_dict` (the fields as llama.cpp's `load_hparams` reads them, with
llama.cpp's choices where the file is silent) -> the HF config.json dict that
`gemma.config_from_hf` turns into per-layer specs; tensor names -> HF names by `GGUF_NAMES` /
`GGUF_LAYER_NAMES`; the norm weights llama.cpp stored as 1 + w -> w by `GGUF_NORM_SHIFTS`
(applied by `gguf_tensor.GGUFTensor`). Kept apart from `gemma.py` because it is one concept
(llama.cpp's conventions) that the HF path never touches.
"""

from __future__ import annotations

from typing import Callable

from .config import ConfigError

# GGUF `general.architecture` -> model_type (llama.cpp's converter: Gemma2Model, Gemma3Model).
GGUF_ARCHITECTURES = {"gemma2": "gemma2", "gemma3": "gemma3_text"}
# GGUF architectures of the Gemma line that are not served, each with why.
_SERVED = "supported Gemma GGUF architectures: gemma2, gemma3, gemma4 (text)"
GGUF_REFUSED = {
    "gemma": f"Gemma 1 (no sandwich norms, no soft-caps) is not supported; {_SERVED}",
    "gemma3n": "Gemma 3n (per-layer embeddings, AltUp, LAuReL, a MatFormer FFN), a different "
               f"architecture from Gemma 3, is not supported; {_SERVED}",
    "gemma-embedding": "EmbeddingGemma, a bidirectional encoder for embeddings, not a causal "
                       f"LM, is not supported; {_SERVED}",
    "clip": "a multimodal projector (mmproj) file: the vision tower that ships beside a "
            "multimodal GGUF (Gemma 3's, ...), with no language model in it; jaxserve serves "
            f"text only: load the text model's GGUF ({_SERVED})",
}
GGUF_PERMUTED: tuple[str, ...] = ()  # llama.cpp runs Gemma with NEOX RoPE: q/k rows as in HF
# llama.cpp's converter stores every Gemma RMSNorm weight as 1 + w (its norm multiplies by the
# stored weight; HF's by 1 + w): `modify_tensors` adds 1 to each tensor named *norm.weight,
# q/k norms (Gemma 3) and the final norm included; transformers' GGUF loader subtracts it
# from the same set (`Gemma2TensorProcessor`, used for gemma2 and gemma3). Read back as w so
# the family's (1 + w) convention holds. GGUF name (top-level, or per-layer suffix) -> shift.
GGUF_NORM_SHIFTS = {name: 1.0 for name in (
    "output_norm.weight", "attn_norm.weight", "post_attention_norm.weight", "ffn_norm.weight",
    "post_ffw_norm.weight", "attn_q_norm.weight", "attn_k_norm.weight")}
GGUFKey = Callable[..., object]
# GGUF tensor name -> HF name (gguf's MODEL_TENSORS for GEMMA2 / GEMMA3); per layer: suffix
# after `blk.{i}.` -> after `model.layers.{i}.`. GGUF's `ffn_norm` is the pre-MLP norm.
GGUF_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
              "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight", "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight",
}


def _gguf_layer_types(pattern: object, n: int, window: int | None, period: int
                      ) -> list[str]:
    """Each layer's attention kind as llama.cpp decides it: no window -> all full; else
    `{arch}.attention.sliding_window_pattern` when present, as a per-layer array (true:
    sliding) or a period p (layer i slides iff i % p < p - 1; p = 0: every layer slides),
    else the architecture's `period` (Gemma 2: 2, sliding first; Gemma 3: 6, five sliding then
    one full) -- llama.cpp's `set_swa_pattern`."""
    if window is None:
        return ["full_attention"] * n
    if isinstance(pattern, list):
        if len(pattern) != n or not all(isinstance(v, (bool, int)) for v in pattern):
            raise ConfigError(f"GGUF metadata attention.sliding_window_pattern={pattern!r} "
                              f"must hold one boolean for each of the {n} layers")
        sliding = [bool(v) for v in pattern]
    else:
        p = period if pattern is None else int(pattern)  # type: ignore[call-overload]
        if p < 0:
            raise ConfigError(f"GGUF metadata attention.sliding_window_pattern={p} must be >= 0")
        sliding = [p == 0 or i % p < p - 1 for i in range(n)]
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def config_dict(key: GGUFKey, tensor_names: set[str], model_type: str, period: int
                ) -> dict[str, object]:
    """The HF config.json fields of a gemma2 / gemma3 GGUF (`model_type` gemma2 /
    gemma3_text) from its `{arch}.*` metadata, read through `key(name, default, required,
    kind)` (`gguf_loader`), as llama.cpp's `load_hparams` reads them. What the file does not
    say is llama.cpp's choice: Gemma 2's window 4096 and soft-caps 50 / 30; Gemma 3's global
    rope base 1e6 and local base 10000 (`rope.freq_base_swa` if present), no soft-caps; a
    Gemma 3 file without a window has none (every layer full). The query scale is
    head_dim ** -0.5, except on 27B-shaped files (46 layers Gemma 2, 62 Gemma 3: llama.cpp
    picks the model size by block count) where it is (hidden // heads) ** -0.5, as the
    checkpoints' `query_pre_attn_scalar` says (144 and 168)."""
    gemma2 = model_type == "gemma2"
    hidden = int(key("embedding_length", required=True))  # type: ignore[call-overload]
    heads = int(key("attention.head_count", required=True))  # type: ignore[call-overload]
    layers = int(key("block_count", required=True))  # type: ignore[call-overload]
    if heads <= 0:
        raise ConfigError(f"GGUF metadata attention.head_count={heads} must be positive")
    head_dim = key("attention.key_length") or hidden // heads
    value_dim = key("attention.value_length")
    if value_dim is not None and value_dim != head_dim:
        raise ConfigError(f"GGUF metadata attention.value_length={value_dim} differs from "
                          f"attention.key_length={head_dim}; Gemma's heads have one size")
    window = key("attention.sliding_window", 4096 if gemma2 else None)
    window = int(window) if window else None  # type: ignore[call-overload]
    big = layers == (46 if gemma2 else 62)
    d: dict[str, object] = {
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length", required=True),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", required=True, kind=float),
        "max_position_embeddings": key("context_length", required=True),
        "query_pre_attn_scalar": hidden // heads if big else head_dim,
        "sliding_window": window,
        "layer_types": _gguf_layer_types(key("attention.sliding_window_pattern", kind=list),
                                         layers, window, period),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
    }
    if gemma2:
        d.update(rope_theta=key("rope.freq_base", 10000.0, kind=float),
                 attn_logit_softcapping=key("attn_logit_softcapping", 50.0, kind=float),
                 final_logit_softcapping=key("final_logit_softcapping", 30.0, kind=float))
    else:
        d.update(rope_theta=key("rope.freq_base", 1e6, kind=float),
                 rope_local_base_freq=key("rope.freq_base_swa", 10000.0, kind=float),
                 attn_logit_softcapping=None, final_logit_softcapping=None)
    return d
