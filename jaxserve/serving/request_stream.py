"""One request's outputs on their way from the engine thread to an asyncio reader, bounded.

Data flow: the engine's loop thread `put`s each RequestOutput of the request into its
`RequestSink`. The sink holds at most ONE pending output: when the reader has not taken the
previous one yet, the new one is folded into it (`outputs.merge_unread`: deltas concatenated),
so a reader that falls behind gets one coalesced output instead of a queue. With the DELTA
output kind (what the servers ask for) an unread stream thus costs what its unread tokens
cost, never a copy of everything per step. Past `max_unread_tokens` unread tokens (summed over
the samples) the pending output is dropped, the sink records `StreamBufferFull` for the reader,
and `put` tells the loop thread to abort the request in the engine (its pages are freed by the
next step). A put that finds the sink empty asks for a wakeup: the loop thread sets the
sink's `ready` event on the reader's asyncio loop (batched, one call per loop per step).

`RequestStream` is the reader's side (an async iterator); leaving it early aborts the request.
Errors (refusal by the engine, EngineStopped, StreamBufferFull) are raised by `__anext__` after
whatever output was pending before them.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Protocol

from jaxserve.engine.outputs import RequestOutput, merge_unread

# Unread tokens a stream may hold before its request is aborted (ServerConfig's default).
DEFAULT_MAX_STREAM_BUFFER_TOKENS = 4096


class StreamBufferFull(RuntimeError):
    """The reader left too many tokens unread: its request was aborted (RESOURCE_EXHAUSTED on
    gRPC, an error event on an HTTP stream)."""


class _Aborter(Protocol):
    def abort(self, request_id: str) -> None: ...


class RequestSink:
    """The pending output (or error) of one request: written by the engine's loop thread,
    read by one asyncio loop."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop,
                 max_unread_tokens: int | None) -> None:
        self.request_id = request_id
        self.loop = loop
        self.max_unread_tokens = max_unread_tokens
        self.ready = asyncio.Event()  # set on `loop` when something is pending
        # Set by the loop thread before the final output is handed over (and before the id
        # may be reused): a late abort from the reader must not hit a new request with this id.
        self.finished = False
        self.closed = False  # the reader left: later outputs are dropped at once
        self._lock = threading.Lock()
        self._pending: RequestOutput | None = None
        self._error: BaseException | None = None
        self._unread_tokens = 0

    # ----------------------------------------------------------------------- loop thread
    def put(self, out: RequestOutput) -> tuple[bool, bool]:
        """Hand over `out` (now owned by the sink); returns (wake the reader, the reader fell
        past the bound: abort the request)."""
        with self._lock:
            if self.closed or self._error is not None:
                return False, False  # nobody will read it (or the stream already failed)
            was_empty = self._pending is None
            if self._pending is None:
                self._pending = out
            else:
                merge_unread(self._pending, out)
            self._unread_tokens += out.num_delta_tokens
            limit = self.max_unread_tokens
            if limit is None or out.finished or self._unread_tokens <= limit:
                return was_empty, False
            self._error = StreamBufferFull(
                f"aborted: the client did not read {self._unread_tokens} tokens "
                f"(max_stream_buffer_tokens={limit})")
            self._pending = None  # its memory goes now, not when the reader comes back
            self._unread_tokens = 0
            return True, True

    def fail(self, error: BaseException) -> bool:
        """Record an error for the reader (after what is pending); True: wake the reader."""
        with self._lock:
            if self._error is not None:
                return False
            self._error = error
            return self._pending is None

    @property
    def unread_tokens(self) -> int:
        with self._lock:
            return self._unread_tokens

    @property
    def holds_output(self) -> bool:
        with self._lock:
            return self._pending is not None

    # ----------------------------------------------------------------------- reader's loop
    def take(self) -> RequestOutput | None:
        """The pending output (None: nothing yet, and `ready` is cleared); raises the
        recorded error once nothing is pending before it."""
        with self._lock:
            item, self._pending = self._pending, None
            self._unread_tokens = 0
            if item is None:
                if self._error is not None:
                    raise self._error
                self.ready.clear()  # under the lock: a put after this schedules a new set
            return item

    def close(self) -> None:
        with self._lock:
            self.closed = True
            self._pending = None


def set_ready(sinks: list[RequestSink]) -> None:
    """Runs on the readers' loop: wake each sink's reader."""
    for sink in sinks:
        sink.ready.set()


def wake(sink: RequestSink) -> None:
    """Wake one reader from any thread (nothing to do if its loop is closed)."""
    try:
        sink.loop.call_soon_threadsafe(sink.ready.set)
    except RuntimeError:
        pass  # that loop is closed: nobody is left to read


class RequestStream:
    """Async iterator over one request's RequestOutputs; ends after the finished one."""

    def __init__(self, engine: _Aborter, sink: RequestSink):
        self._engine = engine
        self._sink = sink
        self.done = False

    @property
    def request_id(self) -> str:
        return self._sink.request_id

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.done:
            raise StopAsyncIteration
        while True:
            try:
                item = self._sink.take()
            except BaseException:
                self.done = True
                raise
            if item is not None:
                self.done = item.finished
                return item
            await self._sink.ready.wait()

    def abort(self) -> None:
        """Abort the request unless it already finished (idempotent, any thread)."""
        if not self.done:
            self.done = True
            self._sink.close()
            if not self._sink.finished:
                self._engine.abort(self.request_id)
