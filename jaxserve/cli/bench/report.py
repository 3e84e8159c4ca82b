"""Benchmark figures: per-request timings in, percentiles, throughput and goodput out.

Data flow: the load generator fills one `RequestRecord` per request (client-side clock:
`time.perf_counter` at send, at every streamed event that carries tokens, at the end) ->
`summarize(records, duration, slo)` -> a `Summary` (plain dict-able dataclass: JSON for
machines) -> `format_table` (text for people).

Definitions (the same as vLLM's `bench serve`, so figures compare):
- TTFT: send -> first event with a token.
- ITL: the gap between consecutive token-carrying events of one request (all requests' gaps
  pooled); a server that streams k tokens per event shows one gap per event.
- TPOT: (last token time - first token time) / (output tokens - 1), per request.
- E2E: send -> end of the stream.
- Goodput (`--goodput KEY:MS ...`, vLLM's flag and semantics): completed requests per second
  for which every given target holds: `ttft`, `tpot` (the request's own TPOT; 0 for a
  one-token output, as vLLM counts it), `e2el` (end-to-end latency), and jaxserve's `itl` (the
  request's own 99th-percentile gap: the stalls a user of that stream felt; vLLM has no ITL
  key). SLO attainment: the share of all sent requests (failed and cut-off ones count as
  misses) that met every target.
Throughput is over the measured window: first send to last completion (a phased run gives
each phase its scheduled window, `phases.py`).
- Speculative decoding (jaxserve gRPC targets only: the server's per-sample Timing counts):
  draft and accepted tokens over the completed requests; acceptance rate = accepted / draft.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Iterable, Sequence

import numpy as np

PERCENTILES = (50, 90, 95, 99)


@dataclasses.dataclass
class RequestRecord:
    """One request's client-side timeline; the target adapter fills it as events arrive."""

    kind: str = "default"
    start: float = 0.0
    end: float | None = None
    token_times: list[float] = dataclasses.field(default_factory=list)  # per token event
    prompt_tokens: int = 0
    output_tokens: int = 0  # from the server's usage when it reports one, else counted
    error: str | None = None
    spec_draft_tokens: int = 0  # speculative decoding, from a jaxserve server's Timing
    spec_accepted_tokens: int = 0

    def begin(self) -> None:
        self.start = time.perf_counter()

    def on_tokens(self, n: int) -> None:
        if n > 0:
            self.token_times.append(time.perf_counter())
            self.output_tokens += n

    def finish(self) -> None:
        self.end = time.perf_counter()

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None and bool(self.token_times)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.start

    @property
    def itls(self) -> np.ndarray:
        return np.diff(np.asarray(self.token_times))

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (self.output_tokens - 1)

    @property
    def e2e(self) -> float:
        assert self.end is not None
        return self.end - self.start


GOODPUT_KEYS = ("ttft", "tpot", "itl", "e2el")  # --goodput KEY:MS; fields KEY_s


@dataclasses.dataclass(frozen=True)
class Slo:
    """Per-request latency targets (seconds; None: no target)."""

    ttft_s: float | None = None
    itl_s: float | None = None  # the request's own p99 inter-token gap
    tpot_s: float | None = None
    e2el_s: float | None = None

    def __post_init__(self) -> None:
        for key in GOODPUT_KEYS:
            v = getattr(self, f"{key}_s")
            if v is not None and not (isinstance(v, (int, float)) and 0 < v < math.inf):
                raise ValueError(f"goodput {key} target {v!r} must be a positive number")

    @property
    def given(self) -> bool:
        return any(getattr(self, f"{k}_s") is not None for k in GOODPUT_KEYS)

    def met_by(self, r: RequestRecord) -> bool:
        """Every given target holds for this (completed) request."""
        return self.met(request_row(r))

    def met(self, row: Sequence[float | None]) -> bool:
        """The same for a `request_row` (a saved one: goodput re-judged without a rerun)."""
        ttft, itl_p99, tpot, e2e = row
        return not ((self.ttft_s is not None and ttft is not None and ttft > self.ttft_s)
                    or (self.itl_s is not None and itl_p99 is not None
                        and itl_p99 > self.itl_s)
                    or (self.tpot_s is not None and (tpot or 0.0) > self.tpot_s)
                    or (self.e2el_s is not None and e2e is not None and e2e > self.e2el_s))

    def describe(self) -> str:
        """`ttft:2000 itl:250` (ms), the --goodput form; '' without targets."""
        return " ".join(f"{k}:{getattr(self, f'{k}_s') * 1e3:g}" for k in GOODPUT_KEYS
                        if getattr(self, f"{k}_s") is not None)


