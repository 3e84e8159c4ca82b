"""AsyncEngine: the synchronous Engine driven by one thread, streamed to asyncio callers.

Data flow:
  caller (any asyncio loop) -> `submit()` checks duplicates and the waiting bound, appends an
  `_Add` command to a lock-guarded list and wakes the loop thread -> the loop thread (the only
  thread that ever touches the Engine) drains the commands each iteration, runs
  `engine.step()`, and hands each RequestOutput to its request's `RequestSink`
  (`request_stream.py`: later outputs folded into a pending one while the reader is behind;
  past `max_stream_buffer_tokens` unread tokens the request is aborted and the reader gets
  `StreamBufferFull`), waking the readers with one `loop.call_soon_threadsafe` per asyncio
  loop per step -> `RequestStream` (an async iterator; leaving it early aborts the request).
  Outputs are of the caller's `RequestOutputKind` (DELTA by default: only what is new).
  Idle, the loop thread sleeps on a condition variable; woken by a request, it may wait
  `idle_batch_window_ms` for others arriving with it (`idle_window.py` decides).
  A live change is a command too (`call`: `admin_settings.py`'s scheduler changes,
  `lora_adapters.py`'s adapter loads), run between two steps in order with the adds around
  it; an add naming an adapter is bound then (`lora_requests.bind_registered`).

A ValueError from `Engine.add_request` (naming the field) is raised by the stream's first
`__anext__`; `QueueFull` by `submit()` at once, when more than `max_waiting` sequences would
wait. Tokenization and the request checks are the caller's (an `Admitted` request from
`serving.admission`), on its threads, not between steps.

A step failure the Engine isolates reaches only its requests (their final output has
finish_reason ERROR and `error`). Only a fatal one (`EngineDead`, or anything else out of
`step`) fails the loop: every stream gets EngineStopped, `error` is set (the fronts' health
reports it) and `on_failure` runs (the server then exits non-zero).

Observers (`serving.metrics.EngineMetrics`) are called on the loop thread after every
iteration with its stats and outputs; their errors are logged, never fatal.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
from typing import Any, Callable, Mapping, Protocol, Sequence

from jaxserve.engine.errors import Overloaded  # noqa: F401 (re-exported: the fronts catch it)
from jaxserve.engine.engine import Engine
from jaxserve.engine.lora_request import LoRARequest
from jaxserve.engine.limits import (Admitted, EngineStats, check_not_in_flight,
                                    check_request_id)
from jaxserve.engine.outputs import RequestOutput, RequestOutputKind
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.serving.idle_window import IdleWindow
from jaxserve.serving.lora_requests import bind_registered
from jaxserve.serving.request_stream import (DEFAULT_MAX_STREAM_BUFFER_TOKENS, RequestSink,
                                             RequestStream, StreamBufferFull, set_ready,
                                             wake)

__all__ = ["AsyncEngine", "EngineStopped", "Overloaded", "QueueFull", "RequestStream", "StreamBufferFull",
           "StepObserver"]

log = logging.getLogger(__name__)


class QueueFull(Overloaded):
    """Too many sequences are waiting; the caller should retry later (RESOURCE_EXHAUSTED)."""


class EngineStopped(RuntimeError):
    """The engine is not accepting requests: not started, shutting down, or failed."""


class StepObserver(Protocol):
    def on_step(self, stats: EngineStats, outputs: Sequence[RequestOutput],
                stepped: bool) -> None:
        """On the loop thread after each iteration (`stepped`: a model step ran)."""


@dataclasses.dataclass(eq=False)
class _Add:
    sink: RequestSink
    prompt: str | list[int] | Admitted
    params: SamplingParams
    priority: int
    arrival_time: float
    output_kind: RequestOutputKind
    queued_at: float  # time.monotonic() at submit (the idle window's clock)
    lora: LoRARequest | None = None  # the registered adapter it runs under (None: base)


@dataclasses.dataclass(eq=False)
class _Abort:
    request_id: str  # "" aborts every request in flight


@dataclasses.dataclass(eq=False)
class _Call:
    """`fn(engine)` run by the loop thread between two steps (a live change)."""

    fn: Callable[[Engine], Any]
    done: "concurrent.futures.Future[Any]"  # fn's result, or what it raised


class AsyncEngine:
    """Owns one thread that alone drives `engine`; see the module docstring."""

    def __init__(self, engine: Engine, max_waiting: int | None = None,
                 observers: Sequence[StepObserver] = (),
                 on_failure: Callable[[BaseException], None] | None = None,
                 max_stream_buffer_tokens: int | None = DEFAULT_MAX_STREAM_BUFFER_TOKENS):
        if max_waiting is not None and max_waiting < 1:
            raise ValueError(f"max_waiting={max_waiting} must be >= 1 (or None: unbounded)")
        if max_stream_buffer_tokens is not None and max_stream_buffer_tokens < 1:
            raise ValueError(f"max_stream_buffer_tokens={max_stream_buffer_tokens} must be "
                             ">= 1 (or None: unbounded)")
        self.engine = engine
        self.max_waiting = max_waiting
        self.max_stream_buffer_tokens = max_stream_buffer_tokens
        self._observers = tuple(observers)
        self._on_failure = on_failure
        self._cond = threading.Condition()
        # Guarded by _cond: the command list and the admission bookkeeping.
        self._commands: list[_Add | _Abort | _Call] = []
        self._in_flight: set[str] = set()
        self._queued_seqs = 0  # sequences submitted but not yet added to the engine
        self._waiting_seqs = 0  # the scheduler's waiting count as of the last iteration
        self._stopping = False
        self._error: BaseException | None = None
        # Loop-thread only (after start): the idle wake-up's wait.
        self._idle_window = IdleWindow(engine.config.idle_batch_window_ms / 1e3,
                                       engine.config.idle_batch_window_policy)
        self._thread: threading.Thread | None = None
        # Loop-thread only: the sinks of requests the engine holds.
        self._sinks: dict[str, RequestSink] = {}

    # ----------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("AsyncEngine.start() called twice")
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
        self._thread.start()

    def request_stop(self) -> None:
        """Stop taking requests; the loop thread aborts what is in flight after its step."""
        with self._cond:
            self._stopping = True
            self._cond.notify()

    def stop(self, timeout: float | None = 30.0) -> None:
        """Abort everything in flight (each stream gets its final ABORT output), end the loop."""
        self.request_stop()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("engine thread did not stop within %.1fs", timeout or 0.0)

    @property
    def error(self) -> BaseException | None:
        return self._error

    @property
    def num_in_flight(self) -> int:
        with self._cond:
            return len(self._in_flight)

    @property
    def num_waiting(self) -> int:
        """Sequences not yet running (submitted or waiting in the scheduler)."""
        with self._cond:
            return self._queued_seqs + self._waiting_seqs

    def holds(self, request_id: str) -> bool:
        """Whether `request_id` is in flight here (submitted and not yet finished)."""
        with self._cond:
            return request_id in self._in_flight

    # ----------------------------------------------------------------------- callers
    def submit(self, request_id: str, prompt: str | list[int] | Admitted,
               params: SamplingParams, priority: int = 0,
               arrival_time: float | None = None,
               output_kind: RequestOutputKind = RequestOutputKind.DELTA,
               lora: LoRARequest | None = None) -> RequestStream:
        """Queue a request from inside a running asyncio loop; returns its stream.
        `output_kind`: what its outputs carry (DELTA, FINAL_ONLY or CUMULATIVE). `lora`: a
        registered adapter (`LoraNotFound` from the stream if it is unloaded before it runs).

        Raises InvalidRequest (a bad or duplicate id), QueueFull or EngineStopped at once; the
        engine's own validation errors are raised by the stream's first `__anext__` (none for
        an `Admitted` prompt, which carries its checked params).
        """
        check_request_id(request_id)
        if isinstance(prompt, Admitted):
            params = prompt.params
        loop = asyncio.get_running_loop()
        sink = RequestSink(request_id, loop, self.max_stream_buffer_tokens)
        now = time.monotonic()
        arrival = now if arrival_time is None else arrival_time
        with self._cond:
            if self._error is not None:
                raise EngineStopped(f"the engine loop failed: {self._error!r}")
            if self._stopping or self._thread is None:
                raise EngineStopped("the engine is not running (shutting down or not started)")
            check_not_in_flight(request_id, self._in_flight)
            waiting = self._queued_seqs + self._waiting_seqs
            # A request larger than the whole bound still runs when nothing is waiting.
            if self.max_waiting is not None and waiting and waiting + params.n > self.max_waiting:
                raise QueueFull(f"{waiting} sequences are waiting (max_waiting="
                                f"{self.max_waiting}); retry later")
            self._in_flight.add(request_id)
            self._queued_seqs += params.n
            self._commands.append(_Add(sink, prompt, params, priority, arrival, output_kind,
                                       now, lora))
            self._cond.notify()
        return RequestStream(self, sink)

    def abort(self, request_id: str) -> None:
        """Abort a request (any thread); its pages are freed by the next loop iteration."""
        with self._cond:
            self._commands.append(_Abort(request_id))
            self._cond.notify()

    def abort_all(self) -> None:
        self.abort("")

    # ----------------------------------------------------------------------- live settings
    def reconfigure(self, changes: Mapping[str, Any]
                    ) -> "concurrent.futures.Future[dict[str, Any]]":
        """`call` of a scheduler change: the new settings, or the InvalidRequest naming the
        field (reads need none: `engine.scheduler_settings()` is one consistent read)."""
        changes = dict(changes)
        return self.call(lambda engine: engine.update_scheduler(changes))

    def call(self, fn: Callable[[Engine], Any]) -> "concurrent.futures.Future[Any]":
        """Queue `fn(engine)` for the loop thread, which runs it between two steps, in order
        with the adds around it (any thread; returns at once). The future holds its result,
        or what it raised (EngineStopped when the loop stops first)."""
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._cond:
            if self._error is not None:
                raise EngineStopped(f"the engine loop failed: {self._error!r}")
            if self._stopping or self._thread is None:
                raise EngineStopped("the engine is not running (shutting down or not started)")
            self._commands.append(_Call(fn, done))
            self._cond.notify()
        return done

    # ----------------------------------------------------------------------- loop thread
    def _run(self) -> None:
        busy = False
        try:
            while True:
                with self._cond:
                    while not self._commands and not busy and not self._stopping:
                        self._cond.wait()
                    if not busy:
                        self._gather_arrivals()
                    commands, self._commands = self._commands, []
                    stopping = self._stopping
                if stopping:
                    self._shutdown(commands)
                    return
                self._apply(commands)
                stepped = self.engine.has_unfinished()
                outputs = self.engine.step() if stepped else []
                stats = self.engine.stats()  # one snapshot per iteration, for all readers
                # Observers first: once a caller sees its final output, metrics include it.
                self._notify_observers(stats, outputs, stepped)
                self._dispatch(outputs)
                busy = self.engine.has_unfinished()
                with self._cond:
                    self._waiting_seqs = stats.num_waiting
        except BaseException as e:  # noqa: BLE001 - any failure must reach every caller
            log.exception("engine loop failed; failing every in-flight request")
            self._fail(e)

    def _gather_arrivals(self) -> None:
        """Idle until a request came: wait the idle window's time more (under `_cond`) so that
        requests arriving together are all in the first step and decode in lockstep (one a
        moment late would trail them by a step for good, stalling their streams each turn)."""
        wait_s = self._idle_window.wait_s()
        queued = [cmd.queued_at for cmd in self._commands if isinstance(cmd, _Add)]
        if not queued:  # woken by an abort or a stop: nothing to gather
            return
        self._idle_window.woke(min(queued))
        deadline = time.monotonic() + wait_s
        while not self._stopping and (left := deadline - time.monotonic()) > 0:
            self._cond.wait(left)

    def _apply(self, commands: list[_Add | _Abort | _Call]) -> None:
        added = 0
        rejected: list[tuple[RequestSink, Exception]] = []
        for cmd in commands:
            if isinstance(cmd, _Call):  # in order: adds before it see the old settings
                try:
                    cmd.done.set_result(cmd.fn(self.engine))
                except Exception as e:  # noqa: BLE001 - InvalidRequest: handed to the caller
                    cmd.done.set_exception(e)
                continue
            if isinstance(cmd, _Abort):
                ids = [cmd.request_id] if cmd.request_id else list(self._sinks)
                for rid in ids:
                    self.engine.abort(rid)
                continue
            added += cmd.params.n
            self._idle_window.arrived(cmd.queued_at)
            rid = cmd.sink.request_id
            try:
                self.engine.add_request(rid, cmd.prompt, cmd.params, priority=cmd.priority,
                                        arrival_time=cmd.arrival_time,
                                        output_kind=cmd.output_kind,
                                        lora_request=bind_registered(self.engine, cmd.lora))
            except Exception as e:  # noqa: BLE001 - ValueError: bad input; others: reported
                rejected.append((cmd.sink, e))
                continue
            self._sinks[rid] = cmd.sink
        with self._cond:
            self._queued_seqs -= added
            # Ids are released before their readers wake, so a caller may reuse one at once.
            self._in_flight.difference_update(sink.request_id for sink, _ in rejected)
            self._waiting_seqs = self.engine.stats().num_waiting
        for sink, error in rejected:
            sink.finished = True
            self._send(sink, error)

    def _dispatch(self, outputs: Sequence[RequestOutput]) -> None:
        """Each output into its request's sink; the readers with something new are woken with
        one call per asyncio loop. A reader past its unread bound gets its request aborted."""
        wakes: dict[asyncio.AbstractEventLoop, list[RequestSink]] = \
            collections.defaultdict(list)
        finished: list[str] = []
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            if out.finished:
                del self._sinks[out.request_id]
                sink.finished = True
                finished.append(out.request_id)
            woken, overflowed = sink.put(out)
            if overflowed:  # its final ABORT output (dropped by the sink) frees its pages
                self.engine.abort(out.request_id)
            if woken:
                wakes[sink.loop].append(sink)
        if finished:  # before the readers wake: a caller may reuse a finished id at once
            with self._cond:
                self._in_flight.difference_update(finished)
        for loop, sinks in wakes.items():
            try:
                loop.call_soon_threadsafe(set_ready, sinks)
            except RuntimeError:
                pass  # that loop is closed: nobody is left to read these outputs

    def _send(self, sink: RequestSink, error: BaseException) -> None:
        if sink.fail(error):
            wake(sink)

    def _notify_observers(self, stats: EngineStats, outputs: Sequence[RequestOutput],
                          stepped: bool) -> None:
        for obs in self._observers:
            try:
                obs.on_step(stats, outputs, stepped)
            except Exception:  # noqa: BLE001 - metrics must never stop serving
                log.exception("step observer %r failed", obs)

    def _shutdown(self, commands: list[_Add | _Abort | _Call]) -> None:
        """Refuse queued adds and changes, abort what runs, step until the engine has
        delivered every request's final (ABORT) output and freed its pages."""
        stopped = EngineStopped("the engine is shutting down")
        with self._cond:
            self._queued_seqs = 0
            self._in_flight.difference_update(c.sink.request_id for c in commands
                                              if isinstance(c, _Add))
        for cmd in commands:
            if isinstance(cmd, _Add):
                self._send(cmd.sink, stopped)
            elif isinstance(cmd, _Call):
                cmd.done.set_exception(stopped)
        for rid in list(self._sinks):
            self.engine.abort(rid)
        steps = 0
        while self.engine.has_unfinished() and steps < 1000:
            outputs = self.engine.step()
            self._notify_observers(self.engine.stats(), outputs, True)
            self._dispatch(outputs)
            steps += 1

    def _fail(self, error: BaseException) -> None:
        with self._cond:
            self._error = error
            sinks = list(self._sinks.values())
            sinks += [c.sink for c in self._commands if isinstance(c, _Add)]
            changes = [c.done for c in self._commands if isinstance(c, _Call)]
            self._commands = []
            self._in_flight.clear()
        self._sinks.clear()
        failure = EngineStopped(f"the engine loop failed: {error!r}")
        for sink in sinks:
            self._send(sink, failure)
        for done in changes:
            done.set_exception(failure)
        if self._on_failure is not None:
            self._on_failure(error)
