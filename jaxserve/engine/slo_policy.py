"""The SLO-driven token budget: how many tokens each step takes, from a fitted step-time model.

Data flow per step (only while `SchedulerConfig.ttft_slo` or `itl_slo` is set; the targets are
read from the live config every step, so the admin endpoint can change them):
  `Scheduler.schedule` -> `SloPolicy.plan(cfg, todo, waiting)` -> the step's token
  budget (a compiled bucket size, or the decodes' tokens) and an admission allowance ->
  `Scheduler` admits waiting sequences while `admit()` says the ITL target holds with them ->
  the step runs -> `StepCore.apply` -> `observe(features, seconds)` refits the model
  (`step_time_model.py`; always on, so a target set live finds a fitted model).

Policy (docs/scheduling.md "SLO targets: the engine turns the knob"):
- ITL target: a step that carries decoding streams is a gap in each of them, so the budget is
  at most the largest one whose predicted step time, with a margin of the model's recent
  relative error, meets the strictest ITL target among those streams; prefill chunks get
  what the decodes leave. With a TTFT target too, the budget is the smallest of those at
  which the prompts in prefill or queued meet their TTFT deadlines (as below): a step nearer
  the ITL target buys no request anything and only risks the streams' gaps. If the decodes alone miss it, no prefill runs that step and speculative
  proposals are verified only as far as the target allows (down to one token a stream; below
  that the overload is counted). A waiting sequence is admitted only while the decode step
  with it (each row at its recent 1 + proposals tokens) stays within the strictest of the
  streams' targets and its own, unless nothing else runs. A stream whose first token missed
  its TTFT target has missed its SLO for good: it no longer sets the bound (with only such
  streams a step is sized as below, without an ITL target), so the steps serve the requests
  that can still meet theirs.
- TTFT target only: the static budget, raised to the smallest budget at whose prefill rate
  every prompt in prefill or queued gets its first token by its deadline, with slack.
- TTFT forecast (`predict_ttft`): a new prompt's tokens plus those queued ahead of it (its
  priority or better), over the prefill rate the current decode load leaves, plus one step.
  Above its level's target the request is counted (`ttft_unattainable`) and, with
  `slo_admission="reject"`, refused (`errors.SloUnattainable`).
"""

from __future__ import annotations

import heapq
import logging
import math
from typing import Callable, Iterable, Sequence as GenericSequence

from jaxserve.config import SchedulerConfig, SloTargets
from jaxserve.engine.batch import bucket_for
from jaxserve.engine.sequence import Sequence, SequenceStatus
from jaxserve.engine.slo_stats import SloStats
from jaxserve.engine.step_time_model import StepFeatures, StepTimeModel, attention_keys

log = logging.getLogger("jaxserve.slo")

SAFETY_SIGMAS = 2.0  # margin: predicted * (1 + this x the model's recent relative error)
MAX_MARGIN = 2.0
TTFT_SLACK = 1.5  # TTFT target only: plan each prompt's first token by 1 / this of its time
ROW_TOKENS_WEIGHT = 0.1  # EWMA weight of a step's tokens per decode row
_PREFILL_LOOKAHEAD = 8  # waiting sequences whose chunks the budget's prediction places
_LOG_EVERY_S = 1.0


