"""Speculative decoding on the tiny real model: greedy equals the plain rollout, sampling keeps
the target's distribution, and nothing compiles after warmup.

Oracles: the plain full-sequence greedy rollout (`rollout`); the same requests without
speculation (seeded sampling draws output token i with the key (seed, i) whatever the step
that samples it, so a seeded request's tokens are the same with or without speculation); a
chi-square test of the first two sampled tokens' joint frequencies over independent draws,
with and without speculation. The proposers are oracles: `ReplayProposer` proposes the
tokens a reference run produced, right for a while then wrong, so acceptance and rejection
both happen at every temperature; n-gram lookup runs on a prompt that repeats itself.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import pytest
from support.engine_fixtures import (FEW_TOKEN_BUCKETS, rollout, run_checked, tiny_engine,
                                     tiny_model)
from support.tiers import run_slow, slow

from jaxserve import SamplingParams
from jaxserve.config import SpeculativeConfig
from jaxserve.engine.engine import Engine
from jaxserve.engine.spec_ngram import NgramProposer
from jaxserve.engine.sequence import FinishReason
from jaxserve.engine.speculation import OnTokens


def ngram(k: int, **kw: object) -> SpeculativeConfig:
    return SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": k, **kw})


class ReplayProposer:
    """Proposes what `reference` (full token lists: prompt + output) continues a sequence
    with, right for `good(n)` tokens (n: the sequence's length), then off by one."""

    def __init__(self, reference: list[list[int]], k: int, vocab: int, good: object = None):
        self.reference, self.k, self.vocab = reference, k, vocab
        self.good = good or (lambda n: n % (k + 2))

    def propose(self, sequences):  # noqa: ANN001, ANN201 - the Proposer protocol
        out = []
        for tokens in sequences:
            n, props = len(tokens), []
            for ref in self.reference:
                if len(ref) > n and ref[:n] == list(tokens):
                    good = self.good(n)
                    props = [t if i < good else (t + 1) % self.vocab
                             for i, t in enumerate(ref[n:n + self.k])]
                    break
            out.append(props)
        return out


def engine(spec: SpeculativeConfig | None = None, proposer: object = None,
           **cfg: object) -> Engine:
    eng = tiny_engine(speculative_config=spec, **cfg)
    if proposer is not None:  # the oracle in place of the config's n-gram lookup
        eng._core.speculator.proposer = OnTokens(proposer)  # type: ignore[union-attr]
    return eng


# One engine without speculation and one with, shared by the module's default-tier tests
# (each build compiles every bucket: two token buckets, as the device workers use):
# chunked prefill (16 sequences, 64-token steps), pages of 4, prefix caching on; every
# running sequence may speculate (disable_by_batch_size 17).
SHARED = dict(max_num_seqs=16, max_num_batched_tokens=64, page_size=4, max_model_len=96,
              token_buckets=FEW_TOKEN_BUCKETS)
SPEC = ngram(3, prompt_lookup_min=2, prompt_lookup_max=3, disable_by_batch_size=17)


@pytest.fixture(scope="module")
def plain() -> Engine:
    return engine(**SHARED)


@pytest.fixture(scope="module")
def spec_engine() -> Engine:
    return engine(SPEC, **SHARED)


@pytest.fixture
def speculating(spec_engine: Engine):  # noqa: ANN201
    """The shared speculating engine; a test may swap its proposer (`use`), put back after.
    (`run` checks that nothing compiled since warmup: the guard counts the whole process's
    compiles, the oracles' included, so the check comes before any oracle runs.)"""
    spec = spec_engine._core.speculator
    ngram_proposer = spec.proposer  # type: ignore[union-attr]

    def use(proposer: object) -> Engine:
        spec.proposer = OnTokens(proposer)  # type: ignore[union-attr]
        return spec_engine

    yield use
    spec.proposer = ngram_proposer  # type: ignore[union-attr]


def test_ngram_greedy_equals_rollout_with_zero_compiles(speculating) -> None:  # noqa: ANN001
    eng = speculating(None)
    eng._core.speculator.proposer = OnTokens(NgramProposer.from_config(SPEC, 96))
    _ngram_greedy(eng)


@pytest.mark.parametrize("k,cfg", [
    pytest.param(1, dict(kv_cache_memory_pages=14, page_size=4), marks=slow(
        "k=1 under preemption: the fake runner's tests cover every k and preemption")),
    pytest.param(5, dict(), marks=slow(
        "k=5 on the default configuration: the fake runner's tests cover every k")),
])
def test_ngram_greedy_other_k(k: int, cfg: dict) -> None:
    # Every running sequence may speculate (the default back-off, 3 running at k = 5, would
    # keep these 4 prompts from speculating at all).
    spec = ngram(k, prompt_lookup_min=2, prompt_lookup_max=3, disable_by_batch_size=17)
    pages = cfg.pop("kv_cache_memory_pages", None)
    eng = engine(spec, max_model_len=96, **cfg)
    if pages is not None:
        eng = engine(spec, max_model_len=96, kv_cache_memory=pages * eng.plan.kv_bytes_per_page,
                     **cfg)
    _ngram_greedy(eng)
    if pages is not None:
        assert eng.stats().num_preemptions > 0


def _ngram_greedy(eng: Engine) -> None:
    """Prompts that repeat, so lookups match: greedy equals the rollout; nothing compiles."""
    model = tiny_model()
    base = [5, 6, 7, 8, 9, 10]
    prompts = [base * 3 + base[:2 + i] for i in range(4)]
    drafts = eng.stats().spec_num_draft_tokens
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * len(prompts)
    finals = run_checked(eng, prompts, params)
    for i, p in enumerate(prompts):
        assert finals[f"r{i}"].outputs[0].token_ids == rollout(model, p, 24), f"prompt {i}"
    assert eng.stats().spec_num_draft_tokens > drafts


def test_seeded_sampling_token_for_token_with_every_transform(plain, speculating
                                                               ) -> None:  # noqa: ANN001
    """Temperature, top-p / top-k / min-p, penalties, logit bias, logprobs: a seeded request
    samples the same tokens, with the same logprobs, with or without speculation (each
    verified position draws with its output index's key), while proposals are accepted and
    rejected."""
    prompts = [[3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13, 14]]
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=1, max_tokens=20, logprobs=2,
                             ignore_eos=True),
              SamplingParams(temperature=0.7, top_k=20, min_p=0.05, seed=2, max_tokens=20,
                             repetition_penalty=1.3, frequency_penalty=0.4, ignore_eos=True),
              SamplingParams(temperature=1.2, seed=3, max_tokens=20, logit_bias={7: 3.0},
                             presence_penalty=0.5, logprobs=1, ignore_eos=True)]
    base = run_checked(plain, prompts, params)
    reference = [p + base[f"r{i}"].outputs[0].token_ids for i, p in enumerate(prompts)]
    eng = speculating(ReplayProposer(reference, 3, tiny_model().config.vocab_size))
    before = eng.stats()
    got = run_checked(eng, prompts, params)
    stats = eng.stats()
    accepted = stats.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    assert 0 < accepted < stats.spec_num_draft_tokens - before.spec_num_draft_tokens
    for rid in base:
        a, b = got[rid].outputs[0], base[rid].outputs[0]
        assert a.token_ids == b.token_ids, rid
        if b.logprobs:
            for x, y in zip(a.logprobs, b.logprobs):
                assert x.keys() == y.keys()
                np.testing.assert_allclose(list(x.values()), list(y.values()), atol=2e-4)


