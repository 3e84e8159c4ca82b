"""The n-gram proposer (engine/spec_ngram.py) against a brute-force oracle and vLLM's cases.

The oracle tries every n-gram length from longest to shortest and every earlier start from
the left, in plain Python: the rule as stated, not the proposer's candidate-extension method.
The fixed cases include the expected outputs of vLLM's own tests of its NgramProposer
(tests/v1/spec_decode/test_ngram.py), so a drift from vLLM's choices fails here too.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from jaxserve.config import SpeculativeConfig
from jaxserve.engine import spec_ngram
from jaxserve.engine.spec_ngram import NgramProposer, pack, propose_ngram

# _DENSE_FRACTION values that force each search path (0: never dense; 1e9: always dense).
PATHS = {"sparse": 0, "dense": 10**9, "auto": spec_ngram._DENSE_FRACTION}


def each_path(fn):
    """fn() under each search path; their results (which must agree)."""
    saved = spec_ngram._DENSE_FRACTION
    try:
        out = {}
        for name, fraction in PATHS.items():
            spec_ngram._DENSE_FRACTION = fraction
            out[name] = fn()
        return out
    finally:
        spec_ngram._DENSE_FRACTION = saved


def oracle(tokens: list[int], k: int, min_n: int, max_n: int,
           max_model_len: int | None = None) -> list[int]:
    n = len(tokens)
    room = k if max_model_len is None else min(k, max_model_len - n)
    if n < min_n or room <= 0:
        return []
    for length in range(max_n, min_n - 1, -1):
        if length >= n:
            continue
        suffix = tokens[n - length:]
        for s in range(0, n - length):  # earlier starts only, leftmost first
            if tokens[s:s + length] == suffix:
                return tokens[s + length:s + length + room]
    return []


def one(tokens, k, min_n, max_n, max_model_len=None) -> list[int]:
    got = each_path(lambda: NgramProposer(k, min_n, max_n, max_model_len).propose([tokens])[0])
    assert got["sparse"] == got["dense"] == got["auto"], got
    return got["auto"]


# (tokens, k, min_n, max_n, expected): vLLM's test expectations first, then ours.
FIXED = [
    ([1, 2, 3, 4, 1, 2, 3, 5, 6], 2, 2, 2, []),
    ([1, 2, 3, 4, 1, 2, 3], 3, 2, 2, [4, 1, 2]),
    ([1, 2, 3, 4, 1, 2, 3], 2, 2, 2, [4, 1]),
    ([1, 2, 3, 4, 1, 2, 3], 3, 1, 1, [4, 1, 2]),
    ([1, 3, 6, 2, 3, 4, 1, 2, 3], 3, 2, 2, [4, 1, 2]),
    ([1, 3, 6, 2, 3, 4, 1, 2, 3], 2, 1, 1, [6, 2]),        # the first match
    ([1, 2, 3, 4, 5], 2, 2, 2, []),                        # no match
    ([1, 2, 3, 4, 1, 2, 3], 2, 4, 4, []),                  # no 4-gram
    ([1, 2, 3, 4, 1, 2, 3], 2, 3, 4, [4, 1]),              # 3-gram
    ([2, 3, 4, 5, 1, 2, 3, 4, 1, 2, 3, 4], 2, 3, 4, [1, 2]),  # the 4-gram, not [5, 1]
    ([3, 4, 5, 2, 3, 4, 1, 2, 3, 4], 2, 2, 4, [1, 2]),     # the 3-gram, not [5, 2]
    ([1, 2, 3, 100, 1, 2, 3, 200, 1, 2, 3, 300, 1, 2, 3], 2, 3, 3, [100, 1]),
    ([1, 2, 3, 4, 2, 3], 4, 2, 3, [4, 2, 3]),              # vLLM's docstring example
    # Ours: match at the very start; a repeated-token run matches itself (overlapping,
    # earliest start, capped by the end); k truncated by the end; short sequences.
    ([7, 8, 9, 1, 7, 8], 3, 2, 2, [9, 1, 7]),
    ([5, 5, 5, 5, 5], 5, 2, 3, [5, 5]),                    # test_repeated_run_self_match
    ([4, 4], 3, 1, 3, [4]),
    ([4], 3, 1, 3, []),
    ([], 3, 1, 3, []),
    ([1, 2], 3, 3, 5, []),
    ([9, 1, 2, 9, 1], 5, 1, 2, [2, 9, 1]),                 # k truncated by the end
]


@pytest.mark.parametrize("tokens,k,min_n,max_n,want", FIXED)
def test_fixed_cases(tokens, k, min_n, max_n, want) -> None:
    assert oracle(tokens, k, min_n, max_n) == want
    assert one(tokens, k, min_n, max_n) == want


def test_repeated_run_self_match() -> None:
    # [5]*5, L=3: suffix t[2:5]; earliest earlier start s=0 (overlapping it); proposal
    # t[3:3+k] capped by the end: two tokens.
    assert one([5] * 5, 5, 2, 3) == [5, 5]


def test_max_model_len_caps_and_stops() -> None:
    t = [1, 2, 3, 1, 2, 3, 1, 2]
    assert one(t, 3, 2, 2) == [3, 1, 2]
    assert one(t, 3, 2, 2, max_model_len=10) == [3, 1]
    assert one(t, 3, 2, 2, max_model_len=8) == []
    assert one(t, 3, 2, 2, max_model_len=5) == []


def test_from_config_and_batch_padding() -> None:
    spec = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2,
                                        "prompt_lookup_max": 2})
    p = NgramProposer.from_config(spec, max_model_len=100)
    assert (p.k, p.min_n, p.max_n) == (2, 2, 2)
    # Padding past num_tokens is never read: fill it with the tokens that would match.
    ids, n = pack([[1, 2, 3, 1, 2], [6, 6]], width=8)
    ids[0, 5:] = [3, 1, 2]
    ids[1, 2:] = 6
    drafts, counts = p.propose_arrays(ids, n)
    assert counts.tolist() == [2, 0] and drafts[0].tolist() == [3, 1]
    assert drafts[1].tolist() == [0, 0]
    with pytest.raises(ValueError, match="needs method 'ngram'"):
        NgramProposer.from_config(SpeculativeConfig("draft_model", 2, model="m"), 10)
    with pytest.raises(ValueError, match="num_tokens"):
        propose_ngram(ids, np.array([9, 1]), k=2, min_n=1, max_n=2)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(seqs=st.lists(st.lists(st.integers(0, 3), max_size=40), min_size=1, max_size=6),
       k=st.integers(1, 6), min_n=st.integers(1, 4), extra=st.integers(0, 3),
       cap=st.one_of(st.none(), st.integers(0, 45)))
def test_matches_oracle(seqs, k, min_n, extra, cap) -> None:
    max_n = min_n + extra
    want = [oracle(s, k, min_n, max_n, cap) for s in seqs]
    for path, got in each_path(lambda: NgramProposer(k, min_n, max_n, cap).propose(seqs)).items():
        assert got == want, path


@settings(max_examples=40, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**31 - 1), vocab=st.integers(2, 50))
def test_matches_oracle_long(seed, vocab) -> None:
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(0, vocab, int(rng.integers(0, 300))).tolist() for _ in range(8)]
    # Copy a span forward in some rows, as a summary quoting its prompt would.
    for s in seqs[::2]:
        if len(s) > 20:
            a = int(rng.integers(0, len(s) - 10))
            s.extend(s[a:a + int(rng.integers(3, 10))])
    want = [oracle(s, 5, 2, 5) for s in seqs]
    for path, got in each_path(lambda: NgramProposer(5, 2, 5).propose(seqs)).items():
        assert got == want, path
