"""Data-parallel replicas as one synchronous engine, for the offline API and batch jobs.

Data flow: `add_request` -> `ReplicaRouter.choose` (loads: each replica's unfinished requests;
the prompt's token ids for prefix affinity) -> that replica's `Engine.add_request`.
`step()` steps every replica that has work, concurrently on a thread pool (JAX releases the
GIL while a device runs, so the replicas' devices work at the same time), and returns their
outputs together. Replicas advance in lockstep here: the server instead drives each replica
with its own loop thread (`async_replica_pool.AsyncReplicaPool`), so one replica's long prefill
never delays another's stream.

Each Engine is still touched by one thread at a time: `step()` joins every replica's step
before it returns, and callers add and abort between steps.

LoRA: `add_lora` / `remove_lora` register and unregister an adapter on every replica (all or
none); a request's `lora_request` goes with it to its replica, which registers an adapter it
does not know yet there (vLLM's offline rule, as one Engine does).
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Mapping, Sequence

from jaxserve.engine.engine import Engine
from jaxserve.engine.limits import (Admitted, EngineLimits, EngineStats, check_not_in_flight,
                                    check_request_id)
from jaxserve.engine.lora_request import LoRARequest
from jaxserve.engine.outputs import RequestOutput, RequestOutputKind
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.serving.router import ReplicaRouter


class ReplicaPool:
    """The Engine calls the offline API and batch jobs make, over several replicas."""

    def __init__(self, engines: Sequence[Engine], router: ReplicaRouter) -> None:
        if len(engines) != router.num_replicas:
            raise ValueError(f"{len(engines)} engines but the router has {router.num_replicas}")
        self.engines = tuple(engines)
        self._router = router
        self._owner: dict[str, Engine] = {}  # unfinished request id -> its replica
        self._pool = concurrent.futures.ThreadPoolExecutor(
            len(engines), thread_name_prefix="jaxserve-replica")

    # What callers read off an Engine: identical on every replica.
    @property
    def config(self):  # noqa: ANN201 - EngineConfig
        return self.engines[0].config

    @property
    def plan(self):  # noqa: ANN201 - EnginePlan
        return self.engines[0].plan

    @property
    def tokenizer(self):  # noqa: ANN201 - Tokenizer
        return self.engines[0].tokenizer

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.engines[0].eos_token_ids

    @property
    def limits(self) -> EngineLimits:
        return self.engines[0].limits

    def stats(self) -> EngineStats:
        """Every replica's stats added up."""
        return EngineStats.total([e.stats() for e in self.engines])

    def admit(self, prompt: str | Sequence[int], params: SamplingParams | None = None
              ) -> Admitted:
        return self.engines[0].admit(prompt, params)

    @property
    def num_requests(self) -> int:
        return sum(e.num_requests for e in self.engines)

    @property
    def prefix_routed(self) -> int:
        return self._router.prefix_routed

    def has_unfinished(self) -> bool:
        return any(e.has_unfinished() for e in self.engines)

    def add_request(self, request_id: str, prompt: str | Sequence[int] | Admitted,
                    params: SamplingParams | None = None, priority: int = 0,
                    arrival_time: float | None = None,
                    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
                    lora_request: LoRARequest | None = None) -> None:
        check_request_id(request_id)
        check_not_in_flight(request_id, self._owner)
        # Checked (and tokenized) once, here; the replica queues it as it is.
        admitted = prompt if isinstance(prompt, Admitted) else self.admit(prompt, params)
        loads = [e.num_requests for e in self.engines]
        route = self._router.choose(loads, self._router.page_hashes(admitted.token_ids))
        engine = self.engines[route.replica]
        engine.add_request(request_id, admitted, priority=priority, arrival_time=arrival_time,
                           output_kind=output_kind,  # ValueError: nothing was recorded
                           lora_request=lora_request)
        self._router.record(route, route.replica)
        self._owner[request_id] = engine

    def abort(self, request_id: str) -> bool:
        engine = self._owner.get(request_id)
        return engine is not None and engine.abort(request_id)

    def step(self) -> list[RequestOutput]:
        """One step of every replica with work (concurrently); their outputs together."""
        busy = [e for e in self.engines if e.has_unfinished()]
        if len(busy) == 1:
            outputs = busy[0].step()
        else:
            futures = [self._pool.submit(e.step) for e in busy]
            # Every replica's step ends before this returns or raises: no engine is left
            # running on the pool's threads while the caller touches it again.
            concurrent.futures.wait(futures)
            outputs = [o for f in futures for o in f.result()]
        for out in outputs:
            if out.finished:
                self._owner.pop(out.request_id, None)
        return outputs

    def scheduler_settings(self) -> dict[str, Any]:
        return self.engines[0].scheduler_settings()  # every replica holds the same

    def update_scheduler(self, changes: Mapping[str, Any]) -> dict[str, Any]:
        """Every replica's, all or none: each checks first (the same check, the same start-up
        bounds), then each applies (between steps: this pool steps them itself)."""
        for e in self.engines:
            e.check_scheduler_update(changes)
        return [e.update_scheduler(changes) for e in self.engines][0]

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Register and load an adapter on every replica, or on none (the first refusal:
        InvalidRequest naming the field; those that took it let it go again)."""
        done: list[Engine] = []
        try:
            for e in self.engines:
                e.add_lora(lora_request)
                done.append(e)
        except BaseException:
            for e in done:
                e.remove_lora(lora_request.lora_name)
            raise

    def remove_lora(self, lora_name: str) -> bool:
        """Unregister an adapter on every replica (False: no such name)."""
        return any([e.remove_lora(lora_name) for e in self.engines])

    def list_loras(self) -> list[LoRARequest]:
        return self.engines[0].list_loras()  # every replica registers the same

    def resolve_lora(self, lora_name: str) -> LoRARequest | None:
        return self.engines[0].resolve_lora(lora_name)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for e in self.engines:
            e.close()