class ModeProposer:
    """After a sampled first token t1, proposes the commonest (t2, t3) that followed t1 in
    a reference run: often right, often not."""

    def __init__(self, prompt_len: int, modes: dict):
        self.prompt_len, self.modes = prompt_len, modes

    def propose(self, sequences):  # noqa: ANN001, ANN201 - the Proposer protocol
        return [list(self.modes.get(s[self.prompt_len], ())) if len(s) == self.prompt_len + 1
                else [] for s in sequences]


def _draws(eng: Engine, prompt: list[int], params: SamplingParams, seeds: range
           ) -> list[tuple[int, ...]]:
    for s in seeds:
        eng.add_request(f"s{s}", prompt, dataclasses.replace(params, seed=s))
    draws, compiles = [], eng.runner.compiles_after_warmup
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                draws.append(tuple(out.outputs[0].token_ids))
    assert eng.runner.compiles_after_warmup == compiles, "compiled after warmup"
    return draws


def test_sampled_distribution_matches_without_speculation(plain, speculating
                                                          ) -> None:  # noqa: ANN001
    """Temperature 1 with top-p 0.95: the frequencies of the 2nd and of the 3rd token over N
    independent draws with speculation (after the 1st token, the commonest continuation of
    a reference run is proposed: accepted or not at random) and N without (other seeds)
    pass a chi-square two-sample test each.

    The statistic over the tokens drawn >= 5 times in both runs (the rest pooled into one
    cell) is chi2 with (cells - 1) degrees of freedom when both come from one distribution;
    the bound is its 0.999 quantile (a false failure about once in a thousand seed sets for
    each of the two; the seeds are fixed, so the test is deterministic). It can fail: a
    verifier that accepted every proposal would give the proposed tokens far more than
    their probability."""
    from scipy.stats import chi2

    prompt = [20, 21, 22]
    # 4 tokens: both proposals fit (a row of 1 + j tokens emits up to j + 1 <= max_tokens).
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=4, ignore_eos=True)
    N = 4000 if run_slow() else 1200
    reference = _draws(plain, prompt, params, range(2 * N, 3 * N))
    follow: dict = collections.defaultdict(collections.Counter)
    for t in reference:
        follow[t[0]][t[1:]] += 1
    modes = {t1: c.most_common(1)[0][0] for t1, c in follow.items()}
    base = _draws(plain, prompt, params, range(N))
    eng = speculating(ModeProposer(len(prompt), modes))
    before = eng.stats()
    spec = _draws(eng, prompt, params, range(N, 2 * N))
    stats = eng.stats()
    drafts = stats.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = stats.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    assert drafts > N and 0 < accepted < drafts, (drafts, accepted)
    for pos in (1, 2):
        a_count = collections.Counter(t[pos] for t in base)
        b_count = collections.Counter(t[pos] for t in spec)
        cells = [c for c in set(a_count) | set(b_count) if a_count[c] >= 5 and b_count[c] >= 5]
        table = np.array([[a_count[c] for c in cells] + [N - sum(a_count[c] for c in cells)],
                          [b_count[c] for c in cells] + [N - sum(b_count[c] for c in cells)]],
                         float)
        table = table[:, table.sum(0) > 0]
        expected = table.sum(0, keepdims=True) * table.sum(1, keepdims=True) / table.sum()
        stat = float(((table - expected) ** 2 / expected).sum())
        dof = table.shape[1] - 1
        assert dof >= 5, f"token {pos}: too few cells ({cells})"
        assert stat < chi2.ppf(0.999, dof), (pos, stat, dof)


def test_stop_string_and_eos_inside_an_accepted_run(plain, speculating
                                                    ) -> None:  # noqa: ANN001
    """A stop string, a stop token id and max_tokens that fall inside a run of accepted
    proposals end the output exactly where the non-speculative engine ends it."""
    model = tiny_model()
    prompt = [30, 31, 32, 33]
    out = rollout(model, prompt, 16)
    tok = model.tokenizer
    cases = [SamplingParams(temperature=0.0, max_tokens=16, stop=[tok.decode([out[6]]).strip()],
                            ignore_eos=True),
             SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[out[5]],
                            ignore_eos=True),
             SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)]
    base = run_checked(plain, [prompt] * 3, cases)
    eng = speculating(ReplayProposer([prompt + out], 3, model.config.vocab_size,
                                     good=lambda n: 3))
    got = run_checked(eng, [prompt] * 3, cases)
    for rid in base:
        a, b = got[rid].outputs[0], base[rid].outputs[0]
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
    assert got["r2"].outputs[0].finish_reason is FinishReason.LENGTH
    assert len(got["r2"].outputs[0].token_ids) == 7
