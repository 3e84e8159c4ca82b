"""Counts XLA compilations through JAX's public monitoring events.

Every new executable JAX builds (a jit cache miss, an eager op on a new shape) is lowered to
MLIR first, and that lowering emits `/jax/core/compile/jaxpr_to_mlir_module_duration` — also
when the persistent compilation cache then supplies the binary. So counting that event after
warmup counts exactly the compiles that serving should never do. The engine exposes the count
as a metric (`compiles_after_warmup`) and tests assert it stays 0.
"""

from __future__ import annotations

import logging
import threading

import jax.monitoring

log = logging.getLogger(__name__)

LOWERING_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"


class CompileGuard:
    """Counts lowerings from `arm()` on; `close()` unregisters."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._armed = False
        self.compiles_after_warmup = 0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, **kwargs: object) -> None:
        if not self._armed:
            return
        with self._lock:
            if event == LOWERING_EVENT:
                self.compiles_after_warmup += 1
                # Serving should never compile: name the function so the bug can be found.
                log.warning("XLA compile after warmup: %s", kwargs.get("fun_name", "?"))

    def arm(self) -> None:
        """Start counting: warmup is over."""
        self._armed = True

    def close(self) -> None:
        self._armed = False
        try:
            jax.monitoring.unregister_event_duration_listener(self._on_event)
        except (AssertionError, ValueError, KeyError):
            pass  # already gone
