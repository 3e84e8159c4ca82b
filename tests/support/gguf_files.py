"""Small synthetic GGUF files for the loader tests: a tiny llama / qwen's HF-named float32
weights, written with `gguf.GGUFWriter` the way llama.cpp's converter lays them out (q/k rows
permuted, GGUF tensor names), any tensor in any GGML type, with keys dropped or overridden
and tensors reshaped or added to make a malformed file; with `tokenizer=True` the file also
carries a byte-level BPE vocabulary of TINY's size (`tiny_gguf_vocab`), so that it loads as a
servable model. `write_gemma_gguf` writes an HF Gemma 2 / Gemma 3 text model's weights as
llama.cpp's converter does (gguf's own tensor-name map, every *norm.weight stored as 1 + w, no
lm_head when tied, its metadata keys), with the same tokenizer metadata."""

from __future__ import annotations

import pathlib

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType

# tiny llama: inner dims are multiples of 32 so every quantized type applies
TINY = dict(vocab=96, hidden=64, heads=4, kv=2, head_dim=16, inter=96, layers=2)


def tiny_gguf_vocab() -> tuple[list[str], list[str]]:
    """(tokens, merges) of a GPT-2 style byte-level BPE over TINY["vocab"] ids: <unk>, <s>
    (bos, id 1), </s> (eos, id 2), the letters, digits, 'Ġ' (a space) and a little
    punctuation, then merged tokens of common English pieces, each merge splitting its token
    into the longest known prefix and the rest (both already tokens). Text of lowercase words
    and spaces encodes without loss."""
    tokens = ["<unk>", "<s>", "</s>", *"abcdefghijklmnopqrstuvwxyz",
              *"ABCDEFGHIJKLMNOPQRSTUVWXYZ", *"0123456789", "\u0120", *".,!?'-"]
    pieces = ["th", "he", "in", "er", "an", "on", "at", "en", "es", "or", "\u0120t", "\u0120a",
              "\u0120s", "\u0120c", "\u0120m", "\u0120o", "\u0120th", "the", "\u0120the",
              "ing", "ed", "\u0120w", "\u0120b", "\u0120f"]
    merges = []
    for piece in pieces:
        cut = max(i for i in range(1, len(piece)) if piece[:i] in tokens)
        assert piece[cut:] in tokens, piece
        merges.append(f"{piece[:cut]} {piece[cut:]}")
        tokens.append(piece)
    assert len(tokens) == TINY["vocab"], len(tokens)
    return tokens, merges


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows (the loader must undo it)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_weights(rng: np.random.Generator, arch: str = "llama") -> dict[str, np.ndarray]:
    """HF-named float32 weights of the tiny model."""
    t = TINY
    h, q, kv, i = t["hidden"], t["heads"] * t["head_dim"], t["kv"] * t["head_dim"], t["inter"]
    w = {"model.embed_tokens.weight": (t["vocab"], h), "model.norm.weight": (h,),
         "lm_head.weight": (t["vocab"], h)}
    for layer in range(t["layers"]):
        p = f"model.layers.{layer}."
        w.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                  p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                  p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                  p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                  p + "mlp.down_proj.weight": (h, i)})
        if arch == "qwen2":
            w.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                      p + "self_attn.v_proj.bias": (kv,)})
        if arch == "qwen3":
            w.update({p + "self_attn.q_norm.weight": (t["head_dim"],),
                      p + "self_attn.k_norm.weight": (t["head_dim"],)})
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in w.items()}


_TO_GGUF = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf: str) -> str:
    if hf.startswith("model.layers."):
        _, _, layer, rest = hf.split(".", 3)
        module, kind = rest.rsplit(".", 1)
        return f"blk.{layer}.{_TO_GGUF[module]}.{kind}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[hf]


