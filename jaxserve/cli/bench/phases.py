"""Phased workloads: traffic that changes shape over time (chat-heavy, then long prompts).

Why: a static scheduler setting is tuned for one traffic shape; an adaptive policy earns its
keep when the shape shifts. A phased run sends phase 1's traffic for its duration, then phase
2's, ..., against one server, and reports every figure per phase and for the whole run.

Data flow: `--phase name=chat,duration=180,rate=2,input-len=uniform:64-256,...` (repeatable)
-> `parse_phase` -> `PhaseSpec`s -> `run_phases(target, workload, phases, seed, slo)`:
  0. warmup: `warmup` requests of phase 1's shape (own seed), closed loop, not measured;
  1. each phase starts at the sum of the earlier phases' durations from one clock: an open-loop
     phase sends at gamma-distributed gaps (vLLM's `--burstiness`: 1 = Poisson) drawn up front
     for its window; a closed-loop phase keeps `concurrency` requests in flight until its
     window ends. A request still running when its phase ends runs on (it overlaps the next
     phase, as real traffic would) and counts for the phase that sent it;
  2. when every sent request ended, or `max_duration_s` after the start, the run stops (what
     is in flight then is cut off and counted as incomplete);
-> one point per phase + one for the whole run (`phase_doc`), each over its scheduled window
(phase: its duration; whole run: the sum), so every policy is divided by the same seconds and
goodputs compare directly; `drain_s` says how long the last requests ran past the windows.
Arrivals and requests (drawn in blocks of `BLOCK`) come from seeds of (seed, the phase's name,
block): the same seed sends the same requests in the same order to any target (a closed loop
may send more or fewer of them, as the server allows), and a phase run alone (`jaxserve tune
--phase`) gets the very requests and arrivals it gets inside the phased run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import re
import sys
import time
import zlib
from typing import Sequence

import numpy as np

from jaxserve.cli.bench.load import run_closed
from jaxserve.cli.bench.report import RequestRecord, Slo, by_kind, request_row, summarize
from jaxserve.cli.bench.targets import Target
from jaxserve.cli.bench.workload import (BenchRequest, LengthDist, WorkloadSpec, build_requests,
                                         parse_length_dist)

BLOCK = 64  # requests drawn (and prepared by the target) at a time
DRAIN_S = 120.0  # default bound past the last window for the stragglers
_KEYS = ("name", "duration", "rate", "burstiness", "concurrency", "input-len", "output-len")


@dataclasses.dataclass(frozen=True)
class PhaseSpec:
    name: str
    duration_s: float  # seconds this phase sends new requests
    rate: float | None = None  # open loop: requests / s
    burstiness: float = 1.0  # open loop: gamma shape of the gaps (1: Poisson; < 1 burstier)
    concurrency: int | None = None  # closed loop: requests in flight
    input_len: LengthDist | None = None  # None: the workload's --input-len
    output_len: LengthDist | None = None  # None: the workload's --output-len

    def __post_init__(self) -> None:
        where = f"--phase {self.name or '?'}"
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", self.name or ""):
            raise ValueError(f"{where}: name={self.name!r} must be letters, digits, _ . -")
        if not (0 < self.duration_s < math.inf):
            raise ValueError(f"{where}: duration={self.duration_s} must be seconds > 0")
        if (self.rate is None) == (self.concurrency is None):
            raise ValueError(f"{where}: give exactly one of rate= (open loop, req/s) and "
                             "concurrency= (closed loop)")
        if self.rate is not None and not 0 < self.rate < math.inf:
            raise ValueError(f"{where}: rate={self.rate} must be a finite number of req/s > 0 "
                             "(a phase sends over its whole duration)")
        if not 0 < self.burstiness < math.inf:
            raise ValueError(f"{where}: burstiness={self.burstiness} must be > 0")
        if self.burstiness != 1.0 and self.rate is None:
            raise ValueError(f"{where}: burstiness= shapes open-loop arrivals: it needs rate=")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"{where}: concurrency={self.concurrency} must be >= 1")

    @property
    def load_label(self) -> str:
        if self.rate is None:
            return f"concurrency={self.concurrency}"
        b = "" if self.burstiness == 1.0 else f" burstiness={self.burstiness:g}"
        return f"rate={self.rate:g}/s{b}"

    def workload(self, base: WorkloadSpec) -> WorkloadSpec:
        return dataclasses.replace(base, input_len=self.input_len or base.input_len,
                                   output_len=self.output_len or base.output_len)

    def describe(self, base: WorkloadSpec) -> str:
        w = self.workload(base)
        return (f"{self.name}: {self.duration_s:g} s at {self.load_label}, "
                f"in={w.input_len} out={w.output_len}")

    def to_json(self) -> dict:
        return {"name": self.name, "duration_s": self.duration_s, "rate": self.rate,
                "burstiness": self.burstiness, "concurrency": self.concurrency,
                "input_len": None if self.input_len is None else str(self.input_len),
                "output_len": None if self.output_len is None else str(self.output_len)}


def parse_phase(text: str, index: int = 0) -> PhaseSpec:
    """`name=chat,duration=180,rate=2,burstiness=1,input-len=uniform:64-256,output-len=96`
    (or `concurrency=N` for a closed loop); `name` defaults to `phase<index+1>`. Commas
    inside a value (`lognormal:200,0.8`) are kept: only `,KEY=` starts a new item."""
    where = f"--phase {text!r}"
    items: dict[str, str] = {}
    for part in re.split(r",(?=\s*[A-Za-z][A-Za-z_-]*\s*=)", text.strip()):
        key, eq, value = part.partition("=")
        key = key.strip().lower().replace("_", "-")
        if not eq or not value.strip():
            raise ValueError(f"{where}: {part!r} is not KEY=VALUE")
        if key not in _KEYS:
            raise ValueError(f"{where}: unknown key {key!r} (known: {', '.join(_KEYS)})")
        if key in items:
            raise ValueError(f"{where}: {key} given twice")
        items[key] = value.strip()
    if "duration" not in items:
        raise ValueError(f"{where}: duration= (seconds) is required")

    def num(key: str, cast: type = float) -> float | int | None:
        if key not in items:
            return None
        try:
            return cast(items[key])
        except ValueError:
            raise ValueError(f"{where}: {key}={items[key]!r} is not a"
                             f"{'n integer' if cast is int else ' number'}") from None

    def dist(key: str) -> LengthDist | None:
        if key not in items:
            return None
        try:
            return parse_length_dist(items[key])
        except ValueError as e:
            raise ValueError(f"{where}: {key}: {e}") from None

    burstiness = num("burstiness")
    try:
        return PhaseSpec(name=items.get("name", f"phase{index + 1}"),
                         duration_s=float(num("duration")),  # type: ignore[arg-type]
                         rate=num("rate"),
                         burstiness=1.0 if burstiness is None else float(burstiness),
                         concurrency=num("concurrency", int),  # type: ignore[arg-type]
                         input_len=dist("input-len"), output_len=dist("output-len"))
    except ValueError as e:
        raise ValueError(f"{where}: {e}" if not str(e).startswith("--phase") else str(e)) \
            from None


def parse_phases(texts: Sequence[str]) -> list[PhaseSpec]:
    phases = [parse_phase(t, i) for i, t in enumerate(texts)]
    names = [p.name for p in phases]
    if len(set(names)) != len(names):
        raise ValueError(f"--phase names {names} must be distinct (they label the report)")
    return phases


def _stream_key(name: str) -> int:
    """A phase's own seed component: its name's, so it does not depend on the phase's place."""
    return zlib.crc32(name.encode())


