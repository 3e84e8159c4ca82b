"""Live scheduler settings (`Engine.update_scheduler`, `engine/live_settings.py`) on the
arithmetic fake runner: every refusal names the field and the limit and changes nothing; a
change shows in the very next steps (their sequences and tokens, read off the scheduler's
own output); requests in flight finish with the tokens they would have had (the runner's
arithmetic oracle), none preempted or aborted; fcfs refuses priorities and ranks by arrival."""

from __future__ import annotations

import pytest
from support.fake_engines import GREEDY, arithmetic, fake_engine

from jaxserve.config import SchedulerConfig
from jaxserve.engine.errors import InvalidRequest
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.sequence import Sequence

# fake_engine: max_num_seqs 4, max_num_batched_tokens 64 (buckets up to (64, 4)), the
# decode budget clamped to 64.
START = {"max_num_seqs": 4, "max_num_batched_tokens": 64, "decode_token_budget": 64,
         "ttft_slo": None, "itl_slo": None, "slo_admission": "queue",
         "scheduling_policy": "priority"}

REFUSED = [
    ({"max_num_seqs": 5}, "max_num_seqs", r"max_num_seqs=5 is past what start-up compiled: at most 4 "
                                          r"\(the largest compiled seqs bucket"),
    ({"max_num_batched_tokens": 65}, "max_num_batched_tokens",
     r"max_num_batched_tokens=65 is past what start-up compiled: at most 64 \(the largest compiled token "
     r"bucket"),
    ({"max_num_batched_tokens": 3, "decode_token_budget": None}, "max_num_batched_tokens",
     r"max_num_batched_tokens=3 must be >= max_num_seqs=4"),
    ({"max_num_batched_tokens": 32}, "decode_token_budget",
     r"decode_token_budget=64 must be in \[max_num_seqs=4, max_num_batched_tokens=32\] or "
     r"null \(unchanged"),
    ({"decode_token_budget": 2}, "decode_token_budget",
     r"decode_token_budget=2 must be in \[max_num_seqs=4, max_num_batched_tokens=64\]"),
    ({"max_num_seqs": 0}, "max_num_seqs", r"max_num_seqs=0 must be >= 1"),
    ({"max_num_seqs": "8"}, "max_num_seqs", r"max_num_seqs='8' must be a positive integer"),
    ({"max_num_seqs": True}, "max_num_seqs", r"max_num_seqs=True must be a positive integer"),
    ({"decode_token_budget": 8.0}, "decode_token_budget", r"must be a positive integer or null"),
    ({"ttft_slo": -1}, "ttft_slo", r"ttft_slo=.-1. must be seconds in \(0, 3600\]"),
    ({"itl_slo": {"x": 1}}, "itl_slo", r"itl_slo: 'x' is not a priority level"),
    ({"slo_admission": "reject"}, "slo_admission", r"slo_admission='reject' needs a ttft_slo"),
    ({"slo_admission": "drop"}, "slo_admission", r"slo_admission='drop' must be one of queue, "
                                                 r"reject"),
    ({"scheduling_policy": "lifo"}, "scheduling_policy", r"must be one of priority, fcfs"),
    ({"max_model_len": 64}, "max_model_len", r"'max_model_len' is not a scheduler setting that "
                                             r"can change on a running server; those are "
                                             r"max_num_seqs, max_num_batched_tokens"),
    # all or nothing: a good field beside a bad one changes nothing either
    ({"max_num_seqs": 2, "itl_slo": 0}, "itl_slo", r"itl_slo='0' must be seconds"),
]


@pytest.mark.parametrize("changes,field,message", REFUSED)
def test_refusals_name_the_field_and_limit_and_change_nothing(changes, field, message):
    engine = fake_engine()
    with pytest.raises(InvalidRequest, match=message) as info:
        engine.update_scheduler(changes)
    assert info.value.field == field
    assert engine.scheduler_settings() == START


def test_settings_are_json_and_a_change_returns_them():
    engine = fake_engine()
    assert engine.scheduler_settings() == START
    new = engine.update_scheduler({"max_num_seqs": 2, "ttft_slo": "1.5,0=0.25",
                                   "itl_slo": 0.1, "slo_admission": "reject",
                                   "decode_token_budget": None, "scheduling_policy": "fcfs"})
    assert new == {**START, "max_num_seqs": 2, "decode_token_budget": None,
                   "ttft_slo": {"default": 1.5, "0": 0.25}, "itl_slo": 0.1,
                   "slo_admission": "reject", "scheduling_policy": "fcfs"}
    assert engine.scheduler_settings() == new
    # what GET returns is what POST takes: sending it back changes nothing
    assert engine.update_scheduler(new) == new
    # and a setting may come back up to what start-up compiled
    assert engine.update_scheduler({"max_num_seqs": 4})["max_num_seqs"] == 4


