"""The overlapped step (`EngineConfig.async_scheduling`): one step on the device while the
host schedules the next, wrapped around the synchronous `step_core.StepCore`.

Plain Python (no jax). Data flow of one `Pipeline.step()`, step N on the device:
  step N samples a row with penalties (the next batch needs that token's history on the
  host), or the next step may speculate (its proposals follow N's tokens:
  `StepCore.wants_host_tokens`): apply N first -> `core.schedule()` step N+1 ->
  `core.launch(N+1)`: its decode rows
  feed on step N's sampled tokens on the device (`InFlight.sampled_rows`); rows whose token
  mask follows their output (a grammar, multi-token bad_words: `Sequence.mask_follows_output`)
  get it late: the runner queues N+1's forward, then the pipeline applies N and the mask is
  filled while the device runs it -> apply N (unless the late mask did) -> fail N+1's failed
  rows (after N's tokens are in, and not for sequences N finished: their row was a discarded
  extra) -> N+1 stays in flight for the next call.
So the device never idles while the host schedules, builds batches, detokenizes and streams.
What only a token's value can end (EOS, stop ids, stop strings) ends one step late and the
extra token is discarded (`scheduler.py`), so outputs are the same as the core's alone.

State: `in_flight` (the dispatched step not yet applied) is this object's; everything else is
the core's.
"""

from __future__ import annotations

from jaxserve.engine.recovery import Staged
from jaxserve.engine.scheduled import SchedulerOutput
from jaxserve.engine.step_core import InFlight, StepCore


class Pipeline:
    def __init__(self, core: StepCore):
        self.core = core
        self.in_flight: InFlight | None = None

    def step(self) -> None:
        """Dispatch the next step and apply the one in flight (see the module docstring)."""
        core = self.core
        prev, self.in_flight = self.in_flight, None
        if prev is not None and (prev.needs_host_tokens or core.wants_host_tokens()):
            core.apply(prev)  # the next batch needs its tokens on the host
            prev = None
        out = core.schedule()
        launched: Staged[InFlight] = self._launch(out, prev) if out.seqs else Staged(None)
        if prev is not None and not prev.applied:
            core.apply(prev)
        core.fail(launched.failures)
        self.in_flight = launched.value

    def _launch(self, out: SchedulerOutput, prev: InFlight | None) -> Staged[InFlight]:
        """`core.launch` of `out` behind `prev`: fed from its sampled tokens, and with late
        masks when a row's mask follows its output (`prev` is applied in between)."""
        if prev is None:
            return self.core.launch(out)
        before_mask = None
        if any(s.samples and s.sequence.mask_follows_output for s in out.seqs):
            def before_mask() -> None:
                self.core.apply(prev)
                prev.applied = True
        return self.core.launch(out, prev.sampled_rows, before_mask)
