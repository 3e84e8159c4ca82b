"""The LoRA adapters of a serving engine: list, load and unload them while it serves, on
every replica.

Data flow of a load (the fronts' `POST /v1/load_lora_adapter` and gRPC `Admin/
LoadLoraAdapter`): (lora_name, lora_path, lora_int_id?) -> `LoraAdmin.load` -> checked here
first (LoRA on, a valid name that is not the base model's nor already loaded, an id: the one
given or the next free one) -> under one lock, `AsyncEngine.call` queues `Engine.add_lora` on
every replica in the same order -> each replica's loop thread runs it between two of its
steps. The adapter is read before that, once, on a worker thread (off the event loop and
off every loop thread: `Engine.read_lora`, the engine's loader: the PEFT directory checked
against the model and `max_lora_rank`, its InvalidRequest naming lora_path and the problem),
and every replica registers that copy (host arrays; each runner copies it into a device
slot when a step first needs it) -> should any replica refuse, those that took it unload it again and the refusal is
raised, so the replicas always register the same adapters.

An unload (`remove_lora` on every replica) unregisters the name at once: requests naming it
afterwards are refused (`lora_requests.LoraNotFound`, 404); requests already queued with it
finish under it, and its device slot is let go only when none of them runs any more (the
engine's slot table), so an adapter in use is never evicted.

The `--lora-modules` of the command line are registered by the engine itself when it is built
(`Engine.__init__`: a bad one fails the start-up with an error naming it and the problem);
`check_startup` then refuses one named as the base model.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Sequence

from jaxserve.engine.engine import Engine
from jaxserve.engine.errors import InvalidRequest
from jaxserve.engine.lora_request import LoRARequest
from jaxserve.lora_config import check_lora_name
from jaxserve.serving.async_engine import AsyncEngine
from jaxserve.serving.async_replica_pool import AsyncReplicaPool, AsyncServing
from jaxserve.serving.lora_requests import LoraNotFound, next_lora_int_id, resolve_model

LORA_OFF = "LoRA is off on this server: start it with --enable-lora (docs/serving/lora.md)"


class LoraDisabled(ValueError):
    """An adapter load or unload on a server without --enable-lora (HTTP 400)."""


def _register(engine: Engine, request: LoRARequest, adapter: object) -> None:
    """On the loop thread, between steps: register the adapter read beforehand."""
    engine.add_lora(request, adapter)


class LoraAdmin:
    """The adapters of `serving` (one AsyncEngine or a pool of replicas), whose first
    replica's Engine is `engine` (read: every replica registers the same adapters);
    `base_names`: what callers may name the base model (the served names, else the model's
    own name)."""

    def __init__(self, serving: AsyncServing, engine: Engine, base_names: Sequence[str]):
        self._serving = serving
        self.base_names = tuple(base_names)
        self._engine = engine
        self._lock = threading.Lock()  # one change queued at a time, on every replica
        self._last_id = 0  # the last lora_int_id handed out

    @property
    def enabled(self) -> bool:
        """Whether the engine serves adapters (--enable-lora)."""
        return self._engine.config.lora_config is not None

    @property
    def replicas(self) -> Sequence[AsyncEngine]:
        s = self._serving
        return s.replicas if isinstance(s, AsyncReplicaPool) else (s,)  # type: ignore

    def check_startup(self) -> None:
        """ValueError naming a start-up adapter (--lora-modules) named as the base model."""
        for r in self.list():
            if r.lora_name in self.base_names:
                raise ValueError(f"lora_modules {r.lora_name}={r.lora_path}: {r.lora_name!r} "
                                 "is the base model's name (--served-model-name / --model); "
                                 "an adapter needs a name of its own")

    def list(self) -> list[LoRARequest]:
        """The registered adapters, in registration order (none without LoRA)."""
        return self._engine.list_loras() if self.enabled else []

    def resolve(self, name: object, strict: bool = True) -> LoRARequest | None:
        """The adapter a request naming model `name` runs under (`lora_requests.
        resolve_model`); LoraNotFound for an unknown name."""
        return resolve_model(self._engine, name, self.base_names, strict)

    def _check_on(self) -> None:
        if not self.enabled:
            raise LoraDisabled(LORA_OFF)

    async def load(self, lora_name: object, lora_path: object,
                   lora_int_id: object = None) -> LoRARequest:
        """Register and load an adapter on every replica or on none. ValueError (an
        InvalidRequest naming the field, or LoraDisabled) for a bad or duplicate one;
        EngineStopped when the engine stops first."""
        self._check_on()
        try:
            name = check_lora_name(lora_name, "lora_name")
        except ValueError as e:
            raise InvalidRequest(str(e), "lora_name") from None
        if name in self.base_names:
            raise InvalidRequest(f"lora_name {name!r} is the base model's name: an adapter "
                                 "needs a name of its own", "lora_name")
        if not isinstance(lora_path, str) or not lora_path:
            raise InvalidRequest(f"lora_path={lora_path!r:.60} must be a non-empty string "
                                 "(a PEFT adapter directory on the server)", "lora_path")
        with self._lock:
            if self._engine.resolve_lora(name) is not None:
                raise InvalidRequest(f"The lora adapter '{name}' has already been loaded.",
                                     "lora_name")
            lora_id = next_lora_int_id(self.list(), self._last_id) if lora_int_id is None \
                else lora_int_id
            try:
                request = LoRARequest(name, lora_id, lora_path)  # type: ignore[arg-type]
            except ValueError as e:
                raise InvalidRequest(str(e), "lora_int_id") from None
            self._last_id = max(self._last_id, request.lora_int_id)
        # The read (disk, checks, numpy) on a worker thread: no step waits for it.
        adapter = await asyncio.get_running_loop().run_in_executor(
            None, self._engine.read_lora, request)
        with self._lock:
            futures = [r.call(lambda e: _register(e, request, adapter))
                       for r in self.replicas]
        results = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures),
                                       return_exceptions=True)
        errors = [e for e in results if isinstance(e, BaseException)]
        if errors:
            for r, result in zip(self.replicas, results):
                if not isinstance(result, BaseException):  # took it: let it go again
                    try:
                        await asyncio.wrap_future(r.call(lambda e: e.resolve_lora(name) ==
                                                         request and e.remove_lora(name)))
                    except Exception:  # noqa: BLE001 - that replica is stopping too
                        pass
            raise errors[0]
        return request

    async def unload(self, lora_name: object, lora_int_id: object = None) -> LoRARequest:
        """Unregister an adapter on every replica; LoraNotFound (404) for an unknown name,
        InvalidRequest naming lora_int_id when it is not that adapter's."""
        self._check_on()
        if not isinstance(lora_name, str) or not lora_name:
            raise InvalidRequest(f"lora_name must be a non-empty string, got "
                                 f"{lora_name!r:.60}", "lora_name")
        with self._lock:
            known = self._engine.resolve_lora(lora_name)
            if known is None:
                raise LoraNotFound(lora_name,
                                   f"The lora adapter '{lora_name}' cannot be found.")
            if lora_int_id is not None and lora_int_id != known.lora_int_id:
                raise InvalidRequest(f"lora_int_id {lora_int_id!r:.20} is not the id of LoRA "
                                     f"adapter {lora_name!r} ({known.lora_int_id})",
                                     "lora_int_id")
            futures = [r.call(lambda e: e.remove_lora(lora_name)) for r in self.replicas]
        await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
        return known
