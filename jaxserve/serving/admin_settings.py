"""Live scheduler settings of a serving engine: read them, change them on every replica.

Data flow of a change (the fronts' admin endpoint): `{field: value}` -> `SchedulerAdmin.
update` -> under one lock: every replica's `Engine.check_scheduler_update` (all checked
before any is touched: InvalidRequest naming the field and the limit, nothing changed) ->
`AsyncEngine.reconfigure` queued on every replica in the same order -> each replica's loop
thread applies it between two of its steps (`Engine.update_scheduler`) -> the new settings.
Changes are queued on every replica in one order under the lock, and the check is a pure
function of the settings and the start-up bounds (the same on every replica), so the
replicas always hold the same settings; should a replica still refuse (its loop stopped),
those that took the change are set back and the refusal is raised.

A read (`settings`) needs no command: each replica's config is one frozen object swapped
whole by its loop thread, so reading it is a consistent snapshot (the first replica's: all
hold the same).

Multi-host: only process 0 has a scheduler (the other processes replay its steps' buckets,
`device/multihost.py`), so a change there is a change everywhere.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Mapping, Sequence

from jaxserve.serving.async_engine import AsyncEngine
from jaxserve.serving.async_replica_pool import AsyncReplicaPool, AsyncServing


class SchedulerAdmin:
    """The live settings of `serving` (one AsyncEngine or a pool of replicas)."""

    def __init__(self, serving: AsyncServing):
        self.replicas: Sequence[AsyncEngine] = serving.replicas \
            if isinstance(serving, AsyncReplicaPool) else (serving,)  # type: ignore[assignment]
        self._lock = threading.Lock()  # one change queued at a time, on every replica

    def settings(self) -> dict[str, Any]:
        """The live settings (`live_settings.settings_of`), a consistent snapshot."""
        return self.replicas[0].engine.scheduler_settings()

    async def update(self, changes: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """Apply `changes` on every replica or on none; (settings before, settings after).
        InvalidRequest (a ValueError) naming the field and the limit; EngineStopped."""
        with self._lock:
            before = self.settings()
            for r in self.replicas:  # (the first refuses what is not a mapping at all)
                r.engine.check_scheduler_update(changes)
            changes = dict(changes)
            futures = [r.reconfigure(changes) for r in self.replicas]
        results = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures),
                                       return_exceptions=True)
        errors = [e for e in results if isinstance(e, BaseException)]
        if not errors:
            return before, results[0]  # type: ignore[return-value]
        restore = {k: before[k] for k in changes}
        for r, result in zip(self.replicas, results):
            if not isinstance(result, BaseException):  # took it: back to the old settings
                try:
                    await asyncio.wrap_future(r.reconfigure(restore))
                except Exception:  # noqa: BLE001 - that replica is stopping too
                    pass
        raise errors[0]
