"""The staleness key of a scheduled row is `Sequence.epoch` (bumped by each preemption), not
the preemption metric: a row scheduled before a preemption is skipped by `update` and
`unschedule` even once the sequence runs again and whatever its metrics say (no jax)."""

from __future__ import annotations

from jaxserve.config import SchedulerConfig
from jaxserve.engine.sequence import FinishReason, Sequence, SequenceStatus
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.engine.scheduler import Scheduler


def _seq(rid: str, prompt: list[int], priority: int) -> Sequence:
    params = SamplingParams(max_tokens=4, temperature=0.0)
    return Sequence(rid, prompt, params, eos_token_ids=(999,), arrival_time=0.0,
                   priority=priority, max_tokens=4)


def test_a_row_scheduled_before_a_preemption_is_stale_after_it():
    # 3 usable pages of 4 tokens: "a" (8 prompt tokens, then a decode on a 3rd page) leaves
    # none for "b", which outranks it and so preempts it.
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32,
                                      max_model_len=64, page_size=4, num_pages=4,
                                      enable_prefix_caching=False))
    a = _seq("a", [1] * 8, priority=1)
    sched.add_request(a)
    sched.update(sched.schedule(), [5])  # prefill: a's first token
    stale = sched.schedule()  # a's decode, dispatched (its result not applied yet)
    assert [s.sequence for s in stale.seqs] == [a] and stale.seqs[0].epoch == 0
    b = _seq("b", [2] * 8, priority=0)
    sched.add_request(b)
    out = sched.schedule()
    assert out.preempted == [a] and a.epoch == 1 and a.metrics.num_preemptions == 1
    sched.finish(b, FinishReason.ABORT)  # its pages back: a runs again
    again = sched.schedule()
    assert [s.sequence for s in again.seqs] == [a] and a.status is SequenceStatus.RUNNING
    assert again.seqs[0].epoch == 1
    a.metrics.num_preemptions = 0  # a metric only: the staleness check must not read it
    scheduled = a.num_scheduled_tokens
    sched.unschedule(stale.seqs)  # a stale rollback leaves the new schedule alone
    assert a.num_scheduled_tokens == scheduled and a.num_in_flight == 1
    assert sched.update(stale, [7]) == []  # the stale token is dropped
    assert a.output_token_ids == [5] and a.num_computed_tokens == 0
    assert sched.update(again, [6]) == [a]  # the recompute appends the real next token
    assert a.output_token_ids == [5, 6] and a.num_in_flight == 0
