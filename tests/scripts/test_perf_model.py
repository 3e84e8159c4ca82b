"""The roofline model behind docs/benchmarks/perf-model.md (`jaxserve.cli.bench.perf_model`,
printed by scripts/bench/perf_model.py): its arithmetic against figures worked out by hand for
Llama-3-8B (no jax, no compile).

The hand figures come from the published shape (hidden 4096, intermediate 14336, 32 layers,
32 query / 8 KV heads of 128, vocabulary 128256, untied head), not from the model's code: the
parameter count is Meta's 8,030,261,248.
"""

from __future__ import annotations

import math

import pytest

from jaxserve.cli.bench import perf_model as pm
from jaxserve.models import shapes

CFG = shapes.llama3_8b()
A = pm.Assumptions()
H200 = pm.CHIPS["h200"]

EMBED = 128256 * 4096                                  # 525,336,576 (and the head again)
LAYER = 4096 * 4096 * 2 + 4096 * 1024 * 2 + 3 * 4096 * 14336  # q, o, k, v, gate/up/down
VECTORS = 32 * 2 * 4096 + 4096                         # two norms a layer + the final norm
KV_TOKEN = 32 * 2 * 8 * 128 * 2                        # bytes of K and V, all layers, bf16


@pytest.fixture(scope="module")
def buckets():
    return pm.engine_buckets(CFG)


def test_weights_of_llama3_8b():
    w = pm.Weights.of(CFG)
    assert w.params == 32 * LAYER + VECTORS + 2 * EMBED == 8_030_261_248
    assert w.bytes("bf16") == 16_060_522_496
    # int8: one byte a matrix weight, an f32 scale per output channel (q+k+v, o, gate+up,
    # down per layer; a row per token of the embedding and of the head), bf16 norms.
    outs = 32 * (4096 + 2 * 1024 + 4096 + 2 * 14336 + 4096) + 2 * 128256
    assert w.bytes("int8") == (32 * LAYER + 2 * EMBED) + 4 * outs + 2 * VECTORS
    with pytest.raises(ValueError, match="fmt='fp4'"):
        w.bytes("fp4")


def test_kv_bytes():
    assert pm.kv_bytes_per_token(CFG) == KV_TOKEN == 131072
    assert 2048 * pm.kv_bytes_per_token(CFG) == 256 << 20  # a 2k sequence: 256 MiB


def test_decode_batch1_h200_by_hand(buckets):
    d = pm.decode(CFG, H200, "bf16", 1, 2048, 1, buckets)
    assert d["bucket"] == (1, 1) and d["bound"] == "memory"
    weights = 2 * (32 * LAYER + VECTORS + EMBED) + 2 * 4096  # the head whole, one embed row
    kv = 2049 * KV_TOKEN + KV_TOKEN                           # read 2048 + 1, write 1
    act = 32 * (12 * 4096 + 6 * 14336) * 2 + 128256 * 4 * 3
    want = (weights + kv + act) / (0.8 * 4.8e12) + 300e-6
    assert d["s"] == pytest.approx(want, rel=1e-12)
    assert 4.2e-3 < d["s"] < 4.4e-3 and d["out_tok_s"] == pytest.approx(1 / d["s"])


def test_decode_monotonic_in_batch(buckets):
    prev = None
    for batch in range(1, 257):
        d = pm.decode(CFG, H200, "bf16", batch, 2048, 1, buckets)
        if prev is not None:
            assert d["s"] >= prev["s"] and d["out_tok_s"] > prev["out_tok_s"] * 0.85
        prev = d
    # A whole-bucket batch beats the next one up, which pays for its padding.
    d32, d33 = (pm.decode(CFG, H200, "bf16", b, 2048, 1, buckets) for b in (32, 33))
    assert d33["bucket"] == (40, 40) and d32["bucket"] == (32, 32)
    # Matmuls and logits scale with the padded 40 rows, attention with the 33 real ones.
    assert d33["cost"]["flops"] - d33["cost"]["attn_flops"] == pytest.approx(
        (d32["cost"]["flops"] - d32["cost"]["attn_flops"]) * 40 / 32)
    assert d33["cost"]["attn_flops"] == pytest.approx(d32["cost"]["attn_flops"] * 33 / 32)