def request_row(r: RequestRecord) -> list[float | None]:
    """What goodput needs of a completed request, in seconds: [TTFT, its own p99 gap (None
    without gaps), TPOT (None below 2 tokens), E2E]; kept per point as samples.requests."""
    gaps = r.itls
    return [r.ttft, float(np.percentile(gaps, 99)) if gaps.size else None, r.tpot, r.e2e]


def rejudge(summary: dict, rows: Sequence[Sequence[float | None]], slo: Slo) -> dict:
    """A saved summary's goodput and attainment under other targets, from its completed
    requests' rows (same rule and denominators as `summarize`)."""
    good = sum(slo.met(r) for r in rows)
    sent = summary["completed"] + summary["failed"] + summary["incomplete"]
    return dict(summary, goodput=good / max(summary["duration_s"], 1e-9) if slo.given else None,
                slo_attainment=good / sent if slo.given and sent else None,
                slo=dataclasses.asdict(slo))


def parse_goodput(items: Sequence[str] | None) -> Slo:
    """`--goodput ttft:2000 itl:250` (milliseconds, as vLLM's flag) -> Slo; errors name the
    flag and the bad item."""
    targets: dict[str, float] = {}
    for item in items or ():
        key, colon, value = item.strip().partition(":")
        key = key.strip().lower()
        if not colon or key not in GOODPUT_KEYS:
            raise ValueError(f"--goodput {item!r}: expected KEY:MILLISECONDS with KEY one of "
                             f"{', '.join(GOODPUT_KEYS)}")
        if f"{key}_s" in targets:
            raise ValueError(f"--goodput gives {key} twice")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of "
                             "milliseconds") from None
        if not 0 < ms < math.inf:
            raise ValueError(f"--goodput {item!r}: the target must be > 0 ms")
        targets[f"{key}_s"] = ms / 1e3
    return Slo(**targets)


@dataclasses.dataclass(frozen=True)
class Dist:
    """Milliseconds."""

    mean: float
    p50: float
    p90: float
    p95: float
    p99: float
    max: float
    count: int

    @staticmethod
    def of(values_s: Iterable[float]) -> "Dist":
        v = np.asarray(list(values_s), dtype=np.float64) * 1e3
        if v.size == 0:
            nan = math.nan
            return Dist(nan, nan, nan, nan, nan, nan, 0)
        p = np.percentile(v, PERCENTILES)
        return Dist(float(v.mean()), *(float(x) for x in p), float(v.max()), int(v.size))


@dataclasses.dataclass(frozen=True)
class Summary:
    completed: int
    failed: int
    incomplete: int  # cut off by the time bound
    duration_s: float
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_throughput: float  # (prompt + output) tokens / s
    prompt_tokens: int
    output_tokens: int
    ttft_ms: Dist
    itl_ms: Dist
    tpot_ms: Dist
    e2e_ms: Dist
    goodput: float | None  # requests / s meeting the SLO; None without an SLO
    slo: Slo
    errors: tuple[str, ...]  # the first few distinct error messages
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    # share of all sent requests (failed, cut off included) meeting the SLO; None without one
    slo_attainment: float | None = None

    @property
    def spec_acceptance_rate(self) -> float | None:
        return self.spec_accepted_tokens / self.spec_draft_tokens \
            if self.spec_draft_tokens else None

    def to_dict(self) -> dict:
        """JSON-ready: NaN (no samples) becomes None."""
        return _no_nan(dataclasses.asdict(self))


def _no_nan(x: object) -> object:
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: _no_nan(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_no_nan(v) for v in x]
    return x


