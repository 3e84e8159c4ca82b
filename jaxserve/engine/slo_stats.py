"""`SloStats`: the SLO policy's counters and latest decision, as `EngineStats.slo` carries them.

Filled by `slo_policy.SloPolicy.stats()` once per engine iteration; data-parallel replicas'
stats add up with `+` (`EngineStats.total`); `serving/slo_metrics.py` turns them into
Prometheus series.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class SloStats:
    """Cumulative SLO counters and the latest decision (EngineStats.slo)."""

    last_budget: int = 0  # the last step's token budget
    predicted_step_s: float = 0.0  # the model's prediction for the last measured step
    measured_step_s: float = 0.0
    itl_overloads: int = 0  # steps whose decodes alone were predicted past the ITL target
    # per priority level: (level, ttft_met, ttft_missed, itl_met, itl_missed, unattainable)
    by_priority: tuple[tuple[int, int, int, int, int, int], ...] = ()

    def __add__(self, other: "SloStats") -> "SloStats":
        levels: dict[int, list[int]] = {}
        for row in self.by_priority + other.by_priority:
            acc = levels.setdefault(row[0], [0] * 5)
            for i, v in enumerate(row[1:]):
                acc[i] += v
        return SloStats(max(self.last_budget, other.last_budget),
                        max(self.predicted_step_s, other.predicted_step_s),
                        max(self.measured_step_s, other.measured_step_s),
                        self.itl_overloads + other.itl_overloads,
                        tuple((p, *v) for p, v in sorted(levels.items())))
