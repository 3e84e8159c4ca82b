"""Data-parallel serving: one AsyncEngine per replica behind the single-engine interface.

Data flow: `submit(request_id, prompt, params)` -> `ReplicaRouter.choose` (loads: each
replica's requests in flight; prompt token ids for prefix affinity) -> that replica's
`AsyncEngine.submit` -> its RequestStream (which aborts on its own replica). Each replica is a
complete engine (scheduler, KV pages, compiled step, loop thread) on its own devices, so
replicas never wait for each other; the facade only routes and aggregates.

Used by the gRPC and HTTP fronts exactly like an AsyncEngine (`AsyncServing` is what they
need). `max_waiting` applies per replica: a QueueFull from the chosen replica is retried on
the others before it reaches the caller.

One replica's fatal failure (`EngineDead`) fails the whole pool (`error`): the fronts refuse
every call and report unavailable, and `jaxserve serve` exits non-zero to be restarted with
every replica, rather than serving on at reduced capacity with a device in an unknown state.
A per-request failure inside a replica's step stays that request's (finish reason ERROR).
Live scheduler changes and LoRA adapter loads go to every replica or to none
(`admin_settings.SchedulerAdmin`, `lora_adapters.LoraAdmin`), so a request naming an adapter
runs on whichever replica the router picks.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol, Sequence

from jaxserve.engine.limits import Admitted, check_not_in_flight
from jaxserve.engine.lora_request import LoRARequest
from jaxserve.engine.outputs import RequestOutputKind
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.serving.async_engine import AsyncEngine, QueueFull, RequestStream
from jaxserve.serving.router import ReplicaRouter


class AsyncServing(Protocol):
    """What the server fronts use: AsyncEngine, or AsyncReplicaPool over several."""

    def start(self) -> None: ...

    def request_stop(self) -> None: ...

    def stop(self, timeout: float | None = 30.0) -> None: ...

    @property
    def error(self) -> BaseException | None: ...

    @property
    def num_in_flight(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    def submit(self, request_id: str, prompt: str | list[int] | Admitted,
               params: SamplingParams, priority: int = 0,
               arrival_time: float | None = None,
               output_kind: RequestOutputKind = RequestOutputKind.DELTA,
               lora: LoRARequest | None = None) -> RequestStream: ...

    def abort(self, request_id: str) -> None: ...

    def abort_all(self) -> None: ...


class AsyncReplicaPool:
    """Routes requests over `replicas` (each started, stopped and failing on its own)."""

    def __init__(self, replicas: Sequence[AsyncEngine], router: ReplicaRouter) -> None:
        if len(replicas) != router.num_replicas:
            raise ValueError(f"{len(replicas)} replicas but the router has "
                             f"{router.num_replicas}")
        self.replicas = tuple(replicas)
        self._router = router
        self._lock = threading.Lock()  # the router's record; one admission at a time

    # ----------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        for r in self.replicas:
            r.start()

    def request_stop(self) -> None:
        for r in self.replicas:
            r.request_stop()

    def stop(self, timeout: float | None = 30.0) -> None:
        """All replicas wind down together; `timeout` bounds the whole wait."""
        self.request_stop()
        deadline = None if timeout is None else time.monotonic() + timeout
        for r in self.replicas:
            r.stop(None if deadline is None else max(0.0, deadline - time.monotonic()))

    @property
    def error(self) -> BaseException | None:
        """The first replica failure: serving stops as a whole, so that health flips."""
        return next((r.error for r in self.replicas if r.error is not None), None)

    @property
    def num_in_flight(self) -> int:
        return sum(r.num_in_flight for r in self.replicas)

    @property
    def num_waiting(self) -> int:
        return sum(r.num_waiting for r in self.replicas)

    @property
    def prefix_routed(self) -> int:
        return self._router.prefix_routed

    # ----------------------------------------------------------------------- callers
    def __contains__(self, request_id: object) -> bool:
        """Whether a replica holds `request_id` in flight."""
        return any(r.holds(request_id) for r in self.replicas)  # type: ignore[arg-type]

    def submit(self, request_id: str, prompt: str | list[int] | Admitted,
               params: SamplingParams, priority: int = 0,
               arrival_time: float | None = None,
               output_kind: RequestOutputKind = RequestOutputKind.DELTA,
               lora: LoRARequest | None = None) -> RequestStream:
        """Route, then `AsyncEngine.submit` on that replica (same errors)."""
        ids = prompt.token_ids if isinstance(prompt, Admitted) else prompt
        # Hashing a long prompt takes a while: not under the lock.
        hashes = self._router.page_hashes(None if isinstance(ids, str) else ids)
        with self._lock:
            check_not_in_flight(request_id, self)
            loads = [r.num_in_flight for r in self.replicas]
            route = self._router.choose(loads, hashes)
            # The chosen replica first, then the others by load: one full queue is not a
            # reason to refuse while another replica has room.
            others = sorted((i for i in range(len(loads)) if i != route.replica),
                            key=lambda i: loads[i])
            error: QueueFull | None = None
            for i in (route.replica, *others):
                try:
                    stream = self.replicas[i].submit(request_id, prompt, params, priority,
                                                     arrival_time, output_kind, lora)
                except QueueFull as e:
                    error = e
                    continue
                self._router.record(route, i)
                return stream
            assert error is not None  # the loop ran at least once
            raise error

    def abort(self, request_id: str) -> None:
        for r in self.replicas:
            if r.holds(request_id):
                r.abort(request_id)

    def abort_all(self) -> None:
        for r in self.replicas:
            r.abort_all()
