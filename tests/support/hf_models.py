"""Tiny random-weight HF models that tests build and save as safetensors directories.

The oracle side of model parity: transformers builds and initialises the model, saves it with
its own `save_pretrained` (safetensors), and jaxserve loads that directory with its own loader.
`save_tiny_tokenizer(dir, vocab_size)` writes the package's word tokenizer beside them (it is
`jaxserve.models.tiny.save_word_tokenizer`: one tokenizer factory for tests and scripts).

The Gemma family (`GEMMA_ARCHS`, `build_gemma_model`) has builders of its own: a 5-layer
sliding / full pattern with a window of 4 tokens (shorter than every test prompt, so prompts
span several windows), head_dim 32, Gemma 2's soft-caps low enough to bend the logits, Gemma
3's qk-norm and two rope bases; the model and engine tests of the family share them.
Gemma 4 (`GEMMA4_ARCHS`, built by the same `build_gemma_model`): the same pattern and window,
local heads of 16 and global heads of 32 (proportional RoPE on a quarter of their pairs), and
either K = V with one global KV head and a final soft-cap, or separate V with biases and an
untied head, or per-layer embeddings with KV shared into the last two layers (double-wide
MLPs there); norms and layer scalars perturbed around their start, 1.
"""

from __future__ import annotations

import pathlib

from jaxserve.models.tiny import save_word_tokenizer as save_tiny_tokenizer

# Architectures under test: name -> (transformers config class name, config kwargs).
_BASE = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
             rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)

