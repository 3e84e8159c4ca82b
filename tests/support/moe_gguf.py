"""MoE GGUF files written as llama.cpp's `convert_hf_to_gguf.py` writes them, from a tiny HF
MoE checkpoint (support.hf_models.build_moe_model, vocabulary of support.gguf_files.TINY so
the file carries the tiny byte-level BPE vocabulary).

What the converter does and this writer repeats (Qwen2MoeModel / Qwen3MoeModel; Mixtral by
LlamaModel as architecture `llama`): tensor names from gguf-py's own name map for the
architecture; a layer's per-expert linears stacked into one tensor per projection
(`torch.stack(datas, dim=0)`: numpy [E, out, in]) named by gguf's MODEL_TENSOR.FFN_*_EXP;
Mixtral's w1 / w3 / w2 as gate / up / down and its q / k rows permuted (LlamaModel.permute);
1-D tensors and the routers (FFN_GATE_INP, which the converter forces to F32) in F32, the
other weights in `qtype`, falling back to F16 where a row is not a whole number of blocks;
metadata: the base keys, head_dim as key / value length, expert count / used count, the
experts' (and shared expert's) feed-forward lengths. `write_moe_gguf` returns the values
the file holds per HF name (gguf-py's dequantization of what it wrote): the oracle's weights.
"""

from __future__ import annotations

import json
import pathlib
import re

import gguf
import numpy as np
from safetensors.numpy import load_file, save_file

from .gguf_files import Q, llama_cpp_permute, tiny_gguf_vocab

GGUF_ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama"}
_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
_PROJ = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up",
         "w2": "down"}
_EXP_TENSOR = {"gate": gguf.MODEL_TENSOR.FFN_GATE_EXP, "up": gguf.MODEL_TENSOR.FFN_UP_EXP,
               "down": gguf.MODEL_TENSOR.FFN_DOWN_EXP}


def _add(writer: gguf.GGUFWriter, name: str, w: np.ndarray, qtype: Q, float_only: bool
         ) -> np.ndarray:
    """Write `w` as the converter would; return what the file holds, as float32."""
    if float_only or w.ndim == 1 or qtype == Q.F32:
        writer.add_tensor(name, w.astype(np.float32))
        return w.astype(np.float32)
    if qtype != Q.F16:
        try:
            data = gguf.quants.quantize(w, qtype)
        except gguf.QuantError:  # not a whole number of blocks: the converter's F16 fallback
            qtype = Q.F16
        else:
            writer.add_tensor(name, data, raw_dtype=qtype)
            return gguf.quants.dequantize(data, qtype).reshape(w.shape).astype(np.float32)
    writer.add_tensor(name, w.astype(np.float16))
    return w.astype(np.float16).astype(np.float32)


def write_moe_gguf(hf_dir: pathlib.Path, path: pathlib.Path, qtype: Q = Q.F32,
                   squeeze_shared_gate: bool = False) -> dict[str, np.ndarray]:
    """`hf_dir`'s checkpoint as llama.cpp's converter writes it (module docstring);
    `squeeze_shared_gate`: Qwen2-MoE's shared-expert gate stored [hidden] (as some files hold
    it) instead of [1, hidden]. Returns {HF name: float32 values as stored}."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    model_type = cfg["model_type"]
    arch = GGUF_ARCH[model_type]
    layers = cfg["num_hidden_layers"]
    model_arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(model_arch, layers)
    dense = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, layers)
    tensors = load_file(str(hf_dir / "model.safetensors"))
    w = gguf.GGUFWriter(str(path), arch=arch)
    tokens, merges = tiny_gguf_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_uint32("tokenizer.ggml.bos_token_id", cfg["bos_token_id"])
    w.add_uint32("tokenizer.ggml.eos_token_id", cfg["eos_token_id"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(layers)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(float(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    if arch == "llama":
        w.add_rope_dimension_count(cfg["head_dim"])
    w.add_expert_count(cfg.get("num_experts") or cfg["num_local_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if "moe_intermediate_size" in cfg:
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    held: dict[str, np.ndarray] = {}
    experts: dict[tuple[int, str], dict[int, tuple[str, np.ndarray]]] = {}
    for hf, t in sorted(tensors.items()):
        t = np.asarray(t, np.float32)
        m = _EXPERT.fullmatch(hf)
        if m:
            experts.setdefault((int(m[1]), _PROJ[m[3]]), {})[int(m[2])] = (hf, t)
            continue
        if hf == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        if arch == "llama" and ".q_proj." in hf:
            t = llama_cpp_permute(t, cfg["num_attention_heads"])
        elif arch == "llama" and ".k_proj." in hf:
            t = llama_cpp_permute(t, cfg["num_key_value_heads"])
        base, suffix = hf.rsplit(".", 1)
        # A dense layer's MLP between sparse ones (HF mlp_only_layers), which gguf's qwen3moe
        # map lacks (llama.cpp's converter refuses such a model): llama's ffn_* names.
        gname = names.get_name(base) or dense.get_name(base)
        name = f"{gname}.{suffix}"
        router = name.endswith("ffn_gate_inp.weight") or name.endswith("ffn_gate_inp_shexp.weight")
        if squeeze_shared_gate and name.endswith("ffn_gate_inp_shexp.weight"):
            t = t.reshape(-1)
        stored = _add(w, name, t, qtype, router)
        if arch == "llama" and (".q_proj." in hf or ".k_proj." in hf):  # back to HF rows
            n = cfg["num_attention_heads" if ".q_proj." in hf else "num_key_value_heads"]
            stored = _unpermute(stored, n)
        held[hf] = stored.reshape(tensors[hf].shape)
    for (layer, proj), per in sorted(experts.items()):
        stack = np.stack([per[e][1] for e in range(len(per))])  # [E, out, in]
        name = gguf.TENSOR_NAMES[_EXP_TENSOR[proj]].format(bid=layer) + ".weight"
        stored = _add(w, name, stack, qtype, False)
        for e in range(len(per)):
            held[per[e][0]] = stored[e]
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of llama_cpp_permute (stored row j * 2 + t of a head is HF row t * half + j)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def save_oracle_dir(hf_dir: pathlib.Path, out_dir: pathlib.Path,
                    held: dict[str, np.ndarray]) -> pathlib.Path:
    """An HF checkpoint of `hf_dir`'s config with the weights `held` (what a GGUF stores), for
    transformers to load as the oracle."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text((hf_dir / "config.json").read_text())
    save_file({k: np.ascontiguousarray(v) for k, v in held.items()},
              str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir
