"""SLO tuner: the (max_num_batched_tokens, max_num_seqs) with the most output tokens/s whose
p99 TTFT and p99 ITL meet the user's targets on the user's workload -- or, with goodput
targets, the one with the most goodput.

Data flow: base EngineConfig + the loaded model (once) + WorkloadSpec + LoadSpec + TuneSpec ->
for each grid point (budgets x sequence limits, skipping budget < seqs, which cannot decode every
sequence in one step), while the time budget lasts: an in-process server with that setting
(`launch.local_server`; warmup compiles its buckets), the same requests (same seed) under the
same load -> a summary -> the point meets the SLO when nothing failed or was cut off and both
p99s are within target -> the best feasible point (highest output tokens/s), or none, with the
whole table. Points the time budget did not reach are listed as not run. The per-point load
bound is the smaller of its own and the time left, so the tuner always stops.

Two criteria, and how they differ. The p99 criterion (`--ttft-p99`, `--itl-p99`) judges the
setting as a whole: the p99 of every request's TTFT and of all streams' gaps pooled, with no
request failed or cut off; the best qualifying point is the one with the most output tokens/s.
Goodput (`--goodput ttft:MS itl:MS ...`, `report.Slo`) judges each request: it counts the
requests for which every target holds (`itl`: that request's own p99 gap) per second of
the run, and the best point is the one with the most goodput (ties: tokens/s), among those
meeting the p99 targets when those are given too. With the same targets the two can
disagree: p99 TTFT <= T lets 1% of requests exceed T (goodput counts each as a miss), and a
few badly stalled streams can push the pooled ITL p99 over while most requests keep their
own p99 within it (goodput still counts those). Compare policies by goodput (what `bench --goodput`
reports); use the p99 criterion for a hard tail bound.

A phase (`PhaseSpec`, the same `--phase` as `bench`) replaces the fixed request count: each
point sends that phase's traffic (open-loop rate or closed loop) for its duration, so the
best static setting for one phase of a phased workload is found on exactly that phase's
traffic. A phase always runs its whole duration, even past the time budget.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Sequence

from jaxserve.cli.bench.launch import local_server
from jaxserve.cli.bench.load import LoadSpec, run_load
from jaxserve.cli.bench.phases import PhaseSpec, phase_points, run_phases
from jaxserve.cli.bench.report import Slo, rejudge
from jaxserve.cli.bench.sweep import fit_workload, machine_facts, point_doc
from jaxserve.cli.bench.targets import GrpcTarget
from jaxserve.cli.bench.workload import WorkloadSpec, build_requests
from jaxserve.config import EngineConfig
from jaxserve.models.loading import LoadedModel
from jaxserve.serving.served import model_name


@dataclasses.dataclass(frozen=True)
class TuneSpec:
    ttft_p99_s: float | None  # both p99 targets or neither
    itl_p99_s: float | None
    batched_tokens: tuple[int, ...] = (128, 256, 512, 1024)
    max_seqs: tuple[int, ...] = (8, 32)
    num_requests: int = 48  # measured requests per point (without a phase)
    max_time_s: float = 1800.0  # the whole tune, warmups included
    goodput: Slo = Slo()  # per-request targets: rank by goodput when given
    phase: PhaseSpec | None = None  # each point runs this phase instead of num_requests

    def __post_init__(self) -> None:
        if (self.ttft_p99_s is None) != (self.itl_p99_s is None):
            raise ValueError("give both --ttft-p99 and --itl-p99, or neither")
        if self.ttft_p99_s is None and not self.goodput.given:
            raise ValueError("tune needs targets: --ttft-p99 and --itl-p99, or --goodput (or its "
                             "--ttft-slo / --itl-slo)")
        if self.ttft_p99_s is not None and not (self.ttft_p99_s > 0 and self.itl_p99_s > 0):
            raise ValueError(f"SLO targets must be > 0 s (ttft_p99={self.ttft_p99_s}, "
                             f"itl_p99={self.itl_p99_s})")
        for name in ("batched_tokens", "max_seqs"):
            v = getattr(self, name)
            if not v or any(x < 1 for x in v):
                raise ValueError(f"{name}={v} must be non-empty positive integers")
        if self.num_requests < 1 or self.max_time_s <= 0:
            raise ValueError("num_requests >= 1 and max_time_s > 0 needed")

    def grid(self) -> list[tuple[int, int]]:
        return [(t, s) for t in sorted(set(self.batched_tokens))
                for s in sorted(set(self.max_seqs)) if t >= s]


def meets(summary: dict, spec: TuneSpec) -> bool:
    """The p99 criterion (every point that completed anything, without p99 targets)."""
    if spec.ttft_p99_s is None or spec.itl_p99_s is None:
        return summary["completed"] > 0
    if summary["completed"] == 0 or summary["failed"] or summary["incomplete"]:
        return False
    ttft, itl = summary["ttft_ms"]["p99"], summary["itl_ms"]["p99"]
    return (ttft is not None and ttft <= spec.ttft_p99_s * 1e3
            and (itl is None or itl <= spec.itl_p99_s * 1e3))


def pick_best(rows: Sequence[dict], spec: TuneSpec) -> dict | None:
    """The qualifying row with the most goodput (with goodput targets; none if no request met
    them anywhere) or the most output tokens/s."""
    feasible = [r for r in rows if r["meets_slo"]]
    if spec.goodput.given:
        feasible = [r for r in feasible if (r["summary"]["goodput"] or 0) > 0]
        return max(feasible, key=lambda r: (r["summary"]["goodput"],
                                            r["summary"]["output_throughput"]), default=None)
    return max(feasible, key=lambda r: r["summary"]["output_throughput"], default=None)


async def _measure(target: GrpcTarget, workload: WorkloadSpec, load: LoadSpec, spec: TuneSpec,
                   slo: Slo, left_s: float, label: str, progress: bool) -> dict:
    wl = fit_workload(workload, target)
    if spec.phase is not None:
        d = spec.phase.duration_s
        result = await run_phases(target, wl, [spec.phase], load.seed, load.warmup,
                                  max(d, min(load.max_duration_s, left_s)), progress)
        return dict(phase_points(result, slo)[0], label=label)
    reqs = build_requests(wl, spec.num_requests + load.warmup, load.seed)
    bounded = dataclasses.replace(load, max_duration_s=max(1.0, min(load.max_duration_s,
                                                                     left_s)))
    return point_doc(await run_load(target, reqs, bounded, progress), slo, label)


async def tune(base: EngineConfig, model: LoadedModel, workload: WorkloadSpec, load: LoadSpec,
               spec: TuneSpec, progress: bool = True) -> dict:
    """`load` gives the warmup and the seed (and, without a phase, the load itself)."""
    t_start = time.perf_counter()
    slo = spec.goodput
    rows: list[dict] = []
    for tokens, seqs in spec.grid():
        row = {"max_num_batched_tokens": tokens, "max_num_seqs": seqs, "summary": None,
               "meets_slo": False, "status": "not run: time budget spent"}
        left = spec.max_time_s - (time.perf_counter() - t_start)
        if left <= 0:
            rows.append(row)
            continue
        # One budget for every step: the swept budget is what each point measures.
        cfg = dataclasses.replace(base, max_num_batched_tokens=tokens, max_num_seqs=seqs,
                                  decode_token_budget=None)
        if progress:
            print(f"[tune] max_num_batched_tokens={tokens} max_num_seqs={seqs}: warming up",
                  file=sys.stderr, flush=True)
        async with local_server(cfg, model) as address:
            target = GrpcTarget(address)
            await target.open()
            try:
                left = spec.max_time_s - (time.perf_counter() - t_start)
                point = await _measure(target, workload, load, spec, slo, left,
                                       f"{tokens}/{seqs}", progress)
            finally:
                await target.close()
        row.update(summary=point["summary"], meets_slo=meets(point["summary"], spec),
                   status="ok", requests=point["samples"]["requests"])
        rows.append(row)
        if progress:
            s = point["summary"]
            good = "" if s["goodput"] is None else \
                f"goodput {s['goodput']:.2f} req/s ({100 * (s['slo_attainment'] or 0):.0f}% " \
                f"of {s['completed'] + s['failed'] + s['incomplete']} sent), "
            print(f"[tune]   -> {s['output_throughput']:.1f} tok/s, {good}TTFT p99 "
                  f"{_ms(s['ttft_ms']['p99'])} ms, ITL p99 {_ms(s['itl_ms']['p99'])} ms"
                  + ("" if spec.ttft_p99_s is None else
                     f", {'meets' if row['meets_slo'] else 'misses'} the p99 SLO"),
                  file=sys.stderr, flush=True)
    phase = spec.phase
    return {"name": "tune", "model": model_name(base, model),
            "workload": phase.describe(workload) if phase else workload.describe(),
            "load": f"{phase.load_label} for {phase.duration_s:g} s" if phase else load.label,
            "phase": phase and phase.to_json(),
            "slo": {"ttft_p99_s": spec.ttft_p99_s, "itl_p99_s": spec.itl_p99_s},
            "goodput": slo.describe() or None,
            "rows": rows, "best": pick_best(rows, spec),
            "elapsed_s": time.perf_counter() - t_start, "machine": machine_facts()}


def repick(doc: dict, spec: TuneSpec) -> dict:
    """A saved tune document judged against other SLO targets (no rerun): the measured
    points do not depend on the targets, only which of them meet them. Goodput targets are
    re-judged from each row's per-request samples (documents older than those cannot)."""
    rows = [dict(r) for r in doc["rows"]]
    if spec.goodput.given:
        if any(r["summary"] is not None and "requests" not in r for r in rows):
            raise ValueError(f"--goodput {spec.goodput.describe()}: this document keeps no "
                             "per-request samples; rerun the tune to judge goodput targets")
        for r in rows:
            if r["summary"] is not None:
                r["summary"] = rejudge(r["summary"], r["requests"], spec.goodput)
    for r in rows:
        r["meets_slo"] = r["summary"] is not None and meets(r["summary"], spec)
    return dict(doc, rows=rows, best=pick_best(rows, spec), goodput=spec.goodput.describe()
                or None, slo={"ttft_p99_s": spec.ttft_p99_s, "itl_p99_s": spec.itl_p99_s})


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def table(rows: Sequence[dict], p99: bool = True) -> str:
    """One line per grid point; "p99 SLO" says whether it meets the p99 targets (`meets`; "-"
    without them, `p99` False)."""
    head = ("batched tokens", "max seqs", "out tok/s", "goodput", "SLO met", "TTFT p99 ms",
            "ITL p99 ms", "ok/fail", "p99 SLO")
    lines = []
    for r in rows:
        s = r["summary"]
        if s is None:
            lines.append((str(r["max_num_batched_tokens"]), str(r["max_num_seqs"]), "-", "-",
                          "-", "-", "-", "-", r["status"]))
            continue
        att = s.get("slo_attainment")
        lines.append((str(r["max_num_batched_tokens"]), str(r["max_num_seqs"]),
                      f"{s['output_throughput']:.1f}",
                      "-" if s.get("goodput") is None else f"{s['goodput']:.2f}",
                      "-" if att is None else f"{100 * att:.0f}%", _ms(s["ttft_ms"]["p99"]),
                      _ms(s["itl_ms"]["p99"]),
                      f"{s['completed']}/{s['failed'] + s['incomplete']}",
                      ("meets" if r["meets_slo"] else "misses") if p99 else "-"))
    widths = [max(len(h), *(len(x[i]) for x in lines)) for i, h in enumerate(head)]
    out = ["  ".join(h.rjust(w) for h, w in zip(head, widths))]
    out += ["  ".join(c.rjust(w) for c, w in zip(x, widths)) for x in lines]
    return "\n".join(out)


def verdict(doc: dict) -> str:
    slo, good = doc["slo"], doc.get("goodput")
    best = doc["best"]
    if best is None:
        wanted = [f"TTFT p99 <= {slo['ttft_p99_s']:g} s and ITL p99 <= {slo['itl_p99_s']:g} s"
                  ] if slo.get("ttft_p99_s") is not None else []
        wanted += [f"a request meeting --goodput {good}"] if good else []
        return (f"no setting met {' with '.join(wanted)} on this workload and load; relax "
                "the targets, lower the load, or try other grid values")
    s = best["summary"]
    good_s = "" if not good else f"goodput {s['goodput']:.2f} req/s ({good}), "
    return (f"best: --max-num-batched-tokens {best['max_num_batched_tokens']} --max-num-seqs "
            f"{best['max_num_seqs']} --decode-token-budget none  "
            f"({good_s}{s['output_throughput']:.1f} output tok/s, TTFT p99 "
            f"{_ms(s['ttft_ms']['p99'])} ms, ITL p99 {_ms(s['itl_ms']['p99'])} ms)")