ARCHS: dict[str, tuple[str, dict]] = {
    "llama2_mha": ("LlamaConfig", dict(_BASE, num_key_value_heads=4, rope_theta=10000.0)),
    "llama3_gqa_rope_scaling": ("LlamaConfig", dict(
        _BASE, num_attention_heads=8, num_key_value_heads=2, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    "llama_tied_headdim": ("LlamaConfig", dict(
        _BASE, tie_word_embeddings=True, head_dim=24, num_attention_heads=4,
        num_key_value_heads=1)),
    "llama_linear_rope": ("LlamaConfig", dict(
        _BASE, rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "mistral_sliding": ("MistralConfig", dict(_BASE, sliding_window=5, rope_theta=10000.0)),
    "qwen2_bias": ("Qwen2Config", dict(_BASE, tie_word_embeddings=True, rope_theta=1e6)),
    "qwen3_qknorm": ("Qwen3Config", dict(_BASE, head_dim=32, num_attention_heads=4,
                                         num_key_value_heads=2, rope_theta=1e6)),
}


def build_hf_model(arch: str, out_dir: pathlib.Path, seed: int = 0):
    """Build a random HF model for `arch`, save it to `out_dir`; returns the torch model."""
    import torch
    import transformers

    cls_name, kwargs = ARCHS[arch]
    config = getattr(transformers, cls_name)(**kwargs)
    if arch == "mistral_sliding":
        # sdpa/flex paths differ in how they apply the window; eager is the reference.
        config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        # Default init leaves norms at exactly 1 and biases at 0: perturb them so a loader that
        # drops or misplaces them is caught.
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
            else:
                p.mul_(2.0)
    model.eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    return model


GEMMA_VOCAB, GEMMA_WINDOW, GEMMA_LAYERS = 211, 4, 5
_GEMMA_BASE = dict(vocab_size=GEMMA_VOCAB, hidden_size=64, intermediate_size=96,
                   num_hidden_layers=GEMMA_LAYERS, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=32, max_position_embeddings=256, query_pre_attn_scalar=24,
                   sliding_window=GEMMA_WINDOW, rms_norm_eps=1e-6, bos_token_id=1,
                   eos_token_id=2, pad_token_id=0)
GEMMA_ARCHS: dict[str, tuple[str, dict]] = {
    # Gemma 2's default alternation (sliding, full, ...), both soft-caps on and low enough
    # to bend the logits.
    "gemma2": ("Gemma2Config", dict(_GEMMA_BASE, attn_logit_softcapping=5.0,
                                    final_logit_softcapping=3.0)),
    # Gemma 3: qk-norm, a 2:1 then 1:1 pattern, each kind its own rope base, linear scaling
    # on the global layers only (as Gemma 3 4B+ ship it).
    "gemma3": ("Gemma3TextConfig", dict(
        _GEMMA_BASE, layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                  "sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
}


_GEMMA4_BASE = dict(
    {k: v for k, v in _GEMMA_BASE.items() if k != "query_pre_attn_scalar"}, head_dim=16,
    global_head_dim=32, hidden_size_per_layer_input=0,
    layer_types=["sliding_attention", "sliding_attention", "full_attention",
                 "sliding_attention", "full_attention"])
GEMMA4_ARCHS: dict[str, tuple[str, dict]] = {
    # Gemma 4 31B's attention: K = V on the global layers, fewer global KV heads (1 of 2).
    "gemma4_kv": ("Gemma4TextConfig", dict(_GEMMA4_BASE, attention_k_eq_v=True,
                                            num_global_key_value_heads=1,
                                            final_logit_softcapping=3.0)),
    # Separate V, q/k/v biases, an untied head, a global rope base of its own.
    "gemma4_bias": ("Gemma4TextConfig", dict(
        _GEMMA4_BASE, attention_bias=True, tie_word_embeddings=False,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                         "full_attention": {"rope_type": "proportional",
                                            "partial_rotary_factor": 0.5,
                                            "rope_theta": 1e5}})),
    # Gemma 4 E2B / E4B's extras: per-layer embeddings (8 per layer), the last 2 layers
    # reusing the K/V of the last earlier layer of their type, their MLP double-wide.
    "gemma4_ple": ("Gemma4TextConfig", dict(
        _GEMMA4_BASE, num_hidden_layers=6, hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=GEMMA_VOCAB, num_kv_shared_layers=2,
        use_double_wide_mlp=True,
        layer_types=["sliding_attention", "full_attention", "sliding_attention",
                     "sliding_attention", "sliding_attention", "full_attention"])),
}


def build_gemma_model(arch: str, out_dir: pathlib.Path, **overrides: object):  # noqa: ANN201
    """Build the random HF Gemma model `arch` of GEMMA_ARCHS (config kwargs `overrides` on
    top), save it with the word tokenizer to `out_dir`; returns the torch model (eager
    attention: the reference for the soft-cap and the window)."""
    import torch
    import transformers

    cls, kwargs = (GEMMA_ARCHS | GEMMA4_ARCHS)[arch]
    config = getattr(transformers, cls)(**(kwargs | overrides))
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # Gemma's norm offsets start at 0: perturb them, scale the rest
        for name, p in model.named_parameters():
            p.add_(0.3 * torch.randn_like(p)) if "norm" in name else p.mul_(2.0)
        for name, b in model.named_buffers():  # Gemma 4's layer scalars start at 1
            if name.endswith("layer_scalar"):
                b.add_(0.3 * torch.randn_like(b))
    model.save_pretrained(out_dir, safe_serialization=True)
    save_tiny_tokenizer(out_dir, GEMMA_VOCAB)
    return model


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:  # noqa: ANN001
    """transformers' greedy `generate` of `n` new tokens after `prompt` (EOS ignored)."""
    import torch
    import transformers

    gen = transformers.GenerationConfig(max_new_tokens=n, do_sample=False,
                                        eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt], dtype=torch.long), generation_config=gen)
    return out[0, len(prompt):].tolist()


# MoE families (`models/moe.py`): 4 experts, top-2, experts of 32 (dense MLPs of 96); the
# Qwen3-MoE model has a dense layer between two sparse ones (mlp_only_layers) and renormalises
# its top-k; the Qwen2-MoE model has a shared expert and q/k/v biases; Mixtral is top-2 of 4.
_MOE_BASE = dict(_BASE, num_hidden_layers=3, head_dim=16, rope_theta=1e6,
                 num_experts_per_tok=2)
MOE_ARCHS: dict[str, tuple[str, dict]] = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(_MOE_BASE, num_experts=4, moe_intermediate_size=32,
                                         norm_topk_prob=True, mlp_only_layers=[1])),
    "qwen2_moe": ("Qwen2MoeConfig", dict(_MOE_BASE, num_hidden_layers=2, num_experts=4,
                                         moe_intermediate_size=32,
                                         shared_expert_intermediate_size=48)),
    "mixtral": ("MixtralConfig", dict(_MOE_BASE, num_hidden_layers=2, num_local_experts=4,
                                      intermediate_size=32)),
}


def build_moe_model(arch: str, out_dir: pathlib.Path, seed: int = 0,
                    overrides: dict | None = None):  # noqa: ANN201
    """Build the random HF MoE model `arch` of MOE_ARCHS (config fields `overrides` changed),
    save it with the word tokenizer to `out_dir`; returns the torch model. Norms and biases perturbed; the routers scaled up so
    each token's top-k is decided by margins far above float32 rounding (a near tie would
    make the choice, not the code, decide the comparison)."""
    import torch
    import transformers

    cls, kwargs = MOE_ARCHS[arch]
    kwargs = {**kwargs, **(overrides or {})}
    config = getattr(transformers, cls)(**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith("gate.weight") and p.shape[0] in (1, 4):  # routers
                p.normal_(0.0, 0.5)
            else:
                p.mul_(2.0)
    model.save_pretrained(out_dir, safe_serialization=True)
    save_tiny_tokenizer(out_dir, kwargs["vocab_size"])
    return model


__all__ = ["ARCHS", "GEMMA_ARCHS", "GEMMA4_ARCHS", "MOE_ARCHS", "build_gemma_model",
           "build_hf_model", "build_moe_model",
           "hf_greedy", "save_tiny_tokenizer"]
