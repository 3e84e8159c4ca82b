"""Batch-invariant mode (`EngineConfig.batch_invariant`) through the real engine on the tiny
random model: a request's token ids, logprobs and prompt logprobs are bit-identical alone
and in a crowd.

Oracle: each request run alone, one after another, on an engine in the mode without prefix
caching (prompts chunked at 32 tokens from position 0). The crowd: the same requests together, greedy and seeded mixed, on an
engine whose step budget chunks every prompt at other boundaries than alone, whose prompts
share a 24-token prefix (prefix-cache hits), and whose KV pages are too few for them all
(preemption, then recompute); slow tier: with n-gram speculation (proposals verified as
1 + k rows), and on the fixed-shape path the mode takes on accelerators (jnp reference
attention and XLA's dot, one step shape) run on CPU. Each run asserts that what it claims happened
(chunks, hits, preemptions, drafts) did.

Without the mode, on this CPU host the generated tokens and their logprobs already are
invariant (issue #33 made the CPU kernels row invariant); what differs is the prompt
logprobs' log_softmax (XLA fuses it with the LM head into a sum ordered by the number of
scored positions), shown at the function (tests/device/test_invariant_logprobs.py), and the
reference attention / XLA dot at varying bucket shapes (slow tier here).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from support.engine_fixtures import tiny_engine, tiny_model
from support.tiers import slow

from jaxserve.config import EngineConfig, SpeculativeConfig
from jaxserve.engine.engine import Engine
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.serving import batch_invariant

PAGE = 8
KV_BYTES_PER_PAGE = 2 * 2 * 2 * 8 * 4 * PAGE  # layers x (K, V) x kv heads x head dim x f32
N = 8
# Every engine here has the same KV array and (but the fixed-shape ones) buckets, so they
# share their compiled steps: jit's cache keys on shapes, not on the engine.
BASE = dict(max_num_seqs=4, page_size=PAGE, max_model_len=128, attention_impl="cpu",
            batch_invariant=True, token_buckets=(8, 32), max_num_batched_tokens=32,
            kv_cache_memory=22 * KV_BYTES_PER_PAGE)


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(7)
    prefix = [int(t) for t in rng.integers(3, 200, 24)]  # 3 pages shared by every prompt
    return [prefix + [int(t) for t in rng.integers(3, 200, int(n))]
            for n in rng.integers(6, 36, N)]


def _params(i: int) -> SamplingParams:
    """Even requests greedy, odd ones seeded sampling; logprobs; prompt logprobs for half of
    them (a request with prompt logprobs skips the prefix cache, so the others hit it)."""
    return SamplingParams(temperature=0.0 if i % 2 == 0 else 0.9, top_p=1.0 if i % 2 == 0
                          else 0.95, seed=None if i % 2 == 0 else 1000 + i, max_tokens=14,
                          ignore_eos=True, logprobs=3, prompt_logprobs=2 if i % 4 < 2 else None)


Result = tuple[list[int], list, list]


def _run(eng: Engine, idx: list[int], prompts: list[list[int]]) -> dict[int, Result]:
    for i in idx:
        eng.add_request(f"r{i}", prompts[i], _params(i))
    out = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                c = o.outputs[0]
                out[int(o.request_id[1:])] = (list(c.token_ids), [sorted(d.items()) for d in
                                              c.logprobs], [None if d is None else sorted(
                                                  d.items()) for d in o.prompt_logprobs or []])
    alloc = eng.scheduler.allocator
    assert alloc.num_free_pages == alloc.num_usable_pages, "KV pages leaked"
    return out


def _assert_same(want: dict[int, Result], got: dict[int, Result]) -> None:
    for i in sorted(want):
        for what, a, b in zip(("token ids", "logprobs", "prompt logprobs"), want[i], got[i]):
            assert a == b, f"request {i} ({'greedy' if i % 2 == 0 else 'seeded'}): {what} " \
                           f"differ in a crowd from alone"


@pytest.fixture(scope="module")
def alone() -> dict[int, Result]:
    """Each request alone on a mode engine without prefix caching (prompts in 32-token
    chunks from position 0)."""
    eng = tiny_engine(tiny_model(), **(BASE | dict(enable_prefix_caching=False)))
    try:
        prompts = _prompts()
        out: dict[int, Result] = {}
        for i in range(N):
            out |= _run(eng, [i], prompts)
        return out
    finally:
        eng.close()


def test_crowd_chunks_prefix_hits_preemption(alone: dict[int, Result]) -> None:
    # 32-token steps, 16 with decodes: every prompt (30-60 tokens) is chunked, at boundaries
    # that depend on its neighbours; 22 pages for 4 running sequences of up to 10 pages each.
    eng = tiny_engine(tiny_model(), **(BASE | dict(decode_token_budget=16)))
    try:
        got = _run(eng, list(range(N)), _prompts())
        stats = eng.stats()
    finally:
        eng.close()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0, stats
    _assert_same(alone, got)


@slow(reason="its own sampler-row buckets: ~35 s of compiles on the 2-core host")
def test_ngram_speculation(alone: dict[int, Result]) -> None:
    """Proposals verified as rows of 1 + k queries give every request the tokens and
    logprobs it has alone without speculation, greedy and seeded (a verified position
    draws with the key its decode would)."""
    spec = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3,
                                        "prompt_lookup_min": 1, "disable_by_batch_size": 5})
    eng = tiny_engine(tiny_model(), **(BASE | dict(speculative_config=spec)))
    try:
        got = _run(eng, list(range(N)), _prompts())
        stats = eng.stats()
    finally:
        eng.close()
    assert stats.spec_num_drafts > 0, stats
    _assert_same(alone, got)


@slow(reason="three engines of another kernel path: ~40 s")
def test_fixed_shape_path() -> None:
    """The accelerators' path (no row-invariant kernels: jnp reference attention and XLA's
    dot), run on CPU: the mode compiles one step shape and runs the reference as
    'reference_invariant' (decodes in prefill tiles), and the crowd (chunks, prefix hits,
    preemption) and n-gram speculation match alone."""
    eng = tiny_engine(tiny_model(), **(BASE | dict(
        attention_impl="reference", dense_impl="xla", token_buckets=None)))
    try:
        assert eng.runner.shape.buckets == ((32, 4),)
        assert eng.runner.attn_impl == "reference_invariant"
        got = _run(eng, list(range(N)), _prompts())
        stats = eng.stats()
        assert stats.prefix_cache_hits > 0 and stats.num_preemptions > 0, stats
    finally:
        eng.close()
    spec = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3,
                                        "prompt_lookup_min": 1, "disable_by_batch_size": 5})
    eng = tiny_engine(tiny_model(), **(BASE | dict(
        attention_impl="reference", dense_impl="xla", token_buckets=None,
        speculative_config=spec)))
    try:
        got_spec = _run(eng, list(range(N)), _prompts())
        assert eng.stats().spec_num_drafts > 0
    finally:
        eng.close()
    # Another kernel path than the oracle's: its bits differ; alone on it is the oracle.
    eng = tiny_engine(tiny_model(), **(BASE | dict(
        attention_impl="reference", dense_impl="xla", token_buckets=None,
        kv_cache_memory=None, enable_prefix_caching=False)))
    try:
        want: dict[int, Result] = {}
        for i in range(N):
            want |= _run(eng, [i], _prompts())
    finally:
        eng.close()
    _assert_same(want, got)
    _assert_same(want, got_spec)


@slow(reason="one more engine (its sampler and prompt logprobs compiles); the default tier "
             "shows the prompt logprobs' difference at the function: tests/device/"
             "test_invariant_logprobs.py")
def test_default_mode_tokens_invariant_on_cpu() -> None:
    """Without the mode, a crowd on the CPU kernels keeps the generated tokens and their
    logprobs (the kernels are row invariant by default since issue #33): on this host the
    mode changes the prompt logprobs' sum order (whose default order differs with the
    number of scored positions, shown in tests/device/test_invariant_logprobs.py) and what
    it refuses or fixes on the other kernel paths. (Its logprobs' bits differ from the
    mode's: another log_softmax.)"""
    eng = tiny_engine(tiny_model(), **(BASE | dict(batch_invariant=False)))
    try:
        prompts = _prompts()
        want: dict[int, Result] = {}
        for i in range(N):
            want |= _run(eng, [i], prompts)
        got = _run(eng, list(range(N)), prompts)
    finally:
        eng.close()
    assert all(got[i][:2] == want[i][:2] for i in range(N))


@slow(reason="two more engines: the reference attention and XLA's dot at the default "
             "bucket shapes, without the mode")
def test_default_mode_fixed_shape_path_differs() -> None:
    cfg = BASE | dict(attention_impl="reference", dense_impl="xla", batch_invariant=False,
                      enable_prefix_caching=False, token_buckets=(1, 2, 4, 8, 16, 32))
    prompts = _prompts()
    eng = tiny_engine(tiny_model(), **cfg)
    try:
        want: dict[int, Result] = {}
        for i in range(N):
            want |= _run(eng, [i], prompts)
        got = _run(eng, list(range(N)), prompts)
    finally:
        eng.close()
    assert any(got[i][1] != want[i][1] for i in range(N))


def test_refusals() -> None:
    with pytest.raises(ValueError, match="batch_invariant"):
        EngineConfig(batch_invariant="yes")  # type: ignore[arg-type]
    for impl in batch_invariant.REFUSED_ATTENTION:
        with pytest.raises(ValueError, match=f"attention_impl='{impl}'"):
            batch_invariant.attention_impl(EngineConfig(attention_impl=impl,
                                                        batch_invariant=True), impl)
    auto = EngineConfig(batch_invariant=True)
    assert batch_invariant.attention_impl(auto, "pallas_gpu") == "reference_invariant"
    assert batch_invariant.attention_impl(auto, "reference") == "reference_invariant"
    assert batch_invariant.attention_impl(auto, "cpu") == "cpu"
    moe = dataclasses.replace(tiny_model().config.uniform_spec(), moe=__import__(
        "jaxserve.models.config", fromlist=["MoESpec"]).MoESpec(4, 2, 16, True))
    cfg = dataclasses.replace(tiny_model().config, per_layer=(moe, moe))
    with pytest.raises(ValueError, match="mixture-of-experts"):
        batch_invariant.check_model(auto, cfg)
    with pytest.raises(ValueError, match="token_buckets"):
        tiny_engine(tiny_model(), warmup=False, **(BASE | dict(
            attention_impl="reference", dense_impl="xla")))

