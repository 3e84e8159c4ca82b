"""The speculative-decoding rows of the roofline model (`jaxserve.cli.bench.perf_model_spec`):
one case (Llama-3-8B, one H200, batch 1, k = 3, acceptance length 3, context 2048) worked out
by hand from the published shapes, and the table's shape and trends.

The EAGLE-3 head's shape is the one its Llama-3 checkpoints describe: one decoder layer whose
q / k / v projections read 2 x 4096 inputs, fc 3 x 4096 -> 4096, lm_head 4096 -> 32,000, four
norms of 4096.
"""

from __future__ import annotations

import pytest

from jaxserve.cli.bench import perf_model as pm
from jaxserve.cli.bench import perf_model_spec as ps
from jaxserve.models import shapes

CFG = shapes.llama3_8b()
H200 = pm.CHIPS["h200"]
BW = 0.8 * 4.8e12           # eta_bw x HBM bandwidth
FL = 0.6 * 989e12           # eta_flops x bf16 peak

LAYER = 4096 * 4096 * 2 + 4096 * 1024 * 2 + 3 * 4096 * 14336
VECTORS = 32 * 2 * 4096 + 4096
EMBED = 128256 * 4096
KV = 32 * 2 * 8 * 128 * 2   # target K + V per token
ACT_LAYER = (12 * 4096 + 6 * 14336) * 2  # activation bytes per token per layer

HEAD_LAYER = 8192 * 4096 + 2 * 8192 * 1024 + 4096 * 4096 + 3 * 4096 * 14336
HEAD_FC = 12288 * 4096
HEAD_LM = 4096 * 32000
HEAD_VEC = 4 * 4096
HEAD_KV = 2 * 8 * 128 * 2   # the head's one layer


def test_head_shape() -> None:
    head = ps.Eagle3Head.of(CFG)
    assert (head.layer_matrix, head.fc, head.lm_head) == (HEAD_LAYER, HEAD_FC, HEAD_LM)
    assert head.params == 424_689_664  # ~0.85 GB bf16: 5% of the target's bytes


def draft_by_hand(q: int, ctx: int, fc: bool) -> float:
    matrix = HEAD_LAYER + (HEAD_FC if fc else 0)
    byts = (2 * (matrix + HEAD_LM + HEAD_VEC) + q * 4096 * 2 + (ctx + q) * HEAD_KV
            + q * HEAD_KV + q * (12 * 4096 + 6 * 14336) * 2 + 32000 * 12)
    flops = 2 * matrix * q + 2 * 4096 * 32000 + 4 * 32 * 128 * (q * ctx + q * (q + 1) // 2)
    return max(byts / BW, flops / FL) + 20e-6


def test_batch1_k3_tau3_by_hand() -> None:
    # Plain decode (as test_perf_model): the weights but the embedding table, one embedding
    # row, the head whole; KV read 2048 + 1 and write 1; f32 logits written and read twice.
    dec = (2 * (32 * LAYER + VECTORS + EMBED) + 2 * 4096 + 2049 * KV + KV
           + 32 * ACT_LAYER + 128256 * 12) / BW + 300e-6
    # Verification: 4 query tokens (bucket 4), logits at all 4.
    vbytes = (2 * (32 * LAYER + VECTORS + EMBED) + 4 * 4096 * 2 + 2052 * KV + 4 * KV
              + 4 * 32 * ACT_LAYER + 4 * 128256 * 12)
    vflops = (2 * 32 * LAYER * 4 + 2 * 4096 * 128256 * 4
              + 4 * 32 * 128 * 32 * (4 * 2048 + 10))
    verify = max(vbytes / BW, vflops / FL) + 300e-6
    # Drafts: 4 positions with the fc at context 2048, then one token at 2052, then at 2053.
    drafts = draft_by_hand(4, 2048, True) + draft_by_hand(1, 2052, False) + draft_by_hand(
        1, 2053, False)
    want_speedup = 3 * dec / (verify + drafts)

    buckets = pm.engine_buckets(CFG)
    s = ps.spec_step(CFG, H200, 1, 3, 2048, buckets)
    assert s["verify_bucket"][0] == 4
    assert s["verify_s"] == pytest.approx(verify, rel=1e-12)
    assert s["draft_s"] == pytest.approx(drafts, rel=1e-12)
    row = next(r for r in ps.table(CFG) if r["batch"] == 1 and r["k"] == 3)
    assert row["decode_ms"] == pytest.approx(dec * 1e3, rel=1e-12)
    assert row["tau"][3]["speedup"] == pytest.approx(want_speedup, rel=1e-12)
    assert row["tau"][3]["out_tok_s"] == pytest.approx(3 / (verify + drafts), rel=1e-12)
    # About 4.3 ms to verify, 0.7 ms of drafting: 2.6x at tau 3.
    assert 2.4 < want_speedup < 2.8


def test_table_shape_and_trends() -> None:
    rows = ps.table(CFG)
    assert [(r["batch"], r["k"]) for r in rows] == [(b, k) for b in (1, 8, 32) for k in (3, 5)]
    for r in rows:
        assert sorted(r["tau"]) == [2, 3, 4]
        sp = [r["tau"][t]["speedup"] for t in (2, 3, 4)]
        assert sp[0] < sp[1] < sp[2]
        # Speculating costs more than a decode step, so tau 1 would lose.
        assert 1 < r["break_even_tau"] < 2
    by = {(r["batch"], r["k"]): r for r in rows}
    for b in (1, 8, 32):
        # At the same tau, proposing more tokens only adds cost.
        assert by[(b, 5)]["tau"][2]["speedup"] < by[(b, 3)]["tau"][2]["speedup"]
    # A larger batch reads more KV and pays more per verified token: smaller gains.
    assert by[(32, 3)]["tau"][3]["speedup"] < by[(1, 3)]["tau"][3]["speedup"]


def test_logit_rows() -> None:
    seqs = [pm.Seq(1, 2048)] * 8
    plain = pm.step_cost(CFG, "bf16", seqs, (8, 8))
    assert plain == pm.step_cost(CFG, "bf16", seqs, (8, 8), logit_rows=8)
    more = pm.step_cost(CFG, "bf16", seqs, (8, 8), logit_rows=24)
    assert more["flops"] - plain["flops"] == 2 * 4096 * 128256 * 16
    assert more["activations"] - plain["activations"] == 16 * 128256 * 12
