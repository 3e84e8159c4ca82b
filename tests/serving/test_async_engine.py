"""AsyncEngine on the arithmetic fake runner: streams equal the offline Engine's outputs, and
aborts, backpressure, shutdown and failures behave. A gated runner lets a test decide when
each step may run, so no test depends on timing."""

from __future__ import annotations

import asyncio

import pytest
from support.engine_fixtures import VOCAB
from support.fake_engines import (DEADLINE_S, FailingRunner, GatedRunner, all_pages_free,
                                  fake_engine, wait_until)

from jaxserve import SamplingParams
from jaxserve.config import EngineConfig
from jaxserve.engine.fake_runner import ArithmeticRunner
from jaxserve.engine.sequence import FinishReason
from jaxserve.serving.async_engine import AsyncEngine, EngineStopped, QueueFull

REQUESTS = [
    ([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)),
    ("w9 w10 w11 w12", SamplingParams(temperature=0.7, seed=3, max_tokens=20, ignore_eos=True)),
    ([40] * 30, SamplingParams(max_tokens=5, n=3, seed=1, ignore_eos=True)),
    ([7, 8], SamplingParams(max_tokens=30, stop_token_ids=(100,), logprobs=2)),
    ([9] * 70, SamplingParams(max_tokens=9, ignore_eos=True)),
]


def offline(requests) -> dict:  # noqa: ANN001
    eng = fake_engine()
    for i, (prompt, params) in enumerate(requests):
        eng.add_request(f"r{i}", prompt, params)
    finals = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


def test_streams_equal_offline_engine() -> None:
    expected = offline(REQUESTS)
    engine = fake_engine()
    ae = AsyncEngine(engine)
    ae.start()

    async def run(i: int, prompt, params) -> tuple:  # noqa: ANN001
        texts: dict[int, str] = {}
        ids: dict[int, list[int]] = {}
        lps: dict[int, list] = {}
        last = None
        async for out in ae.submit(f"r{i}", prompt, params):  # DELTA outputs
            for c in out.outputs:
                texts[c.index] = texts.get(c.index, "") + c.delta_text
                ids.setdefault(c.index, []).extend(c.delta_token_ids)
                lps.setdefault(c.index, []).extend(c.delta_logprobs)
            last = out
        return texts, ids, lps, last

    async def main() -> list:
        return await asyncio.gather(*(run(i, p, sp) for i, (p, sp) in enumerate(REQUESTS)))

    try:
        results = asyncio.run(main())
    finally:
        ae.stop()
    for i, (texts, ids, lps, last) in enumerate(results):
        want = expected[f"r{i}"]
        assert last.finished
        for c, w in zip(last.outputs, want.outputs):
            assert c.finish_reason == w.finish_reason, f"request {i}"
            assert c.num_tokens == len(w.token_ids)
            assert c.cumulative_logprob == w.cumulative_logprob
            # The deltas a stream carries add up to the cumulative output.
            assert ids[c.index] == w.token_ids and texts[c.index] == w.text
            assert lps[c.index] == (w.logprobs or [])
    assert all_pages_free(engine) and ae.num_in_flight == 0


def test_leaving_a_stream_aborts_and_frees_pages_within_a_step() -> None:
    runner = GatedRunner()
    engine = fake_engine(runner)
    alloc = engine.scheduler.allocator
    ae = AsyncEngine(engine)
    ae.start()

    async def main() -> int:
        stream = ae.submit("long", [5] * 20, SamplingParams(max_tokens=100, ignore_eos=True))
        runner.allow(2)  # overlapped steps: a step's output comes once the next is dispatched
        got = 0
        async for out in stream:  # one step per output
            got += len(out.outputs[0].delta_token_ids)
            if got >= 2:
                break  # what a cancelled / disconnected gRPC call does
            runner.allow(1)
        assert alloc.num_free_pages < alloc.num_usable_pages
        steps = runner.steps
        stream.abort()
        return steps

    try:
        steps = asyncio.run(main())
        runner.allow(1)  # at most the step already under way; the abort lands right after it
        wait_until(lambda: all_pages_free(engine), "the aborted request's pages")
        # Its final (ABORT) output needs no model step.
        wait_until(lambda: not engine.has_unfinished() and ae.num_in_flight == 0,
                   "the engine to drop the request")
        assert runner.steps <= steps + 1
    finally:
        runner.allow(1000)
        ae.stop()


