"""Proposal rounds of the speculative drafters (`jaxserve.device.spec_draft*`, issue 33).

Oracles, independent of paging and of the round's chain:
  draft_model: a plain greedy rollout of the draft model, `decoder.forward` over the whole
    sequence (dense causal attention, no pages) once per proposed token;
  eagle3: the head in plain PyTorch (`support.eagle3_oracle.reference`) over the whole row
    sequence, one more row per proposal (token: the previous proposal, hidden: the previous
    row's output), the catch-up rows' hidden fc(aux) computed in numpy.
Every case runs two consecutive rounds over sequences whose pages are out of order at page
size 2: a prefill split over the rounds, a partial acceptance (round 2 catches up only the
bonus token, reading the K/V round 1's chain wrote for the accepted proposal) and a full
rejection; and no compile happens after warmup.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxserve.device.compile_guard import CompileGuard
from jaxserve.device.spec_draft import DraftSeq, pack_round, round_buckets, truncated_draft
from jaxserve.device.spec_draft_model import DraftModelProposer
from jaxserve.device.spec_eagle3 import Eagle3Proposer
from jaxserve.kernels_pallas import select_impl
from jaxserve.models import decoder, eagle3, tiny
from jaxserve.models.config import ConfigError
from support.eagle3_oracle import HEAD_CONFIG, random_weights, reference, write_head
from support.tiers import slow

PAGE, W, NUM_PAGES, K = 2, 8, 30, 3
V = tiny.TEST_SHAPE["vocab_size"]
ORACLE_LEN = 32  # the oracle's padded length: one compile of the dense forward


def _tables(seed: int, n: int) -> list[list[int]]:
    """n block tables of W pages each, page ids 1.. shuffled (page 0 is trash)."""
    perm = np.random.default_rng(seed).permutation(np.arange(1, NUM_PAGES))
    return [perm[i * W:(i + 1) * W].tolist() for i in range(n)]


def _rollout(cfg, params, prefix: list[int], k: int) -> list[int]:  # noqa: ANN001
    seq = list(prefix)
    for _ in range(k):
        tokens = np.zeros((1, ORACLE_LEN), np.int32)
        tokens[0, :len(seq)] = seq
        logits = decoder.forward_jit(params, tokens, np.array([len(seq)], np.int32), cfg=cfg)
        seq.append(int(np.argmax(np.asarray(logits)[0, len(seq) - 1])))
    return seq[len(prefix):]


@pytest.fixture(scope="module")
def target():  # noqa: ANN201
    cfg = tiny.tiny_config(**tiny.TEST_SHAPE)
    return cfg, tiny.random_params(cfg, seed=0, scale=tiny.TEST_INIT_SCALE)


@pytest.mark.parametrize("which,impl", [pytest.param("truncated", "auto", marks=slow(
    "the draft model's round runs end to end against the rollout in the default tier "
    "(tests/serving/test_spec_draft_build.py)")), pytest.param(
    "target", "reference", marks=slow("a second draft model's compiles; the truncated case "
                                      "covers the same round"))])
def test_draft_model_rounds_equal_greedy_rollout(target, which: str, impl: str
                                                 ) -> None:  # noqa: ANN001
    tcfg, tparams = target
    # A draft truncated to the target's first layer; the target itself must propose its
    # own greedy continuation.
    cfg, params = truncated_draft(tparams, tcfg, 1) if which == "truncated" else target
    # "auto": the attention the engine runs on this platform (the C++ kernel on a CPU).
    prop = DraftModelProposer(cfg, params, NUM_PAGES, PAGE, np.float32, K,
                              [(8, 4), (16, 4)], W, select_impl(impl), target_cfg=tcfg)
    prop.warmup()
    rng = np.random.default_rng(7)
    A, B, C = (rng.integers(3, V, n).tolist() for n in (9, 6, 5))
    tA, tB, tC = _tables(1, 3)
    guard = CompileGuard()
    guard.arm()
    try:
        # Round 1: A's prefill first half; B and C whole (16 rows: the (16, 4) bucket).
        r1 = np.asarray(prop.propose(prop.pack([
            DraftSeq(A[:5], 0, tA), DraftSeq(B, 0, tB), DraftSeq(C, 0, tC)])))
        # Round 2 (6 rows: (8, 4)): A's second half; B accepted proposal 1 then a bonus
        # token unlike proposal 2 (only the bonus is caught up: proposal 1's K/V is the
        # chain's); C rejected everything (its bonus replaces proposal 1).
        bB, bC = (int(r1[1, 1]) + 1) % V, (int(r1[2, 0]) + 1) % V
        r2 = np.asarray(prop.propose(prop.pack([
            DraftSeq(A[5:], 5, tA), DraftSeq([bB], len(B) + 1, tB),
            DraftSeq([bC], len(C), tC)])))
        compiles = guard.compiles_after_warmup
    finally:
        guard.close()
    assert compiles == 0
    assert r1.shape == (4, K) and not r1[3].any()  # the padding row
    assert r1[:3].tolist() == [_rollout(cfg, params, p, K) for p in (A[:5], B, C)]
    assert r2[:3].tolist() == [_rollout(cfg, params, p, K)
                               for p in (A, B + [int(r1[1, 0]), bB], C + [bC])]


@pytest.fixture(scope="module")
def head(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    weights = random_weights(HEAD_CONFIG, seed=1)
    cfg, params = eagle3.load_eagle3(write_head(tmp_path_factory.mktemp("head"), HEAD_CONFIG,
                                                weights))
    return weights, cfg, params


def _eagle3_oracle(weights: dict, rows: list[int], aux: np.ndarray, k: int) -> list[int]:
    """Rows' tokens [R] (token at p + 1 for row p) and aux [R, 3H] -> k greedy proposals."""
    tokens, hidden = list(rows), list(aux @ weights["fc.weight"].T)
    proposals = []
    for _ in range(k):
        out, logits = reference(weights, HEAD_CONFIG, np.asarray(tokens),
                                hidden_in=np.asarray(hidden, np.float32))
        d = int(np.argmax(logits[-1]))
        proposals.append(d + int(weights["d2t"][d]))
        tokens.append(proposals[-1])
        hidden.append(out[-1])
    return proposals


