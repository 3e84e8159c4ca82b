"""Calls in flight on one serving front (gRPC or HTTP), and whether it is draining.

Each front owns one `InFlight`: a call `enter()`s once admitted and `exit()`s in its
`finally`; shutdown sets `draining` (new calls are refused by the front) and awaits
`wait_idle(grace)` before aborting what is left. Used on the event loop only.
"""

from __future__ import annotations

import asyncio


class InFlight:
    def __init__(self) -> None:
        self.draining = False
        self.active = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        self.active += 1
        self._idle.clear()

    def exit(self) -> None:
        self.active -= 1
        if self.active == 0:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no call is in flight; False when `timeout` passed first."""
        if self._idle.is_set():
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False
