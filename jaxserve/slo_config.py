"""Latency targets and the live scheduler settings: `SloTargets` and `LIVE_SCHEDULER_FIELDS`.

A user writes `--ttft-slo 2` (every priority level: first token within 2 s) or
`--ttft-slo 0=0.5,1=2` (level 0 within 0.5 s, level 1 within 2 s, other levels no target), or
both (`2,0=0.5`: level 0 within 0.5 s, every other level 2 s); the same for `--itl-slo` (the
gap between two tokens of a stream). `LLM(ttft_slo=...)` and the admin endpoint take a number
or a mapping {"default": s, "0": s, ...}. `SloTargets.parse` turns any of these into the
frozen value the scheduler reads (`engine/slo_policy.py`), refusing a bad one by its text; it
sits in the config layer beside `jaxserve.config` (which re-exports it) and imports nothing
else of jaxserve.

Priority levels are vLLM's: an integer per request, lower served first.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

SLO_ADMISSIONS = ("queue", "reject")  # what a request whose TTFT target cannot be met gets
SCHEDULING_POLICIES = ("priority", "fcfs")  # vLLM's --scheduling-policy values
# The scheduler settings a running server may change (the admin endpoint; names = the flags'):
# each is a SchedulerConfig field, re-checked against what the compiled buckets and the KV
# allocation allow (`engine.live_settings`).
LIVE_SCHEDULER_FIELDS = ("max_num_seqs", "max_num_batched_tokens", "decode_token_budget",
                         "ttft_slo", "itl_slo", "slo_admission", "scheduling_policy")
_MAX_SLO_S = 3600.0  # an hour: anything longer is a typo, not a latency target
_REPR_LIMIT = 60  # characters of a bad value quoted in an error


def _seconds(value: Any, what: str) -> float:
    try:
        s = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what}={str(value)[:_REPR_LIMIT]!r} is not a number of seconds") \
            from None
    if isinstance(value, bool) or not math.isfinite(s) or not 0 < s <= _MAX_SLO_S:
        raise ValueError(f"{what}={str(value)[:_REPR_LIMIT]!r} must be seconds in "
                         f"(0, {_MAX_SLO_S:g}]")
    return s


@dataclasses.dataclass(frozen=True)
class SloTargets:
    """A latency target in seconds per priority level: `per_priority` for the levels named,
    `default` for the others (None: no target for them)."""

    default: float | None = None
    per_priority: tuple[tuple[int, float], ...] = ()  # (level, seconds), levels ascending

    def __post_init__(self) -> None:
        if self.default is not None:
            _seconds(self.default, "default")
        levels = [p for p, _ in self.per_priority]
        if levels != sorted(set(levels)):
            raise ValueError(f"priority levels {levels} must be distinct and ascending")
        for p, s in self.per_priority:
            if not isinstance(p, int) or isinstance(p, bool):
                raise ValueError(f"priority level {p!r} must be an integer")
            _seconds(s, f"priority {p}")
        if self.default is None and not self.per_priority:
            raise ValueError("an SLO needs a default or at least one priority level")

    def for_priority(self, priority: int) -> float | None:
        """The target of a request at `priority` (None: none)."""
        for p, s in self.per_priority:
            if p == priority:
                return s
        return self.default

    @property
    def tightest(self) -> float:
        return min([s for _, s in self.per_priority] +
                   ([self.default] if self.default is not None else []))

    @classmethod
    def parse(cls, value: Any, name: str = "slo") -> "SloTargets | None":
        """A number, "S", "P=S,...", "S,P=S,...", a mapping {"default": S, "P": S}, an
        SloTargets or None; errors name `name` and the bad part."""
        if value is None or isinstance(value, SloTargets):
            return value
        if isinstance(value, Mapping):
            items = [(str(k), v) for k, v in value.items()]
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            items = [("default", value)]
        elif isinstance(value, str):
            items = []
            for part in value.split(","):
                key, eq, s = part.strip().partition("=")
                items.append((key.strip(), s.strip()) if eq else ("default", key.strip()))
        else:
            raise ValueError(f"{name}={str(value)[:_REPR_LIMIT]!r} must be seconds, "
                             "'LEVEL=SECONDS,...' or a mapping of levels to seconds")
        default, levels = None, {}
        for key, s in items:
            if key == "default":
                if default is not None:
                    raise ValueError(f"{name} gives a default target twice")
                default = _seconds(s, name)
                continue
            try:
                level = int(key)
            except ValueError:
                raise ValueError(f"{name}: {key[:_REPR_LIMIT]!r} is not a priority level "
                                 "(an integer) or 'default'") from None
            if level in levels:
                raise ValueError(f"{name} gives priority {level} twice")
            levels[level] = _seconds(s, f"{name} priority {level}")
        try:
            return cls(default, tuple(sorted(levels.items())))
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None

    def to_json(self) -> float | dict[str, float]:
        """A number when only the default is set, else {"default"?: s, "level": s}."""
        if not self.per_priority and self.default is not None:
            return self.default
        out = {} if self.default is None else {"default": self.default}
        out.update({str(p): s for p, s in self.per_priority})
        return out

    def __str__(self) -> str:
        parts = [] if self.default is None else [f"{self.default:g}"]
        return ",".join(parts + [f"{p}={s:g}" for p, s in self.per_priority])
