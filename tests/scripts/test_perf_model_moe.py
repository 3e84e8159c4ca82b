"""The mixture-of-experts rows of the roofline model (`jaxserve.cli.bench.perf_model_moe`,
printed by scripts/bench/perf_model.py) against figures worked out by hand from Qwen3-30B-A3B's
published shape (48 layers, hidden 2048, 32 q / 4 KV heads of 128, 128 experts of 768, top-8,
vocabulary 151936, untied head), and its expected-experts arithmetic against a simulation of
the routing it assumes (no jax)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.cli.bench import perf_model_moe as pm

SHAPE = pm.qwen3_30b_a3b()
H, L, E, I, K, V = 2048, 48, 128, 768, 8, 151936
ATTN = 2 * H * 32 * 128 + 2 * H * 4 * 128          # q, o; k, v
EXPERT = 3 * H * I                                  # gate, up, down
VECTORS = L * (2 * H + 2 * 128) + H                 # norms, q/k norms, final norm
KV_TOKEN = L * 2 * 4 * 128 * 2                      # 96 KiB


def test_parameter_counts_by_hand() -> None:
    assert SHAPE.params == L * (ATTN + H * E + E * EXPERT) + VECTORS + 2 * V * H
    assert round(SHAPE.params / 1e9, 1) == 30.5     # Qwen's "30.5B total"
    assert SHAPE.active_params == L * (ATTN + H * E + K * EXPERT) + VECTORS + V * H
    # Qwen's "3.3B activated", with the input embedding table (0.31 B) counted too
    assert 3.3e9 < SHAPE.active_params + V * H < 3.4e9
    assert SHAPE.kv_bytes_per_token() == KV_TOKEN == 96 * 1024


def test_distinct_experts() -> None:
    assert pm.distinct_experts(E, K, 1) == pytest.approx(8)
    assert pm.distinct_experts(E, K, 32) == pytest.approx(128 * (1 - (15 / 16) ** 32))
    assert 111 < pm.distinct_experts(E, K, 32) < 112
    assert pm.distinct_experts(E, K, 256) == pytest.approx(128, abs=1e-5)


@pytest.mark.parametrize("tokens", [1, 4, 32])
def test_expected_experts_match_a_simulated_routing(tokens: int) -> None:
    """Each token picks 8 distinct experts of 128 uniformly: the touched count per layer and
    the busiest of 8 chips' (16 experts each), by simulation, against the formulas (the
    busiest-chip one treats experts as independent: within 5 %)."""
    rng = np.random.default_rng(0)
    trials = 4000
    picks = np.argsort(rng.random((trials, tokens, E)), axis=-1)[..., :K]
    touched = np.zeros((trials, E), bool)
    np.put_along_axis(touched, picks.reshape(trials, -1), True, axis=1)
    assert touched.sum(1).mean() == pytest.approx(pm.distinct_experts(E, K, tokens), rel=0.01)
    busiest = touched.reshape(trials, 8, 16).sum(2).max(1).mean()
    assert busiest == pytest.approx(pm.busiest_chip_experts(E, K, tokens, 8), rel=0.05)


def test_h200_batch1_decode_by_hand() -> None:
    s = pm.step(SHAPE, pm.Setup("h200", 1, 64), [(1, 2048)])
    weights = 2 * (L * (ATTN + H * E + 8 * EXPERT) + V * H + H + VECTORS)
    kv = 2049 * KV_TOKEN + KV_TOKEN
    act = L * (12 * H + 6 * K * I) * 2 + V * 4 * 3
    assert s["weight_bytes_read"] == pytest.approx(weights)
    assert s["s"] == pytest.approx((weights + kv + act) / (0.8 * 4.8e12) + 300e-6)
    assert s["bound"] == "memory" and s["comm_s"] == 0
    # one tile of 64 rows per touched expert: 8 tiles, 512 rows for 8 real ones
    assert s["expert_tile_rows"] == pytest.approx(8 * 64)


def test_expert_parallel_v6e8_by_hand() -> None:
    setup = pm.Setup("v6e", 8, 128)
    # each chip: 16 whole experts, q/o / 8, k/v / 4 (4 KV heads, replicated past them),
    # router whole, head and embedding / 8
    per_chip = 2 * (L * (2 * H * 32 * 128 / 8 + 2 * H * 4 * 128 / 4 + H * E + 16 * EXPERT)
                    + VECTORS + 2 * V * H / 8)
    assert pm.weight_bytes_per_chip(SHAPE, setup) == pytest.approx(per_chip)
    assert 7.6e9 < per_chip < 7.8e9
    s = pm.step(SHAPE, setup, [(1, 2048)] * 32)
    ring = 2 * 48 * (10e-6 + 1.75 * 32 * H * 2 / 400e9)
    gather = 10e-6 + 7 / 8 * 32 * V * 4 / 400e9
    assert s["comm_s"] == pytest.approx(ring + gather)
    assert s["ici_all_to_all_bytes"] == pytest.approx(2 * 48 * 32 * 8 * H * 2 * 7 / 8)
    # the busiest chip reads more experts than the mean (111.8 / 8 = 14.0) and at most 16
    assert 14.0 < s["busiest_chip_experts"] <= 16


def test_table_grows_then_saturates() -> None:
    rows = pm.table(SHAPE)
    assert len(rows) == 2 * len(pm.BATCHES) and all(r["fits"] for r in rows)
    for setup in pm.SETUPS:
        mine = [r for r in rows if r["setup"] == setup]
        experts = [r["expert_bytes_read"] for r in mine]
        assert experts == sorted(experts)  # more tokens touch more experts...
        assert experts[-1] == pytest.approx(experts[-2], rel=1e-3)  # ...until all are read
        assert [r["out_tok_s"] for r in mine] == sorted(r["out_tok_s"] for r in mine)
    h200_256 = next(r for r in rows if r["setup"] == "h200" and r["batch"] == 256)
    assert h200_256["expert_bytes_read"] == pytest.approx(2 * L * E * EXPERT, rel=1e-6)


def test_peer_rows_cite_and_model() -> None:
    (p,) = pm.peer_rows(SHAPE)
    assert p["url"].startswith("https://github.com/vllm-project/vllm/pull/")
    assert 0.5 < p["measured_over_predicted"] < 1.5 and p["predicted_tpot_ms"] > 0
