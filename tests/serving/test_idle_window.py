"""The idle wake-up window: its policy on given arrival times, and the AsyncEngine using it."""

from __future__ import annotations

import asyncio

import pytest
from support.fake_engines import fake_engine

from jaxserve import SamplingParams
from jaxserve.config import EngineConfig
from jaxserve.serving.async_engine import AsyncEngine
from jaxserve.serving.idle_window import IdleWindow

W = 0.02  # the default 20 ms


def wake(win: IdleWindow, arrivals: list[float]) -> float:
    """One wake-up by arrivals[0], the requests queued at `arrivals` added; its wait."""
    wait = win.wait_s()
    win.woke(arrivals[0])
    for t in arrivals:
        win.arrived(t)
    return wait


def test_adaptive_waits_first_then_only_after_company() -> None:
    win = IdleWindow(W, "adaptive")
    assert wake(win, [0.0, 0.005, 0.01]) == W  # the first wake-up waits; it had company
    assert wake(win, [1.0]) == W  # after company: waits, but this one was alone
    assert wake(win, [2.0]) == 0.0  # sequential traffic stops paying
    assert wake(win, [3.0]) == 0.0
    # A burst after the lull: its first request wakes the engine alone (no wait) and the rest
    # are queued while that step runs, within the window of the first: the window re-arms.
    assert wake(win, [4.0]) == 0.0
    win.arrived(4.0 + W / 2)
    assert wake(win, [5.0, 5.001]) == W


def test_adaptive_counts_only_arrivals_within_the_window() -> None:
    win = IdleWindow(W, "adaptive")
    wake(win, [0.0])
    win.arrived(0.0 + 3 * W)  # a later arrival while busy is not company
    assert win.wait_s() == 0.0
    # The waking request's own time is that of the earliest queued, not of the wake-up.
    wake(win, [1.0])
    win.arrived(1.0 + 0.9 * W)  # within the window: company
    assert win.wait_s() == W


def test_always_waits_every_time() -> None:
    win = IdleWindow(W, "always")
    for t in range(4):
        assert wake(win, [float(t)]) == W


def test_a_zero_window_never_waits() -> None:
    win = IdleWindow(0.0, "adaptive")
    assert wake(win, [0.0, 0.0]) == 0.0 and win.wait_s() == 0.0


def test_policy_is_validated_by_the_config() -> None:
    with pytest.raises(ValueError, match="idle_batch_window_policy='sometimes'"):
        EngineConfig(idle_batch_window_policy="sometimes")


@pytest.mark.parametrize("policy, after", [("adaptive", 0.0), ("always", 1.0)])
def test_sequential_requests_stop_waiting_under_adaptive(policy: str, after: float) -> None:
    """Requests one after another (concurrency 1): under "adaptive" the engine's window is
    disarmed after the first, under "always" it stays."""
    ae = AsyncEngine(fake_engine(idle_batch_window_ms=1000.0, idle_batch_window_policy=policy))
    ae.start()
    params = SamplingParams(max_tokens=2, ignore_eos=True)

    async def one(i: int) -> None:
        async for _ in ae.submit(f"s{i}", [5 + i, 6], params):
            pass

    async def main() -> None:
        for i in range(2):
            await one(i)

    try:
        asyncio.run(main())
        # Read after the loop is idle again (the streams ended: their steps are done).
        assert ae._idle_window.wait_s() == after  # noqa: SLF001 - the loop's decision
    finally:
        ae.stop()