@pytest.mark.parametrize("impl", [pytest.param("reference", marks=slow(
    "the engine runs the round against the dense head in the default tier "
    "(tests/serving/test_spec_eagle3_build.py)")),
    pytest.param("auto", marks=slow(
        "a second compile of the round; the draft model's case runs the platform's attention"))])
def test_eagle3_rounds_equal_dense_head(head, impl: str) -> None:  # noqa: ANN001
    weights, cfg, params = head
    T = 16
    prop = Eagle3Proposer(cfg, params, NUM_PAGES, PAGE, np.float32, K, [(T, 4)], W,
                          attn_impl=select_impl(impl))
    prop.warmup()
    rng = np.random.default_rng(3)
    # Per sequence: its tokens by position and the target's aux state of each position.
    toks = {s: rng.integers(3, V, 12).tolist() for s in "AB"}
    # Small aux states (fc output ~0.1) so the attention over earlier rows, not the hidden
    # input alone, decides the argmax: a chain step that misses a key then changes proposals.
    aux = {s: (0.1 * rng.standard_normal((12, 3 * cfg.target_hidden_size))).astype(np.float32)
           for s in "AB"}
    tables = dict(zip("AB", _tables(2, 2)))

    def round_(spans: dict[str, tuple[int, int]]) -> np.ndarray:
        """Rows [a, b) of each sequence, their aux at shuffled rows of a T-row array."""
        where = rng.permutation(T)
        flat = np.zeros((T, aux["A"].shape[1]), np.float32)
        seqs, off = [], 0
        for s, (a, b) in spans.items():
            idx = where[off:off + b - a]
            flat[idx] = aux[s][a:b]
            seqs.append(DraftSeq(toks[s][a + 1:b + 1], a, tables[s], idx.tolist()))
            off += b - a
        return np.asarray(prop.propose(prop.pack(seqs, T), jax.device_put(flat)))

    guard = CompileGuard()
    guard.arm()
    try:
        r1 = round_({"A": (0, 5), "B": (0, 6)})  # A's prefill first part; B's whole prompt
        # B: proposal 1 accepted, then a bonus unlike proposal 2; the target computed
        # positions 6 and 7, so the head re-runs rows 6 and 7 (over its chain's rows).
        toks["B"][7:9] = [int(r1[1, 0]), (int(r1[1, 1]) + 1) % V]
        r2 = round_({"A": (5, 9), "B": (6, 8)})
        compiles = guard.compiles_after_warmup
    finally:
        guard.close()
    assert compiles == 0
    assert r1[:2].tolist() == [_eagle3_oracle(weights, toks["A"][1:6], aux["A"][:5], K),
                               _eagle3_oracle(weights, toks["B"][1:7], aux["B"][:6], K)]
    assert r2[:2].tolist() == [_eagle3_oracle(weights, toks["A"][1:10], aux["A"][:9], K),
                               _eagle3_oracle(weights, toks["B"][1:9], aux["B"][:8], K)]


def test_refusals(target) -> None:  # noqa: ANN001
    tcfg, tparams = target
    other = tiny.tiny_config(**(tiny.TEST_SHAPE | {"vocab_size": 300}))
    with pytest.raises(ConfigError, match="vocab_size=300"):
        DraftModelProposer(other, None, NUM_PAGES, PAGE, np.float32, K, [(8, 4)], W,
                           target_cfg=tcfg)
    with pytest.raises(ValueError, match="does not cover"):
        pack_round([DraftSeq([5, 6, 7], 0, [3])], [(8, 4)], PAGE, W)
    with pytest.raises(ValueError, match="no row"):
        pack_round([DraftSeq([], 4, [3, 4, 5])], [(8, 4)], PAGE, W)
    with pytest.raises(ValueError, match="aux rows"):
        pack_round([DraftSeq([5], 0, [3], [1, 2])], [(8, 4)], PAGE, W, eagle3=True,
                   num_tokens=8)
    with pytest.raises(ValueError, match="num_layers=3"):
        truncated_draft(tparams, tcfg, 3)


def test_round_buckets_pair_small_seqs_with_decode_token_counts() -> None:
    engine = [(1, 1), (2, 2), (4, 4), (8, 8), (16, 8), (32, 8)]
    got = round_buckets(engine, 3)
    assert set(engine) <= set(got) and list(got) == sorted(got)
    assert {(t, s) for t, s in got if s == 1} == {(1, 1), (2, 1), (4, 1)}
    assert {(t, s) for t, s in got if s == 4} == {(4, 4), (8, 4), (16, 4)}
    # One sequence catching up 4 rows (k=3, all accepted): 4 token rows, 1 sequence row.
    rnd = pack_round([DraftSeq([5, 6, 7, 8], 0, [3, 4, 9])], got, PAGE, W)
    assert rnd.token_ids.shape == (4,) and rnd.last_rows.shape == (1,)
    assert rnd.md.slot_mapping.tolist() == [6, 7, 8, 9]
    assert rnd.md.cu_q_lens.tolist() == [0, 4] and rnd.last_rows.tolist() == [3]
