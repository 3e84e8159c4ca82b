"""Bounded streams (issue #13): output kinds, the one-slot request sink, and slow readers.

The oracle for every output kind is the CUMULATIVE kind (the engine's behaviour before output
kinds existed): DELTA deltas concatenated and the one FINAL_ONLY output must equal its final
output. The arithmetic fake runner (with made-up top logprobs, so a logprobs entry holds 21
tokens as a real one does) makes every run reproducible; a gated runner lets a test decide
when each step runs, so nothing depends on timing. The fronts' tests run a real server over
the fake engine with a small `max_stream_buffer_tokens` and a client that stops reading.
"""

from __future__ import annotations

import asyncio
import gc
import json
import socket
import threading
import time
import tracemalloc
import weakref

import grpc
import numpy as np
import pytest
from support.engine_fixtures import VOCAB, tiny_model_config, tiny_tokenizer

from jaxserve import SamplingParams
from jaxserve.config import EngineConfig
from jaxserve.engine.engine import Engine
from jaxserve.engine.fake_runner import ArithmeticRunner
from jaxserve.engine.outputs import RequestOutputKind, merge_unread
from jaxserve.engine.sequence import FinishReason
from jaxserve.engine.sizing import plan_engine
from jaxserve.server.background import BackgroundServer
from jaxserve.server.client import AsyncClient, Client
from jaxserve.server.config import ServerConfig
from jaxserve.serving.async_engine import AsyncEngine, StreamBufferFull
from jaxserve.serving.served import ServedModel

DEADLINE_S = 60.0
K = RequestOutputKind


class TopLogprobsRunner(ArithmeticRunner):
    """Arithmetic tokens, plus distinct top-N ids and logprobs derived from them."""

    def collect(self, pending):  # noqa: ANN001, ANN201 - the Runner protocol
        r = super().collect(pending)
        k = r.top_ids.shape[1]
        base = r.tokens.astype(np.int64)[:, None]
        r.top_ids[:] = (base + 1 + np.arange(k)) % self.vocab_size
        r.top_logprobs[:] = -0.01 * (np.arange(k) + 1) - 0.001 * base
        r.logprob[:] = -0.005 * r.tokens
        return r


class SteppedRunner(TopLogprobsRunner):
    """Every step waits for the test's permit; `entered` counts the steps begun, so a test
    knows that step i's outputs were handed over once step i+1 has begun."""

    def __init__(self) -> None:
        super().__init__(VOCAB)
        self._permits = threading.Semaphore(0)
        self._cond = threading.Condition()
        self.entered = 0

    def allow(self, steps: int = 1) -> None:
        for _ in range(steps):
            self._permits.release()

    def wait_entered(self, count: int) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: self.entered >= count, DEADLINE_S):
                raise AssertionError(f"step {count} never began")

    def dispatch(self, batch):  # noqa: ANN001, ANN201
        with self._cond:
            self.entered += 1
            self._cond.notify_all()
        if not self._permits.acquire(timeout=DEADLINE_S):
            raise TimeoutError("the test never allowed this step")
        return super().dispatch(batch)


def fake_engine(runner: ArithmeticRunner | None = None, **cfg: object) -> Engine:
    base = dict(max_num_seqs=8, max_num_batched_tokens=64, page_size=8, max_model_len=1024,
                attention_impl="reference")
    base.update(cfg)
    config = EngineConfig(**base)  # type: ignore[arg-type]
    plan = plan_engine(config, tiny_model_config(max_position_embeddings=8192), 4, 1 << 30)
    return Engine(config, plan, runner or TopLogprobsRunner(VOCAB), tiny_tokenizer(), (2,))


def wait_until(predicate, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + DEADLINE_S
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)  # polling with a deadline, not synchronisation by sleep


def all_pages_free(engine: Engine) -> bool:
    alloc = engine.scheduler.allocator
    return alloc.num_free_pages == alloc.num_usable_pages


REQUESTS = [
    ([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)),
    ("w9 w10 w11 w12", SamplingParams(temperature=0.7, seed=3, max_tokens=20, ignore_eos=True,
                                      logprobs=5)),
    ([40] * 30, SamplingParams(max_tokens=9, n=3, seed=1, ignore_eos=True, logprobs=20)),
    ([7, 8], SamplingParams(max_tokens=30, stop_token_ids=(100,), logprobs=2)),
    ([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                               stop=("w1",))),  # a stop string: held-back text
]


