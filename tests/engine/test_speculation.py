"""Speculative decoding through the engine, on the arithmetic fake runner: proposals verified
in the ordinary step may change how many steps a request takes, never what it outputs.

Oracles: the same workload without speculation (`support.arithmetic_workload`: every stop
kind, n samples, logprobs, penalties, prompt logprobs, arrivals) and the arithmetic rollout.
The proposer is an oracle too: it knows the arithmetic continuation and proposes it right for
a chosen number of tokens, then wrong, so every acceptance length (0 .. k) is exercised;
n-gram lookup (the shipped proposer) runs on prompts that repeat. `drive` checks that no KV
page leaked. The real model's tests (samplers, grammars, compiles) are in
tests/serving/test_speculation_model.py.
"""

from __future__ import annotations

import dataclasses

import pytest
from support.arithmetic_workload import arithmetic, drive, engine_of, mixed_requests, summary
from support.engine_fixtures import VOCAB, tiny_model_config

from jaxserve import SamplingParams
from jaxserve.config import EngineConfig, SpeculativeConfig
from jaxserve.engine.fake_runner import ArithmeticRunner, arithmetic_next_token
from jaxserve.engine.sizing import (SPEC_WEIGHT_BOUND_TOKENS, SPEC_WEIGHT_BOUND_TOKENS_ACCELERATOR,
                                    plan_engine, speculative_max_running)


def ngram(k: int, **kw: object) -> SpeculativeConfig:
    """n-gram speculation; every running sequence may speculate (the workload's engines run
    at most 6) unless `disable_by_batch_size` is given."""
    return SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": k,
                                        "disable_by_batch_size": 7, **kw})


class ArithmeticProposer:
    """Proposes the arithmetic continuation, right for `good(len)` tokens, then off by one
    (so rejected) for the rest of its k."""

    def __init__(self, k: int, good: object = None):
        self.k = k
        self.good = good or (lambda n: n % (k + 2))  # 0 .. k + 1 right, by sequence length
        self.calls = 0

    def propose(self, sequences):  # noqa: ANN001, ANN201 - the Proposer protocol
        self.calls += 1
        out = []
        for tokens in sequences:
            seq, props, good = list(tokens), [], self.good(len(tokens))
            for i in range(self.k):
                t = arithmetic_next_token(seq[-1], len(seq) - 1, VOCAB)
                props.append(t if i < good else (t + 1) % VOCAB)
                seq.append(t)
            out.append(props)
        return out


def run(reqs: dict, arrive: dict | None, spec: SpeculativeConfig | None, overlap: bool,
        proposer: object = None, kv_pages: int | None = None, **cfg: object) -> tuple:
    probe = engine_of(ArithmeticRunner(VOCAB), overlap, **cfg)
    mem = None if kv_pages is None else kv_pages * probe.plan.kv_bytes_per_page
    engine = engine_of(ArithmeticRunner(VOCAB), overlap, proposer, kv_cache_memory=mem,
                       speculative_config=spec, **cfg)
    finals = drive(engine, reqs, arrive)  # (asserts no KV page leaked)
    return finals, engine.stats()


# Scheduler configurations the engine tests use: the default (prefix caching on, chunked
# prefill under a 48-token budget), tiny pages with small chunks, and a KV cache so small
# that sequences are preempted mid-speculation.
CONFIGS = {"default": {}, "tiny_pages": dict(page_size=2, max_num_batched_tokens=16),
           "preempting": dict(kv_pages=12)}


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("k", [1, 3, 5])
def test_speculation_changes_no_output(config: str, k: int) -> None:
    reqs, arrive = mixed_requests()
    cfg = dict(CONFIGS[config])
    kv_pages = cfg.pop("kv_pages", None)
    base, base_stats = run(reqs, arrive, None, True, kv_pages=kv_pages, **cfg)
    for overlap in (False, True):
        got, stats = run(reqs, arrive, ngram(k), overlap, ArithmeticProposer(k),
                         kv_pages=kv_pages, **cfg)
        assert summary(got) == summary(base), f"overlap={overlap}"
        # Every acceptance length happened, and the counters add up.
        assert all(stats.spec_acceptance_counts), stats.spec_acceptance_counts
        assert sum(stats.spec_acceptance_counts) == stats.spec_num_drafts
        assert stats.spec_num_accepted_tokens == sum(
            i * c for i, c in enumerate(stats.spec_acceptance_counts))
        assert stats.spec_num_draft_tokens <= k * stats.spec_num_drafts
        assert stats.num_steps < base_stats.num_steps
        if kv_pages is not None:
            assert stats.num_preemptions > 0


