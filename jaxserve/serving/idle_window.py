"""How long an idle engine, woken by a request, waits for others arriving with it.

Data flow (the AsyncEngine's loop thread alone calls it): on waking from idle the loop asks
`wait_s()`, reports the first queued request's time with `woke(t)` and waits that long;
`arrived(t)` is then told the queue time of every request it adds, each iteration.

Why a policy and not a constant wait: the window exists for bursts (a client's batch, vLLM's
benchmark starting N streams at once), so that they are prefilled in one step and decode in
lockstep. A lone request pays the whole window in its TTFT: at concurrency 1, where every
request finds the engine idle, the 20 ms default was most of the gap to vLLM's TTFT
(bundled model, 256-token prompts: ~180 ms against ~170).
- "always": every wake-up waits the window.
- "adaptive" (default): a wake-up waits only when the previous one had company -- a second
  request queued within the window of the first, whether or not that wake-up waited. The
  first wake-up waits (a server usually starts with a burst). Sequential traffic stops
  paying after one request; a burst arriving after a lull of lone requests splits once (its
  first request steps alone, the rest a step later) and re-arms the window for the next.
"""

from __future__ import annotations

from jaxserve.config import IDLE_WINDOW_POLICIES

__all__ = ["IDLE_WINDOW_POLICIES", "IdleWindow"]


class IdleWindow:
    """The idle-wake-up wait; one per AsyncEngine, used by its loop thread only. The
    arguments come from a validated EngineConfig (`idle_batch_window_ms` / 1e3,
    `idle_batch_window_policy`)."""

    def __init__(self, window_s: float, policy: str = "adaptive"):
        self.window_s = window_s
        self.policy = policy
        self._company = True  # the first wake-up waits
        self._woke_at: float | None = None  # queue time of the request that woke the engine
        self._seen = 0  # requests queued within the window of _woke_at

    def wait_s(self) -> float:
        """Seconds this wake-up waits for companions."""
        if self.policy == "always" or self._company:
            return self.window_s
        return 0.0

    def woke(self, first_queued_at: float) -> None:
        """A new wake-up, by a request queued at `first_queued_at` (time.monotonic())."""
        self._woke_at = first_queued_at
        self._seen = 0
        self._company = False

    def arrived(self, queued_at: float) -> None:
        """A request queued at `queued_at` is being added (the waking one included)."""
        if self._woke_at is None or queued_at - self._woke_at > self.window_s:
            return
        self._seen += 1
        if self._seen >= 2:
            self._company = True
