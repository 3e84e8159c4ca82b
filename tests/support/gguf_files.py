"""Small synthetic GGUF files for the loader tests: a tiny llama / qwen's HF-named float32
weights, written with `gguf.GGUFWriter` the way llama.cpp's converter lays them out (q/k rows
permuted, GGUF tensor names), any tensor in any GGML type, with keys dropped or overridden
and tensors reshaped or added to make a malformed file; with `tokenizer=True` the file also
carries a byte-level BPE vocabulary of TINY's size (`tiny_gguf_vocab`), so that it loads as a
servable model."""

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
