"""Runs in a subprocess with 8 virtual CPU devices (XLA_FLAGS set by the caller): the
mixed-layer-spec test model (`engine_fixtures.mixed_layer_model`: sliding-window and global
layers, a soft-cap) at TP 1, 2 and 4 (4: KV heads replicated), printed as one JSON document
for tests/device/test_tensor_parallel.py: greedy tokens and top-5 logprobs of tp_worker's
prompts, compiles after warmup, the logprob tolerance of the model.
"""

from __future__ import annotations

import json
import sys

import jax
from support.engine_fixtures import FEW_TOKEN_BUCKETS, mixed_layer_model, tiny_engine
from support.numerics import model_logprob_atol
from support.workers.tp_worker import PROMPTS, greedy_outputs


def run(tp: int) -> dict:
    model = mixed_layer_model(num_heads=8, num_kv_heads=2, head_dim=8, hidden_size=64,
                              intermediate_size=128, vocab_size=256)
    eng = tiny_engine(model, tensor_parallel_size=tp, token_buckets=FEW_TOKEN_BUCKETS,
                      max_num_batched_tokens=64, attention_impl="cpu")
    return {"outputs": greedy_outputs(eng, PROMPTS),
            "compiles_after_warmup": eng.runner.compiles_after_warmup,
            # How far TP's reordered sums may move a logprob (support.numerics).
            "logprob_atol": model_logprob_atol(model.config, model.params,
                                               eng.config.max_model_len)}


if __name__ == "__main__":
    assert jax.device_count() == 8, jax.devices()
    json.dump({str(tp): run(tp) for tp in (1, 2, 4)}, sys.stdout)
