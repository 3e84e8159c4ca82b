"""The engine end to end on tiny random models, against the plain full-sequence rollout.

Greedy outputs must not depend on how the scheduler cut and packed the work: chunk size,
page size, batch neighbours, preemption, prefix caching, arrival times, aborts. The same
invariants hold for the Gemma family (Gemma 2's soft-caps, Gemma 3's qk-norm and two rope
bases, Gemma 4's wider global heads with K = V and one global KV head, and its per-layer
embeddings with K/V shared across layers, all with sliding windows of 4 tokens that every
prompt outgrows), checked against transformers' greedy
`generate` on the checkpoint jaxserve loads.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from support.engine_fixtures import (few_token_buckets, mixed_layer_model, rollout, tiny_engine,
                                     tiny_model)
from support.hf_models import GEMMA_ARCHS, GEMMA_WINDOW
from support.numerics import gamma
from support.tiers import run_slow, slow, split_tiers

from jaxserve import SamplingParams
from jaxserve.engine.sequence import FinishReason

MODEL = tiny_model()


@functools.lru_cache(maxsize=None)
def expected(prompt: tuple[int, ...], n: int) -> list[int]:
    return rollout(MODEL, list(prompt), n)


def make_prompts(seed: int, count: int, shared_prefix: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    prefix = [int(x) for x in rng.integers(3, 211, shared_prefix)]
    return [prefix + [int(x) for x in rng.integers(3, 211, int(rng.integers(1, 60)))]
            for _ in range(count)]


def run_all(engine, prompts, max_tokens, arrive_every: int = 0, abort: dict | None = None,
            params: SamplingParams | None = None) -> dict:
    """Drive the engine; prompt i arrives at step i * arrive_every; abort maps id -> step."""
    params = params or SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    pending = list(enumerate(prompts))
    finals = {}
    step = 0
    while pending or engine.has_unfinished():
        while pending and pending[0][0] * arrive_every <= step:
            i, p = pending.pop(0)
            engine.add_request(f"r{i}", p, params)
        for rid, at in (abort or {}).items():
            if at == step:
                engine.abort(rid)
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        step += 1
        assert step < 5000
    return finals


# The C++ CPU kernel (the CPU default, impl 'cpu') on every case; the jnp reference (what a
# host without a compiler runs) on one. Where the kernel cannot be built, 'cpu' runs the
# reference too (kernels_pallas.select_impl).
@pytest.mark.parametrize("budget,page_size,caching,kv_pages,arrive,impl", [
    (16, 8, False, None, 0, "cpu"),        # chunks of 16 cut prompts mid-page
    (16, 8, False, None, 0, "reference"),
    (24, 16, True, None, 2, "cpu"),        # staggered arrivals, prefix cache on
    (64, 32, True, 9, 0, "cpu"),           # little KV: preemptions
    (512, 8, False, 40, 1, "cpu"),         # one big step per prefill, preemptions
    (40, 16, True, None, 0, "cpu"),
])
def test_greedy_equals_rollout(budget, page_size, caching, kv_pages, arrive, impl) -> None:
    prompts = make_prompts(seed=budget + page_size, count=10, shared_prefix=20)
    max_seqs = min(6, budget)
    kv_mem = None
    eng = tiny_engine(max_num_batched_tokens=budget, max_num_seqs=max_seqs, page_size=page_size,
                      enable_prefix_caching=caching, max_model_len=128, attention_impl=impl,
                      warmup=kv_pages is None)  # only its plan is read when it is rebuilt
    if kv_pages is not None:
        kv_mem = kv_pages * eng.plan.kv_bytes_per_page
        eng = tiny_engine(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                          page_size=page_size, enable_prefix_caching=caching, max_model_len=128,
                          kv_cache_memory=kv_mem, attention_impl=impl)
    finals = run_all(eng, prompts, max_tokens=16, arrive_every=arrive)
    compiles = eng.runner.compiles_after_warmup  # before the oracle compiles anything
    for i, p in enumerate(prompts):
        got = finals[f"r{i}"].outputs[0]
        assert got.finish_reason is FinishReason.LENGTH
        assert got.token_ids == expected(tuple(p), 16), f"prompt {i}"
    if kv_pages is not None:
        assert eng.scheduler.num_preemptions > 0
    if caching:
        assert eng.scheduler.allocator.prefix_hits > 0
    assert compiles == 0
    assert eng.scheduler.allocator.num_free_pages == eng.scheduler.allocator.num_usable_pages


@pytest.mark.parametrize("budget,page_size,caching,kv_pages,impl", [
    # chunked prefill, prefix hits, the C++ kernel (the Gemma tests below run it too)
    pytest.param(16, 8, True, None, "cpu", marks=slow("the mixed-layer model's chunked-"
                                                      "prefix case: the Gemma tests run it")),
    # tiny pages, preemptions, the jnp reference (Gemma 4's shared-KV model runs it below)
    pytest.param(64, 4, False, 30, "reference", marks=slow(
        "the mixed-layer model under preemption: the Gemma 4 engine test runs it")),
])
def test_mixed_layer_model_greedy_equals_rollout(budget, page_size, caching, kv_pages,
                                                 impl) -> None:
    model = mixed_layer_model(tokenizer=MODEL.tokenizer)
    prompts = make_prompts(seed=3, count=6, shared_prefix=20)
    kw = dict(max_num_batched_tokens=budget, max_num_seqs=4, page_size=page_size,
              enable_prefix_caching=caching, max_model_len=128, attention_impl=impl)
    eng = tiny_engine(model, warmup=kv_pages is None, **kw)
    if kv_pages is not None:
        # kv_pages pages per block table: the model has a table per KV group, each page id
        # a page in each of a group's layer slots.
        eng = tiny_engine(model, kv_cache_memory=kv_pages * eng.plan.batch_shape.num_kv_groups
                          * eng.plan.kv_bytes_per_page, **kw)
    finals = run_all(eng, prompts, max_tokens=12)
    compiles = eng.runner.compiles_after_warmup
    for i, p in enumerate(prompts):
        assert finals[f"r{i}"].outputs[0].token_ids == rollout(model, p, 12), f"prompt {i}"
    if kv_pages is not None:
        assert eng.scheduler.num_preemptions > 0
    if caching:
        assert eng.scheduler.allocator.prefix_hits > 0
    assert compiles == 0


# Gemma 4: the K = V model (padded narrower layers, repeated KV heads in the pages) and the
# per-layer-embedding one with KV shared across layers (reading the storing layer's pages).
@pytest.fixture(scope="module", params=[*sorted(GEMMA_ARCHS), "gemma4_kv", "gemma4_ple"])
def gemma(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """(arch, the loaded checkpoint, the transformers model it was saved from)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from support.hf_models import build_gemma_model

    from jaxserve.models import loading

    d = tmp_path_factory.mktemp(request.param)
    hf_model = build_gemma_model(request.param, d)
    return request.param, loading.load_model(d), hf_model