def test_bound_crossover(buckets):
    # At 2k context the KV reads (256 x 256 MiB) keep even batch 256 memory-bound...
    assert pm.decode(CFG, H200, "bf16", 256, 2048, 1, buckets)["bound"] == "memory"
    # ...while at a short context the same batch is compute-bound.
    assert pm.decode(CFG, H200, "bf16", 256, 16, 1, buckets)["bound"] == "compute"


def test_prefill_2k_h200_by_hand(buckets):
    p = pm.prefill(CFG, H200, "bf16", 2048, 1, buckets)
    (step,) = p["steps"]
    assert step["bucket"] == (2048, 256) and step["bound"] == "compute"
    flops = (2 * 32 * LAYER * 2048 + 2 * 4096 * 128256 * 256
             + 4 * 32 * 128 * 32 * (2048 * 2049 // 2))
    assert p["s"] == pytest.approx(flops / (0.6 * 989e12) + 300e-6, rel=1e-12)


def test_memory_fit_and_tensor_parallelism():
    v5e, v6e = pm.CHIPS["v5e"], pm.CHIPS["v6e"]
    # 16.06 GB of bf16 weights do not fit a 16 GB v5e; int8 (8.04 GB) does.
    assert pm.min_tp(CFG, v5e, "bf16", 1, 2048) == 2
    assert pm.min_tp(CFG, v5e, "int8", 1, 2048) == 1
    # One H200 holds 256 sequences of 2k (64 GiB of KV); one v6e holds 32 but not 128.
    assert pm.min_tp(CFG, H200, "bf16", 256, 2048) == 1
    assert pm.min_tp(CFG, v6e, "bf16", 32, 2048) == 1
    assert pm.min_tp(CFG, v6e, "bf16", 128, 2048) == 2
    assert pm.min_tp(CFG, v5e, "bf16", 10_000, 2048) is None


def test_tensor_parallel_step_splits_bytes_and_adds_all_reduces(buckets):
    cost = pm.step_cost(CFG, "bf16", [pm.Seq(1, 2048)] * 32, (32, 32))
    one, four = pm.step_time(cost, pm.CHIPS["v5e"], 1), pm.step_time(cost, pm.CHIPS["v5e"], 4)
    assert four["bytes_per_chip"] == pytest.approx(one["bytes_per_chip"] / 4)
    assert one["comm_s"] == 0
    # 64 all-reduces of 32 x 4096 bf16 over a 4-chip ring, plus the logits gather.
    ring = 64 * (10e-6 + 1.5 * 32 * 4096 * 2 / 200e9)
    gather = 10e-6 + 0.75 * 32 * 128256 * 4 / 200e9
    assert four["comm_s"] == pytest.approx(ring + gather)


def test_serve_slower_than_decode_alone(buckets):
    s = pm.serve(CFG, H200, "bf16", 64, 1024, 128, 1, buckets)
    d = pm.decode(CFG, H200, "bf16", 64, 1024 + 64, 1, buckets)
    assert s["prefill_s"] > 0 and s["out_tok_s"] < d["out_tok_s"]
    assert s["total_tok_s"] == pytest.approx(s["out_tok_s"] * (1024 + 128) / 128)


def test_table_and_peers_complete():
    rows = pm.table(CFG)
    assert len(rows) == 3 * 2 * len(pm.BATCHES)
    assert all(r["tp"] is not None and math.isfinite(r["out_tok_s"]) for r in rows)
    for p in pm.peer_rows(CFG):
        assert p["url"].startswith("https://") and p["predicted"] > 0
        assert 1 <= p["conc_modelled"] <= (p["conc"] or 512)