def test_waiting_queue_is_bounded() -> None:
    runner = GatedRunner()
    engine = fake_engine(runner, max_num_seqs=1, max_num_batched_tokens=16)
    ae = AsyncEngine(engine, max_waiting=3)
    ae.start()
    params = SamplingParams(max_tokens=2, ignore_eos=True)

    async def main() -> None:
        streams = [ae.submit(f"r{i}", [5, 6], params) for i in range(3)]
        with pytest.raises(QueueFull, match=r"max_waiting=3"):
            ae.submit("r3", [5, 6], params)
        runner.allow(1000)
        for s in streams:
            async for _ in s:
                pass
        async for out in ae.submit("again", [5, 6], params):  # room again
            last = out
        assert last.outputs[0].finish_reason is FinishReason.LENGTH

    try:
        asyncio.run(main())
    finally:
        runner.allow(1000)
        ae.stop()


def test_duplicate_and_invalid_requests() -> None:
    runner = GatedRunner()
    engine = fake_engine(runner)
    ae = AsyncEngine(engine)
    ae.start()

    async def main() -> None:
        stream = ae.submit("dup", [5, 6], SamplingParams(max_tokens=3, ignore_eos=True))
        with pytest.raises(ValueError, match=r"request_id='dup' is already in flight"):
            ae.submit("dup", [5, 6], SamplingParams())
        runner.allow(1000)
        bad = ae.submit("bad", [5, VOCAB + 1], SamplingParams())
        with pytest.raises(ValueError, match=r"prompt_token_ids\[1\]=212 is outside"):
            await bad.__anext__()
        async for _ in stream:
            pass
        # Both ids are free again once finished / refused.
        for rid in ("dup", "bad"):
            async for _ in ae.submit(rid, [5], SamplingParams(max_tokens=1)):
                pass

    try:
        asyncio.run(main())
    finally:
        runner.allow(1000)
        ae.stop()
    assert all_pages_free(engine)


def test_stop_ends_streams_with_abort() -> None:
    runner = GatedRunner()
    engine = fake_engine(runner)
    ae = AsyncEngine(engine)
    ae.start()

    async def main() -> list:
        stream = ae.submit("x", [5] * 9, SamplingParams(max_tokens=100, ignore_eos=True))
        runner.allow(2)
        first = await stream.__anext__()
        assert not first.finished
        ae.request_stop()  # before any further step may run: the request cannot finish
        runner.allow(1000)
        outs = [out async for out in stream]
        ae.stop(DEADLINE_S)
        return outs

    outs = asyncio.run(main())
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason is FinishReason.ABORT
    assert all_pages_free(engine)

    async def refused() -> None:
        with pytest.raises(EngineStopped):
            ae.submit("late", [5], SamplingParams())

    asyncio.run(refused())


def test_engine_failure_reaches_every_stream() -> None:
    failures: list[BaseException] = []
    ae = AsyncEngine(fake_engine(FailingRunner(VOCAB)), on_failure=failures.append)
    ae.start()

    async def main() -> None:
        with pytest.raises(EngineStopped, match="device lost"):
            async for _ in ae.submit("a", [5], SamplingParams()):
                pass
        with pytest.raises(EngineStopped, match="failed"):
            ae.submit("b", [5], SamplingParams())

    try:
        asyncio.run(main())
    finally:
        ae.stop()
    assert len(failures) == 1 and "device lost" in str(failures[0])


class RecordingRunner(ArithmeticRunner):
    """Records how many sequences each dispatched step holds."""

    def __init__(self) -> None:
        super().__init__(VOCAB)
        self.seqs_per_step: list[int] = []

    def dispatch(self, batch):  # noqa: ANN001, ANN201 - the Runner protocol
        self.seqs_per_step.append(int(batch.forward.num_seqs[0]))
        return super().dispatch(batch)


def test_an_idle_engine_gathers_a_burst_into_one_step() -> None:
    """Requests arriving 10 ms apart at an idle engine are all in the first step (prefilled
    together). Without the window the loop wakes on the first at once and runs it alone
    (checked by hand with idle_batch_window_ms=0: not asserted, it depends on timing)."""
    runner = RecordingRunner()
    ae = AsyncEngine(fake_engine(runner, idle_batch_window_ms=1000.0))
    ae.start()
    params = SamplingParams(max_tokens=3, ignore_eos=True)

    async def burst() -> None:
        streams = []
        for i in range(4):
            streams.append(ae.submit(f"b{i}", [5 + i, 6, 7], params))
            await asyncio.sleep(0.01)  # the clients' spread, not synchronisation

        async def drain(stream) -> None:  # noqa: ANN001
            async for _ in stream:
                pass
        await asyncio.gather(*(drain(s) for s in streams))

    try:
        asyncio.run(burst())
    finally:
        ae.stop()
    assert runner.seqs_per_step[0] == 4


def test_idle_batch_window_bounds() -> None:
    with pytest.raises(ValueError, match="idle_batch_window_ms"):
        EngineConfig(idle_batch_window_ms=-1.0)
