"""SLO tuner: the (max_num_batched_tokens, max_num_seqs) with the most output tokens/s whose
p99 TTFT and p99 ITL meet the user's targets on the user's workload.

Data flow: base EngineConfig + the loaded model (once) + WorkloadSpec + LoadSpec + TuneSpec ->
for each grid point (budgets x sequence limits, skipping budget < seqs, which cannot decode every
sequence in one step), while the time budget lasts: an in-process server with that setting
(`launch.local_server`; warmup compiles its buckets), the same requests (same seed) under the
same load -> a summary -> the point meets the SLO when nothing failed or was cut off and both
p99s are within target -> the best feasible point (highest output tokens/s), or none, with the
whole table. Points the time budget did not reach are listed as not run. The per-point load
bound is the smaller of its own and the time left, so the tuner always stops.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Sequence

from jaxserve.cli.bench.launch import local_server
from jaxserve.cli.bench.load import LoadSpec, run_load
from jaxserve.cli.bench.report import Slo
from jaxserve.cli.bench.sweep import fit_workload, machine_facts, point_doc
from jaxserve.cli.bench.targets import GrpcTarget
from jaxserve.cli.bench.workload import WorkloadSpec, build_requests
from jaxserve.config import EngineConfig
from jaxserve.models.loading import LoadedModel
from jaxserve.serving.served import model_name


@dataclasses.dataclass(frozen=True)
class TuneSpec:
    ttft_p99_s: float
    itl_p99_s: float
    batched_tokens: tuple[int, ...] = (128, 256, 512, 1024)
    max_seqs: tuple[int, ...] = (8, 32)
    num_requests: int = 48  # measured requests per point
    max_time_s: float = 1800.0  # the whole tune, warmups included

    def __post_init__(self) -> None:
        if not (self.ttft_p99_s > 0 and self.itl_p99_s > 0):
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
    if summary["completed"] == 0 or summary["failed"] or summary["incomplete"]:
        return False
    ttft, itl = summary["ttft_ms"]["p99"], summary["itl_ms"]["p99"]
    return (ttft is not None and ttft <= spec.ttft_p99_s * 1e3
            and (itl is None or itl <= spec.itl_p99_s * 1e3))


async def tune(base: EngineConfig, model: LoadedModel, workload: WorkloadSpec, load: LoadSpec,
               spec: TuneSpec, progress: bool = True) -> dict:
    t_start = time.perf_counter()
    slo = Slo(spec.ttft_p99_s, spec.itl_p99_s)
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
                wl = fit_workload(workload, target)
                reqs = build_requests(wl, spec.num_requests + load.warmup, load.seed)
                left = spec.max_time_s - (time.perf_counter() - t_start)
                bounded = dataclasses.replace(load, max_duration_s=max(
                    1.0, min(load.max_duration_s, left)))
                result = await run_load(target, reqs, bounded, progress)
            finally:
                await target.close()
        point = point_doc(result, slo, f"{tokens}/{seqs}")
        row.update(summary=point["summary"], meets_slo=meets(point["summary"], spec),
                   status="ok")
        rows.append(row)
        if progress:
            s = point["summary"]
            print(f"[tune]   -> {s['output_throughput']:.1f} tok/s, TTFT p99 "
                  f"{_ms(s['ttft_ms']['p99'])} ms, ITL p99 {_ms(s['itl_ms']['p99'])} ms, "
                  f"{'meets' if row['meets_slo'] else 'misses'} the SLO",
                  file=sys.stderr, flush=True)
    feasible = [r for r in rows if r["meets_slo"]]
    best = max(feasible, key=lambda r: r["summary"]["output_throughput"]) if feasible else None
    return {"name": "tune", "model": model_name(base, model),
            "workload": workload.describe(), "load": load.label,
            "slo": {"ttft_p99_s": spec.ttft_p99_s, "itl_p99_s": spec.itl_p99_s},
            "rows": rows, "best": best, "elapsed_s": time.perf_counter() - t_start,
            "machine": machine_facts()}


def repick(doc: dict, spec: TuneSpec) -> dict:
    """A saved tune document judged against other SLO targets (no rerun): the measured
    points do not depend on the targets, only which of them meet them."""
    rows = [dict(r, meets_slo=r["summary"] is not None and meets(r["summary"], spec))
            for r in doc["rows"]]
    feasible = [r for r in rows if r["meets_slo"]]
    best = max(feasible, key=lambda r: r["summary"]["output_throughput"]) if feasible else None
    return dict(doc, rows=rows, best=best,
                slo={"ttft_p99_s": spec.ttft_p99_s, "itl_p99_s": spec.itl_p99_s})


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def table(rows: Sequence[dict]) -> str:
    head = ("batched tokens", "max seqs", "out tok/s", "TTFT p99 ms", "ITL p99 ms", "ok/fail",
            "SLO")
    lines = []
    for r in rows:
        s = r["summary"]
        if s is None:
            lines.append((str(r["max_num_batched_tokens"]), str(r["max_num_seqs"]), "-", "-",
                          "-", "-", r["status"]))
            continue
        lines.append((str(r["max_num_batched_tokens"]), str(r["max_num_seqs"]),
                      f"{s['output_throughput']:.1f}", _ms(s["ttft_ms"]["p99"]),
                      _ms(s["itl_ms"]["p99"]),
                      f"{s['completed']}/{s['failed'] + s['incomplete']}",
                      "meets" if r["meets_slo"] else "misses"))
    widths = [max(len(h), *(len(x[i]) for x in lines)) for i, h in enumerate(head)]
    out = ["  ".join(h.rjust(w) for h, w in zip(head, widths))]
    out += ["  ".join(c.rjust(w) for c, w in zip(x, widths)) for x in lines]
    return "\n".join(out)


def verdict(doc: dict) -> str:
    slo = doc["slo"]
    best = doc["best"]
    if best is None:
        return (f"no setting met TTFT p99 <= {slo['ttft_p99_s']:g} s and ITL p99 <= "
                f"{slo['itl_p99_s']:g} s on this workload and load; relax the targets, lower "
                "the load, or try other grid values")
    s = best["summary"]
    return (f"best: --max-num-batched-tokens {best['max_num_batched_tokens']} --max-num-seqs "
            f"{best['max_num_seqs']} --decode-token-budget none  "
            f"({s['output_throughput']:.1f} output tok/s, TTFT p99 "
            f"{_ms(s['ttft_ms']['p99'])} ms, ITL p99 {_ms(s['itl_ms']['p99'])} ms)")
