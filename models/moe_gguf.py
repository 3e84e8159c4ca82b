"""The MoE families' GGUF side: llama.cpp's qwen3moe / qwen2moe files and Mixtral (written by
llama.cpp as architecture `llama` with experts) -> the HF config fields and HF tensor names
that `qwen3_moe.py` / `mixtral.py` map on (read there as the families' `GGUF_*` tables and
`config_dict_from_gguf`).

Data flow: a file's `{arch}.*` metadata, through the loader's checked `key(name, default,
required, kind)` -> `config_dict` (the Llama family's attention fields, then the MoE fields as
llama.cpp's `load_hparams` / `build_moe_ffn` read them) -> the HF config.json dict that the
family's `config_from_hf` turns into per-layer specs. Tensors: llama.cpp's converter merges a
layer's E per-expert linears into one 3-D tensor per projection (`blk.N.ffn_{gate,up,down}_exps
.weight`, GGUF dims [in, out, E], numpy [E, out, in]: the HF [out, in] tensors stacked on a new
leading axis); the loader splits each into E per-expert views of the same bytes
(`gguf_tensor.split_experts`, nothing read) named as the family's per-expert HF tensors
(`GGUF_EXPERT_NAMES`), so `moe.ExpertStack` stacks them as it stacks an HF checkpoint's, and a
stored quantization (Q8_0 / Q4_K ...) stays per expert what it is per dense tensor.

llama.cpp's choices where the file is silent (src/models/qwen3moe.cpp, qwen2moe.cpp, llama.cpp):
  - the top-k weights renormalised: always for qwen3moe and llama (Mixtral), never for qwen2moe
    (`build_moe_ffn`'s norm_w argument, fixed per architecture); a file's
    `{arch}.expert_weights_norm` (which llama.cpp does not read for these architectures) is
    honoured where present, as the HF `norm_topk_prob` it was written from;
  - experts of width `expert_feed_forward_length`, else feed_forward_length / expert_used_count;
    Qwen2-MoE's shared expert of width `expert_shared_feed_forward_length`, else
    feed_forward_length, gated by sigmoid(ffn_gate_inp_shexp . x);
  - softmax gating, no weight scale: a file asking otherwise (`expert_gating_func` sigmoid,
    `expert_weights_scale` not 0 / 1) is refused, naming the key.
Which layers are sparse: those with a router tensor (`blk.N.ffn_gate_inp.weight`); llama.cpp
requires it on every layer, a Qwen-MoE file with dense layers between (HF `mlp_only_layers`)
loads here too.
"""

from __future__ import annotations

from typing import Callable

from .config import ConfigError

GGUFKey = Callable[..., object]

# llama.cpp's merged expert tensors (gguf MODEL_TENSOR.FFN_{GATE,UP,DOWN}_EXP) -> the field.
GGUF_EXPERT_FIELDS = {"ffn_gate_exps.weight": "we_gate", "ffn_up_exps.weight": "we_up",
                      "ffn_down_exps.weight": "we_down"}
# Per-layer MoE tensors (FFN_GATE_INP, and Qwen2-MoE's shared expert: FFN_*_SHEXP) -> HF suffix.
QWEN_MOE_LAYER_NAMES = {
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
MIXTRAL_LAYER_NAMES = {"ffn_gate_inp.weight": "block_sparse_moe.gate.weight"}
# Stored with its unit axis dropped by some files ([hidden] for HF's [1, hidden]: transformers'
# GGUF loader notes quantized files carry it so): the same bytes, read at the HF shape.
GGUF_SQUEEZED = ("ffn_gate_inp_shexp.weight",)
# llama.cpp's renormalisation of the top-k weights per architecture (module docstring).
_NORM_TOPK = {"qwen3_moe": True, "qwen2_moe": False, "mixtral": True}
_SOFTMAX = 1  # gguf.ExpertGatingFuncType.SOFTMAX


def expert_names(expert_hf_names: dict[str, str]) -> dict[str, str]:
    """GGUF merged-expert suffix -> the family's per-expert HF name (with `{e}`)."""
    return {s: expert_hf_names[f] for s, f in GGUF_EXPERT_FIELDS.items()}


def _moe_fields(key: GGUFKey, model_type: str, inter: int) -> dict[str, object]:
    """The MoE keys every family reads alike: expert count / used count / width, norm."""
    experts = key("expert_count", required=True)
    used = key("expert_used_count", required=True)
    if not experts or not used or used > experts:  # type: ignore[operator]
        raise ConfigError(f"GGUF metadata expert_count={experts} and expert_used_count={used}: "
                          "a mixture-of-experts file needs 0 < expert_used_count <= "
                          "expert_count")
    gating = key("expert_gating_func")
    if gating is not None and gating != _SOFTMAX:
        raise ConfigError(f"GGUF metadata expert_gating_func={gating}: only softmax gating "
                          f"({_SOFTMAX}) is supported for {model_type}")
    scale = key("expert_weights_scale", kind=float)
    if scale not in (None, 0.0, 1.0):
        raise ConfigError(f"GGUF metadata expert_weights_scale={scale}: scaled expert weights "
                          f"are not supported for {model_type}")
    norm = key("expert_weights_norm", kind=bool)
    return {"num_experts": experts, "num_experts_per_tok": used,
            "moe_intermediate_size": key("expert_feed_forward_length") or inter // used,
            "norm_topk_prob": _NORM_TOPK[model_type] if norm is None else norm}


def config_dict(key: GGUFKey, tensor_names: set[str], model_type: str,
                base: dict[str, object]) -> dict[str, object]:
    """The HF config.json fields of a qwen3moe / qwen2moe / MoE llama (Mixtral) GGUF:
    `base` (the Llama family's attention fields of the file) plus the MoE fields."""
    layers = int(base["num_hidden_layers"])  # type: ignore[call-overload]
    inter = int(base["intermediate_size"])  # type: ignore[call-overload]
    moe = _moe_fields(key, model_type, inter)
    d = {**base, "model_type": model_type}
    shared = any("_shexp." in n for n in tensor_names)
    if model_type == "mixtral":
        if shared:
            raise ConfigError("GGUF tensors ffn_*_shexp: a llama-architecture file with a "
                              "shared expert (Granite MoE) is not supported")
        if moe["moe_intermediate_size"] != inter and key("expert_feed_forward_length"):
            raise ConfigError(f"GGUF metadata expert_feed_forward_length="
                              f"{moe['moe_intermediate_size']} differs from "
                              f"feed_forward_length={inter}: llama.cpp's llama experts are "
                              "feed_forward_length wide")
        if not moe["norm_topk_prob"]:
            raise ConfigError("GGUF metadata expert_weights_norm=false: Mixtral renormalises "
                              "its top-k weights")
        d.update(num_local_experts=moe["num_experts"],
                 num_experts_per_tok=moe["num_experts_per_tok"])
        return d
    sparse = [f"blk.{i}.ffn_gate_inp.weight" in tensor_names for i in range(layers)]
    d.update(moe, decoder_sparse_step=1,
             mlp_only_layers=[i for i, s in enumerate(sparse) if not s])
    if model_type == "qwen2_moe":
        d["qkv_bias"] = d["attention_bias"]
        d["shared_expert_intermediate_size"] = (
            key("expert_shared_feed_forward_length") or inter)
        if not shared:
            raise ConfigError("a qwen2moe GGUF without its shared expert tensors "
                              "(ffn_gate_shexp / ffn_up_shexp / ffn_down_shexp)")
    elif shared:
        raise ConfigError("GGUF tensors ffn_*_shexp: Qwen3-MoE has no shared expert")
    return d
