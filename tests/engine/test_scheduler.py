"""Scheduler + allocator driven by a fake runner whose outputs are arithmetic (no jax).

The fake "model" maps a sequence's full token history to next = (sum of tokens * 31 +
length) % VOCAB, so any mix-up of tokens, positions or chunk boundaries changes the output.
"""

from __future__ import annotations

import itertools
import random

import pytest

from jaxserve.config import SchedulerConfig
from jaxserve.engine.block_allocator import BlockAllocator, NoFreePages, hash_pages
from jaxserve.engine.sequence import FinishReason, Sequence, SequenceStatus
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.engine.scheduler import Scheduler, SchedulerOutput

VOCAB = 1000
EOS = 999


def expected_next(tokens: list[int]) -> int:
    return (sum(tokens) * 31 + len(tokens)) % (VOCAB - 1)  # never EOS


def make_req(rid: str, prompt: list[int], max_tokens: int = 8, priority: int = 0,
             arrival: float = 0.0, **sp: object) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, **sp)  # type: ignore[arg-type]
    return Sequence(rid, list(prompt), params, eos_token_ids=(EOS,), arrival_time=arrival,
                   priority=priority, max_tokens=max_tokens)


class FakeRunner:
    """Checks what a real step would need (pages, chunk bounds) and returns arithmetic."""

    def __init__(self, sched: Scheduler):
        self.sched = sched
        self.kv: dict[tuple[int, int], int] = {}  # (page, offset) -> token stored there

    def run(self, out: SchedulerOutput) -> list[int | None]:
        cfg = self.sched.cfg
        assert out.num_tokens <= cfg.max_num_batched_tokens
        assert len(out.seqs) <= cfg.max_num_seqs
        assert len({id(s.sequence) for s in out.seqs}) == len(out.seqs)
        sampled: list[int | None] = []
        for s in out.seqs:
            req = s.sequence
            end = s.start + s.num_new_tokens
            assert len(req.pages) * cfg.page_size >= end, "pages missing for scheduled tokens"
            # "Write" the K/V of the new tokens, then "read" the whole context back from pages:
            # a page shared or cached wrongly shows up as a wrong history.
            for pos in range(s.start, end):
                page = req.pages[pos // cfg.page_size]
                assert page != 0
                self.kv[(page, pos % cfg.page_size)] = req.all_token_ids[pos]
            history = [self.kv[(req.pages[p // cfg.page_size], p % cfg.page_size)]
                       for p in range(end)]
            assert history == req.all_token_ids[:end]
            sampled.append(expected_next(history) if s.samples else None)
        return sampled


def drive(sched: Scheduler, max_steps: int = 10_000, on_step=None,
          runner: FakeRunner | None = None) -> int:
    runner = runner or FakeRunner(sched)
    steps = 0
    while sched.has_unfinished():
        out = sched.schedule()
        if on_step is not None:
            on_step(steps, out)
        sched.update(out, runner.run(out))
        steps += 1
        assert steps < max_steps, "scheduler made no progress"
    return steps


def reference_output(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(expected_next(seq))
    return seq[len(prompt):]


def config(**kw: object) -> SchedulerConfig:
    base = dict(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=256, page_size=8,
                num_pages=64, enable_prefix_caching=True)
    base.update(kw)
    return SchedulerConfig(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize("budget,page_size,num_pages,caching", [
    (16, 8, 200, False), (32, 8, 30, True), (64, 16, 16, False), (512, 4, 300, True),
    (24, 8, 20, True),
])
def test_random_workload_outputs_budget_and_no_leaks(budget, page_size, num_pages, caching):
    rng = random.Random(budget * 7 + num_pages)
    cfg = config(max_num_batched_tokens=budget, page_size=page_size, num_pages=num_pages,
                 enable_prefix_caching=caching, max_num_seqs=min(8, budget))
    sched = Scheduler(cfg)
    shared = [rng.randrange(VOCAB - 1) for _ in range(20)]
    reqs = []
    for i in range(24):
        prompt = (shared if i % 3 == 0 else []) + [rng.randrange(VOCAB - 1)
                                                    for _ in range(rng.randint(1, 40))]
        r = make_req(f"r{i}", prompt, max_tokens=rng.randint(1, 20), priority=rng.choice([0, 1]))
        reqs.append(r)
        sched.add_request(r)
    drive(sched)
    for r in reqs:
        assert r.finish_reason is FinishReason.LENGTH
        assert r.output_token_ids == reference_output(r.prompt_token_ids, r.max_tokens)
    assert sched.allocator.num_free_pages == sched.allocator.num_usable_pages
    if num_pages <= 20:
        assert sched.num_preemptions > 0


def test_decodes_are_never_starved_by_a_long_prompt():
    sched = Scheduler(config(max_num_batched_tokens=16, max_num_seqs=4, num_pages=100))
    chats = [make_req(f"c{i}", [1, 2, 3], max_tokens=30) for i in range(3)]
    for r in chats:
        sched.add_request(r)
    long = make_req("long", list(range(200)), max_tokens=2)

    def check(step: int, out: SchedulerOutput) -> None:
        if step == 2:
            sched.add_request(long)
        running_decoders = [r for r in chats if r.status is SequenceStatus.RUNNING
                            and r.num_computed_tokens == r.num_tokens - 1]
        scheduled = {id(s.sequence) for s in out.seqs}
        assert all(id(r) in scheduled for r in running_decoders)
        chunk = [s for s in out.seqs if s.sequence is long]
        if chunk:
            assert chunk[0].num_new_tokens <= 16 - len(running_decoders)

    drive(sched, on_step=check)
    assert long.output_token_ids == reference_output(long.prompt_token_ids, 2)


def test_decode_token_budget_caps_steps_with_decodes_only():
    """A burst of prompts is prefilled in one step of the full budget; once streams decode,
    a step holds at most decode_token_budget tokens, so a late prompt is chunked around them."""
    sched = Scheduler(config(max_num_batched_tokens=64, decode_token_budget=16,
                             max_num_seqs=8, num_pages=200))
    burst = [make_req(f"b{i}", list(range(i, i + 15)), max_tokens=6) for i in range(4)]
    for r in burst:
        sched.add_request(r)
    late = make_req("late", list(range(40)), max_tokens=3)
    sizes: list[tuple[int, bool]] = []

    def check(step: int, out: SchedulerOutput) -> None:
        if step == 2:
            sched.add_request(late)
        # Decodes of streams past their first token hold the step to 16 tokens.
        decodes = any(s.num_new_tokens == 1 and s.samples and s.start > 0
                      and s.start == s.sequence.num_tokens - 1
                      and s.sequence.num_output_tokens >= 2 for s in out.seqs)
        sizes.append((out.num_tokens, decodes))
        assert out.num_tokens <= (16 if decodes else 64)

    drive(sched, on_step=check)
    assert sizes[0] == (60, False)  # the whole burst in one step: they decode in lockstep
    late_steps = [n for n, d in sizes if d and n > 4]
    assert late_steps and max(late_steps) == 16  # the late prompt in chunks of 16 - 4 decodes
    for r in burst + [late]:
        assert r.output_token_ids == reference_output(r.prompt_token_ids, r.max_tokens)
    assert sched.allocator.num_free_pages == sched.allocator.num_usable_pages


def test_prompts_a_step_apart_are_still_prefilled_together():
    """Streams with only their first token let one more full-budget step through: prompts
    that arrive a moment after the first ones join them instead of trickling in at the
    decode budget (and staying a step apart for good)."""
    sched = Scheduler(config(max_num_batched_tokens=64, decode_token_budget=16,
                             max_num_seqs=8, num_pages=200))
    first = [make_req(f"a{i}", list(range(i, i + 10)), max_tokens=5) for i in range(2)]
    later = [make_req(f"b{i}", list(range(100 + 20 * i, 114 + 20 * i)), max_tokens=5)
             for i in range(3)]
    for r in first:
        sched.add_request(r)
    steps: list[SchedulerOutput] = []

    def check(step: int, out: SchedulerOutput) -> None:
        steps.append(out)
        if step == 0:
            for r in later:
                sched.add_request(r)

    drive(sched, on_step=check)
    assert steps[0].num_tokens == 20
    assert steps[1].num_tokens == 2 + 42  # two first-token streams decode, all three prefill
    # Then all five decode together (the first two end a step earlier).
    assert [o.num_tokens for o in steps[2:]] == [5, 5, 5, 3]
    for r in first + later:
        assert r.output_token_ids == reference_output(r.prompt_token_ids, r.max_tokens)


@pytest.mark.parametrize("budget", [4, 65])
def test_decode_token_budget_bounds(budget):
    with pytest.raises(ValueError, match="decode_token_budget"):
        config(max_num_batched_tokens=64, max_num_seqs=8, decode_token_budget=budget)


def test_priority_order_and_fcfs_within_level():
    sched = Scheduler(config(max_num_seqs=1, max_num_batched_tokens=64))
    order = []
    reqs = [make_req("low-a", [1], priority=5), make_req("high", [2], priority=0),
            make_req("low-b", [3], priority=5), make_req("mid", [4], priority=2)]
    for r in reqs:
        sched.add_request(r)

    def record(step: int, out: SchedulerOutput) -> None:
        for s in out.seqs:
            if s.sequence.request_id not in order:
                order.append(s.sequence.request_id)

    drive(sched, on_step=record)
    assert order == ["high", "mid", "low-a", "low-b"]


def test_preemption_evicts_lowest_priority_most_recent_and_recomputes():
    # 10 usable pages of 4 tokens: three growing sequences cannot all fit.
    sched = Scheduler(config(page_size=4, num_pages=11, max_num_batched_tokens=64))
    a = make_req("a", [1] * 6, max_tokens=14, priority=0)
    b = make_req("b", [2] * 6, max_tokens=14, priority=0)
    c = make_req("c", [3] * 6, max_tokens=14, priority=1)
    for r in (a, b, c):
        sched.add_request(r)
    first_victim = []

    def watch(step: int, out: SchedulerOutput) -> None:
        if out.preempted and not first_victim:
            first_victim.append(out.preempted[0].request_id)

    drive(sched, on_step=watch)
    assert first_victim == ["c"]
    assert c.metrics.num_preemptions >= 1
    for r in (a, b, c):
        assert r.output_token_ids == reference_output(r.prompt_token_ids, 14)
    assert sched.allocator.num_free_pages == 10


def test_refuses_requests_that_can_never_fit():
    sched = Scheduler(config(max_model_len=64, page_size=8, num_pages=5))
    with pytest.raises(ValueError, match="max_model_len=64"):
        sched.add_request(make_req("x", [1] * 60, max_tokens=10))
    with pytest.raises(ValueError, match="KV pages"):
        sched.add_request(make_req("y", [1] * 30, max_tokens=10))
    z = make_req("z", [1] * 20, max_tokens=10)
    sched.add_request(z)
    # Client ids are labels (the Engine refuses duplicates): the scheduler keys sequences by
    # the seq_id it assigns, so a second "z" is another sequence; one Sequence is queued once.
    z2 = make_req("z", [1], max_tokens=1)
    sched.add_request(z2)
    assert z.seq_id != z2.seq_id and sched.requests[z.seq_id] is z
    with pytest.raises(ValueError, match="queued before"):
        sched.add_request(z)


def test_abort_at_any_moment_frees_everything():
    for abort_step in range(0, 12):
        sched = Scheduler(config(max_num_batched_tokens=16, page_size=4, num_pages=40))
        reqs = [make_req(f"r{i}", list(range(1, 30 + i)), max_tokens=10) for i in range(4)]
        for r in reqs:
            sched.add_request(r)
        runner = FakeRunner(sched)
        for step in itertools.count():
            if not sched.has_unfinished():
                break
            out = sched.schedule()
            sampled = runner.run(out)
            if step == abort_step:
                sched.abort([reqs[1].seq_id, reqs[3].seq_id, 10**6])
            sched.update(out, sampled)
        assert reqs[1].finish_reason is FinishReason.ABORT
        assert reqs[0].output_token_ids == reference_output(reqs[0].prompt_token_ids, 10)
        assert sched.allocator.num_free_pages == 39


def test_prefix_cache_hits_and_counters():
    sched = Scheduler(config(page_size=4, max_num_batched_tokens=64))
    prompt = list(range(1, 19))  # 18 tokens: 4 full pages
    runner = FakeRunner(sched)  # one KV store across both requests, like the real pages
    first = make_req("first", prompt, max_tokens=2)
    sched.add_request(first)
    drive(sched, runner=runner)
    second = make_req("second", prompt + [7, 7], max_tokens=2)
    sched.add_request(second)
    drive(sched, runner=runner)
    assert second.metrics.num_cached_tokens == 16
    assert second.output_token_ids == reference_output(second.prompt_token_ids, 2)
    assert sched.allocator.prefix_hits >= 4
    assert sched.allocator.num_free_pages == sched.allocator.num_usable_pages


def test_eos_stop_ids_and_min_tokens():
    sched = Scheduler(config())
    prompt = [5, 6]
    ref = reference_output(prompt, 6)
    stopper = make_req("s", prompt, max_tokens=6, stop_token_ids=(ref[2],))
    early = make_req("m", prompt, max_tokens=6, stop_token_ids=(ref[0],), min_tokens=3)
    sched.add_request(stopper)
    sched.add_request(early)
    drive(sched)
    assert stopper.finish_reason is FinishReason.STOP and stopper.output_token_ids == ref[:3]
    # ref[0] reappears only if the sequence repeats; with min_tokens it runs to length.
    assert early.num_output_tokens >= 3


def test_n_samples_fork_shares_prompt_pages():
    for caching in (False, True):
        sched = Scheduler(config(page_size=4, enable_prefix_caching=caching))
        prompt = list(range(1, 23))  # 22 tokens: 5 full pages (the 6th holds 2)
        parent = make_req("g#0", prompt, max_tokens=3)
        sched.add_request(parent)
        kids = [make_req(f"g#{i}", prompt, max_tokens=3) for i in (1, 2)]
        for k in kids:
            sched.add_request(k, fork_of=parent)
        assert sched.num_waiting == 3
        drive(sched)
        for k in kids:
            assert k.metrics.num_cached_tokens == 20
            assert k.output_token_ids == reference_output(prompt, 3)
        assert sched.allocator.num_free_pages == sched.allocator.num_usable_pages


def test_allocator_lru_eviction_and_errors():
    alloc = BlockAllocator(num_pages=5, page_size=2)
    pages = alloc.allocate(4)
    assert 0 not in pages
    with pytest.raises(NoFreePages):
        alloc.allocate(1)
    hashes = hash_pages([1, 2, 3, 4, 5, 6, 7, 8], 2)
    for p, h in zip(pages, hashes):
        alloc.register(p, h)
    alloc.free(pages)
    assert alloc.num_free_pages == 4
    assert alloc.match_prefix(hashes[:2]) == pages[:2]
    alloc.free(pages[:2])
    # Eviction takes the least recently freed first: the tail of the sequence.
    fresh = alloc.allocate(1)
    assert fresh == [pages[3]]
    assert alloc.match_prefix(hashes) == pages[:3]
    with pytest.raises(ValueError):
        alloc.free([0])
    # Chained hashes: same page content after a different prefix hashes differently.
    assert hash_pages([9, 9, 1, 2], 2)[1] != hash_pages([8, 8, 1, 2], 2)[1]
