"""The synchronous engine: add_request / abort / step. No threads; the caller drives steps.

Data flow of `step()`:
  scheduler.schedule() -> batch.build_batch() (numpy, bucketed) -> runner.execute() (one
  compiled device step, one device->host copy) -> scheduler.update() (tokens appended, token
  stop rules, pages freed) -> per sequence: logprobs recorded, incremental detokenization and
  stop strings -> RequestOutputs shaped by each request's `RequestOutputKind` (cumulative
  copies, deltas only, or nothing until the final one; see `outputs.py`).

The engine owns the requests' host-side extras (prompt text, detokenizers, n-sample groups);
the scheduler owns their KV state; the runner owns everything on the device. Callers outside
read `limits` (what a request must fit in) and `stats()` (a snapshot of the counters), never
the scheduler or allocator. `admit()` runs every request check (`limits.EngineLimits`) without
queueing; `add_request` runs it unless handed the `Admitted` result.
"""

from __future__ import annotations

import dataclasses
import random
import time
from typing import Callable, Sequence

from jaxserve.config import EngineConfig
from jaxserve.engine.batch import build_batch
from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.engine.limits import (Admitted, EngineLimits, EngineStats, check_not_in_flight,
                                    check_priority, check_request_id)
from jaxserve.engine.outputs import (CompletionOutput, RequestOutput, RequestOutputKind,
                                     TokenLogprobs)
from jaxserve.engine.request import FinishReason, Request
from jaxserve.engine.runner import Runner, StepResult
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.sizing import EnginePlan
from jaxserve.models.tokenizer import Tokenizer


