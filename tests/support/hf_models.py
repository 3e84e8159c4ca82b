"""Tiny random-weight HF models that tests build and save as safetensors directories.

The oracle side of model parity: transformers builds and initialises the model, saves it with
its own `save_pretrained` (safetensors), and jaxserve loads that directory with its own loader.
`save_tiny_tokenizer(dir, vocab_size)` writes the package's word tokenizer beside them (it is
`jaxserve.models.tiny.save_word_tokenizer`: one tokenizer factory for tests and scripts).
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


__all__ = ["ARCHS", "build_hf_model", "save_tiny_tokenizer"]