def summarize(records: Sequence[RequestRecord], duration_s: float,
              slo: Slo = Slo()) -> Summary:
    ok = [r for r in records if r.ok]
    failed = [r for r in records if r.error is not None]
    incomplete = len(records) - len(ok) - len(failed)
    dur = max(duration_s, 1e-9)
    out_tok = sum(r.output_tokens for r in ok)
    in_tok = sum(r.prompt_tokens for r in ok)
    itls = np.concatenate([r.itls for r in ok]) if ok else np.zeros(0)
    tpots = [t for t in (r.tpot for r in ok) if t is not None]
    n_good = sum(slo.met_by(r) for r in ok) if slo.given else None
    good = None if n_good is None else n_good / dur
    attainment = n_good / len(records) if n_good is not None and records else None
    errors = tuple(dict.fromkeys(r.error for r in failed if r.error))[:5]
    return Summary(len(ok), len(failed), incomplete, duration_s, len(ok) / dur, out_tok / dur,
                   (in_tok + out_tok) / dur, in_tok, out_tok, Dist.of(r.ttft for r in ok),
                   Dist.of(itls.tolist()), Dist.of(tpots), Dist.of(r.e2e for r in ok), good,
                   slo, errors, sum(r.spec_draft_tokens for r in ok),
                   sum(r.spec_accepted_tokens for r in ok), attainment)


def by_kind(records: Sequence[RequestRecord], duration_s: float,
            slo: Slo = Slo()) -> dict[str, Summary]:
    kinds = sorted({r.kind for r in records})
    return {k: summarize([r for r in records if r.kind == k], duration_s, slo) for k in kinds}


def _fmt(x: float | None, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{digits}f}"


_HEAD = ("run", "ok", "fail", "req/s", "out tok/s", "tot tok/s", "goodput", "SLO met",
         "TTFT p50", "TTFT p90", "TTFT p99", "ITL p50", "ITL p90", "ITL p99", "TPOT p50", "TPOT p99",
         "E2E p50", "E2E p99")


def _cells(name: str, s: Summary) -> list[str]:
    return [name, str(s.completed), str(s.failed + s.incomplete),
            _fmt(s.request_throughput, 2), _fmt(s.output_throughput), _fmt(s.total_throughput),
            _fmt(s.goodput, 2),
            "-" if s.slo_attainment is None else f"{100 * s.slo_attainment:.0f}%",
            _fmt(s.ttft_ms.p50, 0), _fmt(s.ttft_ms.p90, 0),
            _fmt(s.ttft_ms.p99, 0), _fmt(s.itl_ms.p50, 0), _fmt(s.itl_ms.p90, 0),
            _fmt(s.itl_ms.p99, 0), _fmt(s.tpot_ms.p50, 0), _fmt(s.tpot_ms.p99, 0),
            _fmt(s.e2e_ms.p50, 0), _fmt(s.e2e_ms.p99, 0)]


def format_table(rows: Sequence[tuple[str, Summary]], title: str = "") -> str:
    """One line per run: throughput, goodput, then percentiles of each latency (ms)."""
    lines = [_cells(name, s) for name, s in rows]
    widths = [max([len(h)] + [len(r[i]) for r in lines]) for i, h in enumerate(_HEAD)]
    out = [title] if title else []
    out.append("  ".join(h.rjust(w) for h, w in zip(_HEAD, widths)))
    out += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in lines]
    slos = dict.fromkeys(s.slo.describe() for _, s in rows if s.slo.given)
    meaning = f"req/s meeting {' / '.join(slos)} (ms)" if slos else "no --goodput targets"
    out.append("(latencies in ms; fail = failed + cut off by the time bound; goodput: "
               f"{meaning}; SLO met: share of sent requests)")
    spec = [(name, s) for name, s in rows if s.spec_draft_tokens]
    out += [f"speculation, {name}: {s.spec_accepted_tokens} of {s.spec_draft_tokens} draft "
            f"tokens accepted ({100 * (s.spec_acceptance_rate or 0):.1f}%)" for name, s in spec]
    return "\n".join(out)
