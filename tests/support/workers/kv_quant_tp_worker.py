"""Runs in a subprocess with 8 virtual CPU devices (XLA_FLAGS set by the caller): a tiny
engine with an int8 KV cache at TP 1 and TP 2 (the C++ CPU kernel inside the step's
shard_map; pages and scales split by KV head), printed as one JSON document for
test_kv_quant_engine.py: greedy tokens, compiles after warmup, and how the cache is placed.
"""

from __future__ import annotations

import json
import sys

import jax
from support.engine_fixtures import (  # noqa: E402 - run with tests/ on the path
    FEW_TOKEN_BUCKETS, tiny_engine, tiny_model)
from support.workers.tp_worker import PROMPTS, greedy_outputs, shard_bytes

from jaxserve.kernels_pallas import QuantizedKV


def run(tp: int) -> dict:
    model = tiny_model(num_heads=8, num_kv_heads=4, head_dim=8, hidden_size=64,
                       intermediate_size=128, vocab_size=256)
    eng = tiny_engine(model, tensor_parallel_size=tp, attention_impl="cpu",
                      kv_cache_dtype="int8", token_buckets=FEW_TOKEN_BUCKETS)
    kv = eng.runner.kv_pages
    assert isinstance(kv, QuantizedKV), type(kv)
    scales_dev, scales_all = shard_bytes(kv.scales)
    pages_dev, pages_all = shard_bytes(kv.pages)
    return {"outputs": greedy_outputs(eng, PROMPTS), "impl": eng.runner.attn_impl,
            "compiles_after_warmup": eng.runner.compiles_after_warmup,
            "pages_dtype": str(kv.pages.dtype),
            "pages_spec": str(getattr(kv.pages.sharding, "spec", None)),
            "scales_spec": str(getattr(kv.scales.sharding, "spec", None)),
            "pages_bytes_device0": pages_dev, "pages_bytes_total": pages_all,
            "scales_bytes_device0": scales_dev, "scales_bytes_total": scales_all}


if __name__ == "__main__":
    assert jax.device_count() == 8, jax.devices()
    json.dump({"tp1": run(1), "tp2": run(2)}, sys.stdout)
