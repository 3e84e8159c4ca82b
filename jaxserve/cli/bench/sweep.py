"""A load sweep against one target, and the result document that every bench tool writes.

Data flow: an open `Target` + a WorkloadSpec + LoadSpecs (e.g. concurrency 1, 4, 16, 64) ->
for load i: requests drawn with seed + i (fresh prompts per point, so a point never hits the
prefix cache that an earlier point filled; the same prompts for every target given the same
seed; vocabulary from the server when it says) ->
`load.run_load` -> `report.summarize` (overall and per request kind) -> a point dict with the
summary and the raw samples (TTFT, ITL: CDF plots; per request [TTFT, own p99 ITL, TPOT,
E2E]: goodput re-judged under other targets, `report.rejudge`) -> one document:
  {"target", "endpoint", "model", "workload", "points": [...], "machine": {...}}
which `write_outputs` saves as JSON plus PNG plots and prints as a table. `run_phased` makes
the same document of a phased workload (`phases.py`): one point per phase, then "all".
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import platform
import sys
import time
from typing import Sequence

from jaxserve.cli.bench import plots
from jaxserve.cli.bench.load import LoadResult, LoadSpec, run_load
from jaxserve.cli.bench.phases import PhaseSpec, describe, phase_points, run_phases
from jaxserve.cli.bench.report import (Slo, Summary, by_kind, format_table, request_row,
                                       summarize)
from jaxserve.cli.bench.targets import Target
from jaxserve.cli.bench.workload import WorkloadSpec, build_requests


def machine_facts() -> dict:
    return {"platform": platform.platform(), "python": platform.python_version(),
            "cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def point_doc(result: LoadResult, slo: Slo, label: str | None = None) -> dict:
    s = summarize(result.records, result.duration_s, slo)
    ok = [r for r in result.records if r.ok]
    return {"label": label or result.spec.label, "concurrency": result.spec.concurrency,
            "rate": result.spec.rate, "summary": s.to_dict(),
            "by_kind": {k: v.to_dict() for k, v in
                        by_kind(result.records, result.duration_s, slo).items()},
            "samples": {"ttft_s": [r.ttft for r in ok],
                        "itl_s": [float(x) for r in ok for x in r.itls],
                        "requests": [request_row(r) for r in ok]}}


def summary_of(point: dict) -> Summary:
    """A point's summary back as a Summary (for tables of saved documents)."""
    from jaxserve.cli.bench.report import Dist

    d = dict(point["summary"])
    for k in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        d[k] = Dist(**{f: (float("nan") if v is None else v) for f, v in d[k].items()})
    d["slo"] = Slo(**d["slo"])
    d["errors"] = tuple(d["errors"])
    return Summary(**d)


def fit_workload(spec: WorkloadSpec, target: Target) -> WorkloadSpec:
    """Draw ids from the server's vocabulary and keep prompts within its context."""
    changes: dict = {}
    if target.vocab_size:
        changes["vocab_size"] = target.vocab_size
    if target.max_model_len and spec.max_prompt_len is None:
        changes["max_prompt_len"] = target.max_model_len
    return dataclasses.replace(spec, **changes) if changes else spec


async def run_sweep(target: Target, workload: WorkloadSpec, loads: Sequence[LoadSpec],
                    num_requests: int | Sequence[int], seed: int = 0, slo: Slo = Slo(),
                    progress: bool = True, name: str = "") -> dict:
    """Run each load on its number of measured requests (+ its warmup); `num_requests` is
    one count for every load or one per load."""
    workload = fit_workload(workload, target)
    counts = [num_requests] * len(loads) if isinstance(num_requests, int) else \
        list(num_requests)
    if len(counts) != len(loads):
        raise ValueError(f"{len(counts)} request counts for {len(loads)} loads")
    points = []
    for i, (spec, count) in enumerate(zip(loads, counts)):
        reqs = build_requests(workload, count + spec.warmup, seed + i)
        result = await run_load(target, reqs, spec, progress)
        points.append(point_doc(result, slo))
        if progress:
            print(format_table([(points[-1]["label"], summary_of(points[-1]))]).splitlines()[1],
                  file=sys.stderr)
    return {"name": name or target.name, "target": target.name,
            "endpoint": target.endpoint, "model": target.model,
            "workload": workload.describe(), "num_requests": counts, "seed": seed,
            "points": points, "machine": machine_facts(), "command": sys.argv}


async def run_phased(target: Target, workload: WorkloadSpec, phases: Sequence[PhaseSpec],
                     seed: int = 0, slo: Slo = Slo(), warmup: int = 2,
                     max_duration_s: float | None = None, progress: bool = True,
                     name: str = "") -> dict:
    """A phased run (`phases.run_phases`) as a result document: one point per phase, then
    "all"; the same shape as a sweep's, so tables, --compare and plots take it."""
    workload = fit_workload(workload, target)
    result = await run_phases(target, workload, phases, seed, warmup, max_duration_s,
                              progress)
    points = phase_points(result, slo)
    return {"name": name or target.name, "target": target.name,
            "endpoint": target.endpoint, "model": target.model,
            "workload": describe(phases, workload), "phases": [p.to_json() for p in phases],
            "drain_s": result.drain_s, "seed": seed, "goodput": slo.describe() or None,
            "points": points, "machine": machine_facts(), "command": sys.argv}


def write_outputs(doc: dict, json_path: str | None, plot_prefix: str | None) -> list[str]:
    """Save the document and its plots; returns what was written."""
    written = []
    if json_path:
        p = pathlib.Path(json_path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(doc, indent=1) + "\n")
        written.append(str(p))
    if plot_prefix and doc["points"]:
        written += [str(x) for x in plots.plot_sweep([doc], f"{plot_prefix}_sweep.png")]
        written += [str(x) for x in plots.plot_cdfs([doc], f"{plot_prefix}_cdf.png")]
    return written


def table_of(doc: dict) -> str:
    endpoint = f"  endpoint={doc['endpoint']}" if doc.get("endpoint") else ""
    title = f"{doc['name']}{endpoint}  model={doc['model']}  workload={doc['workload']}"
    return format_table([(p["label"], summary_of(p)) for p in doc["points"]], title)
