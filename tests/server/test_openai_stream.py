"""stream_sse's client-gone paths, driven directly with a mocked aiohttp request: a client
that disconnects mid-stream, and one that stops reading until the write times out. Either
ends the stream quietly (no exception reaches aiohttp, which would log a 500-like error),
closes the socket, and stops consuming the engine's outputs (the caller's `finally` then
aborts the request). A real socket cannot make these deterministic: when a disconnect is
noticed depends on the kernel's buffers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from unittest import mock

from aiohttp.test_utils import make_mocked_request
from jaxserve.server.openai_stream import stream_sse

from jaxserve.engine.outputs import CompletionOutput, RequestOutput
from jaxserve.engine.sequence import RequestMetrics


def _output(i: int) -> RequestOutput:
    c = CompletionOutput(index=0, text="", token_ids=[i], cumulative_logprob=None,
                         logprobs=None, delta_token_ids=[i])
    return RequestOutput(request_id="r", prompt=None, prompt_token_ids=[1], outputs=[c],
                         finished=False, metrics=RequestMetrics(arrival_time=0.0))


def _run(write_side_effect, body_timeout: float) -> tuple[list[int], mock.Mock, mock.Mock]:
    """Streams up to 5 outputs through stream_sse whose payload writer's `write` behaves as
    `write_side_effect`; returns the outputs consumed, the writer and the transport."""
    consumed: list[int] = []

    async def outputs() -> AsyncIterator[RequestOutput]:
        for i in range(5):
            consumed.append(i)
            yield _output(i)

    async def main() -> tuple[mock.Mock, mock.Mock]:
        transport = mock.Mock()
        writer = mock.Mock()
        writer.write_headers = mock.AsyncMock()
        writer.write = mock.AsyncMock(side_effect=write_side_effect)
        writer.write_eof = mock.AsyncMock()
        writer.drain = mock.AsyncMock()
        writer.buffer_size = 0
        writer.output_size = 0
        request = make_mocked_request("POST", "/v1/completions", writer=writer,
                                      transport=transport)
        await stream_sse(request, "r", outputs(), lambda out: [{"token": out.outputs[0].token_ids}],
                         lambda: [{"usage": {}}], body_timeout=body_timeout)
        return writer, transport

    writer, transport = asyncio.run(main())
    return consumed, writer, transport


def test_a_disconnect_mid_stream_ends_it_quietly_and_closes_the_socket() -> None:
    writes = 0

    def write(data: bytes) -> None:
        nonlocal writes
        writes += 1
        if writes == 2:  # the first event went out; the client is gone before the second
            raise ConnectionResetError("Cannot write to closing transport")

    consumed, writer, transport = _run(write, body_timeout=30.0)
    assert consumed == [0, 1], consumed  # nothing read from the engine after the failure
    assert writer.write.await_count == 2
    writer.write_eof.assert_not_awaited()  # no [DONE] and no end of body on a dead socket
    transport.close.assert_called_once()


def test_a_reader_that_stops_gets_body_timeout_seconds_then_its_socket_closed() -> None:
    async def never_drains(data: bytes) -> None:
        await asyncio.Event().wait()  # the socket's buffers are full: this write never ends

    consumed, writer, transport = _run(never_drains, body_timeout=0.05)
    assert consumed == [0], consumed
    writer.write_eof.assert_not_awaited()
    transport.close.assert_called_once()
