"""Prompt logprobs (SamplingParams.prompt_logprobs) and prefill-only requests (max_tokens=0).

Oracles: the plain full-sequence forward (`decoder.forward_jit`, no pages, no chunks) for the
real tiny model: log_softmax of its logits at position j scores prompt token j + 1; and the
fake runner's arithmetic (`fake_runner.arithmetic_prompt_logprobs`) for the scheduling paths
(chunked prefill, preemption, forks, output kinds) at no compile cost.
"""

from __future__ import annotations

import numpy as np
import pytest
from support.engine_fixtures import VOCAB, tiny_engine, tiny_logprob_atol
from support.numerics import rounding_rtol
from support.oracles import oracle
from support.fake_engines import fake_engine as async_fake_engine

from jaxserve import SamplingParams
from jaxserve.engine.engine import Engine
from jaxserve.engine.fake_runner import arithmetic_prompt_logprobs
from jaxserve.engine.outputs import RequestOutputKind
from jaxserve.engine.sequence import FinishReason

GREEDY = dict(temperature=0.0, ignore_eos=True)


def fake_engine(**cfg: object) -> Engine:
    """test_async_engine's fake-runner engine, with small steps and pages: prompts span
    several prefill chunks and pages."""
    return async_fake_engine(**{"max_num_batched_tokens": 16, "page_size": 4, **cfg})


def run(engine: Engine, requests: dict, kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
        ) -> dict:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params, output_kind=kind)
    outputs: dict = {rid: [] for rid in requests}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id].append(out)
    return outputs


def fake_expected(prompt: list[int], k: int) -> list[dict | None]:
    lp, ids, tops = arithmetic_prompt_logprobs(np.array(prompt[:-1]), np.array(prompt[1:]),
                                               VOCAB)
    want: list[dict | None] = [None]
    for j in range(len(prompt) - 1):
        entry = {prompt[j + 1]: float(lp[j])}
        for t, v in zip(ids[j][:k].tolist(), tops[j][:k].tolist()):
            entry.setdefault(t, v)
        want.append(entry)
    return want


# Default: the fake runner's numbers against the same numpy arithmetic, at most rounded once to
# float32 on the way (rounding_rtol(float32, 1)), plus 1e-12 for float64 exp / log evaluated
# by another numpy loop (a few ulps of values below ~20). The real runner's: tiny_logprob_atol.
def assert_close(got: list, want: list, atol: float = 1e-12,
                 rtol: float = rounding_rtol("float32", 1)) -> None:
    assert len(got) == len(want)
    for j, (g, w) in enumerate(zip(got, want)):
        if w is None:
            assert g is None, j
            continue
        assert list(g) == list(w), (j, g, w)  # same ids, the prompt token first
        np.testing.assert_allclose(list(g.values()), list(w.values()), atol=atol, rtol=rtol,
                                   err_msg=str(j))


# --------------------------------------------------------------------------- the real model
def test_prompt_logprobs_match_the_full_forward_across_prefill_chunks() -> None:
    # 16-token steps: the 37-token prompt is scored over three chunks, beside a decoding
    # request that does not want prompt logprobs (its rows are never scored).
    engine = tiny_engine(max_num_batched_tokens=16)
    prompt = [(7 * i + 3) % (VOCAB - 3) + 3 for i in range(37)]
    outs = run(engine, {"p": (prompt, SamplingParams(max_tokens=3, prompt_logprobs=5, **GREEDY)),
                        "other": ([5, 6, 7], SamplingParams(max_tokens=8, **GREEDY))})
    # (before the oracle compiles: the guard counts every compile of the process)
    assert engine.stats().compiles_after_warmup == 0  # the pass was compiled at warmup
    final = outs["p"][-1]
    assert_close(final.prompt_logprobs, oracle(prompt, 5), atol=tiny_logprob_atol(), rtol=0)
    assert outs["other"][-1].prompt_logprobs is None


