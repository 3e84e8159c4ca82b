"""Load shapes: closed loop at a fixed concurrency, open loop with Poisson arrivals.

Data flow: a target (already open) + the run's requests + a `LoadSpec` -> `run_load`:
  0. `target.prepare(requests)`: what the target must know of them before the clock starts;
  1. warmup: the first `spec.warmup` requests run (at the same concurrency, capped at 4) and
     are thrown away: connection set-up, first-touch compilation of anything lazy;
  2. measured phase: closed loop = `concurrency` workers, each sending its next request as
     soon as its previous one ended; open loop = sends at exponential inter-arrival times of
     mean 1/rate, whatever is in flight (the load a service sees from many users);
  3. bounds: it ends when every request is done or `max_duration_s` passes -- then sends stop,
     in-flight requests are cancelled and counted as incomplete -- so a run always stops.
-> `LoadResult` (the records and the measured window) for `report.summarize`.
A tqdm bar counts finished requests. `run_scheduled` sends requests at given offsets (the
chunked-prefill scenario's long prompts) alongside a closed loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Sequence

import numpy as np
from tqdm.auto import tqdm

from jaxserve.cli.bench.report import RequestRecord
from jaxserve.cli.bench.targets import Target
from jaxserve.cli.bench.workload import BenchRequest


@dataclasses.dataclass(frozen=True)
class LoadSpec:
    concurrency: int | None = None  # closed loop: requests in flight
    rate: float | None = None  # open loop: requests / s (Poisson); inf: all at once
    warmup: int = 2
    max_duration_s: float = 600.0
    seed: int = 0

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.rate is None):
            raise ValueError("give exactly one of concurrency (closed loop) and rate (open "
                             "loop)")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency={self.concurrency} must be >= 1")
        if self.rate is not None and not self.rate > 0:
            raise ValueError(f"request rate={self.rate} must be > 0")
        if self.warmup < 0 or self.max_duration_s <= 0:
            raise ValueError(f"warmup={self.warmup} must be >= 0 and max_duration_s="
                             f"{self.max_duration_s} > 0")

    @property
    def label(self) -> str:
        if self.concurrency is not None:
            return f"concurrency={self.concurrency}"
        return f"rate={self.rate:g}/s"


@dataclasses.dataclass
class LoadResult:
    spec: LoadSpec
    records: list[RequestRecord]
    duration_s: float  # first send -> last completion (or the time bound)


async def run_closed(target: Target, reqs: Sequence[BenchRequest], concurrency: int,
                     records: list[RequestRecord], bar: tqdm | None,
                     stop: asyncio.Event | None = None) -> None:
    """`concurrency` workers send `reqs` in order, each its next one when the last ended,
    until they run out or `stop` is set; one record per sent request lands in `records`."""
    queue = list(reversed(reqs))

    async def worker() -> None:
        while queue and not (stop is not None and stop.is_set()):
            req = queue.pop()
            rec = RequestRecord(kind=req.kind)
            records.append(rec)
            await target.send(req, rec)
            if bar is not None:
                bar.update(1)

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(reqs)))))


async def _open(target: Target, reqs: Sequence[BenchRequest], rate: float,
                records: list[RequestRecord], bar: tqdm | None, seed: int) -> None:
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, size=len(reqs)) if np.isfinite(rate) else \
        np.zeros(len(reqs))
    tasks = []
    for req, gap in zip(reqs, gaps):
        rec = RequestRecord(kind=req.kind)
        records.append(rec)
        tasks.append(asyncio.ensure_future(_one(target, req, rec, bar)))
        if gap > 0:  # rate=inf: every request goes out before any is served
            await asyncio.sleep(float(gap))
    await asyncio.gather(*tasks)


async def _one(target: Target, req: BenchRequest, rec: RequestRecord,
               bar: tqdm | None) -> None:
    await target.send(req, rec)
    if bar is not None:
        bar.update(1)


async def run_scheduled(target: Target, reqs: Sequence[BenchRequest],
                        offsets_s: Sequence[float], records: list[RequestRecord],
                        bar: tqdm | None = None) -> None:
    """Send reqs[i] at offsets_s[i] seconds from now (concurrently with anything else)."""
    t0 = time.perf_counter()
    tasks = []
    for req, at in sorted(zip(reqs, offsets_s), key=lambda x: x[1]):
        await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
        rec = RequestRecord(kind=req.kind)
        records.append(rec)
        tasks.append(asyncio.ensure_future(_one(target, req, rec, bar)))
    await asyncio.gather(*tasks)


async def run_load(target: Target, reqs: Sequence[BenchRequest], spec: LoadSpec,
                   progress: bool = True) -> LoadResult:
    """Warm up on the first `spec.warmup` requests, then measure the rest under `spec`."""
    warm, measured = list(reqs[:spec.warmup]), list(reqs[spec.warmup:])
    if not measured:
        raise ValueError(f"{len(reqs)} requests leave none to measure after warmup="
                         f"{spec.warmup}")
    await target.prepare(reqs)
    if warm:
        await run_closed(target, warm, min(4, spec.concurrency or 4), [], None)
    records: list[RequestRecord] = []
    with tqdm(total=len(measured), desc=spec.label, unit="req", disable=not progress,
              leave=False) as bar:
        t0 = time.perf_counter()
        if spec.concurrency is not None:
            job = run_closed(target, measured, spec.concurrency, records, bar)
        else:
            job = _open(target, measured, float(spec.rate), records, bar, spec.seed)
        try:
            await asyncio.wait_for(job, spec.max_duration_s)
        except asyncio.TimeoutError:
            pass  # in-flight sends were cancelled: their records stay incomplete
    ends = [r.end for r in records if r.end is not None]
    duration = (max(ends) - t0) if ends and len(ends) == len(records) else \
        time.perf_counter() - t0
    return LoadResult(spec, records, duration)