def arrival_offsets(phase: PhaseSpec, seed: int) -> np.ndarray:
    """f64[n] send times (s from the phase start) of an open-loop phase, all < duration."""
    assert phase.rate is not None
    rng = np.random.default_rng([seed, _stream_key(phase.name), 1 << 20])
    shape = phase.burstiness  # gamma(shape, 1 / (rate * shape)): mean gap 1 / rate
    out: list[float] = []
    t = 0.0
    while True:
        gaps = rng.gamma(shape, 1.0 / (phase.rate * shape), size=256)
        for g in gaps.tolist():
            t += g
            if t >= phase.duration_s:
                return np.asarray(out, dtype=np.float64)
            out.append(t)


class RequestStream:
    """A phase's requests, drawn `BLOCK` at a time and prepared by the target before use."""

    def __init__(self, target: Target, workload: WorkloadSpec, seed: int, kind: str,
                 key: str | None = None):
        # key: the seed component's name (default: kind, the phase's name)
        self._target, self._workload = target, workload
        self._seed, self._key, self._kind = seed, _stream_key(key or kind), kind
        self._block = 0
        self._ready: list[BenchRequest] = []
        self._lock = asyncio.Lock()

    async def next(self) -> BenchRequest:
        async with self._lock:
            if not self._ready:
                seed = int(np.random.SeedSequence([self._seed, self._key, self._block])
                           .generate_state(1)[0])
                self._block += 1
                drawn = build_requests(self._workload, BLOCK, seed)
                await self._target.prepare(drawn)
                self._ready = [dataclasses.replace(
                    r, kind=self._kind if r.kind in ("chat", "default") else
                    f"{self._kind}/{r.kind}") for r in reversed(drawn)]
            return self._ready.pop()


