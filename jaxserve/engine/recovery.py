"""Failure recovery of the engine's steps: which requests a failure costs, and when it is fatal.

Plain Python (no jax). The engine owns one `Recovery` and is its only caller.

When a step fails (see `runner.RunnerFailed` and docs/serving/index.md, "When a step fails"):
  per request (the engine carries on): the batch build fails (each scheduled row is then
    built alone to find the culprit rows; none found: every row of the step), the runner
    raises a non-fatal RunnerFailed (its `rows`, else every row), applying a row's result
    fails (`Scheduler.update` isolates rows), or a request's token processing fails
    (logprobs, detokenization, stop strings, its output). Those requests finish with
    FinishReason.ERROR and `error` set (the n samples of a request fail together); their
    pages are freed by `Scheduler.finish` like any finish, and the other scheduled rows,
    whose results never came, are scheduled again for the same tokens (their pages stay
    reserved, nothing was computed).
  fatal (`EngineDead`, raised by this and every later `step` / `add_request`): a fatal
    RunnerFailed or any other exception out of the runner (the device state is unknown),
    a failing `schedule()`, or a recovery that itself fails (the host state is unknown).

Data flow: each stage of a step (`step_core.StepCore`) returns the (sequence, message) pairs
it failed as a value: `build` (a `Staged` batch, None when it cannot be built, with the culprit
rows), `step_lost` (a dispatch that raised a non-fatal RunnerFailed: its rows), and the core's
apply stage (a malformed result, the rows `Scheduler.update` isolated, a sequence's token
processing). The core hands them to `fail`, which finishes each of them, and the other samples
of its request, with ERROR through `Scheduler.finish`, and returns the groups it touched, so
the step's outputs report them. A request whose output itself cannot be built gets
`error_output`. Anything that leaves the device or host state unknown goes to `die`, after
which `check_alive` raises EngineDead for good.

State: `dead` (why the engine cannot step any more) is this object's alone. The sequences are
the scheduler's (finished and rolled back through it), the groups the engine's (`group_of`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Generic, Mapping, TypeVar

from jaxserve.engine.batch import BatchShape, StepBatch, build_batch
from jaxserve.engine.errors import EngineDead, bounded
from jaxserve.engine.group import Group
from jaxserve.engine.outputs import RequestOutput
from jaxserve.engine.sequence import FinishReason, Sequence
from jaxserve.engine.runner import RunnerFailed
from jaxserve.engine.scheduler import Scheduler, SchedulerOutput

# The engine's logger: failures are logged under the name they had before this module was
# split out of engine.py, so log filters and alerts on it keep matching.
log = logging.getLogger("jaxserve.engine.engine")

Failures = list[tuple[Sequence, str]]  # (sequence, why it failed), to finish with ERROR
T = TypeVar("T")


@dataclasses.dataclass
class Staged(Generic[T]):
    """What one stage of a step produced (None: nothing, its rows were rolled back) and the
    sequences it failed, for the caller to hand to `Recovery.fail`."""

    value: T | None
    failures: Failures = dataclasses.field(default_factory=list)


class Recovery:
    def __init__(self, scheduler: Scheduler, group_of: Callable[[Sequence], Group | None]):
        self._scheduler = scheduler
        self._group_of = group_of  # the engine's group of a sequence (None: it has none)
        self.dead: str | None = None  # why the engine cannot step any more (None: it can)

    # ----------------------------------------------------------------------- fatal
    def check_alive(self) -> None:
        if self.dead is not None:
            raise EngineDead(self.dead)

    def die(self, what: str, error: BaseException) -> EngineDead:
        """Mark the engine dead (`what` failed with `error`); the caller raises the result."""
        self.dead = f"{what}: {error!r}"
        log.error("engine dead: %s", self.dead, exc_info=error)
        return EngineDead(self.dead)

    # ----------------------------------------------------------------------- a lost step
    def build(self, out: SchedulerOutput, shape: BatchShape, prev_rows: Mapping[int, int] | None,
              late: bool = False) -> Staged[StepBatch]:
        """The step's batch, or None when it could not be built: then the rows that fail
        alone (else every row) are its failures and every row is rolled back to wait for
        the next step, its pages reserved and nothing computed."""
        try:
            return Staged(build_batch(out, shape, prev_rows, fill_grammars=not late))
        except Exception as e:  # noqa: BLE001 - find the culprit rows
            error = e
        culprits = []
        for s in out.seqs:
            try:
                build_batch(SchedulerOutput([s], s.num_new_tokens, []), shape, prev_rows,
                            fill_grammars=not late)
            except Exception as e:  # noqa: BLE001
                culprits.append((s.sequence, f"building the step's batch failed: {e!r}"))
        self._scheduler.unschedule(out.seqs)
        return Staged(None, culprits or [(s.sequence, f"building the step's batch failed: "
                                          f"{error!r}") for s in out.seqs])

    def step_lost(self, out: SchedulerOutput, error: RunnerFailed) -> Failures:
        """A dispatch of `out` raised `error`: fatal, the engine dies (EngineDead is raised);
        else the step is rolled back, its other rows scheduled again for the same tokens, and
        its rows (every row when it names none) are returned as failed."""
        if error.fatal:
            raise self.die("the model step failed", error) from error
        rows = range(len(out.seqs)) if error.rows is None else error.rows
        self._scheduler.unschedule(out.seqs)
        return [(out.seqs[i].sequence, f"the model step failed: {error}") for i in rows]

    # ----------------------------------------------------------------------- failed requests
    def fail(self, failures: Failures) -> list[Group]:
        """Finish each failed sequence with ERROR and its message, and the other samples of
        its request (already finished ones keep their result); pages go back through
        `Scheduler.finish`. Returns the groups of the failed sequences (news for the step's
        outputs), in failure order."""
        touched = []
        for req, message in failures:
            # An exception's text can quote a whole grammar or prompt: the client's error
            # and the log line get a bounded excerpt.
            message = bounded(message)
            log.warning("request %r failed: %s", req.request_id, message)
            group = self._group_of(req)
            seqs = group.seqs if group is not None else [req]
            for seq in seqs:
                text = message if seq is req else \
                    f"sample {req.sample_index} of this request failed: {message}"
                if not seq.is_finished:
                    self._scheduler.finish(seq, FinishReason.ERROR, text)
                elif seq is req:  # finished by this very step (e.g. its last token)
                    seq.finish_reason, seq.error = FinishReason.ERROR, text
            if group is not None:
                touched.append(group)
        return touched

    def error_output(self, g: Group, message: str) -> RequestOutput:
        """A final output for a request whose output could not be built: its unfinished
        samples end with ERROR (finished ones keep their reason; no sample is blamed)."""
        for seq in g.seqs:
            if not seq.is_finished:
                self._scheduler.finish(seq, FinishReason.ERROR, message)
        return g.error_output(message)