def run_kind(kind: RequestOutputKind) -> dict[str, list]:
    """Every output of REQUESTS, per request, on a fresh engine with this output kind."""
    eng = fake_engine()
    for i, (prompt, params) in enumerate(REQUESTS):
        eng.add_request(f"r{i}", prompt, params, output_kind=kind)
    outs: dict[str, list] = {f"r{i}": [] for i in range(len(REQUESTS))}
    while eng.has_unfinished():
        for out in eng.step():
            outs[out.request_id].append(out)
        if kind is K.DELTA:  # the engine keeps no logprob history for DELTA requests
            assert all(not s.output_logprobs for g in eng._groups.values() for s in g.seqs)
    assert all_pages_free(eng) and not eng._groups
    return outs


def assert_final_equal(got, want) -> None:  # noqa: ANN001 - CompletionOutputs
    assert got.text == want.text and got.token_ids == want.token_ids
    assert got.logprobs == want.logprobs
    assert got.cumulative_logprob == want.cumulative_logprob
    assert got.finish_reason == want.finish_reason and got.num_tokens == len(want.token_ids)


def test_delta_and_final_only_equal_cumulative() -> None:
    cumulative, delta, final_only = run_kind(K.CUMULATIVE), run_kind(K.DELTA), \
        run_kind(K.FINAL_ONLY)
    assert any(c.finish_reason is FinishReason.STOP_STRING
               for c in cumulative["r4"][-1].outputs), "the stop string never matched"
    for rid, outs in cumulative.items():
        want = outs[-1]
        assert want.finished and len(delta[rid]) == len(outs)
        for c in want.outputs:
            ds = [o.outputs[c.index] for o in delta[rid]]
            assert "".join(d.delta_text for d in ds) == c.text, rid
            assert [t for d in ds for t in d.delta_token_ids] == c.token_ids
            assert [e for d in ds for e in d.delta_logprobs] == (c.logprobs or [])
            # A DELTA output carries no cumulative copy, only the running counts.
            assert all(d.text == "" and d.token_ids == [] for d in ds)
            assert ds[-1].num_tokens == len(c.token_ids)
            assert ds[-1].cumulative_logprob == c.cumulative_logprob
            assert ds[-1].finish_reason == c.finish_reason
        # FINAL_ONLY: exactly one output, the cumulative final (its deltas: everything).
        assert len(final_only[rid]) == 1 and final_only[rid][0].finished
        for got, c in zip(final_only[rid][0].outputs, want.outputs):
            assert_final_equal(got, c)
            assert got.delta_token_ids == c.token_ids and got.delta_text == c.text


async def _first_item(stream):  # noqa: ANN001, ANN202
    return await stream.__anext__()


def test_unread_stream_holds_one_coalesced_output() -> None:
    """Never read while 150 steps run: one pending output, its unread count growing by n a
    step and its memory by a constant a step (tracemalloc, printed); read once, it equals
    the cumulative oracle; the engine ends with nothing held."""
    runner = SteppedRunner()
    engine = fake_engine(runner)
    ae = AsyncEngine(engine, max_stream_buffer_tokens=None)
    ae.start()
    params = SamplingParams(n=4, logprobs=20, max_tokens=150, ignore_eos=True, seed=5)
    steps = params.max_tokens - 1
    loop = asyncio.new_event_loop()
    try:
        stream = loop.run_until_complete(_submit(ae, "slow", [5, 6, 7], params))
        sink = stream._sink
        tracemalloc.start()
        try:
            sizes = []
            runner.allow()  # overlapped steps: step i is applied once step i+1 is dispatched
            for i in range(steps - 1):
                runner.allow()
                runner.wait_entered(i + 3)  # step i+1's output is in the sink
                # (the engine thread waits in step i+3: its state can be read)
                generated = sum(s.num_output_tokens for s in engine._groups["slow"].seqs)
                assert sink.holds_output and sink.unread_tokens == generated > i
                assert len(ae._sinks) == 1
                if i in (9, 74, 139):
                    gc.collect()
                    sizes.append(tracemalloc.get_traced_memory()[0])
            runner.allow(8)  # the last steps (forked samples may trail by a step)
            wait_until(lambda: ae.num_in_flight == 0, "the request to finish")
            out = loop.run_until_complete(_first_item(stream))
        finally:
            tracemalloc.stop()
    finally:
        ae.stop()
        loop.close()
    first, second = sizes[1] - sizes[0], sizes[2] - sizes[1]  # 65 steps each
    print(f"\nunread n=4 logprobs=20 stream: {first / 65 / 4:.0f} B per unread token over "
          f"steps 10-75, {second / 65 / 4:.0f} over steps 75-140")
    assert second < 1.5 * first, "per-step growth is not constant: outputs are being copied"
    assert out.finished and stream.done
    want = run_one(K.CUMULATIVE, [5, 6, 7], params)
    for got, c in zip(out.outputs, want.outputs):
        assert got.delta_text == c.text and got.delta_token_ids == c.token_ids
        assert got.delta_logprobs == c.logprobs and got.num_tokens == len(c.token_ids)
    assert all_pages_free(engine) and not ae._sinks and engine.num_requests == 0


