"""Fault injection: make chosen steps fail on purpose, to exercise the engine's recovery.

Plain Python/numpy (no jax). An `InjectedFault` names a marker token id; a step whose new
tokens include it (e.g. one request's prompt) raises `RunnerFailed` before the wrapped runner
sees the batch, so no device work starts and no donated KV buffer is consumed: the recovery a
real non-fatal runner failure gets (`recovery.py`: the culprit rows finish with ERROR, the rest
carry on). A fatal fault then refuses every later step, as a lost device would.

Used by the fake runner's tests (`ArithmeticRunner(vocab, fault)`) and, through
`EngineConfig.fault_injection_token` (`--fault-injection-token`, for soak and chaos testing
only), around the real model runner by `serving.build`.
"""

from __future__ import annotations

import dataclasses
import logging

from jaxserve.config import EngineConfig
from jaxserve.engine.batch import StepBatch
from jaxserve.engine.runner import LateMask, PendingStep, Runner, RunnerFailed, StepResult

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class InjectedFault:
    """Fail a step whose new tokens include `token_id` (e.g. in one request's prompt)."""

    token_id: int
    fatal: bool = False
    name_rows: bool = False  # report the rows holding the token (else the culprit is unknown)
    times: int | None = 1  # how many steps fail (None: every one that matches)
    # Match only a sequence's first token (position 0): generated tokens never sit there, nor
    # do they after a preemption's recompute, so only prompts that start with `token_id` fail.
    at_start: bool = False


class FaultInjector:
    """The state of one injected fault: how often it fired, and whether it killed the
    (pretend) device."""

    def __init__(self, fault: InjectedFault):
        self.fault = fault
        self.faults_raised = 0
        self.dead = False

    def check(self, batch: StepBatch) -> None:
        """Raise RunnerFailed when this step must fail (call before running it)."""
        if self.dead:
            raise RunnerFailed("the device was lost by an earlier (injected) fault", fatal=True)
        f = self.fault
        if f.times is not None and self.faults_raised >= f.times:
            return
        fwd = batch.forward
        num = int(fwd.num_seqs[0])
        cu = fwd.cu_q_lens
        hit = fwd.token_ids[:cu[num]] == f.token_id
        if f.at_start:
            hit &= fwd.positions[:cu[num]] == 0
        rows = tuple(r for r in range(num) if hit[cu[r]:cu[r + 1]].any())
        if not rows:
            return
        self.faults_raised += 1
        self.dead = f.fatal
        raise RunnerFailed(f"injected fault on token {f.token_id}", fatal=f.fatal,
                           rows=rows if f.name_rows else None)


class FaultInjectingRunner:
    """Any Runner with an `InjectedFault` checked before each step."""

    def __init__(self, inner: Runner, fault: InjectedFault):
        self.inner = inner
        self.injector = FaultInjector(fault)

    @property
    def compiles_after_warmup(self) -> int:
        return self.inner.compiles_after_warmup

    def warmup(self, progress: bool = True) -> None:
        self.inner.warmup(progress)

    def arm(self) -> None:
        self.inner.arm()

    def close(self) -> None:
        self.inner.close()

    def execute(self, batch: StepBatch) -> StepResult:
        return self.collect(self.dispatch(batch))

    def dispatch(self, batch: StepBatch, late_mask: LateMask | None = None) -> PendingStep:
        self.injector.check(batch)
        return self.inner.dispatch(batch, late_mask) if late_mask is not None else \
            self.inner.dispatch(batch)

    def collect(self, pending: PendingStep) -> StepResult:
        return self.inner.collect(pending)

    def load_lora(self, slot: int, adapter: object) -> None:
        self.inner.load_lora(slot, adapter)


def with_faults(config: EngineConfig, runner: Runner) -> Runner:
    """The runner, wrapped to fail on purpose when fault injection is on (testing only;
    every engine build applies it)."""
    if config.fault_injection_token is None:
        return runner
    log.warning("fault injection on: steps holding token %d fail on purpose",
                config.fault_injection_token)
    return FaultInjectingRunner(runner, InjectedFault(
        config.fault_injection_token, name_rows=True, times=None, at_start=True))
