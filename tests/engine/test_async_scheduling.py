"""Overlapped (async) scheduling: the engine dispatches step N+1 before it applies step N, and
step N+1's decode rows read step N's tokens on the device. Nothing a client sees may change.

Oracles: the arithmetic fake runner's own rollout (`fake_runner.arithmetic_next_token`), the
same engine run one step at a time (`async_scheduling=False`), and on the tiny real model the
plain full-sequence rollout. A recording runner shows that the overlap really happened (fed
rows), and where its cost lands (the discarded extra row of a late stop).
"""

from __future__ import annotations

import numpy as np
import pytest
from support.engine_fixtures import VOCAB, rollout, tiny_engine, tiny_model, tiny_model_config, \
    tiny_tokenizer

from jaxserve import SamplingParams
from jaxserve.config import EngineConfig
from jaxserve.engine.engine import Engine
from jaxserve.engine.fake_runner import ArithmeticRunner, arithmetic_next_token
from jaxserve.engine.sequence import FinishReason
from jaxserve.engine.sizing import plan_engine

EOS = 2


class RecordingRunner(ArithmeticRunner):
    """Arithmetic outputs; records each dispatched batch's fed tokens and live rows."""

    def __init__(self) -> None:
        super().__init__(VOCAB)
        self.fed_tokens = 0
        self.rows_per_step: list[int] = []

    def dispatch(self, batch):  # noqa: ANN001, ANN201 - the Runner protocol
        self.fed_tokens += int((batch.forward.feed_rows >= 0).sum())
        self.rows_per_step.append(int(batch.forward.num_seqs[0]))
        return super().dispatch(batch)


def engine_of(runner: ArithmeticRunner, overlap: bool, **cfg: object) -> Engine:
    base = dict(max_num_seqs=6, max_num_batched_tokens=48, page_size=8, max_model_len=160,
                attention_impl="reference", async_scheduling=overlap)
    base.update(cfg)
    config = EngineConfig(**base)  # type: ignore[arg-type]
    plan = plan_engine(config, tiny_model_config(), 4, 1 << 30)
    return Engine(config, plan, runner, tiny_tokenizer(), (EOS,))


