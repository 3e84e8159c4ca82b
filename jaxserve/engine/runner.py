"""The engine <-> runner contract, jax-free: the Runner protocol and what a step returns.

A step is `dispatch(batch)` (queued on the device, returns at once with a `PendingStep`) then
`collect(pending)` (waits for it, one device->host copy). Between the two the engine schedules
and dispatches the next step, so the device never waits for the host: the runner keeps each
step's sampled tokens on the device, and the next batch's `feed_rows` read them from there.
Steps run in dispatch order; a runner may have one step in flight besides the one being
dispatched. `execute(batch)` = `collect(dispatch(batch))` (warmup, followers, scripts).

A step whose sampler needs the host to see the previous step's tokens first (a grammar's
token mask) is dispatched with `late_mask`: the runner queues the step's forward, then calls
`late_mask()` (the engine applies the previous step there and fills the mask, while the
device runs the forward) and queues the sampler with the (bitmask, constrained) it returns in
place of the batch's. So grammar-constrained steps keep the device busy too.

LoRA: `load_lora(slot, adapter)` puts an adapter (opaque to the engine: what the loader
serving.build injects returned) into a device slot before the step that first reads it;
the engine calls it only for a slot that no dispatched, uncollected step reads
(`lora_slots.py`), and the step's `StepBatch.lora` names each token's slot.

Implementations: `model_runner.ModelRunner` (the model on a device), `multihost.LeaderRunner`
(the same on several hosts) and `fake_runner.ArithmeticRunner` (arithmetic outputs, for
scheduler tests and host benchmarks).

Failures: `dispatch` raises `RunnerFailed`, whose `fatal` says whether the runner can run
another step. Not fatal: the step did not run or its KV writes do not matter (the batch could
not be converted or placed, a trace-time error before the donated KV pages were consumed); the
engine finishes the step's requests (or only `rows`, when the runner knows the culprits) with
ERROR and carries on. Fatal: the device state is gone or unknown (the donated KV buffer was
consumed by a failed step, an XLA runtime error, a broken multi-host job); the engine raises
`EngineDead`. Any other exception out of `dispatch` counts as fatal, and so does any failure
out of `collect` (the step ran, or failed, on the device: a later step that was already
dispatched may have read its outputs).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Protocol

import numpy as np

from jaxserve.engine.batch import StepBatch


@dataclasses.dataclass
class StepResult:
    tokens: np.ndarray  # i32[S_b]
    logprob: np.ndarray  # f32[S_b]
    top_ids: np.ndarray  # i32[S_b, MAX_LOGPROBS] (sampling_params.MAX_LOGPROBS)
    top_logprobs: np.ndarray  # f32[S_b, MAX_LOGPROBS]
    # Only on steps that score prompt tokens (StepBatch.prompt_logprobs present), in
    # `engine.prompt_logprobs.pack`'s order; else None.
    prompt_logprob: np.ndarray | None = None  # f32[L]
    prompt_top_ids: np.ndarray | None = None  # i32[L, MAX_LOGPROBS]
    prompt_top_logprobs: np.ndarray | None = None  # f32[L, MAX_LOGPROBS]


# Called between a step's forward and its sampler: (i32[S_b, W] bitmask or None, bool[S_b]
# constrained rows), replacing the batch's `bitmask` / `constrained`.
LateMask = Callable[[], tuple["np.ndarray | None", np.ndarray]]


class RunnerFailed(RuntimeError):
    """A step failed in the runner; `fatal`: the runner cannot run another step. `rows`: the
    batch rows known to have caused it (None: unknown, every row of the step is affected)."""

    def __init__(self, message: str, fatal: bool, rows: tuple[int, ...] | None = None):
        super().__init__(message)
        self.fatal = fatal
        self.rows = rows


class PendingStep(Protocol):
    """A dispatched step (runner-specific): what `Runner.collect` takes."""


class Runner(Protocol):
    def warmup(self, progress: bool = True) -> None:
        """Compile every bucket (compiles are counted only after `arm`)."""

    def arm(self) -> None:
        """Warmup is over (for every engine of the process): count compiles from now on."""

    def dispatch(self, batch: StepBatch, late_mask: LateMask | None = None) -> PendingStep:
        """Queue one step on the device; RunnerFailed when it fails (module docstring).
        `late_mask`: called once the forward is queued, for the sampler's grammar mask."""

    def collect(self, pending: PendingStep) -> StepResult:
        """Wait for a dispatched step's result (steps are collected in dispatch order)."""

    def execute(self, batch: StepBatch) -> StepResult:
        """`collect(dispatch(batch))`."""

    def load_lora(self, slot: int, adapter: object) -> None:
        """Load `adapter` into LoRA slot `slot` (1..max_loras), replacing what it held, for
        the steps dispatched after; RunnerFailed (not fatal) when this adapter cannot be
        loaded (the engine fails the requests using it)."""

    @property
    def compiles_after_warmup(self) -> int: ...

    def close(self) -> None:
        """Release what the runner holds (multi-host: stop the other processes)."""