def test_greedy_stream_equals_arithmetic_rollout_and_saves_steps() -> None:
    prompt = [7, 8, 9]
    reqs = {"a": (prompt, SamplingParams(max_tokens=40, ignore_eos=True))}
    got, stats = run(reqs, None, ngram(4), True, ArithmeticProposer(4, good=lambda n: 4))
    assert got["a"].outputs[0].token_ids == arithmetic(prompt, 40)
    # All right: every proposal accepted, 5 tokens a step after the prefill's (the last
    # draft cut to what max_tokens leaves).
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens > 0
    assert stats.num_steps == 1 + -(-39 // 5)
    m = got["a"].metrics
    assert m.spec_num_draft_tokens == stats.spec_num_draft_tokens
    assert m.spec_num_accepted_tokens == stats.spec_num_accepted_tokens


def test_ngram_lookup_through_the_engine() -> None:
    """The shipped proposer. The arithmetic continuation depends only on the prompt's last
    token and length, so a prompt can quote its own output: lookups of the quoted span are
    accepted, those of the repeated filler rejected; the output is the rollout's."""
    L, last, prompts = 30, 17, {}
    for i in range(3):
        out = arithmetic([0] * (L - 1) + [last + i], 14)
        quoted = 8 - 2 * i
        prompts[f"r{i}"] = ([last + i] + out[:quoted] + [3] * (L - quoted - 2) + [last + i],
                            SamplingParams(max_tokens=14, ignore_eos=True))
    base, _ = run(prompts, None, None, True)
    got, stats = run(prompts, None, ngram(3, prompt_lookup_min=2, prompt_lookup_max=4), True)
    assert summary(got) == summary(base)
    for rid, (p, params) in prompts.items():
        assert got[rid].outputs[0].token_ids == arithmetic(p, 14), rid
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens


def test_opt_out_and_batch_backoff() -> None:
    """`SamplingParams.speculative=False` rows are never drafted for; with
    disable_by_batch_size=2 nothing speculates while two sequences run, and the long request
    speculates once it runs alone."""
    prompt = [3, 4, 5]
    reqs = {"short": (prompt, SamplingParams(max_tokens=6, ignore_eos=True)),
            "long": (prompt + [6], SamplingParams(max_tokens=20, ignore_eos=True)),
            "off": ([9, 9], SamplingParams(max_tokens=20, ignore_eos=True, speculative=False))}
    arrive = {"off": 30}  # after the others ended
    got, _ = run(reqs, arrive, ngram(2, disable_by_batch_size=2), True, ArithmeticProposer(2))
    assert got["short"].metrics.spec_num_draft_tokens == 0
    assert got["long"].metrics.spec_num_draft_tokens > 0
    assert got["off"].metrics.spec_num_draft_tokens == 0
    for rid, (p, params) in reqs.items():
        assert got[rid].outputs[0].token_ids == arithmetic(p, params.max_tokens), rid


def test_admission_keeps_sampler_rows_within_the_compiled_buckets() -> None:
    """max_num_seqs 8, k 3, back-off at 3 running: the seqs buckets stay at 8 rows, which two
    speculating sequences fill (2 x 4). Six requests arriving then are admitted only as the
    rows allow (without the cap a step of 8 sequences and 6 proposals would exceed every
    compiled bucket and fail); everything ends with the arithmetic output."""
    reqs = {f"r{i}": ([3 + i, 4, 5], SamplingParams(max_tokens=24, ignore_eos=True))
            for i in range(8)}
    arrive = {f"r{i}": 0 if i < 2 else 6 for i in range(8)}
    spec = ngram(3, disable_by_batch_size=3)
    engine = engine_of(ArithmeticRunner(VOCAB), True, ArithmeticProposer(3, lambda n: 3),
                       speculative_config=spec, max_num_seqs=8, max_num_batched_tokens=64)
    assert engine.plan.scheduler.max_num_rows == 8
    assert max(s for _, s in engine.plan.batch_shape.buckets) == 8
    got = drive(engine, reqs, arrive)
    for rid, (p, params) in reqs.items():
        assert got[rid].outputs[0].token_ids == arithmetic(p, params.max_tokens), rid
    assert got["r0"].metrics.spec_num_draft_tokens > 0


def test_aborts_and_preemption_mid_speculation_leak_no_page() -> None:
    """Requests aborted at various steps while others speculate: every page comes back
    (`drive` checks), the aborted ones report ABORT, the others are untouched."""
    reqs = {f"r{i}": ([3 + i, 4, 5], SamplingParams(max_tokens=40, ignore_eos=True))
            for i in range(6)}
    probe = engine_of(ArithmeticRunner(VOCAB), True)
    engine = engine_of(ArithmeticRunner(VOCAB), True, ArithmeticProposer(3),
                       kv_cache_memory=11 * probe.plan.kv_bytes_per_page,
                       speculative_config=ngram(3))
    for rid, (p, params) in reqs.items():
        engine.add_request(rid, p, params)
    finals, step = {}, 0
    while engine.has_unfinished():
        if step in (2, 4, 7):
            engine.abort(f"r{step % 6}")
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        step += 1
        assert step < 500
    alloc = engine.scheduler.allocator
    assert alloc.num_free_pages == alloc.num_usable_pages
    assert engine.stats().num_preemptions > 0 and engine.stats().spec_num_drafts > 0
    for rid, (p, _) in reqs.items():
        c = finals[rid].outputs[0]
        if rid in ("r2", "r4", "r1"):
            assert c.finish_reason.value == "abort"
        assert c.token_ids == arithmetic(p, len(c.token_ids)), rid


def test_default_back_off_follows_the_platform() -> None:
    """No disable_by_batch_size: the running sequences whose (k + 1)-token queries fit the
    platform's weight-bound tokens (16 on CPU, 96 on accelerators), at least 2; a step's
    sampler rows (the largest seqs bucket, and the scheduler's admission cap) are
    max_num_seqs, or (k + 1) per sequence that may speculate when that is more."""
    assert (SPEC_WEIGHT_BOUND_TOKENS, SPEC_WEIGHT_BOUND_TOKENS_ACCELERATOR) == (16, 96)
    assert speculative_max_running(3, None) == speculative_max_running(3, None, "cpu") == 5
    assert speculative_max_running(3, None, "gpu") == speculative_max_running(3, None,
                                                                              "tpu") == 25
    assert speculative_max_running(16, None) == 2  # one sequence may always speculate
    assert speculative_max_running(3, 7, "gpu") == 7  # the user's disable_by_batch_size
    spec = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    cfg = EngineConfig(speculative_config=spec, max_num_seqs=64, max_model_len=256)
    for platform, running in (("cpu", 5), ("gpu", 25)):
        plan = plan_engine(cfg, tiny_model_config(), 4, 1 << 30, platform=platform)
        assert plan.speculative_max_running == running
        rows = max(64, 4 * (running - 1))  # cpu: 64 (no wider than without), gpu: 96
        assert max(s for _, s in plan.batch_shape.buckets) == rows
        assert plan.scheduler.max_num_rows == rows
    # On CPU a step that does not speculate runs exactly the buckets it runs without a
    # speculative config (what keeps backed-off concurrency at the plain engine's speed).
    plain = plan_engine(dataclasses.replace(cfg, speculative_config=None), tiny_model_config(),
                        4, 1 << 30)
    spec_plan = plan_engine(cfg, tiny_model_config(), 4, 1 << 30)
    assert spec_plan.batch_shape.buckets == plain.batch_shape.buckets
