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
from support.arithmetic_workload import (RecordingRunner, arithmetic, drive, engine_of,
                                         mixed_requests, summary)
from support.engine_fixtures import VOCAB, rollout, tiny_engine, tiny_model

from jaxserve import SamplingParams
from jaxserve.engine.fake_runner import ArithmeticRunner
from jaxserve.engine.sequence import FinishReason


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
