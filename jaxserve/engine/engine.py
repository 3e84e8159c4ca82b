"""The synchronous engine: add_request / abort / step. No threads; the caller drives steps.

Data flow of `step()`:
  scheduler.schedule() -> batch.build_batch() (numpy, bucketed) -> runner.dispatch() (one
  compiled device step, queued) -> runner.collect() (one device->host copy) ->
  scheduler.update() (tokens appended, token stop rules, pages freed) -> per sequence:
  logprobs recorded, incremental detokenization and stop strings -> RequestOutputs shaped by
  each request's `RequestOutputKind` (cumulative copies, deltas only, or nothing until the
  final one; see `outputs.py`).

Overlap (`EngineConfig.async_scheduling`, on by default): `step()` schedules and dispatches
step N+1 while step N runs on the device, then collects and applies step N, so the device
never idles while the host schedules, builds batches, detokenizes and streams. Step N+1's
decode rows feed on step N's sampled tokens on the device (`ForwardInputs.feed_rows`); what
only a token's value can end (EOS, stop ids, stop strings) ends one step late and the extra
token is discarded, so outputs are the same as without overlap (see `scheduler.py`). When
step N samples a row with penalties (step N+1 needs its history), N is applied before N+1 is
scheduled; rows whose token mask follows their output (a grammar, vLLM's bad_words of several
tokens: `Request.mask_follows_output`) get it late (`_launch`). Each `step()` returns
the outputs of the step it applied.

The engine owns the requests' host-side extras (prompt text, detokenizers, n-sample groups,
grammar matchers); the scheduler owns their KV state; the runner owns everything on the
device. Callers outside read `limits` (what a request must fit in) and `stats()` (a snapshot
of the counters), never the scheduler or allocator. `admit()` runs every request check
(`limits.EngineLimits`, the grammar compile) without queueing; `add_request` runs it unless
handed the `Admitted` result.

Identity: the client's request id names a group (one per user request, the duplicate check
is on it whatever `n` is); each of its n sequences gets an integer `seq_id` from the
scheduler, the only key below this class. A request is queued whole or not at all.

When a step fails, the requests it cost finish with FinishReason.ERROR and the engine carries
on, unless the device or host state is unknown: then `EngineDead`, raised by that and every
later `step` / `add_request`. Which failure costs what, and how: `recovery.py`.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import time
from typing import Callable, Sequence

import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.engine import prompt_logprobs
from jaxserve.engine.batch import late_bitmask
from jaxserve.engine.errors import EngineDead
from jaxserve.engine.grammar import grammar_compiler
from jaxserve.engine.group import Group
from jaxserve.engine.limits import (Admitted, EngineLimits, EngineStats, check_not_in_flight,
                                    check_priority, check_request_id)
from jaxserve.engine.outputs import RequestOutput, RequestOutputKind
from jaxserve.engine.recovery import Failures, Recovery
from jaxserve.engine.request import FinishReason, Request
from jaxserve.engine.runner import PendingStep, Runner, RunnerFailed, StepResult
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.engine.scheduler import Scheduler, SchedulerOutput
from jaxserve.engine.sizing import EnginePlan
from jaxserve.models.tokenizer import Tokenizer


@dataclasses.dataclass
class _Dispatched:
    """A step on the device whose results the engine has not applied yet."""

    out: SchedulerOutput
    pending: PendingStep
    applied: bool = False  # by the next step's late mask (`_launch`)

    @functools.cached_property
    def sampled_rows(self) -> dict[int, int]:
        """seq_id -> batch row of each sequence this step samples (the next step's feeds)."""
        return {s.request.seq_id: i for i, s in enumerate(self.out.seqs) if s.samples}

    @property
    def needs_host_tokens(self) -> bool:
        """A row it samples uses penalties: the next batch needs that token's history."""
        return any(s.samples and s.request.sampling_params.uses_penalties
                   for s in self.out.seqs)


class Engine:
    def __init__(self, config: EngineConfig, plan: EnginePlan, runner: Runner,
                 tokenizer: Tokenizer, eos_token_ids: Sequence[int],
                 clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.plan = plan
        self.runner = runner
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self.clock = clock
        self.scheduler = Scheduler(plan.scheduler, clock)
        self._groups: dict[str, Group] = {}
        self._seed_rng = random.Random(config.seed)
        sc = plan.scheduler
        self._limits = EngineLimits(
            max_model_len=sc.max_model_len, vocab_size=plan.batch_shape.vocab_size,
            page_size=sc.page_size, num_kv_pages=sc.num_pages - 1,
            max_num_seqs=sc.max_num_seqs, max_num_batched_tokens=sc.max_num_batched_tokens,
            kv_windows=sc.kv_windows, eos_token_ids=self.eos_token_ids, max_token_bytes=tokenizer.max_token_bytes,
            grammars=grammar_compiler(tokenizer, plan.batch_shape.vocab_size),
            encode_words=functools.partial(tokenizer.encode, add_special_tokens=False))
        self.num_steps = 0
        self.last_step_tokens = 0
        self._in_flight: _Dispatched | None = None  # dispatched, not yet applied
        # Groups with news for the next step's outputs besides this step's tokens (aborts).
        self._touched: dict[str, Group] = {}
        # What a failed step costs; it alone keeps why the engine is dead.
        self._recovery = Recovery(self.scheduler, self._group_of)

    # ----------------------------------------------------------------------- read-only views
    @property
    def limits(self) -> EngineLimits:
        """What a request must fit in (and what callers are told about the model)."""
        return self._limits

    def stats(self) -> EngineStats:
        """A snapshot of the running state and cumulative counters (call it from the thread
        that drives the engine)."""
        sched = self.scheduler
        alloc = sched.allocator
        total = alloc.num_usable_pages
        return EngineStats(
            num_requests=len(self._groups), num_running=sched.num_running,
            num_waiting=sched.num_waiting, kv_pages_used=total - alloc.num_free_pages,
            kv_pages_total=total, prefix_cache_queries=alloc.prefix_queries * alloc.page_size,
            prefix_cache_hits=alloc.prefix_hits * alloc.page_size,
            num_preemptions=sched.num_preemptions, num_steps=self.num_steps,
            last_step_tokens=self.last_step_tokens,
            compiles_after_warmup=self.runner.compiles_after_warmup)

    # ----------------------------------------------------------------------- intake
    def admit(self, prompt: str | Sequence[int], params: SamplingParams | None = None
              ) -> Admitted:
        """Every check of one request (its limits, its grammar's compile), without queueing
        it (thread-safe: it reads only the limits and the tokenizer)."""
        return self._limits.admit(prompt, params or SamplingParams(), self._encode)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True)

    def add_request(self, request_id: str, prompt: str | Sequence[int] | Admitted,
                    params: SamplingParams | None = None, priority: int = 0,
                    arrival_time: float | None = None,
                    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE) -> None:
        """Queue a request; ValueError (an InvalidRequest naming the field) for anything that
        cannot run. An `Admitted` prompt (from `admit`) carries its params and is not checked
        again. Every check runs before anything is queued. `output_kind`: what its outputs
        carry (see `outputs.RequestOutputKind`)."""
        self._recovery.check_alive()
        check_request_id(request_id)
        check_not_in_flight(request_id, self._groups)
        check_priority(priority)
        req = prompt if isinstance(prompt, Admitted) else self.admit(prompt, params)
        params, ids = req.params, list(req.token_ids)
        now = self.clock() if arrival_time is None else arrival_time
        base_seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        grammars = self._limits.grammars  # one matcher per sample, of the admitted grammar
        seqs = [Request(request_id, list(ids), params, self.eos_token_ids, now,
                        priority=priority, sample_index=i, max_tokens=req.max_tokens,
                        seed=(base_seed + i) % (1 << 64), grammar=None if req.grammar is None
                        else grammars.matcher(req.grammar),  # type: ignore[union-attr]
                        token_filter=req.token_filter)
                for i in range(params.n)]
        group = Group.create(request_id, req.prompt, ids, params, seqs, self.tokenizer.backend,
                             output_kind)
        for i, seq in enumerate(seqs):  # cannot fail: checked, and fresh sequences
            self.scheduler.add_request(seq, fork_of=seqs[0] if i else None, checked=True)
        self._groups[request_id] = group

    def abort(self, request_id: str) -> bool:
        """Abort a request at any moment; its final output (ABORT) comes from the next step."""
        group = self._groups.get(request_id)
        if group is None:
            return False
        self.scheduler.abort([s.seq_id for s in group.seqs])
        self._touched[request_id] = group  # its final ABORT output comes from the next step
        return True

    def has_unfinished(self) -> bool:
        return bool(self._groups) or self._in_flight is not None

    def close(self) -> None:
        """Release the runner (multi-host: the other processes stop following)."""
        self.runner.close()

    @property
    def num_requests(self) -> int:
        return len(self._groups)

    @property
    def dead(self) -> str | None:
        """Why the engine cannot step any more (None: it can)."""
        return self._recovery.dead

    # ----------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Run one scheduler iteration; outputs for every request with news. A failure of
        some requests finishes them with ERROR (see `recovery.py`); EngineDead when the
        engine cannot go on."""
        recovery = self._recovery
        recovery.check_alive()
        touched = self._touched
        self._touched = {}
        prev, self._in_flight = self._in_flight, None
        try:
            if prev is not None and prev.needs_host_tokens:
                self._apply(prev, touched)  # the next batch needs its tokens on the host
                prev = None
            try:
                out = self.scheduler.schedule()
            except Exception as e:  # noqa: BLE001 - the scheduler's state is unknown
                raise recovery.die("scheduling a step failed", e) from e
            failed: Failures = []
            launched = self._launch(out, prev, failed, touched) if out.seqs else None
            if prev is not None and not prev.applied:
                self._apply(prev, touched)
            # After `prev`'s tokens are in (they were computed), and not for sequences that
            # `prev` finished (their row in the failed step was a discarded extra).
            recovery.fail([(r, m) for r, m in failed if not r.is_finished], touched)
            if launched is not None:
                if self.config.async_scheduling:
                    self._in_flight = launched
                else:
                    self._apply(launched, touched)
        except EngineDead:
            raise
        except Exception as e:  # noqa: BLE001 - a failed recovery: state unknown
            raise recovery.die("recovering from a failed step failed", e) from e
        outputs = []
        for g in touched.values():
            try:
                output = g.output()
                if output is not None:
                    outputs.append(output)
            except Exception as e:  # noqa: BLE001 - this request's output only
                try:
                    outputs.append(recovery.error_output(
                        g, f"building the output failed: {e!r}"))
                except Exception as e2:  # noqa: BLE001 - a failed recovery: state unknown
                    raise recovery.die("recovering from a failed output failed", e2) from e2
            if g.done_reported:
                del self._groups[g.request_id]
        return outputs

    def _launch(self, out: SchedulerOutput, prev: "_Dispatched | None",
                failed: Failures, touched: dict[str, Group]) -> "_Dispatched | None":
        """Build and dispatch one scheduled step (fed rows read `prev`'s sampled tokens);
        None when it did not run: its rows are rolled back to be scheduled again, and the
        failed ones are added to `failed` (for the caller to finish with ERROR). Rows whose
        mask follows their output (a grammar, multi-token bad_words) behind a step in flight
        get the step's mask late: once the forward is queued, `prev` is applied and the mask
        filled while the device runs it."""
        late = prev is not None and any(s.samples and s.request.mask_follows_output
                                        for s in out.seqs)
        batch = self._recovery.build(out, self.plan.batch_shape,
                                     None if prev is None else prev.sampled_rows, failed, late)
        if batch is None:
            return None

        def late_mask() -> tuple[np.ndarray | None, np.ndarray]:
            self._apply(prev, touched)  # type: ignore[arg-type]
            prev.applied = True  # type: ignore[union-attr]
            return late_bitmask(out, batch.num_seqs_bucket, self.plan.batch_shape.vocab_size,
                                failed)
        try:
            pending = self.runner.dispatch(batch, late_mask) if late else \
                self.runner.dispatch(batch)
        except RunnerFailed as e:
            self._recovery.step_lost(out, e, failed)  # EngineDead when it is fatal
            return None
        except Exception as e:  # noqa: BLE001 - the device state is unknown
            raise self._recovery.die("the model step failed", e) from e
        self.num_steps += 1
        self.last_step_tokens = out.num_tokens
        return _Dispatched(out, pending)

    def _apply(self, step: "_Dispatched", touched: dict[str, Group]) -> None:
        """Collect a dispatched step's result and apply it: tokens, stops, outputs."""
        out, fail = step.out, self._recovery.fail
        try:
            result = self.runner.collect(step.pending)
        except Exception as e:  # noqa: BLE001 - later steps may have read its outputs
            raise self._recovery.die("the model step failed", e) from e
        if result.prompt_logprob is not None:
            self._take_prompt_logprobs(out, result, touched)
        try:
            sampled = [int(result.tokens[i]) if s.samples else None
                       for i, s in enumerate(out.seqs)]
        except Exception as e:  # noqa: BLE001 - a malformed result: every row's is suspect
            fail([(s.request, f"the model step's result is unusable: {e!r}")
                  for s in out.seqs], touched)
            return
        errors: list[tuple[Request, Exception]] = []
        progressed = self.scheduler.update(out, sampled, errors)
        fail([(r, f"applying the step's result failed: {e!r}") for r, e in errors], touched)
        rows = {id(s.request): i for i, s in enumerate(out.seqs)}
        for req in progressed:
            group = self._group_of(req)
            if group is None:  # no group to report to: only give the pages back
                self.scheduler.finish(req, FinishReason.ERROR, "no request holds this sequence")
                continue
            touched[group.request_id] = group
            try:
                self._on_token(req, group, result, rows[id(req)])
            except Exception as e:  # noqa: BLE001 - this request's tokens only
                fail([(req, f"processing the sampled token failed: {e!r}")], touched)

    def _take_prompt_logprobs(self, out: SchedulerOutput, result: StepResult,
                              touched: dict[str, Group]) -> None:
        scored = prompt_logprobs.spans(out)
        try:
            prompt_logprobs.unpack(out, scored, result.prompt_logprob, result.prompt_top_ids,
                                   result.prompt_top_logprobs)
        except Exception as e:  # noqa: BLE001 - a malformed result: the scored rows' fail
            self._recovery.fail([(out.seqs[s.row].request, f"the step's prompt logprobs are "
                                  f"unusable: {e!r}") for s in scored], touched)

    def _group_of(self, req: Request) -> Group | None:
        group = self._groups.get(req.request_id)
        return group if group is not None and group.holds(req) else None

    def _on_token(self, req: Request, group: Group, result: StepResult, row: int) -> None:
        if not req.output_token_ids:
            return  # a prefill-only request (max_tokens=0) finished without a token
        if req.sampling_params.logprobs is not None:
            req.record_logprobs(result.logprob[row], result.top_ids[row], result.top_logprobs[row])
        detok = group.detoks[req.sample_index]
        token = req.output_token_ids[-1]
        if req.is_finished and req.finish_reason in (FinishReason.EOS, FinishReason.STOP):
            return  # the stop token's own text is never shown
        ended = req.grammar is not None and req.grammar.advance(token, req.num_output_tokens)
        if detok.add_token(token):
            self.scheduler.finish(req, FinishReason.STOP_STRING)
        elif ended and not req.is_finished:  # the grammar's last token: its text is shown
            self.scheduler.finish(req, FinishReason.STOP)