def _record_steps(engine):  # noqa: ANN001, ANN202 - each scheduled step's (ids, tokens)
    steps: list[tuple[list[str], int]] = []
    schedule = engine.scheduler.schedule

    def spy():  # noqa: ANN202
        out = schedule()
        steps.append(([s.sequence.request_id for s in out.seqs], out.num_tokens))
        return out

    engine.scheduler.schedule = spy
    return steps


def _run(engine, prompts, max_tokens, change_after=None, changes=None):  # noqa: ANN001, ANN202
    """Queue every prompt (`max_tokens`: one for all, or one each), step to the end;
    `changes` applied after `change_after` steps. Returns (each request's tokens, the
    steps scheduled after the change: (request ids, tokens))."""
    steps = _record_steps(engine)
    counts = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    for i, (p, n) in enumerate(zip(prompts, counts)):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=n, **GREEDY))
    done: dict[str, list[int]] = {}
    mark = 0
    while engine.has_unfinished():
        if changes is not None and engine.num_steps == change_after and not mark:
            engine.update_scheduler(changes)
            mark = len(steps)
        for out in engine.step():
            if out.finished:
                assert out.outputs[0].finish_reason == "length"
                done[out.request_id] = list(out.outputs[0].token_ids)
    return done, steps[mark:] if changes is not None else steps


PROMPTS = [[5 + i, 6, 7, 8] for i in range(6)]
# r0..r3 run first and finish one after another; r4, r5 wait for a seat.
MAX_TOKENS = [6, 10, 14, 18, 8, 8]
FIRST, LATER = {"r0", "r1", "r2", "r3"}, {"r4", "r5"}


def test_lower_max_num_seqs_limits_the_next_steps_and_spares_those_running():
    engine = fake_engine()
    done, after = _run(engine, PROMPTS, MAX_TOKENS, change_after=3,
                       changes={"max_num_seqs": 2})
    assert done == {f"r{i}": arithmetic(p, n)
                    for i, (p, n) in enumerate(zip(PROMPTS, MAX_TOKENS))}
    assert engine.stats().num_preemptions == 0  # nobody recomputed
    # The 4 running when it changed keep running until they finish; r4 / r5 are admitted
    # only once fewer than 2 run, and from then on no step holds more than 2.
    assert set(after[0][0]) == FIRST
    with_later = [ids for ids, _ in after if LATER & set(ids)]
    assert with_later and all(len(ids) <= 2 for ids in with_later)
    assert max(len(ids) for ids in with_later) == 2  # the limit, not fewer
    # Without the change r4 takes r0's seat at once, beside three of the first four.
    _, steps = _run(fake_engine(), PROMPTS, MAX_TOKENS)
    assert any(LATER & set(ids) and len(FIRST & set(ids)) == 3 for ids, _ in steps)


def test_lower_max_num_batched_tokens_bounds_every_next_step():
    engine = fake_engine()
    prompts = [[9 + i] * 50 for i in range(3)]
    done, after = _run(engine, prompts, 6, change_after=1,
                       changes={"max_num_batched_tokens": 16, "decode_token_budget": None})
    assert done == {f"r{i}": arithmetic(p, 6) for i, p in enumerate(prompts)}
    assert engine.stats().num_preemptions == 0
    assert after and all(t <= 16 for _, t in after)
    assert max(t for _, t in after) == 16  # prefill chunks now fill the smaller budget
    _, steps = _run(fake_engine(), prompts, 6)
    assert max(t for _, t in steps) > 16  # (the change is what bounded them)


def test_fcfs_refuses_priorities_at_add_request():
    engine = fake_engine()
    params = SamplingParams(max_tokens=2, **GREEDY)
    engine.add_request("before", [5, 6], params, priority=3)  # allowed under priority
    engine.update_scheduler({"scheduling_policy": "fcfs"})
    with pytest.raises(InvalidRequest, match=r"priority=3 must be 0: the scheduling policy "
                                             r"is fcfs") as info:
        engine.add_request("after", [5, 6], params, priority=3)
    assert info.value.field == "priority"
    engine.add_request("zero", [5, 6], params, priority=0)
    while engine.has_unfinished():  # the one queued before still runs
        engine.step()
    engine.update_scheduler({"scheduling_policy": "priority"})
    engine.add_request("again", [5, 6], params, priority=3)