async def _submit(ae: AsyncEngine, rid: str, prompt, params, **kw):  # noqa: ANN001, ANN202
    return ae.submit(rid, prompt, params, **kw)


def run_one(kind: RequestOutputKind, prompt, params: SamplingParams):  # noqa: ANN001, ANN201
    eng = fake_engine()
    eng.add_request("x", prompt, params, output_kind=kind)
    last = None
    while eng.has_unfinished():
        for out in eng.step():
            last = out
    return last


def test_past_the_limit_the_request_is_aborted_and_others_carry_on() -> None:
    engine = fake_engine()
    ae = AsyncEngine(engine, max_stream_buffer_tokens=10)
    ae.start()
    long = SamplingParams(n=2, max_tokens=200, ignore_eos=True, logprobs=3)
    short = SamplingParams(n=2, max_tokens=5, ignore_eos=True)  # 10 tokens: within the bound
    # Read as it comes; the fake runner's steps take microseconds, so a reader could lag by
    # more than 10 tokens on a busy machine: within the bound whatever the timing.
    reader = SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.0)

    async def main() -> tuple:
        slow = ae.submit("slow", [5, 6, 7], long)
        fits = ae.submit("fits", [9, 9], short)
        read = ae.submit("read", [1, 2, 3], reader)
        ids = [t async for out in read for t in out.outputs[0].delta_token_ids]
        await asyncio.to_thread(wait_until, lambda: ae.num_in_flight == 0, "every request")
        # The aborted stream's pending output was dropped at once, before anyone read.
        assert not slow._sink.holds_output
        with pytest.raises(StreamBufferFull) as err:
            await slow.__anext__()
        outs = [out async for out in fits]
        return ids, str(err.value), outs

    try:
        ids, message, fits = asyncio.run(main())
    finally:
        ae.stop()
    assert "did not read" in message and "max_stream_buffer_tokens=10" in message
    assert ids == run_one(K.CUMULATIVE, [1, 2, 3], reader).outputs[0].token_ids
    # Unread but within the bound, a whole request comes as one coalesced output.
    want = run_one(K.CUMULATIVE, [9, 9], short)
    assert len(fits) == 1
    for got, c in zip(fits[0].outputs, want.outputs):
        assert got.delta_token_ids == c.token_ids and got.finish_reason is FinishReason.LENGTH
    assert all_pages_free(engine) and not ae._sinks and engine.num_requests == 0


def test_finished_requests_leave_nothing_behind() -> None:
    """The outputs of a stream nobody read are garbage once the request ended and its stream
    was dropped (no sink, group or detokenizer keeps them)."""
    engine = fake_engine()
    ae = AsyncEngine(engine, max_stream_buffer_tokens=8)
    ae.start()

    async def main() -> list:
        refs = []
        for rid in ("a", "b"):
            stream = ae.submit(rid, [5, 6], SamplingParams(n=2, max_tokens=100, logprobs=20,
                                                           ignore_eos=True))
            await asyncio.to_thread(wait_until, lambda: not ae.holds(rid), rid)
            refs.append(weakref.ref(stream._sink))
            stream.abort()
        return refs

    try:
        refs = asyncio.run(main())
    finally:
        ae.stop()
    gc.collect()
    assert [r() for r in refs] == [None, None]
    assert all_pages_free(engine) and engine.num_requests == 0 and not ae._sinks


