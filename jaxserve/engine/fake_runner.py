"""A model runner without a model: arithmetic outputs, for scheduler-level tests and benchmarks.

Implements the `runner.Runner` protocol on numpy alone (no jax): each sequence's next
token is a function of the token it just fed and that token's position, so a test can
predict every output and a benchmark can time the host side (schedule + batch build) with
no device work in the way.

Fault injection (`InjectedFault`): a step whose new tokens include a marker token id raises
`RunnerFailed`, fatal or not, naming the culprit rows or not, so tests can drive the engine's
recovery paths. A fatal fault leaves the runner refusing every later step, as a lost device
would.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxserve.engine.batch import StepBatch
from jaxserve.engine.runner import RunnerFailed, StepResult
from jaxserve.engine.sampling_params import MAX_LOGPROBS


def arithmetic_next_token(last_token: int, position: int, vocab_size: int) -> int:
    return (last_token * 31 + position * 7 + 1) % vocab_size


@dataclasses.dataclass(frozen=True)
class InjectedFault:
    """Fail a step whose new tokens include `token_id` (e.g. in one request's prompt)."""

    token_id: int
    fatal: bool = False
    name_rows: bool = False  # report the rows holding the token (else the culprit is unknown)
    times: int | None = 1  # how many steps fail (None: every one that matches)


class ArithmeticRunner:
    def __init__(self, vocab_size: int, fault: InjectedFault | None = None):
        self.vocab_size = vocab_size
        self.fault = fault
        self.steps = 0
        self.faults_raised = 0
        self._dead = False

    @property
    def compiles_after_warmup(self) -> int:
        return 0

    def warmup(self, progress: bool = True) -> None:
        return None

    def arm(self) -> None:
        return None

    def close(self) -> None:
        return None

    def execute(self, batch: StepBatch) -> StepResult:
        if self._dead:
            raise RunnerFailed("the (fake) device was lost by an earlier step", fatal=True)
        self._maybe_fail(batch)
        last = np.maximum(batch.cu_q_lens[1:] - 1, 0)
        tokens = (batch.token_ids[last].astype(np.int64) * 31 + batch.positions[last] * 7 + 1) \
            % self.vocab_size
        S = len(batch.kv_lens)
        self.steps += 1
        return StepResult(tokens=tokens.astype(np.int32), logprob=np.zeros(S, np.float32),
                          top_ids=np.zeros((S, MAX_LOGPROBS), np.int32),
                          top_logprobs=np.zeros((S, MAX_LOGPROBS), np.float32))

    def _maybe_fail(self, batch: StepBatch) -> None:
        f = self.fault
        if f is None or (f.times is not None and self.faults_raised >= f.times):
            return
        num = int(batch.num_seqs[0])
        cu = batch.cu_q_lens
        rows = tuple(r for r in range(num)
                     if f.token_id in batch.token_ids[cu[r]:cu[r + 1]].tolist())
        if not rows:
            return
        self.faults_raised += 1
        self._dead = f.fatal
        raise RunnerFailed(f"injected fault on token {f.token_id}", fatal=f.fatal,
                           rows=rows if f.name_rows else None)