@dataclasses.dataclass
class PhasedResult:
    phases: list[PhaseSpec]
    records: list[list[RequestRecord]]  # per phase, in send order
    drain_s: float  # last end - end of the last window (0 when all ended inside it)


async def _send(target: Target, req: BenchRequest, records: list[RequestRecord]) -> None:
    rec = RequestRecord(kind=req.kind)
    records.append(rec)
    await target.send(req, rec)


async def _drive(target: Target, phase: PhaseSpec, stream: RequestStream, start: float,
                 seed: int, records: list[RequestRecord]) -> None:
    """Send one phase's traffic in [start, start + duration) (perf_counter clock)."""
    end = start + phase.duration_s
    await asyncio.sleep(max(0.0, start - time.perf_counter()))
    if phase.concurrency is not None:
        async def worker() -> None:
            while time.perf_counter() < end:
                await _send(target, await stream.next(), records)

        await asyncio.gather(*(worker() for _ in range(phase.concurrency)))
        return
    tasks = []
    for at in arrival_offsets(phase, seed).tolist():
        req = await stream.next()
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        tasks.append(asyncio.ensure_future(_send(target, req, records)))
    await asyncio.gather(*tasks)


async def run_phases(target: Target, workload: WorkloadSpec, phases: Sequence[PhaseSpec],
                     seed: int = 0, warmup: int = 2, max_duration_s: float | None = None,
                     progress: bool = True) -> PhasedResult:
    """Run the phases back to back on one clock; `max_duration_s` bounds the whole run
    (default: the phases' durations + DRAIN_S)."""
    if not phases:
        raise ValueError("a phased run needs at least one --phase")
    total = sum(p.duration_s for p in phases)
    bound = total + DRAIN_S if max_duration_s is None else max_duration_s
    if bound < total:
        raise ValueError(f"--max-duration {bound:g} is shorter than the phases' "
                         f"{total:g} s: it bounds the whole phased run")
    if warmup:
        # "<warmup>" is no phase name: warmup prompts never repeat a measured one (which
        # would then hit the prefix cache)
        warm = RequestStream(target, phases[0].workload(workload), seed, "warmup", "<warmup>")
        await run_closed(target, [await warm.next() for _ in range(warmup)],
                         min(4, warmup), [], None)
    records: list[list[RequestRecord]] = [[] for _ in phases]
    t0 = time.perf_counter()
    starts = np.concatenate([[0.0], np.cumsum([p.duration_s for p in phases])[:-1]])
    jobs = []
    for i, (phase, start) in enumerate(zip(phases, starts.tolist())):
        stream = RequestStream(target, phase.workload(workload), seed, phase.name)
        jobs.append(_drive(target, phase, stream, t0 + start, seed, records[i]))
        if progress:
            print(f"[phases] {phase.describe(workload)} from t={start:g} s", file=sys.stderr)
    try:
        await asyncio.wait_for(asyncio.gather(*jobs), bound)
    except asyncio.TimeoutError:
        pass  # cut-off sends keep their records incomplete
    ends = [r.end for rs in records for r in rs if r.end is not None]
    drain = max(0.0, max(ends, default=t0) - (t0 + total))
    return PhasedResult(list(phases), records, drain)


def _point(records: Sequence[RequestRecord], window_s: float, slo: Slo, label: str,
           phase: PhaseSpec | None) -> dict:
    s = summarize(records, window_s, slo)
    ok = [r for r in records if r.ok]
    return {"label": label, "concurrency": phase and phase.concurrency,
            "rate": phase and phase.rate, "window_s": window_s,
            "phase": phase and phase.to_json(), "summary": s.to_dict(),
            "by_kind": {k: v.to_dict() for k, v in by_kind(records, window_s, slo).items()},
            "samples": {"ttft_s": [r.ttft for r in ok],
                        "itl_s": [float(x) for r in ok for x in r.itls],
                        "requests": [request_row(r) for r in ok]}}


def phase_points(result: PhasedResult, slo: Slo) -> list[dict]:
    """One point per phase (over its duration), then "all" (over the sum of durations)."""
    points = [_point(recs, p.duration_s, slo, p.name, p)
              for p, recs in zip(result.phases, result.records)]
    everything = [r for recs in result.records for r in recs]
    points.append(_point(everything, sum(p.duration_s for p in result.phases), slo, "all",
                         None))
    return points


def describe(phases: Sequence[PhaseSpec], base: WorkloadSpec) -> str:
    return "phases: " + "; ".join(p.describe(base) for p in phases)