def test_memory_held_by_an_unread_stream_before_and_after() -> None:
    """For the issue note: bytes held by an unread n=4, logprobs=20 stream after 250 tokens
    per sample. Before: the old unbounded queue held every CUMULATIVE output (a fresh copy of
    everything so far each step). After: the sink holds one coalesced DELTA output."""
    params = SamplingParams(n=4, logprobs=20, max_tokens=250, ignore_eos=True, seed=2)

    def held(kind: RequestOutputKind, keep_all: bool) -> int:
        eng = fake_engine()
        eng.add_request("u", [5, 6, 7], params, output_kind=kind)
        gc.collect()
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            kept: list = []
            pending = None
            while eng.has_unfinished():
                for out in eng.step():
                    if keep_all:
                        kept.append(out)
                    elif pending is None:
                        pending = out
                    else:
                        merge_unread(pending, out)
            gc.collect()
            return tracemalloc.get_traced_memory()[0] - base
        finally:
            tracemalloc.stop()

    before, after = held(K.CUMULATIVE, True), held(K.DELTA, False)
    print(f"\nunread n=4 logprobs=20 stream after 250 tokens/sample: before {before / 1e6:.1f} "
          f"MB (every cumulative output queued), after {after / 1e6:.2f} MB (one coalesced "
          f"delta output; bounded by max_stream_buffer_tokens)")
    assert after * 20 < before


# --------------------------------------------------------------------------- the fronts
FRONT_LIMIT = 64  # unread tokens (over the samples) before the request is aborted
HEAVY = dict(n=4, logprobs=20, max_tokens=8000, ignore_eos=True)  # ~1.5 KB per step on a wire


class DeviceTimeRunner(TopLogprobsRunner):
    """Steps that take 2 ms, as a small model's would: the fake runner's microsecond steps
    would outrun the server's own handler (which then lags by more than FRONT_LIMIT tokens
    whatever the client does), not what these tests are about."""

    def collect(self, pending):  # noqa: ANN001, ANN201
        time.sleep(0.002)  # simulated device time, not synchronisation
        return super().collect(pending)


@pytest.fixture(scope="module")
def server() -> BackgroundServer:
    cfg = ServerConfig(port=0, http_port=0, max_stream_buffer_tokens=FRONT_LIMIT)
    srv = BackgroundServer(cfg, lambda: ServedModel(
        fake_engine(DeviceTimeRunner(VOCAB), max_model_len=8192), "fake", "hf")).start()
    yield srv
    srv.stop()


def settled(server: BackgroundServer) -> bool:
    eng = server.server.engine.engine
    return server.server.engine.num_in_flight == 0 and not eng.has_unfinished() and \
        all_pages_free(eng)


def test_grpc_client_that_stops_reading_is_aborted(server: BackgroundServer) -> None:
    # No BDP probing: the client's flow-control window stays small, so the server's writes
    # block once the client stops reading (as they would behind a slow network).
    opts = [("grpc.http2.bdp_probe", 0)]

    async def main() -> tuple:
        async with AsyncClient(server.target, options=opts) as client:
            call = client.stream([5, 6, 7], SamplingParams(**HEAVY))
            first = await call.read()
            assert first.HasField("chunk")
            # Then nothing is read until the server has aborted the request.
            await asyncio.to_thread(wait_until, lambda: settled(server), "the abort")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                while await call.read() is not grpc.aio.EOF:
                    pass
            # The server stays healthy: the next request runs.
            ok = [m async for m in client.stream([9], SamplingParams(max_tokens=3))]
        return err.value, ok

    err, ok = asyncio.run(main())
    assert err.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, err
    assert f"max_stream_buffer_tokens={FRONT_LIMIT}" in err.details()
    assert ok[-1].HasField("finished") and ok[-1].finished.usage.completion_tokens == 3
    assert settled(server) and server.server.engine.error is None


def test_http_client_that_stops_reading_is_aborted(server: BackgroundServer) -> None:
    port = server.server.http_port
    body = json.dumps({"prompt": [5, 6, 7], "stream": True, **HEAVY}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window
    sock.connect(("127.0.0.1", port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    head = sock.recv(64)
    assert head.startswith(b"HTTP/1.1 200"), head
    wait_until(lambda: settled(server), "the abort")  # while the client reads nothing
    raw = bytearray(head)
    sock.settimeout(DEADLINE_S)
    while not raw.endswith(b"0\r\n\r\n"):  # the chunked body's end
        data = sock.recv(1 << 16)
        assert data, "the server closed the connection without ending the stream"
        raw += data
    sock.close()
    text = raw.decode(errors="replace")
    assert '"code":"stream_buffer_full"' in text and f"max_stream_buffer_tokens={FRONT_LIMIT}" \
        in text and "data: [DONE]" in text
    with Client(server.target) as client:  # still healthy
        assert client.generate([5], SamplingParams(max_tokens=2))[0].finish_reason == "LENGTH"
    assert settled(server)
