"""Prometheus series of the SLO-driven scheduler (`engine/slo_policy.py`), from `EngineStats.slo`.

Data flow: `EngineMetrics.on_step` (the engine's loop thread, once per iteration) ->
`SloView.on_step(stats.slo, stepped)` -> gauges of the step-time model's prediction and the
measurement for the last step, a histogram of the token budget chosen per step, counters
advanced by the deltas of the cumulative per-priority counts (first tokens and requests'
p99 inter-token gaps against their level's targets, requests whose forecast TTFT passed the
target, steps whose decodes alone were predicted past the ITL target), and the attainment
ratio per priority level and target. The families exist whether targets are set or not:
targets can be set on a live server (the admin endpoint), and the model is always fitted.
"""

from __future__ import annotations

from typing import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from jaxserve.engine.slo_stats import SloStats

_SLOS = ("ttft", "itl")


class SloFamilies:
    def __init__(self, r: CollectorRegistry, prefix: str, labels: tuple[str, ...],
                 budget_buckets: Sequence[float]):
        self.predicted = Gauge(prefix + "slo_step_time_predicted_seconds",
                               "The step-time model's prediction for the last step.", labels,
                               registry=r)
        self.measured = Gauge(prefix + "slo_step_time_measured_seconds",
                              "The last step's measured time (as its streams saw it).", labels,
                              registry=r)
        self.budget = Histogram(prefix + "slo_step_token_budget",
                                "Token budget chosen per step (static without SLO targets).",
                                labels, buckets=budget_buckets, registry=r)
        self.overloads = Counter(prefix + "slo_itl_overloads",
                                 "Steps whose decodes alone were predicted past the ITL target "
                                 "(no prefill ran).", labels, registry=r)
        self.requests = Counter(prefix + "slo_requests",
                                "Finished sequences judged against their priority level's "
                                "target (ttft: first token; itl: p99 gap), by outcome.",
                                (*labels, "priority", "slo", "outcome"), registry=r)
        self.attainment = Gauge(prefix + "slo_attainment",
                                "Fraction of judged sequences that met the target, per priority "
                                "level.", (*labels, "priority", "slo"), registry=r)
        self.unattainable = Counter(prefix + "slo_ttft_unattainable",
                                    "Requests whose forecast TTFT passed the target at arrival "
                                    "(queued, or refused with --slo-admission reject).",
                                    (*labels, "priority"), registry=r)


class SloView:
    """One engine's SLO series, fed its `EngineStats.slo` every iteration."""

    def __init__(self, fam: SloFamilies, values: tuple[str, ...]):
        self._fam = fam
        self._values = values
        self.predicted = fam.predicted.labels(*values)
        self.measured = fam.measured.labels(*values)
        self.budget = fam.budget.labels(*values)
        self.overloads = fam.overloads.labels(*values)
        self._last_overloads = 0
        self._last_levels: dict[int, tuple[int, ...]] = {}

    def on_step(self, slo: SloStats, new_step: bool) -> None:
        """`new_step`: a step ran since the last call (its budget is observed once)."""
        self.predicted.set(slo.predicted_step_s)
        self.measured.set(slo.measured_step_s)
        if new_step:
            self.budget.observe(slo.last_budget)
        self.overloads.inc(slo.itl_overloads - self._last_overloads)
        self._last_overloads = slo.itl_overloads
        for level, *counts in slo.by_priority:
            old = self._last_levels.get(level, (0,) * len(counts))
            if tuple(counts) == old:
                continue
            p = str(level)
            fam = self._fam
            for i, slo_name in enumerate(_SLOS):
                met, missed = counts[2 * i], counts[2 * i + 1]
                for outcome, new, was in (("met", met, old[2 * i]),
                                          ("missed", missed, old[2 * i + 1])):
                    if new > was:
                        fam.requests.labels(*self._values, p, slo_name, outcome).inc(new - was)
                if met + missed:
                    fam.attainment.labels(*self._values, p, slo_name).set(met / (met + missed))
            if counts[4] > old[4]:
                fam.unattainable.labels(*self._values, p).inc(counts[4] - old[4])
            self._last_levels[level] = tuple(counts)
