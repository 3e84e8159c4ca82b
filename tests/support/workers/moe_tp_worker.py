"""Runs in a subprocess with 8 virtual CPU devices (XLA_FLAGS set by the caller): tiny MoE
models under tensor parallelism, printed as one JSON document for
tests/device/test_tensor_parallel.py.

Models, each an HF config.json read by `families.config_from_hf` with random weights
(`tiny.random_model` at the test suite's scale, 0.5: sharp router logits, so each token's
top-k is decided by margins far above the sums' reordering under TP):
  - "qwen3-moe": 4 experts of 32, top-2 renormalised, qk-norm, a dense layer between two
    sparse ones (mlp_only_layers: two scan groups);
  - "qwen2-moe": 4 experts, top-2, a shared expert of 48 with its sigmoid gate, q/k/v biases;
  - "mixtral": 4 experts, top-2;
  - "gpt-oss": 4 experts of 32, top-2, router / expert biases, the clamped SwiGLU (limit 1,
    so it clamps), attention sinks split with the query heads, q/k/v/o biases, sliding
    (window 8) and full layers, YaRN (its own part, "gpt-oss": TP 1 and 2).
TP splits each expert's intermediate axis (gate / up outputs, down inputs) as the dense MLP's;
the router is replicated. For each (model, TP) row of the part named by the argument: greedy
tokens, top-5 logprobs and top-3 prompt logprobs of tp_worker's prompts, compiles after
warmup, the model's logprob tolerance. "default": DEFAULT_ROWS; "slow": the rest of ROWS;
"quant": QUANT_ROWS, Qwen3-MoE with --quantization int8 (the expert stacks quantized per
expert and column: values split as the float stacks, scales with them) at TP 1 and 2.
"""

from __future__ import annotations

import json
import sys

import jax
from support.engine_fixtures import FEW_TOKEN_BUCKETS, tiny_engine, tiny_tokenizer
from support.numerics import model_logprob_atol
from support.workers.tp_worker import PROMPTS, greedy_outputs

from jaxserve.models import families, tiny
from jaxserve.models.linear import PackedExperts

_BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=1e6,
             bos_token_id=1, eos_token_id=2, num_experts_per_tok=2)
CONFIGS = {
    "qwen3-moe": dict(_BASE, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                      num_experts=4, moe_intermediate_size=32, norm_topk_prob=True,
                      mlp_only_layers=[1]),
    "qwen2-moe": dict(_BASE, architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe",
                      num_hidden_layers=2, num_experts=4, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48),
    "mixtral": dict(_BASE, architectures=["MixtralForCausalLM"], model_type="mixtral",
                    num_hidden_layers=2, num_local_experts=4, intermediate_size=32),
    "gpt-oss": dict(_BASE, architectures=["GptOssForCausalLM"], model_type="gpt_oss",
                    num_local_experts=4, intermediate_size=32, sliding_window=8,
                    swiglu_limit=1.0),
}
ROWS = [(m, tp) for m in CONFIGS for tp in (1, 2, 4)]
DEFAULT_ROWS = [("qwen3-moe", 1), ("qwen3-moe", 2), ("qwen2-moe", 1), ("qwen2-moe", 2)]
QUANT_ROWS = [("qwen3-moe-int8", 1), ("qwen3-moe-int8", 2)]


def run(name: str, tp: int) -> dict:
    base, _, scheme = name.partition("-int")
    # int8 activations off: TP 1 would otherwise run the packed dense linears as W8A8 on
    # CPU and TP 2 (sharded, unpacked) as W8A16, a difference of numerics, not of TP.
    quant = {"quantization": f"int{scheme}", "int8_activations": "off"} if scheme else {}
    name_cfg = base if scheme else name
    cfg = families.config_from_hf(CONFIGS[name_cfg], f"{name_cfg}/config.json")
    model = tiny.random_model(cfg, seed=2, scale=tiny.TEST_INIT_SCALE,
                              tokenizer=tiny_tokenizer())
    eng = tiny_engine(model, tensor_parallel_size=tp, token_buckets=FEW_TOKEN_BUCKETS,
                      max_num_batched_tokens=64, attention_impl="cpu", **quant)
    layers = eng.runner.params.layers

    def stored(f: str) -> jax.Array:  # a quantized stack's values
        w = getattr(layers, f)
        assert bool(scheme) == hasattr(w, "values"), (name, f, type(w))
        return getattr(w, "values", w)

    # bytes of each expert stack held by device 0 against the whole stack
    # (TP 1 packs float ones for the CPU grouped kernel: PackedExperts, the bytes as panels)
    stacks = {f: getattr(layers, f) for f in ("we_gate", "we_up", "we_down")}
    stacks = {f: w.panels if isinstance(w, PackedExperts) else stored(f)
              for f, w in stacks.items()}
    experts = {f: [sum(s.data.nbytes for s in w.addressable_shards
                       if s.device == jax.devices()[0]), w.nbytes] for f, w in stacks.items()}
    return {"model": name, "tp": tp, "outputs": greedy_outputs(eng, PROMPTS),
            "expert_bytes": experts,
            "compiles_after_warmup": eng.runner.compiles_after_warmup,
            "logprob_atol": model_logprob_atol(model.config, model.params,
                                               eng.config.max_model_len)}


if __name__ == "__main__":
    assert jax.device_count() == 8, jax.devices()
    part = sys.argv[1] if len(sys.argv) > 1 else "default"
    if part == "gpt-oss":
        rows = [("gpt-oss", 1), ("gpt-oss", 2)]
    elif part == "quant":
        rows = QUANT_ROWS
    else:
        rows = DEFAULT_ROWS if part == "default" else [
            r for r in ROWS if (r not in DEFAULT_ROWS or r[1] == 1) and r[0] != "gpt-oss"]
    json.dump([run(*r) for r in rows], sys.stdout)
