"""The engine's synchronous step: schedule -> build -> run -> apply, each stage a method.

Plain Python (no jax). Data flow of one `StepCore.step()`:
  `schedule()` (scheduler.schedule(): a SchedulerOutput, rows in batch order) ->
  `launch(out)`: `Recovery.build` (batch.build_batch(): numpy, bucketed), the step's LoRA
    slot loads (`runner.load_lora`, adapters from the engine's host cache) then
    runner.dispatch() (one compiled device step, queued) -> an `InFlight` step, or None when
    the build, an adapter load or a non-fatal dispatch failed (its rows rolled back) ->
  `fail(failures)`: the sequences a stage failed finish with ERROR (`recovery.py`) ->
  `apply(step)`: runner.collect() (one device->host copy) -> scheduler.update() (tokens
    appended, token stop rules, pages freed) -> per sequence: prompt logprobs, logprobs,
    grammar advance, incremental detokenization and stop strings.
The overlapped pipeline (`pipeline.py`) calls the same stages in another order.

Failures are values: `launch` returns a `recovery.Staged` (the step it dispatched, or None,
and the (sequence, message) pairs it failed); the caller decides when they are failed (the
pipeline first applies the step before). `apply` fails the rows it finds at once, in the
order it finds them, so a failed sample's siblings are finished before their own tokens are
processed. Anything that leaves the device or host state unknown raises EngineDead through
`Recovery.die`.

State, one owner each: the step counters (`num_steps`, `last_step_tokens`) and `news` (the
groups with news for the next outputs: sampled tokens, failures, aborts) are this object's;
the sequences' KV state is the scheduler's, the groups the engine's (`group_of`), the device
the runner's, `dead` the recovery's.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Mapping

import numpy as np

from jaxserve.engine import batch_spec, prompt_logprobs
from jaxserve.engine.batch import BatchShape, late_bitmask
from jaxserve.engine.group import Group
from jaxserve.engine.lora_request import LoraBinding
from jaxserve.engine.recovery import Failures, Recovery, Staged
from jaxserve.engine.sequence import FinishReason, Sequence
from jaxserve.engine.runner import LateMask, PendingStep, Runner, RunnerFailed, StepResult
from jaxserve.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from jaxserve.engine.speculation import Speculator
from jaxserve.engine.step_time_model import StepFeatures, attention_keys


@dataclasses.dataclass
class InFlight:
    """A step on the device whose results have not been applied yet."""

    out: SchedulerOutput
    pending: PendingStep
    applied: bool = False  # by the next step's late mask (`pipeline.Pipeline`)
    started: float = 0.0  # clock when its scheduling began (its step-time measurement)
    bucket: tuple[int, int] = (0, 0)  # (T_b, S_b) it was padded to

    @functools.cached_property
    def sampled_rows(self) -> dict[int, int]:
        """seq_id -> sampler row of the token each sequence this step samples (the next
        step's feeds; a verifying row's last, though such steps are never overlapped)."""
        rows = batch_spec.first_rows(self.out)
        return {s.sequence.seq_id: r + len(s.spec_token_ids)
                for r, s in zip(rows, self.out.seqs) if s.samples}

    @property
    def needs_host_tokens(self) -> bool:
        """A row it samples uses penalties: the next batch needs that token's history."""
        return any(s.samples and s.sequence.sampling_params.uses_penalties
                   for s in self.out.seqs)