@dataclasses.dataclass(eq=False)
class _Group:
    """One user request: its n sample sequences and what has been reported for each."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Request]
    detoks: list[IncrementalDetokenizer]
    sent_tokens: list[int]  # tokens already reported per sample
    sent_logprobs: list[int]
    cumulative_logprob: list[float]
    kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    done_reported: bool = False


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
        self._groups: dict[str, _Group] = {}
        self._seed_rng = random.Random(config.seed)
        sc = plan.scheduler
        self._limits = EngineLimits(
            max_model_len=sc.max_model_len, vocab_size=plan.batch_shape.vocab_size,
            page_size=sc.page_size, num_kv_pages=sc.num_pages - 1,
            max_num_seqs=sc.max_num_seqs, max_num_batched_tokens=sc.max_num_batched_tokens,
            eos_token_ids=self.eos_token_ids)
        self.num_steps = 0
        self.last_step_tokens = 0
        # Groups with news for the next step's outputs besides this step's tokens (aborts).
        self._touched: dict[str, _Group] = {}

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
        """Every limit check of one request, without queueing it (thread-safe: it reads only
        the limits and the tokenizer)."""
        return self._limits.admit(prompt, params or SamplingParams(), self._encode)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True)

    def add_request(self, request_id: str, prompt: str | Sequence[int] | Admitted,
                    params: SamplingParams | None = None, priority: int = 0,
                    arrival_time: float | None = None,
                    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE) -> None:
        """Queue a request; ValueError (an InvalidRequest naming the field) for anything that
        cannot run. An `Admitted` prompt (from `admit`) carries its params and is not checked
        again. `output_kind`: what its outputs carry (see `outputs.RequestOutputKind`)."""
        check_request_id(request_id)
        check_not_in_flight(request_id, self._groups)
        check_priority(priority)
        req = prompt if isinstance(prompt, Admitted) else self.admit(prompt, params)
        params, ids = req.params, list(req.token_ids)
        now = self.clock() if arrival_time is None else arrival_time
        base_seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        seqs = []
        for i in range(params.n):
            seq_id = request_id if params.n == 1 else f"{request_id}#{i}"
            seqs.append(Request(seq_id, list(ids), params, self.eos_token_ids, now,
                                priority=priority, group_id=request_id, sample_index=i,
                                max_tokens=req.max_tokens,
                                seed=(base_seed + i) % (1 << 64)))
        for i, seq in enumerate(seqs):
            self.scheduler.add_request(seq, fork_of=seqs[0] if i else None, checked=True)
        backend = self.tokenizer.backend
        self._groups[request_id] = _Group(
            request_id, req.prompt, ids, params, seqs,
            [IncrementalDetokenizer(backend, params) for _ in seqs],
            [0] * params.n, [0] * params.n, [0.0] * params.n, output_kind)

    def abort(self, request_id: str) -> bool:
        """Abort a request at any moment; its final output (ABORT) comes from the next step."""
        group = self._groups.get(request_id)
        if group is None:
            return False
        self.scheduler.abort([s.request_id for s in group.seqs])
        self._touched[request_id] = group  # its final ABORT output comes from the next step
        return True

    def has_unfinished(self) -> bool:
        return bool(self._groups)

    def close(self) -> None:
        """Release the runner (multi-host: the other processes stop following)."""
        self.runner.close()

    @property
    def num_requests(self) -> int:
        return len(self._groups)

    # ----------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Run one scheduler iteration; outputs for every request with news."""
        out = self.scheduler.schedule()
        touched = self._touched
        self._touched = {}
        if out.seqs:
            result = self.runner.execute(build_batch(out, self.plan.batch_shape))
            sampled = [int(result.tokens[i]) if s.samples else None
                       for i, s in enumerate(out.seqs)]
            progressed = self.scheduler.update(out, sampled)
            rows = {id(s.request): i for i, s in enumerate(out.seqs)}
            for req in progressed:
                self._on_token(req, result, rows[id(req)])
                gid = req.group_id or req.request_id
                touched[gid] = self._groups[gid]
            self.num_steps += 1
            self.last_step_tokens = out.num_tokens
        outputs = [o for g in touched.values() if (o := self._make_output(g)) is not None]
        for g in touched.values():
            if g.done_reported:
                del self._groups[g.request_id]
        return outputs

    def _on_token(self, req: Request, result: StepResult, row: int) -> None:
        group = self._groups[req.group_id or req.request_id]
        k = req.sampling_params.logprobs
        if k is not None:
            entry: TokenLogprobs = {int(req.output_token_ids[-1]): float(result.logprob[row])}
            for tid, lp in zip(result.top_ids[row][:k], result.top_logprobs[row][:k]):
                entry.setdefault(int(tid), float(lp))
            req.output_logprobs.append((float(result.logprob[row]), list(entry.items())))
        detok = group.detoks[req.sample_index]
        token = req.output_token_ids[-1]
        if req.is_finished and req.finish_reason in (FinishReason.EOS, FinishReason.STOP):
            return  # the stop token's own text is never shown
        if detok.add_token(token):
            self.scheduler.finish(req, FinishReason.STOP_STRING)

    def _make_output(self, g: _Group) -> RequestOutput | None:
        """The group's output for this step as its kind asks (None: a FINAL_ONLY request that
        has not finished); what it reports is marked as sent."""
        finished = all(s.is_finished for s in g.seqs)
        if g.kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None  # its detokenizers keep the text; the final output takes it all
        completions = [self._completion(g, i) for i in range(len(g.seqs))]
        g.done_reported = finished
        first = g.seqs[0].metrics
        return RequestOutput(request_id=g.request_id, prompt=g.prompt,
                             prompt_token_ids=g.prompt_token_ids, outputs=completions,
                             finished=finished, metrics=first,
                             num_cached_tokens=first.num_cached_tokens)

    def _completion(self, g: _Group, i: int) -> CompletionOutput:
        seq, detok = g.seqs[i], g.detoks[i]
        new_ids = seq.output_token_ids[g.sent_tokens[i]:]
        g.sent_tokens[i] = len(seq.output_token_ids)
        # A finished sequence flushes what was held back for a possible stop string.
        delta_text = detok.finish() if seq.is_finished else detok.pop_delta()
        with_lp = g.params.logprobs is not None
        new_lp = seq.output_logprobs[g.sent_logprobs[i]:]
        g.cumulative_logprob[i] += sum(lp for lp, _ in new_lp)
        delta_lp: list[TokenLogprobs] = [dict(items) for _, items in new_lp]
        if g.kind is RequestOutputKind.DELTA:
            # Nothing of a DELTA request is reported twice: the engine keeps no logprob
            # history for it (its token ids stay: preemption recomputes from them).
            seq.output_logprobs.clear()
            g.sent_logprobs[i] = 0
            text, ids, lps = "", [], ([] if with_lp else None)
        else:
            g.sent_logprobs[i] = len(seq.output_logprobs)
            text, ids = detok.text, list(seq.output_token_ids)
            lps = [dict(items) for _, items in seq.output_logprobs] if with_lp else None
        return CompletionOutput(
            index=i, text=text, token_ids=ids,
            cumulative_logprob=g.cumulative_logprob[i] if with_lp else None, logprobs=lps,
            finish_reason=seq.finish_reason, delta_text=delta_text, delta_token_ids=new_ids,
            delta_logprobs=delta_lp, metrics=seq.metrics, num_tokens=len(seq.output_token_ids))
