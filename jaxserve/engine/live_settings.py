"""The scheduler settings a running engine may change, and what bounds them.

Plain Python (no jax). The admin endpoint (`Engine.update_scheduler`, reached from the fronts
through `AsyncEngine` / `AsyncReplicaPool`) changes the `LIVE_SCHEDULER_FIELDS` of the
scheduler's frozen `SchedulerConfig`; the scheduler reads its `cfg` at every step, so a change
is one reference swap between two steps.

Data flow: `{field: value}` (JSON values, the flags' names) -> `check_changes(cfg, changes,
bounds)`: every field and value checked before anything changes (an unknown field, a wrong
type, a value past what start-up compiled and allocated, a combination the config refuses)
-> InvalidRequest naming the field and the limit, or the new `SchedulerConfig`
(`dataclasses.replace`) -> the caller swaps it in. `settings_of(cfg)` is the JSON view (the
SLOs as `SloTargets.to_json()`, None where unset).

The bounds (`LiveBounds.of(plan)`) are what start-up fixed for good:
- max_num_batched_tokens <= the largest compiled token bucket (a step past it has no
  executable; nothing is recompiled live) and >= max_num_seqs (every running sequence must
  be able to decode in one step);
- max_num_seqs <= the largest compiled seqs bucket, and with speculative decoding <= the
  sampler rows the buckets were sized for (`SchedulerConfig.max_num_rows`: a speculating
  step's rows); the KV pages are not a bound (more sequences than the pages hold are
  preempted and recomputed, as at start-up);
- decode_token_budget in [max_num_seqs, max_num_batched_tokens] or None; an unchanged budget
  that a new max_num_seqs / max_num_batched_tokens puts out of range is refused, not clamped
  (send the new budget, or null, with the change);
- SLO targets as `SloTargets.parse` reads them (null: none); slo_admission "reject" needs a
  ttft_slo; scheduling_policy "fcfs" makes `Engine.add_request` refuse priorities != 0.

Requests in flight keep running: none is aborted or recomputed by a change. A max_num_seqs
below the number running lets them all finish; no sequence is admitted until fewer run.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from jaxserve.config import SchedulerConfig
from jaxserve.engine.errors import InvalidRequest
from jaxserve.engine.sampling_rules import show
from jaxserve.slo_config import (LIVE_SCHEDULER_FIELDS, SCHEDULING_POLICIES, SLO_ADMISSIONS,
                                 SloTargets)

__all__ = ["LIVE_SCHEDULER_FIELDS", "LiveBounds", "check_changes", "settings_of"]

_INT_FIELDS = ("max_num_seqs", "max_num_batched_tokens", "decode_token_budget")


@dataclasses.dataclass(frozen=True)
class LiveBounds:
    """What start-up compiled and allocated: the ceiling of every live setting."""

    max_step_tokens: int  # the largest compiled token bucket
    max_seqs: int  # the most sequences a step's compiled buckets hold (sampler rows)
    speculative: bool  # speculating steps need k + 1 rows per sequence (rows stay fixed)

    @classmethod
    def of(cls, plan: Any) -> "LiveBounds":
        """`plan`: an `engine.sizing.EnginePlan` (its buckets and the rows they were sized
        for)."""
        buckets = plan.batch_shape.buckets
        max_seqs = max(s for _, s in buckets)
        speculative = plan.speculative_max_running > 0
        if speculative:  # the rows a speculating step may fill were sized at start-up
            max_seqs = min(max_seqs, plan.scheduler.max_num_rows or max_seqs)
        return cls(max(t for t, _ in buckets), max_seqs, speculative)


def settings_of(cfg: SchedulerConfig) -> dict[str, Any]:
    """The live settings as JSON values, named as the flags."""
    out: dict[str, Any] = {}
    for name in LIVE_SCHEDULER_FIELDS:
        value = getattr(cfg, name)
        out[name] = value.to_json() if isinstance(value, SloTargets) else value
    return out


def _int(name: str, value: Any, nullable: bool) -> int | None:
    if value is None and nullable:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        what = "a positive integer or null" if nullable else "a positive integer"
        raise InvalidRequest(f"{name}={show(value)} must be {what}", name)
    if value < 1:
        raise InvalidRequest(f"{name}={value} must be >= 1", name)
    return value


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in allowed:
        raise InvalidRequest(f"{name}={show(value)} must be one of {', '.join(allowed)}", name)
    return value


def _parse(changes: Mapping[str, Any]) -> dict[str, Any]:
    """Each change's type and form (JSON values -> the config's types)."""
    if not isinstance(changes, Mapping):
        raise InvalidRequest("the scheduler changes must be an object of "
                             f"{{field: value}}; fields: {', '.join(LIVE_SCHEDULER_FIELDS)}")
    out: dict[str, Any] = {}
    for name, value in changes.items():
        if name not in LIVE_SCHEDULER_FIELDS:
            raise InvalidRequest(f"{show(name)} is not a scheduler setting that can change on a "
                                 f"running server; those are {', '.join(LIVE_SCHEDULER_FIELDS)}",
                                 str(name))
        if name in _INT_FIELDS:
            out[name] = _int(name, value, nullable=name == "decode_token_budget")
        elif name in ("ttft_slo", "itl_slo"):
            try:
                out[name] = SloTargets.parse(value, name)
            except ValueError as e:
                raise InvalidRequest(str(e), name) from None
        elif name == "slo_admission":
            out[name] = _choice(name, value, SLO_ADMISSIONS)
        else:
            out[name] = _choice(name, value, SCHEDULING_POLICIES)
    return out


def check_changes(cfg: SchedulerConfig, changes: Mapping[str, Any],
                  bounds: LiveBounds) -> SchedulerConfig:
    """The scheduler config with `changes` applied, every value checked first (against the
    others' new values and `bounds`); InvalidRequest naming the field and its limit."""
    new = _parse(changes)
    seqs = new.get("max_num_seqs", cfg.max_num_seqs)
    tokens = new.get("max_num_batched_tokens", cfg.max_num_batched_tokens)
    if seqs > bounds.max_seqs:
        why = ("the sampler rows the compiled buckets were sized for, with speculative "
               "decoding" if bounds.speculative else "the largest compiled seqs bucket")
        raise InvalidRequest(f"max_num_seqs={seqs} is past what start-up compiled: at most "
                             f"{bounds.max_seqs} ({why}; restart with a larger --max-num-seqs "
                             "to compile more)", "max_num_seqs")
    if tokens > bounds.max_step_tokens:
        raise InvalidRequest(f"max_num_batched_tokens={tokens} is past what start-up compiled: at most "
                             f"{bounds.max_step_tokens} (the largest compiled token bucket; "
                             "restart with larger --token-buckets to raise it)",
                             "max_num_batched_tokens")
    if tokens < seqs:  # every running sequence must decode in one step
        if "max_num_batched_tokens" in new:
            raise InvalidRequest(f"max_num_batched_tokens={tokens} must be >= max_num_seqs="
                                 f"{seqs} (every running sequence decodes in one step)",
                                 "max_num_batched_tokens")
        raise InvalidRequest(f"max_num_seqs={seqs} must be <= max_num_batched_tokens={tokens} "
                             "(every running sequence decodes in one step)", "max_num_seqs")
    budget = new.get("decode_token_budget", cfg.decode_token_budget)
    if budget is not None and not seqs <= budget <= tokens:
        unchanged = "" if "decode_token_budget" in new else \
            " (unchanged: send a new decode_token_budget, or null, with this change)"
        raise InvalidRequest(f"decode_token_budget={budget} must be in [max_num_seqs={seqs}, "
                             f"max_num_batched_tokens={tokens}] or null{unchanged}",
                             "decode_token_budget")
    admission = new.get("slo_admission", cfg.slo_admission)
    if admission == "reject" and new.get("ttft_slo", cfg.ttft_slo) is None:
        name = "ttft_slo" if "ttft_slo" in new else "slo_admission"
        raise InvalidRequest(f"{name}: slo_admission='reject' needs a ttft_slo (requests are "
                             "refused when their predicted time to first token passes it); "
                             "set ttft_slo, or slo_admission 'queue'", name)
    # Without speculation a sequence is one sampler row: the rows follow max_num_seqs. With
    # it they stay what the buckets were sized for (the scheduler's admission keeps a
    # speculating step within them whatever max_num_seqs is).
    rows = cfg.max_num_rows if bounds.speculative else seqs
    try:  # the config's own checks (all done above, so this is a backstop)
        return dataclasses.replace(cfg, **new, max_num_rows=rows)
    except ValueError as e:
        raise InvalidRequest(str(e)) from None