class StepCore:
    def __init__(self, scheduler: Scheduler, runner: Runner, shape: BatchShape,
                 recovery: Recovery, group_of: Callable[[Sequence], Group | None],
                 speculator: Speculator | None = None,
                 clock: Callable[[], float] | None = None,
                 lora_adapter: Callable[[LoraBinding], object] | None = None):
        """`clock`: what step times are measured with (the scheduler's by default).
        `lora_adapter`: a registered adapter's loaded weights (`LoraRegistry.adapter`)."""
        self.scheduler = scheduler
        self.clock = clock or scheduler.clock
        self._started = 0.0  # when the step being launched began scheduling
        self._last_ready = -math.inf  # when the last applied step's results were ready
        self.speculator = speculator  # None: no speculative decoding
        self.runner = runner
        self.shape = shape
        self.recovery = recovery
        self._group_of = group_of
        self._lora_adapter = lora_adapter
        self.num_steps = 0
        self.last_step_tokens = 0
        self.news: dict[str, Group] = {}  # request_id -> group with news for the outputs

    @property
    def in_flight(self) -> InFlight | None:
        """The step dispatched and not applied: never one, every step is applied at once."""
        return None

    def step(self) -> None:
        """One synchronous step: schedule, build and dispatch, fail what failed, apply."""
        out = self.schedule()
        if not out.seqs:
            return
        launched = self.launch(out)
        self.fail(launched.failures)
        if launched.value is not None:
            self.apply(launched.value)

    def touch(self, groups: list[Group]) -> None:
        """These groups have news for the next outputs (an abort, a failure, a token)."""
        for g in groups:
            self.news[g.request_id] = g

    def take_news(self) -> dict[str, Group]:
        """The groups with news since the last call (their outputs are due)."""
        news, self.news = self.news, {}
        return news

    # ----------------------------------------------------------------------- stages
    def wants_host_tokens(self) -> bool:
        """The next step may verify proposals, which follow the tokens of the step before:
        the pipeline applies that step before scheduling (`Speculator.wants_host_tokens`)."""
        return self.speculator is not None and \
            self.speculator.wants_host_tokens(self.scheduler.running)

    def schedule(self) -> SchedulerOutput:
        self._started = self.clock()
        try:
            if self.speculator is not None:
                self.speculator.propose(self.scheduler.running)
            return self.scheduler.schedule()
        except Exception as e:  # noqa: BLE001 - the scheduler's state is unknown
            raise self.recovery.die("scheduling a step failed", e) from e

    def launch(self, out: SchedulerOutput, feeds: Mapping[int, int] | None = None,
               before_mask: Callable[[], None] | None = None) -> Staged[InFlight]:
        """Build and dispatch one scheduled step; `feeds` (seq_id -> row of the step before)
        are its fed rows. None when it did not run: its rows are rolled back to be scheduled
        again, and the ones that caused it are its failures. `before_mask`: the rows whose
        mask follows their output get it late, once the forward is queued and
        `before_mask()` (the pipeline applying the step before) has run."""
        built = self.recovery.build(out, self.shape, feeds, late=before_mask is not None)
        batch = built.value
        lora = self.scheduler.lora
        if batch is None:
            lora.loads_lost(out)
            lora.step_done(out)
            return Staged(None, built.failures)
        lost = self._load_loras(out)
        if lost:  # rows read a slot whose adapter is missing: the step cannot run as built
            self.scheduler.unschedule(out.seqs)
            lora.step_done(out)
            return Staged(None, lost)
        # The late mask is filled inside `dispatch` (the runner calls it between the forward
        # and the sampler): the rows it cannot mask are collected here, part of this result.
        failures: Failures = []
        late_mask: LateMask | None = None
        if before_mask is not None:
            def fill_late() -> tuple[np.ndarray | None, np.ndarray]:
                before_mask()
                return late_bitmask(out, batch.num_seqs_bucket, self.shape.vocab_size, failures)
            late_mask = fill_late
        try:
            pending = self.runner.dispatch(batch, late_mask) if late_mask is not None else \
                self.runner.dispatch(batch)
        except RunnerFailed as e:
            failures += self.recovery.step_lost(out, e)  # EngineDead when it is fatal
            lora.step_done(out)  # (its loads reached the runner: they stand)
            return Staged(None, failures)
        except Exception as e:  # noqa: BLE001 - the device state is unknown
            raise self.recovery.die("the model step failed", e) from e
        self.num_steps += 1
        self.last_step_tokens = out.num_tokens
        return Staged(InFlight(out, pending, started=self._started,
                               bucket=(len(batch.forward.token_ids), batch.num_seqs_bucket)),
                      failures)

    def fail(self, failures: Failures) -> None:
        """Finish the failed sequences with ERROR (`Recovery.fail`); their groups have news.
        Sequences already finished (a step before ended them: their failed row was a
        discarded extra) are skipped."""
        failures = [(r, m) for r, m in failures if not r.is_finished]
        if failures:
            self.touch(self.recovery.fail(failures))

    def apply(self, step: InFlight) -> None:
        """Collect a dispatched step's result and apply it: tokens, stops, outputs."""
        out = step.out
        try:
            result = self.runner.collect(step.pending)
        except Exception as e:  # noqa: BLE001 - later steps may have read its outputs
            raise self.recovery.die("the model step failed", e) from e
        self.scheduler.lora.step_done(out)  # its adapter slots may be refilled now
        self._measure(step)
        if result.prompt_logprob is not None:
            self._fail_now(self._take_prompt_logprobs(out, result))
        rows = batch_spec.first_rows(out) if out.num_rows > out.num_seqs else \
            range(len(out.seqs))
        try:
            sampled = [self._row_tokens(s, result.tokens, r) if s.samples else None
                       for s, r in zip(out.seqs, rows)]
        except Exception as e:  # noqa: BLE001 - a malformed result: every row's is suspect
            self._fail_now([(s.sequence, f"the model step's result is unusable: {e!r}")
                            for s in out.seqs])
            return
        before = {id(s.sequence): s.sequence.num_output_tokens for s in out.seqs}
        errors: list[tuple[Sequence, Exception]] = []
        progressed = self.scheduler.update(out, sampled, errors)
        if self.speculator is not None:  # an EAGLE-3 head reads every applied step
            self.speculator.observe(out, step.pending)
        self._fail_now([(r, f"applying the step's result failed: {e!r}") for r, e in errors])
        first = {id(s.sequence): r for s, r in zip(out.seqs, rows)}
        for req in progressed:
            group = self._group_of(req)
            if group is None:  # no group to report to: only give the pages back
                self.scheduler.finish(req, FinishReason.ERROR, "no request holds this sequence")
                continue
            self.news[group.request_id] = group
            try:
                self._take_tokens(req, group, result, first[id(req)], before[id(req)])
            except Exception as e:  # noqa: BLE001 - this request's tokens only
                self._fail_now([(req, f"processing the sampled token failed: {e!r}")])

    def _measure(self, step: InFlight) -> None:
        """Hand the step-time model this step's time as its streams saw it: from the later
        of its scheduling and the previous step's results to its own results (overlapped,
        back-to-back steps: the gap between results; after an idle spell: host + device)."""
        ready = self.clock()
        seconds = ready - max(step.started, self._last_ready)
        self._last_ready = ready
        budget = self.scheduler.budget
        keys = attention_keys((s.start, s.num_new_tokens) for s in step.out.seqs)
        budget.observe(StepFeatures(*step.bucket, keys), seconds)

    def _row_tokens(self, row: ScheduledSeq, tokens: np.ndarray, first: int
                    ) -> int | list[int]:
        """A sampling row's token, or the tokens a verification row emits."""
        if not row.spec_token_ids:
            return int(tokens[first])
        if self.speculator is None:
            raise ValueError("a row verifies proposals but the engine has no speculator")
        return self.speculator.verify(row, tokens[first:first + 1 + len(row.spec_token_ids)])

    # ----------------------------------------------------------------------- helpers
    def _load_loras(self, out: SchedulerOutput) -> Failures:
        """Hand the runner each adapter the step loads into a slot (`SchedulerOutput.
        lora_loads`; no step in flight reads those slots: `lora_slots.py`). An adapter that
        cannot be read from its path any more, or that the runner refuses (a non-fatal
        RunnerFailed), fails the running sequences pinning its slot, which is emptied."""
        failures: Failures = []
        loads, out.lora_loads = out.lora_loads, []
        for slot, binding in loads:
            try:
                if self._lora_adapter is None:
                    raise ValueError("the engine has no LoRA adapters")
                self.runner.load_lora(slot, self._lora_adapter(binding))
                continue
            except RunnerFailed as e:
                if e.fatal:
                    raise self.recovery.die("loading a LoRA adapter failed", e) from e
                why = f"loading LoRA adapter {binding.name!r} failed: {e}"
            except ValueError as e:  # the host copy (InvalidRequest naming lora_path)
                why = str(e)
            except Exception as e:  # noqa: BLE001 - the device state is unknown
                raise self.recovery.die("loading a LoRA adapter failed", e) from e
            failures += [(r, why) for r in self.scheduler.running if r.lora_slot == slot]
            self.scheduler.lora.clear(slot)
        return failures

    def _fail_now(self, failures: Failures) -> None:
        """`Recovery.fail` without the finished filter: a sequence this very step finished
        (e.g. its last token) still takes the blame."""
        if failures:
            self.touch(self.recovery.fail(failures))

    def _take_prompt_logprobs(self, out: SchedulerOutput, result: StepResult) -> Failures:
        scored = prompt_logprobs.spans(out)
        try:
            prompt_logprobs.unpack(out, scored, result.prompt_logprob, result.prompt_top_ids,
                                   result.prompt_top_logprobs)
        except Exception as e:  # noqa: BLE001 - a malformed result: the scored rows' fail
            return [(out.seqs[s.row].sequence, f"the step's prompt logprobs are unusable: "
                     f"{e!r}") for s in scored]
        return []

    def _take_tokens(self, req: Sequence, group: Group, result: StepResult, row: int,
                     before: int) -> None:
        """A sequence's new tokens on the host side, one by one: logprobs (sampler rows
        `row`, `row + 1`, ...), grammar, text, stop strings. A stop string or the grammar's
        end at a token before the last of a verified run cuts the run there, as if the
        later tokens had never been generated (the non-speculative engine stops there)."""
        if not req.output_token_ids:
            return  # a prefill-only request (max_tokens=0) finished without a token
        new = req.num_output_tokens - before
        detok = group.detoks[req.sample_index]
        for k in range(new):
            index = before + k
            token = req.output_token_ids[index]
            if req.sampling_params.logprobs is not None:
                req.record_logprobs(result.logprob[row + k], result.top_ids[row + k],
                                    result.top_logprobs[row + k], index=index)
            last = k == new - 1
            if last and req.is_finished and req.finish_reason in (FinishReason.EOS,
                                                                  FinishReason.STOP):
                return  # the stop token's own text is never shown
            ended = req.grammar is not None and req.grammar.advance(token, index + 1)
            if detok.add_token(token):
                self._end_at(req, index, last, FinishReason.STOP_STRING)
                return
            if ended and not req.is_finished:  # the grammar's last token: its text is shown
                self._end_at(req, index, last, FinishReason.STOP)
                return

    def _end_at(self, req: Sequence, index: int, last: bool, reason: FinishReason) -> None:
        """Finish `req` with `reason` at output token `index` (dropping any after it)."""
        if not last:
            req.truncate_output(index + 1)
            if req.is_finished:  # by a later token of the run, which is gone now
                req.finish_reason = reason
                return
        self.scheduler.finish(req, reason)