def write_tiny_gguf(path: pathlib.Path, weights: dict[str, np.ndarray], *, arch: str = "llama",
                    types: dict[str, Q] | None = None, drop_keys: tuple[str, ...] = (),
                    extra_tensors: dict[str, np.ndarray] | None = None,
                    shape_override: dict[str, np.ndarray] | None = None,
                    meta_override: dict[str, int] | None = None,
                    tokenizer: bool = False) -> None:
    t = TINY
    writer = gguf.GGUFWriter(str(path), arch=arch)
    if tokenizer:
        tokens, merges = tiny_gguf_vocab()
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list(tokens)
        writer.add_token_merges(merges)
    meta = {f"{arch}.block_count": t["layers"], f"{arch}.context_length": 256,
            f"{arch}.embedding_length": t["hidden"], f"{arch}.feed_forward_length": t["inter"],
            f"{arch}.attention.head_count": t["heads"], f"{arch}.attention.head_count_kv": t["kv"],
            f"{arch}.rope.dimension_count": t["head_dim"], f"{arch}.vocab_size": t["vocab"],
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            **(meta_override or {})}
    for key, value in meta.items():
        if key not in drop_keys:
            writer.add_uint32(key, value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_float32(f"{arch}.rope.freq_base", 10000.0)
    for hf, w in weights.items():
        if arch == "llama" and ".q_proj." in hf:
            w = llama_cpp_permute(w, t["heads"])
        elif arch == "llama" and ".k_proj." in hf:
            w = llama_cpp_permute(w, t["kv"])
        w = (shape_override or {}).get(hf, w)
        qtype = (types or {}).get(hf, Q.F32)
        if qtype == Q.F32:
            writer.add_tensor(_gguf_name(hf), w)
        elif qtype == Q.F16:
            writer.add_tensor(_gguf_name(hf), w.astype(np.float16))
        else:
            writer.add_tensor(_gguf_name(hf), gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    for name, w in (extra_tensors or {}).items():
        writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_gemma_gguf(path: pathlib.Path, weights: dict[str, np.ndarray], config: dict, *,
                     qtype: Q = Q.F32, tokenizer: bool = True,
                     meta_override: dict[str, object] | None = None,
                     drop_keys: tuple[str, ...] = (), vocab: object = None) -> None:
    """An HF Gemma 2 (`config["model_type"]` gemma2) or Gemma 3 text (gemma3_text) model's
    HF-named float32 `weights` as llama.cpp's `convert_hf_to_gguf.py` writes them
    (Gemma2Model / Gemma3Model): tensor names from gguf's own name map for the architecture,
    1 added to every tensor whose name ends in "norm.weight" (the converter's
    `modify_tensors`), `lm_head.weight` skipped (Gemma ties it), the 2-D weights in `qtype`
    (norms stay F32, as the converter keeps 1-D tensors); metadata: context / embedding /
    block / feed-forward lengths, head counts, key and value lengths (head_dim), the rms eps,
    the sliding window, Gemma 2's two soft-caps, Gemma 3's rope base. `meta_override` sets or
    adds `{arch}.*` keys (name without the prefix; a bool list becomes an array), `drop_keys`
    drops them. `vocab` (a `support.spm_vocab.SpmVocab`): write that SentencePiece vocabulary
    and its special ids, as a real Gemma GGUF carries, instead of the tiny gpt2 one."""
    model_type = config["model_type"]
    arch = {"gemma2": "gemma2", "gemma3_text": "gemma3"}[model_type]
    model_arch = {"gemma2": gguf.MODEL_ARCH.GEMMA2, "gemma3": gguf.MODEL_ARCH.GEMMA3}[arch]
    names = gguf.get_tensor_name_map(model_arch, config["num_hidden_layers"])
    writer = gguf.GGUFWriter(str(path), arch=arch)
    if vocab is not None:
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(list(vocab.tokens))
        writer.add_token_scores(list(vocab.scores))
        writer.add_token_types(list(vocab.types))
        if vocab.merges is not None:
            writer.add_token_merges(list(vocab.merges))
        writer.add_unk_token_id(vocab.unk)
        bos, eos, pad = vocab.bos, vocab.eos, vocab.pad
    else:
        if tokenizer:
            tokens, merges = tiny_gguf_vocab()
            writer.add_tokenizer_model("gpt2")
            writer.add_token_list(tokens)
            writer.add_token_merges(merges)
        bos, eos, pad = 1, 2, 0
    writer.add_uint32("tokenizer.ggml.bos_token_id", bos)
    writer.add_uint32("tokenizer.ggml.eos_token_id", eos)
    if pad is not None:
        writer.add_uint32("tokenizer.ggml.padding_token_id", pad)
    meta: dict[str, object] = {
        "context_length": config["max_position_embeddings"],
        "embedding_length": config["hidden_size"], "block_count": config["num_hidden_layers"],
        "feed_forward_length": config["intermediate_size"],
        "attention.head_count": config["num_attention_heads"],
        "attention.head_count_kv": config["num_key_value_heads"],
        "attention.key_length": config["head_dim"], "attention.value_length": config["head_dim"],
        "attention.layer_norm_rms_epsilon": float(config["rms_norm_eps"]),
        "attention.sliding_window": config["sliding_window"], "vocab_size": config["vocab_size"],
    }
    if arch == "gemma2":
        meta["attn_logit_softcapping"] = float(config["attn_logit_softcapping"])
        meta["final_logit_softcapping"] = float(config["final_logit_softcapping"])
    else:
        rope = config.get("rope_parameters") or {}
        meta["rope.freq_base"] = float((rope.get("full_attention") or {}).get("rope_theta", 1e6))
    meta.update(meta_override or {})
    for key, value in meta.items():
        if key in drop_keys:
            continue
        if isinstance(value, list):
            writer.add_array(f"{arch}.{key}", value)
        elif isinstance(value, float):
            writer.add_float32(f"{arch}.{key}", value)
        else:
            writer.add_uint32(f"{arch}.{key}", int(value))
    for hf, w in weights.items():
        if hf == "lm_head.weight":
            continue
        base, suffix = hf.rsplit(".", 1)
        name = f"{names.get_name(base)}.{suffix}"
        w = np.asarray(w, np.float32)
        if name.endswith("norm.weight"):
            w = w + np.float32(1.0)
        if w.ndim == 2 and qtype != Q.F32:
            writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_arch_gguf(path: pathlib.Path, arch: str, metadata: dict[str, object] | None = None
                    ) -> None:
    """A minimal GGUF of `general.architecture` `arch` (one small tensor): what a loader
    must refuse by its architecture before reading anything else."""
    writer = gguf.GGUFWriter(str(path), arch=arch)
    for key, value in (metadata or {}).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_uint32(key, int(value))
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_gemma4_gguf(path: pathlib.Path, weights: dict[str, np.ndarray], config: dict, *,
                      qtype: Q = Q.F32, meta_override: dict[str, object] | None = None,
                      drop_keys: tuple[str, ...] = (),
                      rope_freqs: bool | np.ndarray = True,
                      tokenizer_model: str = "gpt2") -> None:
    """An HF Gemma 4 text model's (`Gemma4TextConfig.to_dict()`) HF-named float32 `weights`
    as llama.cpp's converter writes them (`Gemma4Model` over `Gemma3Model` / `TextModel`):
    gguf's own tensor-name map for GEMMA4, `layer_scalar` renamed `layer_scalar.weight` first
    (the converter's `filter_tensors`: -> `blk.N.layer_output_scale.weight`), norms as they
    are (its `norm_shift` is 0 for Gemma 4), `lm_head.weight` skipped when tied, 2-D weights
    of whole-block rows in `qtype`; the global layers' proportional RoPE as the `rope_freqs` tensor (1 on the
    rotated pairs, 1e30 on the others; `rope_freqs=False` leaves it out, an array is written
    in its place); metadata (`meta_override`: strings too): the
    Gemma 3 keys, key / value lengths of the global heads and `_swa` ones of the sliding
    heads, `head_count_kv` as an array of per-layer counts when the global layers' differ,
    `feed_forward_length` as an array when the MLPs are double-wide, the per-layer sliding
    pattern (booleans), shared-KV layer count, per-layer-input size, both rope bases and
    rope dimension counts, the final soft-cap when set. The global head size / KV-head
    count come from transformers 5's `per_layer_config` (the converter reads them from
    `global_head_dim` / `num_global_key_value_heads`, which that form replaces). The
    vocabulary is the tiny byte-level BPE one (`tokenizer_model` names its kind; the
    converter writes "gemma4", Gemma 4's own vocabulary, with its real tokens)."""
    n = config["num_hidden_layers"]
    types = config["layer_types"]
    plc = config.get("per_layer_config") or {}
    shapes = [(plc.get(str(i), {}).get("head_dim", config["head_dim"]),
               plc.get(str(i), {}).get("num_key_value_heads", config["num_key_value_heads"]))
              for i in range(n)]
    swa = [t == "sliding_attention" for t in types]
    full_i = swa.index(False)
    swa_i = swa.index(True) if True in swa else full_i
    (d_full, kv_full), (d_swa, kv_swa) = shapes[full_i], shapes[swa_i]
    rope = config["rope_parameters"]
    shared = config.get("num_kv_shared_layers") or 0
    inter = config["intermediate_size"]
    ff: object = inter
    if config.get("use_double_wide_mlp") and shared:
        ff = [inter if i < n - shared else 2 * inter for i in range(n)]
    meta: dict[str, object] = {
        "context_length": config["max_position_embeddings"],
        "embedding_length": config["hidden_size"], "block_count": n,
        "feed_forward_length": ff, "attention.head_count": config["num_attention_heads"],
        "attention.head_count_kv": (kv_swa if kv_full == kv_swa
                                    else [kv_swa if s else kv_full for s in swa]),
        "attention.layer_norm_rms_epsilon": float(config["rms_norm_eps"]),
        "attention.key_length": d_full, "attention.value_length": d_full,
        "attention.key_length_swa": d_swa, "attention.value_length_swa": d_swa,
        "rope.freq_base": float(rope["full_attention"]["rope_theta"]),
        "rope.freq_base_swa": float(rope["sliding_attention"]["rope_theta"]),
        "rope.dimension_count": d_full, "rope.dimension_count_swa": d_swa,
        "attention.sliding_window": config["sliding_window"],
        "attention.shared_kv_layers": shared,
        "embedding_length_per_layer_input": config.get("hidden_size_per_layer_input") or 0,
        "attention.sliding_window_pattern": swa, "vocab_size": config["vocab_size"],
    }
    if config.get("final_logit_softcapping"):
        meta["final_logit_softcapping"] = float(config["final_logit_softcapping"])
    meta.update(meta_override or {})
    writer = gguf.GGUFWriter(str(path), arch="gemma4")
    tokens, merges = tiny_gguf_vocab()
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_uint32("tokenizer.ggml.bos_token_id", 1)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
    writer.add_uint32("tokenizer.ggml.padding_token_id", 0)
    for key, value in meta.items():
        if key in drop_keys:
            continue
        if isinstance(value, list):
            writer.add_array(f"gemma4.{key}", value)
        elif isinstance(value, str):
            writer.add_string(f"gemma4.{key}", value)
        elif isinstance(value, float):
            writer.add_float32(f"gemma4.{key}", value)
        else:
            writer.add_uint32(f"gemma4.{key}", int(value))
    if isinstance(rope_freqs, np.ndarray):
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    elif rope_freqs:
        rotated = int(d_full * rope["full_attention"].get("partial_rotary_factor", 1.0) / 2)
        writer.add_tensor("rope_freqs.weight", np.array(
            [1.0] * rotated + [1e30] * (d_full // 2 - rotated), np.float32))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, n)
    for hf, w in weights.items():
        if hf == "lm_head.weight" and config.get("tie_word_embeddings", True):
            continue
        if hf.endswith("layer_scalar"):
            hf += ".weight"
        base, suffix = hf.rsplit(".", 1)
        name = f"{names.get_name(base)}.{suffix}"
        w = np.asarray(w, np.float32)
        # rows not a whole number of blocks stay unquantized, as the converter falls back
        if w.ndim == 2 and qtype != Q.F32 and w.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0:
            writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
