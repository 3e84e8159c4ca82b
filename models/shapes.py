"""Published model shapes as ModelConfigs (no weights): what the accelerator export tests,
the device check and the performance model size their work by, defined once here.

Llama-3-8B and Qwen3-8B as their HF configs give them (the token ids are the real ones).
"""

from __future__ import annotations

from .config import ModelConfig


def llama3_8b() -> ModelConfig:
    return ModelConfig(model_type="llama", vocab_size=128256, hidden_size=4096,
                       intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                       head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
                       max_position_embeddings=8192, tie_word_embeddings=False,
                       attention_bias=False, qk_norm=False, bos_token_id=128000,
                       eos_token_ids=(128001, 128009))


def qwen3_8b() -> ModelConfig:
    return ModelConfig(model_type="qwen3", vocab_size=151936, hidden_size=4096,
                       intermediate_size=12288, num_layers=36, num_heads=32, num_kv_heads=8,
                       head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
                       max_position_embeddings=40960, tie_word_embeddings=False,
                       attention_bias=False, qk_norm=True, bos_token_id=151643,
                       eos_token_ids=(151645,))
