"""Continuous-batching scheduler: which sequences run this step, and how many tokens each.

Plain Python (no jax). Data flow per step:
  `schedule()` -> SchedulerOutput (decodes first, then prefill chunks, under the step's token
  budget (`max_num_batched_tokens`; `decode_token_budget` when it carries decodes; with SLO
  targets, chosen per step: `slo_policy.SloPolicy.plan`) and `max_num_seqs`; pages allocated as KV grows (a waiting sequence first
  matches the prefix cache, `prefix_cache.PrefixCache`); preemption when pages run out) -> the
  engine builds the device batch and runs it -> `update(output, sampled)` appends sampled
  tokens, advances `num_computed_tokens`, registers full pages in the prefix cache, releases
  the forks waiting on a computed prompt (`forks.Forks`), frees the pages that slid out of
  a sliding-window KV group's window (`kv_manager.KVManager.slide`), applies token stop rules
  and frees the pages of finished sequences. A sequence's pages in every KV group are the
  `KVManager`'s to allocate and free.

Overlap: the engine may call `schedule()` for step N+1 before `update()` of step N (whose
sampled tokens are still on the device). `schedule()` therefore plans from
`Sequence.num_scheduled_tokens` and counts each token a dispatched step samples as in flight
(`Sequence.num_in_flight`): a sequence whose step N samples is scheduled in step N+1 as a
decode of that unknown token (`ScheduledSeq.fed`: the device feeds it from step N's sampler
output), unless the in-flight token is already its last by `max_tokens` / `max_model_len`.
A stop that only the token's value reveals (EOS, stop ids, stop strings) lands one step late:
the sequence is finished by step N's update and step N+1's row for it is discarded (its
update skips sequences that are no longer running, or were preempted since: `ScheduledSeq.
epoch`). A step that never ran is rolled back by `unschedule()`.

Policy:
- Running sequences are served in (priority, arrival) order, decodes before prefill chunks, so
  a long prompt never stalls the streams already generating; a prompt is spread over steps in
  chunks of whatever is left of the step's budget (`SloPolicy.plan`).
- Waiting sequences are admitted in (priority, arrival) order while budget, seats and pages
  allow; a waiting sequence may preempt running ones of strictly lower priority for pages.
  One whose LoRA adapter has no device slot free (`lora_slots.LoraSlots`) is skipped: it
  keeps its place and the sequences behind it go on; adapters in use are never evicted.
- Out of pages: the lowest-priority, most recently arrived running sequence is preempted: its
  pages are freed and it goes back to the front of its priority level; it recomputes its tokens
  later (mostly from the prefix cache when that is on).
- `n` > 1 samples: child 0 prefills the prompt; the other children wait until it is computed,
  then share its full prompt pages (ref counts) and compute only the partial last page
  (`forks.py`).

Every table here is keyed by `Sequence.seq_id`, an integer `add_request` assigns; the client's
request id is only a label. Between `schedule()` and `update()` the state is consistent on its
own (pages reserved, nothing computed yet): a step whose results never come back (it failed)
leaves each scheduled sequence to be scheduled again for the same tokens, or to be finished
(`finish`) by the engine, which frees its pages through the normal path.
"""

from __future__ import annotations

import heapq
import itertools
import time
from typing import Callable, Iterable, Sequence as GenericSequence

from jaxserve.config import SchedulerConfig
from jaxserve.engine.block_allocator import BlockAllocator
from jaxserve.engine.forks import Forks
from jaxserve.engine.kv_manager import KVManager
from jaxserve.engine.limits import check_fits
from jaxserve.engine.lora_slots import LoraSlots
from jaxserve.engine.prefix_cache import PrefixCache
from jaxserve.engine.scheduled import ScheduledSeq, SchedulerOutput
from jaxserve.engine.slo_policy import SloPolicy
from jaxserve.engine.sequence import FinishReason, Sequence, SequenceStatus

