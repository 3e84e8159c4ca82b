"""Runs in a subprocess with 8 virtual CPU devices (XLA_FLAGS set by the caller): tiny Gemma
family models at tensor-parallel sizes their KV heads do not divide, printed as one JSON
document for tests/device/test_tensor_parallel.py.

Two models, each a `Gemma*ForCausalLM` config.json read by `families.config_from_hf` with
random weights (`tiny.random_model`: the family's own init, at the test suite's scale):
  - "gemma3-kv1": Gemma 3 1B's head layout (4 query heads, 1 KV head: replicated at every
    TP > 1) with qk-norm, a sliding / full pattern with both rope bases and linear scaling on
    the global layers, a window of 4 that every prompt but one outgrows;
  - "gemma2-cap": Gemma 2 with both soft-caps low enough to bend the logits and 2 KV heads
    (sharded at TP 2, replicated at TP 4);
  - "gemma4-kv": Gemma 4 with local heads of 16 padded into global heads of 32, K = V on the
    global layers, the value norm, layer scalars and proportional RoPE, per-layer embeddings
    (their token table split by rows at TP 2), the last layer reusing layer 1's K/V with a
    double-wide MLP, an untied head (tied, the scaled input embedding dominates and every step
    repeats one token); its 2 KV heads sharded at TP 2 (the padded layers' heads split with
    the others).
For each (model, TP) row of the part named by the argument: greedy tokens, top-5 logprobs and
top-3 prompt logprobs of tp_worker's prompts, compiles after warmup, and the model's logprob
tolerance. "default": DEFAULT_ROWS (each model at one TP size, with its TP 1); "slow": the
rest of ROWS.
"""

from __future__ import annotations

import json
import sys

import jax
from support.engine_fixtures import FEW_TOKEN_BUCKETS, tiny_engine, tiny_tokenizer
from support.numerics import model_logprob_atol
from support.workers.tp_worker import PROMPTS, greedy_outputs

from jaxserve.models import families, tiny

_BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
             head_dim=16, max_position_embeddings=256, query_pre_attn_scalar=16,
             sliding_window=4, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
             pad_token_id=0)
CONFIGS = {
    "gemma3-kv1": dict(
        _BASE, architectures=["Gemma3ForCausalLM"], model_type="gemma3_text",
        num_hidden_layers=5, num_key_value_heads=1,
        layer_types=["sliding_attention", "sliding_attention", "full_attention",
                     "sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
    "gemma2-cap": dict(
        _BASE, architectures=["Gemma2ForCausalLM"], model_type="gemma2", num_hidden_layers=4,
        num_key_value_heads=2, attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
        rope_theta=10000.0),
    "gemma4-kv": dict(
        {k: v for k, v in _BASE.items() if k != "query_pre_attn_scalar"},
        architectures=["Gemma4ForCausalLM"], model_type="gemma4_text", num_hidden_layers=4,
        num_key_value_heads=2, global_head_dim=32, attention_k_eq_v=True,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=256, num_kv_shared_layers=1,
        use_double_wide_mlp=True, tie_word_embeddings=False,
        layer_types=["sliding_attention", "full_attention", "sliding_attention",
                     "full_attention"]),
}
# Rows at a TP size that divides the model's KV heads (sharded, not replicated).
SHARDED_ROWS = {("gemma4-kv", 2)}
ROWS = [(m, tp) for m in CONFIGS for tp in (1, 2, 4)]
# Each model once past its KV heads in the default run: Gemma 3's single KV head replicated
# over 2 devices, Gemma 2's two over 4 (and its soft-caps under the sharded attention).
# Gemma 4 at TP 2: its KV heads and padded global layers sharded.
DEFAULT_ROWS = [("gemma3-kv1", 1), ("gemma3-kv1", 2), ("gemma2-cap", 1), ("gemma2-cap", 4),
                ("gemma4-kv", 1), ("gemma4-kv", 2)]


def model_of(name: str):  # noqa: ANN201 - LoadedModel
    cfg = families.config_from_hf(CONFIGS[name], f"{name}/config.json")
    return tiny.random_model(cfg, seed=2, scale=tiny.TEST_INIT_SCALE,
                             tokenizer=tiny_tokenizer())


def run(name: str, tp: int) -> dict:
    model = model_of(name)
    eng = tiny_engine(model, tensor_parallel_size=tp, token_buckets=FEW_TOKEN_BUCKETS,
                      max_num_batched_tokens=64, attention_impl="cpu")
    return {"model": name, "tp": tp, "outputs": greedy_outputs(eng, PROMPTS),
            "compiles_after_warmup": eng.runner.compiles_after_warmup,
            "kv_heads": model.config.num_kv_heads,
            "logprob_atol": model_logprob_atol(model.config, model.params,
                                               eng.config.max_model_len)}


if __name__ == "__main__":
    assert jax.device_count() == 8, jax.devices()
    part = sys.argv[1] if len(sys.argv) > 1 else "default"
    rows = DEFAULT_ROWS if part == "default" else [
        r for r in ROWS if r not in DEFAULT_ROWS or r[1] == 1]
    json.dump([run(*r) for r in rows], sys.stdout)
