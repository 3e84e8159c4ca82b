"""Published model shapes as ModelConfigs (no weights): what the accelerator export tests,
the device check and the performance model size their work by, defined once here.

Llama-3-8B and Qwen3-8B as their HF configs give them (the token ids are the real ones);
Gemma 3 1B and 4B (text) as their config.json files read through the Gemma family's own
`config_from_hf`, so the per-layer specs (five sliding layers per global one, the two rope
bases, the 4B's linear scaling on the global layers) are what loading the checkpoint gives.
"""

from __future__ import annotations

from .config import ModelConfig

# The fields of google/gemma-3-1b-it's config.json (Gemma3ForCausalLM) and of
# google/gemma-3-4b-it's `text_config` that shape the model; the rest take the class defaults.
_GEMMA3_COMMON = dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text",
                      head_dim=256, query_pre_attn_scalar=256, rms_norm_eps=1e-6,
                      rope_theta=1000000.0, rope_local_base_freq=10000.0,
                      sliding_window_pattern=6, hidden_activation="gelu_pytorch_tanh",
                      attn_logit_softcapping=None, final_logit_softcapping=None,
                      tie_word_embeddings=True, bos_token_id=2, eos_token_id=[1, 106],
                      pad_token_id=0)
GEMMA3_1B = dict(_GEMMA3_COMMON, vocab_size=262144, hidden_size=1152, intermediate_size=6912,
                 num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1,
                 sliding_window=512, max_position_embeddings=32768, rope_scaling=None)
GEMMA3_4B = dict(_GEMMA3_COMMON, vocab_size=262208, hidden_size=2560, intermediate_size=10240,
                 num_hidden_layers=34, num_attention_heads=8, num_key_value_heads=4,
                 sliding_window=1024, max_position_embeddings=131072,
                 rope_scaling={"rope_type": "linear", "factor": 8.0})


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


def gemma3_1b() -> ModelConfig:
    # Imported here: the Gemma module imports jax, and this module's Llama / Qwen shapes are
    # read by callers that load no jax (the performance model).
    from .gemma import config_from_hf

    return config_from_hf(GEMMA3_1B, "gemma3_text", "gemma-3-1b/config.json")


def gemma3_4b() -> ModelConfig:
    from .gemma import config_from_hf

    return config_from_hf(GEMMA3_4B, "gemma3_text", "gemma-3-4b/config.json")