__all__ = ["ScheduledSeq", "Scheduler", "SchedulerOutput"]  # (the step's rows: scheduled.py)


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, clock: Callable[[], float] = time.monotonic,
                 buckets: GenericSequence[tuple[int, int]] | None = None, max_loras: int = 0):
        """`buckets`: the compiled (tokens, seqs) pairs, which the step-time model sees as
        the steps' sizes (None: steps are not padded). `max_loras`: LoRA device slots."""
        self.cfg = cfg  # replaced whole by a live change between steps (`Engine`)
        self.clock = clock
        # Each step's token budget (static, or from SLO targets and a fitted step-time model).
        self.budget = SloPolicy(buckets, clock)
        self.allocator = BlockAllocator(cfg.num_pages, cfg.page_size, cfg.enable_prefix_caching)
        # The pages are the allocator's, the allocator the KV manager's (a sequence's pages
        # in every KV group), the manager the scheduler's: these two only call it.
        self.kv = KVManager(self.allocator, cfg.kv_groups)
        self._prefix_cache = PrefixCache(self.kv, cfg.page_size, cfg.enable_prefix_caching)
        self._forks = Forks(self.kv, cfg.page_size)  # n > 1 samples held for a prompt
        self.lora = LoraSlots(max_loras)  # which adapter each device slot holds
        self.running: list[Sequence] = []
        self._waiting: list[tuple[int, int, Sequence]] = []  # heap of (priority, order, req)
        self._num_waiting = 0
        self._order = itertools.count()
        self._front = itertools.count(-1, -1)
        self._seq_ids = itertools.count()
        self._arrival_order: dict[int, int] = {}  # seq_id -> arrival rank
        self.requests: dict[int, Sequence] = {}  # seq_id -> unfinished sequence
        self.num_preemptions = 0

    # ----------------------------------------------------------------------- intake
    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise InvalidRequest when a sequence could never run to completion."""
        check_fits(num_prompt_tokens, max_tokens, self.cfg.max_model_len, self.cfg.page_size,
                   self.allocator.num_usable_pages, self.cfg.kv_windows,
                   self.cfg.max_num_batched_tokens)

    def add_request(self, req: Sequence, fork_of: Sequence | None = None,
                    checked: bool = False) -> None:
        """Queue `req` and assign its `seq_id`; `fork_of` (child 0 of its group, queued
        before) delays it to share that prompt. `checked`: the caller (the Engine) already
        ran `check_fits` for this request."""
        if req.seq_id >= 0 or req.status is not SequenceStatus.WAITING:
            raise ValueError(f"sequence {req.seq_id} of request {req.request_id!r} was "
                             "queued before")
        if not checked and fork_of is None:
            self.check_fits(req.num_prompt_tokens, req.max_tokens)
        req.seq_id = next(self._seq_ids)
        self.requests[req.seq_id] = req
        self._arrival_order[req.seq_id] = next(self._order)
        if fork_of is not None and self._forks.hold(req, fork_of):
            return
        self._push_waiting(req, front=False)

    def _push_waiting(self, req: Sequence, front: bool) -> None:
        order = next(self._front) if front else self._arrival_order[req.seq_id]
        heapq.heappush(self._waiting, (self.cfg.level(req.priority), order, req))
        self._num_waiting += 1

    @property
    def num_waiting(self) -> int:
        return self._num_waiting + self._forks.num_held

    @property
    def waiting_heap(self) -> list[tuple[int, int, Sequence]]:
        """The waiting queue as (priority, order, sequence) heap entries (read only; aborted
        entries are skipped lazily: check the status)."""
        return self._waiting

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ----------------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        now = self.clock()
        decodes: list[ScheduledSeq] = []
        prefills: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        self.running.sort(key=self._rank)
        # Decodes (exactly one token left to compute) first, then running prefill chunks.
        todo = [(r, self._to_schedule(r)) for r in self.running]
        order = [r for r, left in todo if left == 1] + [r for r, left in todo if left > 1]
        budget = self.budget.plan(self.cfg, todo, self._waiting)
        decodes_left = sum(1 for _, left in todo if left == 1)
        for req in order:
            if budget == 0:
                break
            if req.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            start = req.num_scheduled_tokens
            total = req.num_tokens + req.num_in_flight
            decodes_left -= total - start == 1
            # Proposals take only what leaves a token for each decode after this one.
            spec = req.take_proposals(start, budget - max(decodes_left, 0),
                                      self.cfg.max_model_len)
            n = min(total - start, budget) + len(spec)
            if not self._reserve(req, start + n, preempted, may_self=True):
                continue
            seq = ScheduledSeq(req, start, n, samples=start + n - len(spec) == total,
                               fed=start >= req.num_tokens, epoch=req.epoch,
                               spec_token_ids=spec)
            (decodes if n - len(spec) == 1 and seq.samples else prefills).append(seq)
            budget -= n

        # Sampler rows: a sequence's one, plus its proposals (each verified position samples);
        # admission keeps them within the compiled seqs buckets (`max_num_rows`).
        spec_rows = sum(len(s.spec_token_ids) for s in decodes)
        max_rows = self.cfg.max_num_rows or self.cfg.max_num_seqs
        skipped = []  # heap entries whose adapter has no slot this step: pushed back below
        while self._waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs \
                and len(self.running) + spec_rows < max_rows:
            _, _, req = self._waiting[0]
            if req.status is not SequenceStatus.WAITING:  # aborted while waiting
                heapq.heappop(self._waiting)
                continue
            if req in preempted:
                break  # pages are contended: nothing behind it runs this step either
            if req.lora is not None and not self.lora.can_acquire(req.lora):
                skipped.append(heapq.heappop(self._waiting))  # (still counted as waiting)
                continue
            if not self.budget.admit(req):
                break  # it would push the decode step past the ITL target
            if not req.pages:
                self._prefix_cache.match(req)
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            self.lora.acquire(req)  # before `_reserve`, whose preemptions may unpin its slot
            if not self._reserve(req, req.num_computed_tokens + n, preempted, may_self=False):
                self.lora.release(req)
                break  # (a waiting sequence has nothing in flight: scheduled == computed)
            heapq.heappop(self._waiting)
            self._num_waiting -= 1
            req.status = SequenceStatus.RUNNING
            self.running.append(req)
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
            prefills.append(ScheduledSeq(req, req.num_computed_tokens, n,
                                         samples=req.num_computed_tokens + n == req.num_tokens,
                                         epoch=req.epoch))
            budget -= n
        for entry in skipped:
            heapq.heappush(self._waiting, entry)
        # A sequence scheduled early in this step may have been preempted by a later one.
        gone = {id(r) for r in preempted}
        seqs = [s for s in decodes + prefills if id(s.sequence) not in gone]
        for s in seqs:
            s.sequence.num_scheduled_tokens = s.start + s.num_new_tokens
            s.sequence.num_in_flight += s.samples
        loads, slots = self.lora.take_step(seqs)
        return SchedulerOutput(seqs=seqs, num_tokens=sum(s.num_new_tokens for s in seqs),
                               preempted=preempted, lora_loads=loads, lora_slots=slots)

    def _to_schedule(self, req: Sequence) -> int:
        """How many of a running sequence's tokens are left to schedule: 0 while its only
        one is an in-flight token that will end it anyway (max_tokens / max_model_len; its
        update finishes it), or a prefill-only request's last chunk is in flight."""
        if req.num_in_flight and (
                req.num_output_tokens + req.num_in_flight >= req.max_tokens
                or req.num_tokens + req.num_in_flight >= self.cfg.max_model_len):
            return 0
        return req.num_tokens + req.num_in_flight - req.num_scheduled_tokens

    def unschedule(self, seqs: Iterable[ScheduledSeq]) -> None:
        """Roll back scheduled rows whose step never ran (its build or dispatch failed): each
        still-running sequence is scheduled again for the same tokens (its pages stay)."""
        for seq in seqs:
            req = seq.sequence
            if req.status is SequenceStatus.RUNNING and \
                    seq.epoch == req.epoch:
                req.num_scheduled_tokens = seq.start
                req.num_in_flight -= seq.samples

    def _rank(self, req: Sequence) -> tuple[int, int]:
        return self.cfg.level(req.priority), self._arrival_order[req.seq_id]

    def _reserve(self, req: Sequence, num_tokens: int, preempted: list[Sequence],
                 may_self: bool) -> bool:
        """Ensure `req` holds pages for `num_tokens`, preempting lower-ranked running seqs.

        A running `req` may preempt any running sequence ranked after it, or itself last
        (may_self); a waiting one only sequences of strictly lower priority.
        """
        need = self.kv.pages_needed(req, num_tokens)
        while need > self.allocator.num_free_pages:
            victim = self.running[-1] if self.running else None
            if victim is None or victim is req:
                if may_self and victim is req:
                    self._preempt(req, preempted)
                elif not may_self:
                    self._prefix_cache.undo_match(req)
                return False
            if not may_self and self.cfg.level(victim.priority) <= self.cfg.level(req.priority):
                self._prefix_cache.undo_match(req)
                return False
            self._preempt(victim, preempted)
        if need > 0:
            self.kv.allocate(req, num_tokens)
        return True

    def _preempt(self, req: Sequence, preempted: list[Sequence]) -> None:
        self.running.remove(req)
        self.lora.release(req)
        self.kv.free(req)
        req.num_computed_tokens = req.num_scheduled_tokens = req.num_in_flight = 0
        req.num_registered_pages = 0
        req.spec_token_ids = []
        req.status = SequenceStatus.WAITING
        req.epoch += 1  # rows scheduled before this are stale (`update`, `unschedule`)
        req.metrics.num_preemptions += 1
        self.num_preemptions += 1
        preempted.append(req)
        self._push_waiting(req, front=True)

    # ----------------------------------------------------------------------- update
    def update(self, out: SchedulerOutput,
               sampled: GenericSequence[int | GenericSequence[int] | None],
               errors: list[tuple[Sequence, Exception]] | None = None) -> list[Sequence]:
        """Apply one step's results; `sampled[i]` is the token of `out.seqs[i]` (None if the
        chunk did not sample), or for a row that verified proposals the tokens it emits
        (the accepted proposals, then the target's own: `speculation.Speculator.verify`).
        Returns the requests that got a new token this step.

        `errors`: a failure while applying one sequence's result is appended there as
        (request, exception) and the other sequences are still applied (the caller finishes
        the failed ones); without it the first failure is raised.
        """
        now = self.clock()
        progressed: list[Sequence] = []
        for seq, token in zip(out.seqs, sampled):
            try:
                if self._update_seq(seq, token, now):
                    progressed.append(seq.sequence)
            except Exception as e:  # noqa: BLE001 - handed to the caller with its request
                if errors is None:
                    raise
                errors.append((seq.sequence, e))
        return progressed

    def _update_seq(self, seq: ScheduledSeq, token: int | GenericSequence[int] | None,
                    now: float) -> bool:
        """One sequence's result; True when it got a new token."""
        req = seq.sequence
        if req.status is not SequenceStatus.RUNNING or seq.epoch != req.epoch:
            return False  # finished (aborted, a stop) or preempted since it was scheduled
        if seq.spec_token_ids:
            return self._update_verified(seq, list(token or ()), now)  # type: ignore[arg-type]
        req.num_computed_tokens = seq.start + seq.num_new_tokens
        req.num_in_flight -= seq.samples
        self._prefix_cache.register(req)
        if req.num_computed_tokens >= req.num_prompt_tokens:
            self._release_forks(req)
        # After the prefix cache and the forks took what they share: pages that slid out of
        # a sliding group's window are freed (still cached until evicted).
        self.kv.slide(req)
        if not seq.samples or token is None:
            return False
        if req.max_tokens == 0:  # prefill only (prompt scoring): nothing is generated
            self.finish(req, FinishReason.LENGTH)
            return True
        req.append_token(int(token))
        req.metrics.token_arrived(now)
        reason = self._token_stop(req, int(token))
        if reason is not None:
            self.finish(req, reason)
        return True

    def _update_verified(self, seq: ScheduledSeq, tokens: list[int], now: float) -> bool:
        """A row that verified proposals: `tokens` (1 to 1 + len(proposals)) are appended one
        by one up to the first token stop. The KV is then valid for every token but the last
        appended (the last token before the step and the accepted proposals); what rejected
        proposals wrote lies past `num_computed_tokens` (never cached, overwritten when those
        positions are computed) and the pages only they needed go back to the pool. Such a
        step is never overlapped (`Speculator.wants_host_tokens`): nothing else of the
        sequence is in flight."""
        req = seq.sequence
        if not tokens:
            raise ValueError(f"sequence {req.seq_id}'s verification row emitted no token")
        req.metrics.token_arrived(now)  # one gap per step, as a stream sees it
        reason = None
        for token in tokens:
            req.append_token(int(token))
            reason = self._token_stop(req, int(token))
            if reason is not None:
                break
        req.num_computed_tokens = req.num_scheduled_tokens = req.num_tokens - 1
        req.num_in_flight -= 1
        self._prefix_cache.register(req)  # (after the tokens whose pages it hashes are in)
        self.kv.slide(req)
        if reason is not None:
            self.finish(req, reason)
        else:
            self.kv.trim(req, req.num_tokens)
        return True

    def _token_stop(self, req: Sequence, token: int) -> FinishReason | None:
        return req.token_stop(token, self.cfg.max_model_len)

    def _release_forks(self, parent: Sequence) -> None:
        """Queue the children `parent` held back (`Forks.release`): they share its full
        prompt pages and compute the rest themselves."""
        for child in self._forks.release(parent):
            self._push_waiting(child, front=False)

    # ----------------------------------------------------------------------- finish / abort
    def finish(self, req: Sequence, reason: FinishReason, error: str | None = None) -> None:
        """Finish `req` (any state) with `reason`, freeing its pages; `error` with ERROR."""
        if req.status is SequenceStatus.FINISHED or self.requests.get(req.seq_id) is not req:
            return
        if req.status is SequenceStatus.RUNNING:
            self.running.remove(req)
            self.lora.release(req)
        elif req.status is SequenceStatus.WAITING and not self._forks.drop(req):
            self._num_waiting -= 1  # lazy deletion: its heap entry is skipped at the top
        self.kv.free(req)
        req.status = SequenceStatus.FINISHED
        req.finish_reason = reason
        req.error = error
        req.metrics.finished_time = self.clock()
        self.requests.pop(req.seq_id, None)
        self._arrival_order.pop(req.seq_id, None)
        self._release_forks(req)  # children it held compute the prompt themselves (no pages)

    def abort(self, seq_ids: Iterable[int]) -> list[Sequence]:
        """Finish the given sequences with ABORT, freeing every page they held."""
        aborted = []
        for sid in seq_ids:
            req = self.requests.get(sid)
            if req is not None:
                self.finish(req, FinishReason.ABORT)
                aborted.append(req)
        return aborted