# Chunked prefill with prefix hits on the C++ kernel; tiny pages with preemptions on the
# reference, here in chunks of 16 tokens too, with page ids just over what one sequence can
# need over its block tables (a global one and the sliding ones, which hold their window and
# two chunks): the sliding groups free what leaves the window, so the mixed-layer test's
# budget would hold every prompt at once and nothing would be preempted.
# Default tier: Gemma 3 through the C++ kernel with prefix hits, and Gemma 4's shared-KV
# model under preemption (its layers reading other layers' pages); the slow tier runs all.
# Two token buckets (a decode bucket and the whole chunk): the family's numerics and the
# paging are what is checked here, the bucket set in test_buckets and the rollout tests above.
_GEMMA_DEFAULT_TIER = {("gemma3", "cpu"), ("gemma4_ple", "reference")}


@pytest.mark.parametrize("budget,page_size,caching,kv_pages,impl", [
    (16, 8, True, None, "cpu"),
    (16, 4, False, 36, "reference"),
], ids=["chunked-prefix-cpu", "tiny-pages-preempt-reference"])
def test_gemma_greedy_equals_transformers_generate(gemma, budget, page_size, caching,  # noqa: ANN001
                                                   kv_pages, impl) -> None:
    from support.hf_models import hf_greedy

    arch, model, hf_model = gemma
    if (arch, impl) not in _GEMMA_DEFAULT_TIER and not run_slow():
        pytest.skip("slow test (the other Gemma cases through the engine; tests/models runs "
                    "each family's greedy through LLM): set JAXSERVE_RUN_SLOW=1 to run it")
    assert {s.sliding_window for s in model.config.layer_specs} == {GEMMA_WINDOW, None}
    prompts = make_prompts(seed=5, count=5, shared_prefix=20)
    assert min(map(len, prompts)) > 4 * GEMMA_WINDOW  # every prompt spans several windows
    n = 8
    kw = dict(max_num_batched_tokens=budget, max_num_seqs=4, page_size=page_size,
              enable_prefix_caching=caching, max_model_len=128, attention_impl=impl,
              token_buckets=few_token_buckets(budget))
    eng = tiny_engine(model, warmup=kv_pages is None, **kw)
    if kv_pages is not None:
        # Just over what the longest sequence holds at once (a model with more KV groups,
        # e.g. Gemma 4's shared-KV layers leaving 3 sliding tables, needs more page ids).
        total = max(map(len, prompts)) + n
        full = -(-total // page_size)
        groups = eng.plan.scheduler.kv_groups
        # (limits.check_request's rule: a sliding group holds its window and two chunks)
        one = sum(full if w is None else min(full, -(-(w - 1 + 2 * budget) // page_size) + 1)
                  for w in (groups.windows if groups else (None,)))
        kv_pages = max(kv_pages, one + 2)
        eng = tiny_engine(model, kv_cache_memory=kv_pages * eng.plan.kv_bytes_per_page, **kw)
    finals = run_all(eng, prompts, max_tokens=n)
    compiles = eng.runner.compiles_after_warmup
    for i, p in enumerate(prompts):
        assert finals[f"r{i}"].outputs[0].token_ids == hf_greedy(hf_model, p, n), \
            f"{arch} prompt {i}"
    if kv_pages is not None:
        assert eng.scheduler.num_preemptions > 0
    if caching:
        assert eng.scheduler.allocator.prefix_hits > 0
    assert compiles == 0
    assert eng.scheduler.allocator.num_free_pages == eng.scheduler.allocator.num_usable_pages


# The MoE families (Qwen3-MoE with a dense layer between sparse ones, Qwen2-MoE's shared
# expert, Mixtral): the routing is data inside one compiled step per bucket, so chunked
# prefill, prefix hits and preemption change nothing, and nothing compiles after warmup.
# Default tier: Qwen3-MoE (dense and sparse layer groups); the slow tier adds the others.
_MOE_ENGINE_ARCHS = ["mixtral", "qwen2_moe", "qwen3_moe"]


@pytest.fixture(scope="module", params=split_tiers(
    _MOE_ENGINE_ARCHS, _MOE_ENGINE_ARCHS, ["qwen3_moe"],
    "Mixtral / Qwen2-MoE through the engine: tests/models/test_moe.py compares their logits"))
def moe_family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """(arch, the loaded checkpoint, the transformers model it was saved from)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from support.hf_models import build_moe_model

    from jaxserve.models import loading

    d = tmp_path_factory.mktemp(request.param)
    hf_model = build_moe_model(request.param, d)
    return request.param, loading.load_model(d), hf_model


@pytest.mark.parametrize("budget,page_size,caching,kv_pages,impl", [
    (16, 8, True, None, "cpu"),
    (64, 4, False, 30, "reference"),
], ids=["chunked-prefix-cpu", "tiny-pages-preempt-reference"])
def test_moe_greedy_equals_transformers_generate(moe_family, budget, page_size, caching,  # noqa: ANN001
                                                 kv_pages, impl) -> None:
    from support.hf_models import hf_greedy

    arch, model, hf_model = moe_family
    if impl == "reference" and not run_slow():
        pytest.skip("slow test (MoE under tiny pages and preemption: the routing is data, "
                    "the paging the engine's own): set JAXSERVE_RUN_SLOW=1 to run it")
    assert any(s.moe is not None for s in model.config.layer_specs)
    prompts = make_prompts(seed=5, count=5, shared_prefix=20)
    n = 8
    kw = dict(max_num_batched_tokens=budget, max_num_seqs=4, page_size=page_size,
              enable_prefix_caching=caching, max_model_len=128, attention_impl=impl,
              token_buckets=few_token_buckets(budget))
    eng = tiny_engine(model, warmup=kv_pages is None, **kw)
    if kv_pages is not None:
        # Just over what the longest sequence holds at once (a model with more KV groups,
        # e.g. Gemma 4's shared-KV layers leaving 3 sliding tables, needs more page ids).
        total = max(map(len, prompts)) + n
        full = -(-total // page_size)
        groups = eng.plan.scheduler.kv_groups
        # (limits.check_request's rule: a sliding group holds its window and two chunks)
        one = sum(full if w is None else min(full, -(-(w - 1 + 2 * budget) // page_size) + 1)
                  for w in (groups.windows if groups else (None,)))
        kv_pages = max(kv_pages, one + 2)
        eng = tiny_engine(model, kv_cache_memory=kv_pages * eng.plan.kv_bytes_per_page, **kw)
    finals = run_all(eng, prompts, max_tokens=n)
    compiles = eng.runner.compiles_after_warmup
    for i, p in enumerate(prompts):
        assert finals[f"r{i}"].outputs[0].token_ids == hf_greedy(hf_model, p, n), \
            f"{arch} prompt {i}"
    if kv_pages is not None:
        assert eng.scheduler.num_preemptions > 0
    if caching:
        assert eng.scheduler.allocator.prefix_hits > 0
    assert compiles == 0
    assert eng.scheduler.allocator.num_free_pages == eng.scheduler.allocator.num_usable_pages


def test_aborts_mid_flight_free_pages_and_leave_others_intact() -> None:
    eng = tiny_engine(max_num_batched_tokens=16, page_size=8)
    prompts = make_prompts(seed=7, count=6)
    finals = run_all(eng, prompts, 12, abort={"r1": 0, "r3": 3, "r5": 9})
    for i, p in enumerate(prompts):
        out = finals[f"r{i}"]
        if i in (1, 3, 5):
            assert out.outputs[0].finish_reason is FinishReason.ABORT
        else:
            assert out.outputs[0].token_ids == expected(tuple(p), 12)
    assert eng.scheduler.allocator.num_free_pages == eng.scheduler.allocator.num_usable_pages
    assert not eng.has_unfinished()


def test_seeded_sampling_independent_of_batch_neighbours() -> None:
    eng = tiny_engine()
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=12,
                            ignore_eos=True)
    target = [5, 9, 11, 40]
    eng.add_request("alone", target, params)
    alone = run_until_done(eng)["alone"].outputs[0].token_ids
    others = make_prompts(seed=3, count=5)
    for i, p in enumerate(others):
        eng.add_request(f"o{i}", p, SamplingParams(temperature=0.8, max_tokens=20, seed=i))
    eng.add_request("crowd", target, params)
    crowd = run_until_done(eng)["crowd"].outputs[0].token_ids
    assert alone == crowd
    eng.add_request("other-seed", target, SamplingParams(temperature=1.0, top_p=0.9, top_k=50,
                                                         seed=99, max_tokens=12,
                                                         ignore_eos=True))
    assert run_until_done(eng)["other-seed"].outputs[0].token_ids != alone


def run_until_done(eng) -> dict:
    finals = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


def test_n_samples_share_prompt_and_logprobs() -> None:
    eng = tiny_engine(page_size=8)
    prompt = make_prompts(seed=11, count=1)[0] + [7] * 20
    eng.add_request("g", prompt, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8,
                                                logprobs=3, ignore_eos=True))
    out = run_until_done(eng)["g"]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # seeds differ per sample
    for c in out.outputs[1:]:
        assert c.metrics.num_cached_tokens == (len(prompt) - 1) // 8 * 8
    for c in out.outputs:
        assert len(c.logprobs) == 8
        for tok, lp in zip(c.token_ids, c.logprobs):
            assert tok in lp and len(lp) <= 4 and all(v <= 0 for v in lp.values())
        # The same 8 float32 values summed in another order (and precision): 2 gamma_8.
        assert c.cumulative_logprob == pytest.approx(sum(lp[t] for t, lp in zip(
            c.token_ids, c.logprobs)), rel=2 * gamma(len(c.token_ids)))


def test_stop_strings_and_eos() -> None:
    eng = tiny_engine()
    prompt = [5, 6, 7]
    ref = expected(tuple(prompt), 10)
    text = eng.tokenizer.decode(ref)
    words = text.split()
    stop = words[3]
    eng.add_request("s", prompt, SamplingParams(temperature=0.0, max_tokens=10, stop=[stop],
                                                ignore_eos=True))
    eng.add_request("t", prompt, SamplingParams(temperature=0.0, max_tokens=10,
                                                stop_token_ids=[ref[4]], ignore_eos=True))
    outs = run_until_done(eng)
    s = outs["s"].outputs[0]
    assert s.finish_reason is FinishReason.STOP_STRING
    assert s.text == text[: text.find(stop)]
    t = outs["t"].outputs[0]
    assert t.finish_reason is FinishReason.STOP and t.token_ids == ref[: ref.index(ref[4]) + 1]


@pytest.mark.parametrize("prompt,params,match", [
    ("", SamplingParams(), "prompt must not be empty"),
    ([], SamplingParams(), "must not be empty"),
    ([5, 999], SamplingParams(), r"prompt_token_ids\[1\]=999 is outside the vocabulary"),
    ([5] * 250, SamplingParams(max_tokens=10), "max_model_len=256"),
])
def test_bad_requests_raise_and_engine_carries_on(prompt, params, match) -> None:
    eng = tiny_engine()
    eng.add_request("ok", [5, 6], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    with pytest.raises(ValueError, match=match):
        eng.add_request("bad", prompt, params)
    outs = run_until_done(eng)
    assert outs["ok"].outputs[0].token_ids == expected((5, 6), 4)
    assert eng.scheduler.allocator.num_free_pages == eng.scheduler.allocator.num_usable_pages


def test_sampling_params_validation_names_the_field() -> None:
    for kwargs, field in [(dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"),
                          (dict(top_k=-2), "top_k"), (dict(min_p=2), "min_p"),
                          (dict(max_tokens=-1), "max_tokens"), (dict(logprobs=21), "logprobs"),
                          (dict(n=17), "n"), (dict(stop=[""]), "stop"),
                          (dict(temperature=float("nan")), "temperature")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)