class SloPolicy:
    def __init__(self, buckets: GenericSequence[tuple[int, int]] | None,
                 clock: Callable[[], float], model: StepTimeModel | None = None):
        """`buckets`: the compiled (tokens, seqs) pairs (None: steps are not padded)."""
        self.model = model or StepTimeModel()
        self._buckets = tuple(buckets) if buckets else None
        self._clock = clock
        self.last_budget = 0
        self.itl_overloads = 0
        self._levels: dict[int, list[int]] = {}  # priority -> the SloStats counters
        self._last_log = -math.inf
        # This step's plan, for `admit`: the decode rows (and their key reads) already in it,
        # the ITL target (None: no gate) and the margin.
        self._rows = 0
        self._keys = 0
        self._itl: float | None = None
        self._itl_slo: SloTargets | None = None  # the step's targets, for `admit`
        self._prefilling = 0  # running sequences still in their prompt
        # Tokens a decode row takes (1 + its proposals), averaged over recent steps, for
        # `admit`; `expect_proposals` sets where it starts.
        self._row_tokens = 1.0
        self._margin = 1.0
        self._prefill_rate = math.inf  # prompt tokens / s the last plan leaves for prefill

    # ----------------------------------------------------------------------- model
    def features(self, num_tokens: int, num_rows: int, keys: int) -> StepFeatures:
        if self._buckets is None:
            return StepFeatures(num_tokens, num_rows, keys)
        top_t, top_s = self._buckets[-1]
        t, s = bucket_for(min(num_tokens, top_t), min(num_rows, top_s), self._buckets)
        return StepFeatures(t, s, keys)

    def expect_proposals(self, k: int) -> None:
        """Speculative decoding with k proposals: decode rows start out counted as 1 + k
        tokens in the admission gate (then as the steps show: backed off, rejected, cut)."""
        self._row_tokens = 1.0 + k

    def observe(self, features: StepFeatures, seconds: float) -> None:
        self.model.observe(features, seconds)

    def margin(self) -> float:
        return min(MAX_MARGIN, 1.0 + SAFETY_SIGMAS * self.model.relative_error)

    # ----------------------------------------------------------------------- per step
    def plan(self, cfg: SchedulerConfig, todo: list[tuple[Sequence, int]],
             waiting: list[tuple[int, int, Sequence]]) -> int:
        """The step's token budget: the static policy's (`SchedulerConfig.step_budget`)
        without targets, else the SLO policy's. `todo`: each running sequence with its tokens
        left to schedule (1: a decode); `waiting`: the scheduler's waiting heap."""
        established = any(left == 1 and r.num_output_tokens + r.num_in_flight >= 2
                          for r, left in todo)
        static_budget = cfg.step_budget(established)
        self._itl, self._itl_slo = None, cfg.itl_slo
        self._prefilling = sum(1 for _, left in todo if left > 1)
        if not cfg.slo_enabled:
            self.last_budget = static_budget
            return static_budget
        # A decode verifies its proposals too (one token and row each), when it may.
        decodes = [(r, 1 + (0 if r.num_in_flight else len(r.spec_token_ids)))
                   for r, left in todo if left == 1]
        prefilling = [r for r, left in todo if left > 1]
        return self._slo_budget(cfg, decodes, prefilling, waiting, static_budget)

    def _slo_budget(self, cfg: SchedulerConfig, decodes: list[tuple[Sequence, int]],
                    prefilling: list[Sequence], waiting: list[tuple[int, int, Sequence]],
                    static_budget: int) -> int:
        """`decodes`: each decoding sequence with its tokens this step; `prefilling`: the
        running sequences still in their prompt."""
        now = self._clock()
        dec_tokens = sum(n for _, n in decodes)
        dec_keys = attention_keys((r.num_scheduled_tokens, n) for r, n in decodes)
        chunks = [(r.num_scheduled_tokens, r.num_tokens - r.num_scheduled_tokens)
                  for r in prefilling] + [(r.num_computed_tokens, r.num_tokens - r.num_computed_tokens)
                             for _, _, r in heapq.nsmallest(_PREFILL_LOOKAHEAD, waiting)
                             if r.status is SequenceStatus.WAITING]
        # A stream whose first token came after its TTFT target has missed its SLO whatever
        # comes next: it no longer holds the step to its ITL target (with only such streams
        # the step is sized as without an ITL target), so steps go to the requests that can
        # still meet theirs.
        itl = _strictest(cfg.itl_slo, (r for r, _ in decodes if not _ttft_missed(cfg, r))) \
            if cfg.itl_slo else None
        self._margin = self.margin()
        self._rows, self._keys, self._itl = len(decodes), dec_keys, itl
        if decodes:  # a decode row's tokens in later steps (1 + its proposals), for `admit`
            self._row_tokens += ROW_TOKENS_WEIGHT * (dec_tokens / len(decodes) -
                                                     self._row_tokens)
        candidates = [b for b in self._budgets(cfg) if b > dec_tokens]
        cost = {b: self._predict(dec_tokens, dec_keys, chunks, b)
                for b in candidates}
        capacity = candidates[-1] if candidates else None  # the most the policy would take
        if itl is not None:
            fits = [b for b in candidates if cost[b] * self._margin <= itl]
            capacity = max(fits) if fits else None
            if not fits:
                budget = self._lean_budget(cfg, decodes, dec_keys, itl)
            elif cfg.ttft_slo is not None:
                # Both targets: no more than the queue's TTFT deadlines need (a step nearer
                # the ITL target buys no request anything and only risks its gaps), at
                # most the largest that meets ITL.
                budget = self._ttft_budget(cfg, now, dec_tokens, fits, cost, prefilling,
                                           waiting, fits[0], max(fits))
            else:
                budget = max(fits)
        elif cfg.ttft_slo is not None:
            budget = self._ttft_budget(cfg, now, dec_tokens, candidates, cost, prefilling,
                                       waiting, static_budget, static_budget)
        else:
            budget = capacity = static_budget
        budget = max(budget, min(len(decodes), cfg.max_num_batched_tokens))
        step_s = cost.get(budget) or self._predict(min(dec_tokens, budget), dec_keys, chunks,
                                                   budget)
        # The forecast's prefill rate: that of the largest budget the policy would take now
        # (it raises the budget for deadlines), not of the one it took.
        cap_s = cost.get(capacity, 0.0) if capacity is not None else 0.0
        self._prefill_rate = 0.0 if capacity is None else \
            (capacity - dec_tokens) / cap_s if cap_s > 0 else math.inf
        self.last_budget = budget
        if now - self._last_log >= _LOG_EVERY_S and log.isEnabledFor(logging.DEBUG):
            self._last_log = now
            log.debug("slo: budget=%d decode_tokens=%d prefill_chunks=%d itl_target=%s "
                      "predicted=%.1fms margin=%.2f last step predicted/measured=%.1f/%.1fms "
                      "coef=%s", budget, dec_tokens, len(chunks), itl, step_s * 1e3,
                      self._margin, self.model.last_predicted * 1e3,
                      self.model.last_measured * 1e3,
                      ",".join(f"{c:.3g}" for c in self.model.coefficients))
        return budget

    def admit(self, req: Sequence) -> bool:
        """Whether admitting `req` keeps the decode step within the ITL target (the
        strictest of the decoding streams' and its own) once it decodes, with the running
        prefills, which will decode too; counts it in when so. The first stream is always
        admitted."""
        own = self._itl_slo.for_priority(req.priority) if self._itl_slo is not None else None
        target = min((t for t in (self._itl, own) if t is not None), default=None)
        if target is None:
            return True
        rows = self._rows + self._prefilling + 1
        tokens = math.ceil(rows * self._row_tokens)  # (each a sampler row too)
        keys = self._keys + req.num_tokens
        if self._rows + self._prefilling > 0 and \
                self.model.predict(self.features(tokens, tokens, keys)) * self._margin > target:
            return False
        self._rows += 1
        self._keys += req.num_tokens
        return True

    def _lean_budget(self, cfg: SchedulerConfig, decodes: list[tuple[Sequence, int]],
                     dec_keys: int, itl: float) -> int:
        """No room for prefill: the decodes alone, with as many of their proposals as the
        ITL target leaves (the scheduler cuts proposals to the budget, keeping a token for
        every decode), down to one token a stream; that one missing too is an overload."""
        rows = len(decodes)
        top = sum(n for _, n in decodes)
        lean = [b for b in self._budgets(cfg) + [top] if rows <= b <= top and
                self._predict(b, dec_keys, [], b) * self._margin <= itl]
        if lean:
            return max(lean)
        self.itl_overloads += 1
        return rows

    def _budgets(self, cfg: SchedulerConfig) -> list[int]:
        top = cfg.max_num_batched_tokens
        sizes = [t for t, _ in self._buckets or () if t < top]
        return sorted(set(sizes)) + [top]

    def _predict(self, dec_tokens: int, dec_keys: int, chunks: list[tuple[int, int]],
                 budget: int) -> float:
        """Predicted seconds of a step of these decodes (a sampler row per token: proposals
        are verified row by row) plus prefill chunks filling the rest of `budget`, in order
        (a row each)."""
        left, rows, placed = budget - dec_tokens, dec_tokens, []
        for start, n in chunks:
            if left <= 0:
                break
            placed.append((start, min(n, left)))
            left -= placed[-1][1]
            rows += 1
        tokens = budget - max(left, 0)
        return self.model.predict(self.features(tokens, rows, dec_keys + attention_keys(placed)))

    def _ttft_budget(self, cfg: SchedulerConfig, now: float, dec_tokens: int,
                     candidates: list[int], cost: dict[int, float], prefilling: list[Sequence],
                     waiting: list[tuple[int, int, Sequence]], floor: int,
                     no_deadlines: int) -> int:
        """The smallest budget >= `floor` at whose prefill rate every prompt still in
        prefill (the running ones first, then the queue in its order) gets its first token
        by its TTFT deadline, with slack (`TTFT_SLACK`): its tokens and those ahead of it at
        that rate, plus the step in flight and the one that samples it. The largest
        candidate if none does (the misses are counted where the forecast is made);
        `no_deadlines` when no prompt has one."""
        deadlines, ahead = [], 0  # (prompt tokens up to and including it, seconds left)
        queue = [r for _, _, r in sorted(waiting, key=lambda e: e[:2])
                 if r.status is SequenceStatus.WAITING]
        for r in prefilling + queue:
            ahead += r.num_tokens - r.num_scheduled_tokens
            target = cfg.ttft_slo.for_priority(r.priority)  # type: ignore[union-attr]
            if target is not None and r.metrics.first_token_time is None:
                left = r.metrics.arrival_time + target - now
                if left > 0:  # (one already late is lost either way)
                    deadlines.append((ahead, left))
        if not deadlines:
            return no_deadlines
        for b in candidates:
            if b < floor or cost[b] <= 0:
                continue
            rate = (b - dec_tokens) / cost[b]
            # Two steps: the one in flight, then the one that samples its first token; and
            # slack, since more decode rows join as prompts finish (fewer prefill tokens).
            if all((tokens / rate + 2 * cost[b]) * TTFT_SLACK <= left
                   for tokens, left in deadlines):
                return b
        return candidates[-1] if candidates else floor

    # ----------------------------------------------------------------------- admission
    def predict_ttft(self, num_prompt_tokens: int, priority: int, running: list[Sequence],
                     waiting: list[tuple[int, int, Sequence]]) -> float:
        """Seconds until a new prompt's first token: its tokens and those ahead of it (the
        running prompts, the waiting ones of its priority or better) at the prefill rate the
        last plan left, plus one step (inf when decodes leave no room; 0 before the model
        has anything to go on)."""
        if not self.model.fitted:
            return 0.0
        tokens_ahead = sum(r.num_tokens - r.num_scheduled_tokens for r in running
                           if r.num_scheduled_tokens < r.num_prompt_tokens)
        tokens_ahead += sum(r.num_tokens - r.num_computed_tokens for p, _, r in waiting
                            if p <= priority and r.status is SequenceStatus.WAITING)
        step = self.model.predict(self.features(max(self.last_budget, 1), 1, 0))
        if self._prefill_rate <= 0:
            return math.inf
        return (num_prompt_tokens + tokens_ahead) / self._prefill_rate + step

    def count_unattainable(self, priority: int) -> None:
        self._level(priority)[4] += 1

    # ----------------------------------------------------------------------- attainment
    def record_finished(self, cfg: SchedulerConfig, seq: Sequence) -> None:
        """A finished sequence against its level's targets: TTFT, and ITL as the bench's
        goodput judges it (its p99 gap)."""
        m = seq.metrics
        if m.first_token_time is None:
            return
        counts = None
        if cfg.ttft_slo is not None and (t := cfg.ttft_slo.for_priority(seq.priority)):
            counts = self._level(seq.priority)
            counts[0 if m.first_token_time - m.arrival_time <= t else 1] += 1
        if cfg.itl_slo is not None and m.inter_token_latencies and \
                (t := cfg.itl_slo.for_priority(seq.priority)):
            counts = counts or self._level(seq.priority)
            counts[2 if _p99(m.inter_token_latencies) <= t else 3] += 1

    def _level(self, priority: int) -> list[int]:
        return self._levels.setdefault(priority, [0] * 5)

    def stats(self) -> SloStats:
        return SloStats(self.last_budget, self.model.last_predicted, self.model.last_measured,
                        self.itl_overloads,
                        tuple((p, *v) for p, v in sorted(self._levels.items())))


def _ttft_missed(cfg: SchedulerConfig, seq: Sequence) -> bool:
    """Whether `seq`'s first token came after its level's TTFT target (never, without one)."""
    m = seq.metrics
    target = cfg.ttft_slo.for_priority(seq.priority) if cfg.ttft_slo is not None else None
    return target is not None and m.first_token_time is not None and \
        m.first_token_time - m.arrival_time > target


def _strictest(targets, seqs: Iterable[Sequence]) -> float | None:  # noqa: ANN001
    values = [t for r in seqs if (t := targets.for_priority(r.priority)) is not None]
    return min(values) if values else None


def _p99(gaps: GenericSequence[float]) -> float:
    """The 99th percentile by linear interpolation (numpy's default, as the bench computes)."""
    s = sorted(gaps)
    pos = 0.99 * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)
