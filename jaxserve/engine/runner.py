"""The engine <-> runner contract, jax-free: the Runner protocol and what a step returns.

Two implementations: `model_runner.ModelRunner` (the model on a device) and
`fake_runner.ArithmeticRunner` (arithmetic outputs, for scheduler tests and host benchmarks).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np

from jaxserve.engine.batch import StepBatch


@dataclasses.dataclass
class StepResult:
    tokens: np.ndarray  # i32[S_b]
    logprob: np.ndarray  # f32[S_b]
    top_ids: np.ndarray  # i32[S_b, MAX_LOGPROBS] (sampling_params.MAX_LOGPROBS)
    top_logprobs: np.ndarray  # f32[S_b, MAX_LOGPROBS]


class Runner(Protocol):
    def warmup(self, progress: bool = True) -> None:
        """Compile every bucket (compiles are counted only after `arm`)."""

    def arm(self) -> None:
        """Warmup is over (for every engine of the process): count compiles from now on."""

    def execute(self, batch: StepBatch) -> StepResult: ...

    @property
    def compiles_after_warmup(self) -> int: ...

    def close(self) -> None:
        """Release what the runner holds (multi-host: stop the other processes)."""