def test_prefill_only_request_scores_the_prompt_and_generates_nothing() -> None:
    engine = tiny_engine()
    prompt = [3, 9, 27, 81, 50, 17, 4]
    outs = run(engine, {"s": (prompt, SamplingParams(max_tokens=0, prompt_logprobs=0))})
    (final,) = [o for o in outs["s"] if o.finished]
    c = final.outputs[0]
    assert c.finish_reason is FinishReason.LENGTH and c.token_ids == [] and c.text == ""
    assert_close(final.prompt_logprobs, oracle(prompt, 0), atol=tiny_logprob_atol(), rtol=0)
    assert engine.stats().kv_pages_used == 0


def test_one_token_prompt_has_one_empty_entry() -> None:
    engine = tiny_engine()
    outs = run(engine, {"s": ([5], SamplingParams(max_tokens=1, prompt_logprobs=2))})
    assert outs["s"][-1].prompt_logprobs == [None]


# --------------------------------------------------------------------------- scheduling paths
def test_chunked_prefill_preemption_and_forks_keep_every_entry() -> None:
    # A KV cache of few pages: long requests preempt each other and recompute their
    # prefills; n=2 forks sample 0's prompt pages; every entry is still the expected one.
    engine = fake_engine(kv_cache_memory=18 * 1024)  # 18 pages of 4 tokens
    reqs = {f"r{i}": ([(5 * i + 3 * j) % 200 + 3 for j in range(20 + 3 * i)],
                      SamplingParams(max_tokens=12, prompt_logprobs=i % 3, n=1 + i % 2, **GREEDY))
            for i in range(4)}
    outs = run(engine, reqs)
    assert engine.stats().num_preemptions > 0
    for rid, (prompt, params) in reqs.items():
        final = outs[rid][-1]
        assert final.finished
        assert final.prompt_logprobs == fake_expected(prompt, params.prompt_logprobs), rid


def test_prompt_logprobs_requests_skip_the_prefix_cache() -> None:
    engine = fake_engine()
    prompt = list(range(10, 30))
    plain = SamplingParams(max_tokens=2, **GREEDY)
    scored = SamplingParams(max_tokens=2, prompt_logprobs=1, **GREEDY)
    run(engine, {"warm": (prompt, plain)})
    again = run(engine, {"again": (prompt, plain)})["again"][-1]
    assert again.num_cached_tokens > 0  # the cache holds the prompt ...
    out = run(engine, {"s": (prompt, scored)})["s"][-1]
    assert out.num_cached_tokens == 0  # ... but a scored request computes every position
    assert out.prompt_logprobs == fake_expected(prompt, 1)


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_output_kinds_carry_prompt_logprobs_once_or_every_time(kind: RequestOutputKind) -> None:
    engine = fake_engine()
    prompt = list(range(40, 75))  # three prefill chunks: no output before the first token
    outs = run(engine, {"s": (prompt, SamplingParams(max_tokens=4, prompt_logprobs=2,
                                                     **GREEDY))}, kind)["s"]
    carrying = [o.prompt_logprobs for o in outs if o.prompt_logprobs is not None]
    want = fake_expected(prompt, 2)
    if kind is RequestOutputKind.DELTA:
        assert carrying == [want] and outs[0].prompt_logprobs == want
    else:
        assert carrying and all(p == want for p in carrying)
        assert len(carrying) == len(outs)


def test_prefill_only_with_n_and_a_stream() -> None:
    engine = fake_engine()
    prompt = list(range(3, 12))
    outs = run(engine, {"s": (prompt, SamplingParams(max_tokens=0, n=2, prompt_logprobs=1))},
               RequestOutputKind.DELTA)["s"]
    assert outs[-1].finished
    assert [c.finish_reason for c in outs[-1].outputs] == [FinishReason.LENGTH] * 2
    assert sum(o.num_delta_tokens for o in outs) == 0
    assert [o.prompt_logprobs for o in outs if o.prompt_logprobs] == [fake_expected(prompt, 1)]
    assert engine.stats().kv_pages_used == 0


def test_prompt_logprobs_range_is_checked() -> None:
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1)