def arithmetic(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(arithmetic_next_token(seq[-1], len(seq) - 1, VOCAB))
    return seq[len(prompt):]


def drive(engine: Engine, requests: dict, arrive: dict | None = None) -> dict:
    """Run to completion; `arrive`: request id -> the step() call before which it is added."""
    finals = {}
    pending = dict(requests)
    step = 0
    while pending or engine.has_unfinished():
        for rid in [r for r in pending if (arrive or {}).get(r, 0) <= step]:
            prompt, params = pending.pop(rid)
            engine.add_request(rid, prompt, params)
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        step += 1
        assert step < 2000, "the engine made no progress"
    alloc = engine.scheduler.allocator
    assert alloc.num_free_pages == alloc.num_usable_pages, "KV pages leaked"
    return finals


def mixed_requests() -> tuple[dict, dict]:
    """Every kind of stop and sampling path, with prompts whose arithmetic outputs make the
    token-value stops fire mid-stream."""
    rng = np.random.default_rng(7)
    tok = tiny_tokenizer()
    reqs: dict = {}
    for i in range(14):
        prompt = [int(x) for x in rng.integers(3, VOCAB, int(rng.integers(3, 40)))]
        out = arithmetic(prompt, 12)
        kind = i % 7
        if kind == 0:  # max_tokens only: known in advance, no wasted row
            params = SamplingParams(max_tokens=int(rng.integers(1, 12)), ignore_eos=True)
        elif kind == 1:  # a stop token id that the stream reaches: known one step late
            params = SamplingParams(max_tokens=12, stop_token_ids=[out[4]], ignore_eos=True)
        elif kind == 2:  # a stop string: found by the detokenizer, one step late
            params = SamplingParams(max_tokens=12, stop=[tok.decode([out[5]]).strip()],
                                    ignore_eos=True)
        elif kind == 3:  # n samples forking one prompt, with logprobs
            params = SamplingParams(max_tokens=9, n=2, logprobs=2, ignore_eos=True)
        elif kind == 4:  # penalties: the step in flight is applied before the next is built
            params = SamplingParams(max_tokens=8, repetition_penalty=1.3, ignore_eos=True)
        elif kind == 5:  # prompt logprobs and the EOS rule (the stream may end on EOS)
            params = SamplingParams(max_tokens=10, prompt_logprobs=2)
        else:  # prefill only (prompt scoring)
            params = SamplingParams(max_tokens=0, prompt_logprobs=1)
        reqs[f"r{i}"] = (prompt, params)
    arrive = {f"r{i}": (i * 3) % 11 for i in range(14)}
    return reqs, arrive


def summary(finals: dict) -> dict:
    return {rid: [(c.token_ids, c.finish_reason, c.text, c.logprobs) for c in o.outputs]
            + [o.prompt_logprobs] for rid, o in finals.items()}


@pytest.mark.parametrize("kv_pages", [None, 12])  # 12 pages: preemptions
def test_overlap_changes_no_output(kv_pages) -> None:  # noqa: ANN001
    reqs, arrive = mixed_requests()
    results, runners = {}, {}
    for overlap in (False, True):
        runner = RecordingRunner()
        probe = engine_of(ArithmeticRunner(VOCAB), overlap)
        mem = None if kv_pages is None else kv_pages * probe.plan.kv_bytes_per_page
        engine = engine_of(runner, overlap, kv_cache_memory=mem)
        results[overlap], runners[overlap] = drive(engine, reqs, arrive), runner
        if kv_pages is not None:
            assert engine.stats().num_preemptions > 0
    assert summary(results[True]) == summary(results[False])
    assert runners[False].fed_tokens == 0 and runners[True].fed_tokens > 50
    for rid, (prompt, params) in reqs.items():  # and both equal the arithmetic oracle
        for c in results[True][rid].outputs:
            assert c.token_ids == arithmetic(prompt, len(c.token_ids)), rid
        if params.stop_token_ids or params.stop:
            assert results[True][rid].outputs[0].finish_reason in (FinishReason.STOP,
                                                                   FinishReason.STOP_STRING)


def test_late_stop_discards_one_extra_row_and_known_ends_waste_none() -> None:
    prompt = [11, 12, 13]
    out = arithmetic(prompt, 10)
    cases = {"stop": SamplingParams(max_tokens=10, stop_token_ids=[out[3]], ignore_eos=True),
             "length": SamplingParams(max_tokens=4, ignore_eos=True)}
    for rid, params in cases.items():
        runner = RecordingRunner()
        finals = drive(engine_of(runner, True), {rid: (prompt, params)})
        assert finals[rid].outputs[0].token_ids == out[:4]
        # One prefill + 3 decodes made the 4 tokens; the stop token's value is known one step
        # late, so its sequence ran (and discarded) one more decode; max_tokens is known.
        assert sum(runner.rows_per_step) == (5 if rid == "stop" else 4), rid


def test_abort_with_a_step_in_flight_frees_pages_and_reports_abort() -> None:
    runner = RecordingRunner()
    engine = engine_of(runner, True)
    prompt = [21, 22, 23, 24]
    engine.add_request("a", prompt, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("b", [30, 31], SamplingParams(max_tokens=6, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert engine._in_flight is not None  # a step is on the device while we abort
    engine.abort("a")
    finals = drive(engine, {})
    a = finals["a"].outputs[0]
    assert a.finish_reason is FinishReason.ABORT
    assert a.token_ids == arithmetic(prompt, len(a.token_ids))
    assert finals["b"].outputs[0].token_ids == arithmetic([30, 31], 6)


def test_real_model_overlap_equals_rollout_and_one_step_at_a_time() -> None:
    """The device feed on the tiny real model: greedy equals the rollout, and seeded random
    sampling draws the same tokens as without overlap (same draw numbers)."""
    model = tiny_model()
    rng = np.random.default_rng(3)
    prompts = [[int(x) for x in rng.integers(3, 211, int(rng.integers(2, 30)))]
               for _ in range(5)]
    greedy = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=7, ignore_eos=True, seed=4)
    runs = {}
    for overlap in (True, False):
        engine = tiny_engine(model, warmup=False, max_num_batched_tokens=32, max_num_seqs=4,
                             async_scheduling=overlap)
        reqs = {f"g{i}": (p, greedy) for i, p in enumerate(prompts)}
        reqs.update({f"s{i}": (p, sampled) for i, p in enumerate(prompts)})
        runs[overlap] = drive(engine, reqs, {rid: i for i, rid in enumerate(reqs)})
    for i, p in enumerate(prompts):
        assert runs[True][f"g{i}"].outputs[0].token_ids == rollout(model, p, 7)
    assert summary(runs[True]) == summary(runs[False])