@pytest.mark.parametrize("policy,first", [("priority", "urgent"), ("fcfs", "early")])
def test_fcfs_ranks_by_arrival_only(policy, first):
    cfg = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=16, max_model_len=64,
                          page_size=8, num_pages=32, scheduling_policy=policy)
    sched = Scheduler(cfg)
    for rid, prio in (("early", 5), ("urgent", 0)):
        params = SamplingParams(max_tokens=2, temperature=0.0)
        sched.add_request(Sequence(rid, [1, 2], params, (999,), 0.0, priority=prio,
                                   max_tokens=2))
    assert [s.sequence.request_id for s in sched.schedule().seqs] == [first]


def test_raise_within_the_compiled_buckets():
    # Compiled up to 64 tokens, started at 16: the budget may rise to 64 live, not past it.
    engine = fake_engine(max_num_batched_tokens=16, token_buckets=(8, 64))
    assert engine.scheduler_settings()["max_num_batched_tokens"] == 16
    with pytest.raises(InvalidRequest, match="at most 64"):
        engine.update_scheduler({"max_num_batched_tokens": 72})
    prompts = [[9 + i] * 50 for i in range(2)]
    done, after = _run(engine, prompts, 4, change_after=1,
                       changes={"max_num_batched_tokens": 64})
    assert done == {f"r{i}": arithmetic(p, 4) for i, p in enumerate(prompts)}
    assert 16 < max(t for _, t in after) <= 64


def test_kv_check_sizes_sliding_chunks_by_the_largest_bucket():
    """A request admitted now may still run after max_num_batched_tokens is raised to the
    largest compiled bucket: a sliding-window group must hold two chunks of that size."""
    from jaxserve.engine.limits import EngineLimits

    base = dict(max_model_len=256, vocab_size=211, page_size=8, num_kv_pages=10,
                max_num_seqs=4, max_num_batched_tokens=16, eos_token_ids=(2,),
                kv_windows=(32,))
    # window 32 + two chunks of 16: 9 pages fit in 10; two chunks of 64 need 21
    assert EngineLimits(**base).check_fits(100, 100) == 100
    with pytest.raises(InvalidRequest, match="need 21 KV pages but the cache holds only 10"):
        EngineLimits(**base, max_step_tokens=64).check_fits(100, 100)
    assert fake_engine(max_num_batched_tokens=16,
                       token_buckets=(8, 64)).limits.max_step_tokens == 64


def test_speculation_bounds_max_num_seqs_by_the_rows_compiled():
    """With speculation the buckets hold (k + 1) rows per speculating sequence: max_num_seqs
    may rise to those rows (a step that full does not speculate), not past them."""
    from jaxserve.spec_config import SpeculativeConfig

    spec = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3,
                                        "disable_by_batch_size": 3})
    engine = fake_engine(speculative_config=spec)  # rows: max(4, 4 * min(3 - 1, 4)) = 8
    assert engine.plan.scheduler.max_num_rows == 8
    with pytest.raises(InvalidRequest, match=r"max_num_seqs=9 is past what start-up compiled: at most 8 "
                                             r"\(the sampler rows"):
        engine.update_scheduler({"max_num_seqs": 9})
    engine.update_scheduler({"max_num_seqs": 8})
    assert engine.scheduler.cfg.max_num_rows == 8  # the rows stay what was compiled
    prompts = [[5 + i, 6, 7, 5 + i, 6, 7] for i in range(8)]
    done, steps = _run(engine, prompts, 5)
    assert done == {f"r{i}": arithmetic(p, 5) for i, p in enumerate(prompts)}
    assert max(len(ids) for ids, _ in steps) == 8


def test_slo_targets_set_live_are_what_the_policy_judges_by():
    engine = fake_engine()
    params = SamplingParams(max_tokens=4, **GREEDY)
    engine.add_request("before", [5, 6, 7], params)
    while engine.has_unfinished():
        engine.step()
    assert engine.stats().slo.by_priority == ()  # no targets: nothing judged
    # Generous targets (an hour): every request meets both; level 2 gets its own row.
    engine.update_scheduler({"ttft_slo": 3600, "itl_slo": "3600,2=3600"})
    engine.add_request("p0", [5, 6, 8], params)
    engine.add_request("p2", [5, 6, 9], params, priority=2)
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    assert done == {"p0": arithmetic([5, 6, 8], 4), "p2": arithmetic([5, 6, 9], 4)}
    assert engine.stats().slo.by_priority == ((0, 1, 0, 1, 0, 0), (2, 1, 0, 1, 0, 0))
    engine.update_scheduler({"ttft_slo": None, "itl_slo": None})
    engine.add_request("after", [5, 6, 7], params)
    while engine.has_unfinished():
        engine.step()
    assert engine.stats().slo.by_priority == ((0, 1, 0, 1, 0, 0), (2, 1, 0, 1, 0, 0))
