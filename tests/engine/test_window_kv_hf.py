"""Window-aware KV end to end: a tiny random Gemma 3 (transformers) served by the engine.

The model: support.hf_models' Gemma 3 builder (2 global and 3 sliding-window layers, two
rope bases) with a window of 6 tokens, which is no multiple of the 4-token pages. Its KV
groups: a global group and two sliding groups of two layer slots (`models/kv_groups.py`).
Prompts are 8-15 windows long and prefill in chunks of 8 tokens; the KV budget is tight
enough to preempt. Checked against transformers' greedy `generate` (eager attention): every
output, including those served from a prefix hit whose window pages were still cached and
one whose window pages had been evicted (the hit must be cut back, not served); after every
step, no decoding sequence holds more than ceil(6 / 4) + 1 = 3 pages in a sliding group; no
page left behind; no compile after warmup.
"""

from __future__ import annotations

import numpy as np
import pytest
from support.engine_fixtures import few_token_buckets, tiny_engine

from jaxserve import SamplingParams

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

WINDOW, PAGE = 6, 4


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    from support.hf_models import build_gemma_model

    from jaxserve.models import loading

    d = tmp_path_factory.mktemp("gemma3_window")
    hf_model = build_gemma_model("gemma3", d, sliding_window=WINDOW)
    return loading.load_model(d), hf_model


def _drive(eng, requests: dict[str, list[int]], n: int, check=None) -> dict:  # noqa: ANN001
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    for rid, p in requests.items():
        eng.add_request(rid, p, sp)
    finals = {}
    steps = 0
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                finals[out.request_id] = out
        if check is not None:
            check()
        steps += 1
        assert steps < 5000
    return finals


def _flush_cache(sched) -> None:  # noqa: ANN001
    """Evict every cached free page (allocate all free pages, free them without hashes)."""
    alloc = sched.allocator
    alloc.free(alloc.allocate(alloc.num_free_pages))


def test_gemma3_window_kv_equals_transformers(gemma3) -> None:  # noqa: ANN001
    from support.hf_models import hf_greedy

    model, hf_model = gemma3
    windows = {s.sliding_window for s in model.config.layer_specs}
    assert windows == {WINDOW, None}
    rng = np.random.default_rng(11)
    prompts = {f"r{i}": [int(x) for x in rng.integers(3, 211, int(rng.integers(48, 90)))]
               for i in range(5)}
    n = 8
    # One token bucket, the whole 8-token chunk (the windows and the paging are what is
    # checked; each bucket is a whole-model compile).
    kw = dict(max_num_batched_tokens=8, max_num_seqs=3, page_size=PAGE,
              enable_prefix_caching=True, max_model_len=128, attention_impl="reference",
              token_buckets=few_token_buckets(8))
    probe = tiny_engine(model, warmup=False, **kw)
    groups = probe.plan.scheduler.kv_groups
    assert groups is not None and groups.windows == (None, WINDOW, WINDOW)
    # One sequence of 98 tokens needs 25 global pages + 4 per sliding group during a chunk;
    # 40 page ids hold about one and a half: three sequences in flight must preempt.
    eng = tiny_engine(model, kv_cache_memory=40 * probe.plan.kv_bytes_per_page, **kw)
    sched = eng.scheduler
    bound = -(-WINDOW // PAGE) + 1
    most = [0]

    def check() -> None:
        # Decoding sequences (a prefill chunk holds its own pages for its step as well);
        # the step just dispatched is counted (its token's page is allocated).
        for req in sched.running:
            if req.num_computed_tokens < req.num_prompt_tokens:
                continue
            for g in groups.sliding:
                live = sched.kv.num_live_pages(req, g)
                most[0] = max(most[0], live)
                assert live <= bound, (req.request_id, g, live)

    finals = _drive(eng, prompts, n, check)
    for rid, p in prompts.items():
        assert finals[rid].outputs[0].token_ids == hf_greedy(hf_model, p, n), rid
    assert sched.num_preemptions > 0 and most[0] == bound  # reached, not vacuous

    # A prefix hit with its window pages cached: r0 again, alone, max_tokens 1 so nothing
    # slides past the prompt; then r0 + 3 tokens matches all its full pages.
    _flush_cache(sched)
    base = prompts["r0"][: len(prompts["r0"]) // PAGE * PAGE]
    _drive(eng, {"warm": base}, 1)
    longer = base + [7, 8, 9]
    hit = _drive(eng, {"hit": longer}, n)["hit"]
    assert hit.num_cached_tokens == len(base)
    assert hit.outputs[0].token_ids == hf_greedy(hf_model, longer, n)
    assert sched.kv.window_cut_pages == 0

    # The same after a decode slid the windows past the prompt and the slid pages were
    # evicted, the global ones still cached: cut back to 0. The slid pages still cached are
    # the oldest in the LRU (the finish freed the rest later): the leading run of pages
    # cached under a sliding group's key (`kv_manager.group_key`: salted, 17 bytes).
    _flush_cache(sched)
    _drive(eng, {"slide": base}, 10)
    alloc = sched.allocator
    slid = 0
    for page in alloc._evictable:
        if len(alloc._page_hash[page]) == 16:
            break
        slid += 1
    assert slid > 0
    alloc.free(alloc.allocate(alloc.num_free_pages - len(alloc._evictable) + slid))
    cut = _drive(eng, {"cut": longer}, n)["cut"]
    # (The output first: a hit served without its window pages must show up against HF.)
    assert cut.outputs[0].token_ids == hf_greedy(hf_model, longer, n)
    assert cut.num_cached_tokens == 0
    assert sched.kv.window_cut_pages == len(base) // PAGE

    assert alloc.num_free_pages == alloc.num_usable_pages  # no page left behind
    assert eng.runner.compiles_after_warmup == 0
