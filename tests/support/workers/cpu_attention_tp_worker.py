"""Runs in a subprocess with 8 virtual CPU devices (XLA_FLAGS set by the caller): the C++ CPU
attention under tensor parallelism, printed as one JSON document for test_attention_cpu.py.

1. The kernel alone inside `jax.shard_map` over 8 devices (one KV head and its query heads
   per device, metadata replicated: the engine's specs) against the unsharded reference.
2. A tiny engine whose paged_forward runs it inside its shard_map: TP 4 (one KV head per
   device) with impl 'cpu' against TP 1 with the reference; two token buckets (the default
   buckets with JAXSERVE_RUN_SLOW=1).
"""

from __future__ import annotations

import json
import sys

import jax
import numpy as np
from support.engine_fixtures import (  # noqa: E402 - run with tests/ on the path
    FEW_TOKEN_BUCKETS, run_slow, tiny_engine, tiny_model)
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as PS
from support.kernel_cases import random_batch
from support.numerics import attention_atol, model_logprob_atol
from support.workers.tp_worker import PROMPTS, greedy_outputs

from jaxserve.kernels_pallas import ragged_paged_attention_reference, select_impl, write_kv
from jaxserve.kernels_pallas.cpu import ragged_paged_attention_cpu


def kernel_under_shard_map() -> float:
    rng = np.random.default_rng(8)
    specs = [(37, 1), (0, 21), (50, 9), (130, 1), (5, 1)]
    batch = random_batch(rng, specs, num_q_heads=16, num_kv_heads=8, head_dim=32, page_size=16,
                         num_tokens=36, num_seqs=7, fill_nan=False)
    pages = write_kv(batch.kv_pages, batch.k_new, batch.v_new, batch.md.slot_mapping)
    want = ragged_paged_attention_reference(batch.q, pages, batch.md, sm_scale=0.2)
    mesh = Mesh(np.array(jax.devices()), ("model",))
    heads = PS(None, "model", None)
    fn = jax.jit(jax.shard_map(
        lambda q, p, md: ragged_paged_attention_cpu(q, p, md, sm_scale=0.2), mesh=mesh,
        in_specs=(heads, PS(None, "model", None, None), PS()), out_specs=heads,
        check_vma=False))
    err = np.abs(np.asarray(fn(batch.q, pages, batch.md)) - np.asarray(want))
    # max |got - want| over its float32 reordering bound (support.numerics.attention_atol:
    # head_dim 32, <= 131 keys); padding rows must be exact zeros on both sides.
    live = int(np.asarray(batch.md.cu_q_lens)[len(specs)])
    if err[live:].any():
        return float("inf")
    return float((err[:live] / attention_atol(batch, sm_scale=0.2)).max())


def engine_outputs(impl: str, tp: int) -> dict:
    model = tiny_model(num_heads=8, num_kv_heads=4, head_dim=8, hidden_size=64,
                       intermediate_size=128, vocab_size=256)
    few = {} if run_slow() else {"token_buckets": FEW_TOKEN_BUCKETS}
    eng = tiny_engine(model, tensor_parallel_size=tp, attention_impl=impl, **few)
    return {"impl": eng.runner.attn_impl, "outputs": greedy_outputs(eng, PROMPTS),
            "compiles_after_warmup": eng.runner.compiles_after_warmup,
            # Another layout of the same model (the C++ kernel, TP partial sums): the bound
            # support.numerics derives from its weights, over the engine's max_model_len.
            "logprob_atol": model_logprob_atol(model.config, model.params,
                                               eng.config.max_model_len)}


if __name__ == "__main__":
    assert jax.device_count() == 8, jax.devices()
    json.dump({"built": select_impl("cpu") == "cpu",
               "shard_map_err_over_bound": kernel_under_shard_map(),
               "tp1_reference": engine_outputs("reference", 1),
               "tp4_cpu": engine_outputs("cpu", 4)},
              sys.stdout)
