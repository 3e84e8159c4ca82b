"""Phased workloads and goodput: the --phase parser, arrivals, per-phase figures, tune on a phase.

Oracles: hand-computed goodput / attainment for records with known timestamps (vLLM's rule: a
request counts when every given target holds); the phase spec itself (a closed loop never has
more than `concurrency` in flight, an open loop sends exactly the drawn arrivals, requests are
the same for the same seed). The end-to-end two-phase CLI run is in test_bench.py (its
module-scoped tiny server).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math

import numpy as np
import pytest

from jaxserve.cli.bench import tune as tune_mod
from jaxserve.cli.bench.load import LoadSpec
from jaxserve.cli.bench.phases import (PhasedResult, PhaseSpec, arrival_offsets, parse_phase,
                                       parse_phases, phase_points, run_phases)
from jaxserve.cli.bench.report import (RequestRecord, Slo, parse_goodput, rejudge, request_row,
                                       summarize)
from jaxserve.cli.bench.tune import TuneSpec, pick_best, repick, tune, verdict
from jaxserve.cli.bench.workload import BenchRequest, LengthDist, WorkloadSpec


# ----------------------------------------------------------------------------- parsing
def test_phase_parser_reads_every_key() -> None:
    p = parse_phase("name=chat,duration=180,rate=2,burstiness=0.5,input-len=uniform:64-256,"
                    "output-len=lognormal:96,0.4")
    assert p == PhaseSpec("chat", 180.0, rate=2.0, burstiness=0.5,
                          input_len=LengthDist("uniform", 64, 256),
                          output_len=LengthDist("lognormal", 96, 0.4))
    q = parse_phase(" duration=5 , concurrency=3 ,output_len=7", index=1)
    assert (q.name, q.concurrency, q.rate, q.input_len) == ("phase2", 3, None, None)
    assert q.output_len == LengthDist("fixed", 7)
    base = WorkloadSpec(input_len=LengthDist("fixed", 11))
    assert q.workload(base).input_len == LengthDist("fixed", 11)  # inherits --input-len
    assert q.workload(base).output_len == LengthDist("fixed", 7)
    assert p.load_label == "rate=2/s burstiness=0.5" and q.load_label == "concurrency=3"


@pytest.mark.parametrize("text, needle", [
    ("name=a,rate=1", "duration= (seconds) is required"),
    ("name=a,duration=5", "exactly one of rate="),
    ("name=a,duration=5,rate=1,concurrency=2", "exactly one of rate="),
    ("name=a,duration=5,rate=inf", "rate=inf must be a finite"),
    ("name=a,duration=0,rate=1", "duration=0.0 must be"),
    ("name=a,duration=5,concurrency=0", "concurrency=0 must be"),
    ("name=a,duration=5,concurrency=1.5", "concurrency='1.5' is not an integer"),
    ("name=a,duration=5,concurrency=2,burstiness=2", "burstiness= shapes open-loop"),
    ("name=a,duration=5,rate=1,burstiness=0", "burstiness=0.0 must be > 0"),
    ("name=a,duration=x,rate=1", "duration='x' is not a number"),
    ("name=a,duration=5,rate=1,speed=3", "unknown key 'speed'"),
    ("name=a,duration=5,rate=1,rate=2", "rate given twice"),
    ("name=a b,duration=5,rate=1", "name='a b' must be"),
    ("name=a,duration=5,rate=1,input-len=gauss:3", "input-len: length distribution"),
    ("name=a,duration=5,rate", "duration='5,rate' is not a number"),
    ("rate,duration=5", "'rate' is not KEY=VALUE"),
])
def test_phase_parser_names_the_bad_key(text: str, needle: str) -> None:
    with pytest.raises(ValueError, match="--phase") as e:
        parse_phase(text)
    assert needle in str(e.value)


def test_phase_names_must_be_distinct() -> None:
    with pytest.raises(ValueError, match="distinct"):
        parse_phases(["name=a,duration=1,rate=1", "name=a,duration=1,rate=2"])


def test_goodput_flag_parses_milliseconds_like_vllm() -> None:
    slo = parse_goodput(["ttft:2000", "TPOT:50", "itl:250", "e2el:9000"])
    assert slo == Slo(ttft_s=2.0, itl_s=0.25, tpot_s=0.05, e2el_s=9.0)
    assert slo.describe() == "ttft:2000 tpot:50 itl:250 e2el:9000"
    assert not parse_goodput(None).given
    for bad, needle in (["ttft"], "KEY:MILLISECONDS"), (["foo:3"], "KEY:MILLISECONDS"), \
            (["ttft:x"], "not a number"), (["ttft:0"], "> 0 ms"), \
            (["ttft:1", "ttft:2"], "ttft twice"):
        with pytest.raises(ValueError, match="--goodput") as e:
            parse_goodput(bad)
        assert needle in str(e.value)


# ----------------------------------------------------------------------------- figures
def _rec(start: float, times: list[float], end: float | None = None, kind: str = "x",
         error: str | None = None) -> RequestRecord:
    return RequestRecord(kind=kind, start=start, end=times[-1] if end is None and times
                         else end, token_times=times, output_tokens=len(times), error=error)


def test_goodput_counts_requests_meeting_every_target() -> None:
    recs = [_rec(0.0, [0.1, 0.2, 0.3, 0.4]),           # ttft .1, tpot .1, gaps .1
            _rec(0.0, [0.5, 0.55, 0.6]),               # ttft .5, tpot .05, gaps .05
            _rec(1.0, [1.1, 1.2, 2.0, 2.1]),           # ttft .1, tpot 1/3, p99 gap ~.8
            _rec(2.0, [2.05]),                         # one token: tpot 0 (vLLM), no gaps
            _rec(3.0, [], error="RESOURCE_EXHAUSTED"),  # failed: a miss
            _rec(3.0, [3.1])]                          # never ended: cut off, a miss
    recs[-1].end = None
    cases = {  # targets -> how many of the 4 completed requests count (hand-checked above)
        Slo(ttft_s=0.2): 3,                 # all but #2
        Slo(tpot_s=0.08): 2,                # #2 and #4
        Slo(itl_s=0.3): 3,                  # all but #3
        Slo(ttft_s=0.2, itl_s=0.3): 2,      # #1 and #4
        Slo(e2el_s=0.5): 2,                 # #1 (0.4 s) and #4 (0.05 s)
    }
    for slo, good in cases.items():
        s = summarize(recs, 4.0, slo)
        assert s.completed == 4 and s.failed == 1 and s.incomplete == 1
        assert math.isclose(s.goodput, good / 4.0), slo
        assert math.isclose(s.slo_attainment, good / 6), slo  # over all sent requests
    s = summarize(recs, 4.0)
    assert s.goodput is None and s.slo_attainment is None
    # re-judged from the saved per-request rows: the same as summarizing again
    rows = [request_row(r) for r in recs if r.ok]
    assert rows[3] == [pytest.approx(0.05), None, None, pytest.approx(0.05)]
    for slo in cases:
        again = rejudge(s.to_dict(), rows, slo)
        fresh = summarize(recs, 4.0, slo)
        assert math.isclose(again["goodput"], fresh.goodput)
        assert math.isclose(again["slo_attainment"], fresh.slo_attainment)


def test_phase_points_divide_by_each_phase_window() -> None:
    chat, long_ = PhaseSpec("chat", 10.0, rate=1.0), PhaseSpec("long", 5.0, concurrency=2)
    a = [_rec(0.0, [0.1, 0.2, 0.3], kind="chat"), _rec(1.0, [2.5, 2.6], kind="chat")]
    b = [_rec(10.0, [10.2, 10.3, 11.3], kind="long"), _rec(11.0, [11.3, 11.4], kind="long"),
         _rec(12.0, [], error="boom", kind="long")]
    slo = Slo(ttft_s=1.0, itl_s=0.5)
    points = phase_points(PhasedResult([chat, long_], [a, b], drain_s=0.0), slo)
    assert [p["label"] for p in points] == ["chat", "long", "all"]
    # chat: #2's TTFT 1.5 s misses -> 1 good over 10 s; long: #1's gap 1.0 misses, #2 good,
    # #3 failed -> 1 good over 5 s; whole run: 2 good over 15 s, 2 of 5 sent
    want = [(1 / 10, 1 / 2, 2), (1 / 5, 1 / 3, 2), (2 / 15, 2 / 5, 4)]
    for p, (goodput, attainment, completed) in zip(points, want):
        s = p["summary"]
        assert math.isclose(s["goodput"], goodput) and s["completed"] == completed
        assert math.isclose(s["slo_attainment"], attainment)
    assert math.isclose(points[0]["summary"]["output_throughput"], 5 / 10)
    assert points[1]["window_s"] == 5.0 and points[2]["window_s"] == 15.0
    assert points[1]["phase"]["concurrency"] == 2 and points[2]["phase"] is None
    assert json.dumps(points)
    # a phase that sent nothing: no goodput to speak of, no attainment
    empty = phase_points(PhasedResult([chat], [[]], drain_s=0.0), slo)[0]["summary"]
    assert empty["goodput"] == 0.0 and empty["slo_attainment"] is None


def test_arrivals_are_seeded_inside_the_window_at_the_rate() -> None:
    p = PhaseSpec("a", 200.0, rate=5.0)
    x = arrival_offsets(p, seed=3)
    assert np.array_equal(x, arrival_offsets(p, seed=3))
    assert not np.array_equal(x, arrival_offsets(p, seed=4))
    # seeded by the phase's name, not its place: a phase alone sends what it sends in a run
    assert not np.array_equal(x, arrival_offsets(dataclasses.replace(p, name="b"), seed=3))
    assert x.min() > 0 and x.max() < 200 and np.all(np.diff(x) > 0)
    assert abs(len(x) - 1000) < 5 * math.sqrt(1000)  # Poisson count: mean 1000
    gaps = np.diff(x)
    bursty = np.diff(arrival_offsets(dataclasses.replace(p, burstiness=0.25), 3))
    # gamma(shape k): coefficient of variation 1/sqrt(k): 1 (Poisson) vs 2
    assert 0.9 < gaps.std() / gaps.mean() < 1.1 and 1.7 < bursty.std() / bursty.mean() < 2.3


# ----------------------------------------------------------------------------- running
class InstantTarget:
    """Fake target: answers every request at once (one event per token), counts what was
    sent per phase and how many were in flight; prepare may come any time."""

    name, endpoint, model, vocab_size, max_model_len = "fake", "fake", "fake", 5000, None

    def __init__(self) -> None:
        self.sent: list[BenchRequest] = []
        self.prepared = 0
        self.in_flight = self.max_in_flight = 0

    async def prepare(self, reqs: list[BenchRequest]) -> None:
        self.prepared += len(reqs)

    async def send(self, req: BenchRequest, rec: RequestRecord) -> None:
        self.sent.append(req)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        rec.begin()
        for _ in range(req.max_tokens):
            await asyncio.sleep(0)
            rec.on_tokens(1)
        rec.finish()
        self.in_flight -= 1


def test_phases_run_back_to_back_with_their_own_shapes() -> None:
    wl = WorkloadSpec(input_len=LengthDist("fixed", 5), output_len=LengthDist("fixed", 2),
                      vocab_size=5000)
    phases = [PhaseSpec("closed", 0.3, concurrency=2, input_len=LengthDist("fixed", 7)),
              PhaseSpec("open", 0.3, rate=40.0, output_len=LengthDist("fixed", 3))]
    t = InstantTarget()
    res = asyncio.run(run_phases(t, wl, phases, seed=1, warmup=2, progress=False))
    closed, open_ = res.records
    warm = t.sent[:2]
    assert all(r.kind == "warmup" and len(r.prompt) == 7 for r in warm)
    assert t.max_in_flight <= 2 + 1  # the closed loop's 2, maybe one open arrival beside
    assert len(closed) > 2 and all(r.ok and r.output_tokens == 2 for r in closed)
    assert [r.kind for r in closed] == ["closed"] * len(closed)
    # the open phase sends exactly its drawn arrivals, each with the phase's lengths
    assert len(open_) == len(arrival_offsets(phases[1], 1)) > 0
    assert all(r.ok and r.output_tokens == 3 and r.kind == "open" for r in open_)
    assert min(r.start for r in open_) >= max(r.start for r in closed) - 1e-3
    sent = [r for r in t.sent if r.kind == "open"]
    assert all(len(r.prompt) == 5 for r in sent)  # inherits the workload's input length
    again = InstantTarget()
    asyncio.run(run_phases(again, wl, phases, seed=1, warmup=2, progress=False))
    assert [r for r in again.sent if r.kind == "open"] == sent  # seeded
    alone = InstantTarget()  # the open phase alone (what tune --phase runs): the same requests
    asyncio.run(run_phases(alone, wl, phases[1:], seed=1, warmup=0, progress=False))
    assert alone.sent == sent
    assert not set(warm) & set(t.sent[2:])  # warmup prompts are never measured ones
    with pytest.raises(ValueError, match="--max-duration"):
        asyncio.run(run_phases(t, wl, phases, max_duration_s=0.5, progress=False))


def test_tune_runs_the_phase_at_every_point_and_ranks_by_goodput(monkeypatch) -> None:  # noqa: ANN001
    """tune's phase path with the server swapped for the instant fake: every grid point runs
    the phase; with only --goodput the best is the most goodput, and the verdict says so."""
    import contextlib

    @contextlib.asynccontextmanager
    async def fake_server(cfg, model):  # noqa: ANN001, ANN202
        yield f"cfg-{cfg.max_num_batched_tokens}"

    class Target(InstantTarget):
        def __init__(self, address: str):
            super().__init__()

        async def open(self) -> None: ...

        async def close(self) -> None: ...

    monkeypatch.setattr(tune_mod, "local_server", fake_server)
    monkeypatch.setattr(tune_mod, "GrpcTarget", Target)
    monkeypatch.setattr(tune_mod, "model_name", lambda base, model: "fake")
    from jaxserve.config import EngineConfig

    phase = parse_phase("name=long,duration=0.2,rate=30,output-len=2")
    spec = TuneSpec(None, None, batched_tokens=(16, 32), max_seqs=(4,), goodput=Slo(ttft_s=60),
                    phase=phase)
    doc = asyncio.run(tune(EngineConfig(), None, WorkloadSpec(), LoadSpec(rate=30, warmup=0),
                           spec, progress=True))
    n = len(arrival_offsets(phase, 0))
    assert [r["summary"]["completed"] for r in doc["rows"]] == [n, n]
    assert doc["phase"]["name"] == "long" and doc["goodput"] == "ttft:60000"
    assert doc["best"] is not None and "goodput" in verdict(doc)
    # the ranking: most goodput first, tokens/s breaks ties
    rows = [{"meets_slo": True, "summary": {"goodput": g, "output_throughput": t}}
            for g, t in ((1.0, 50.0), (2.0, 10.0), (2.0, 20.0), (0.0, 99.0))]
    assert pick_best(rows, spec) is rows[2]
    assert pick_best(rows[3:], spec) is None  # nothing met the goodput targets
    p99 = TuneSpec(1.0, 1.0)
    assert pick_best(rows, p99) is rows[3]  # without goodput: the most tokens/s
    # other goodput targets re-judged from the rows' per-request samples, no rerun
    strict = repick(doc, dataclasses.replace(spec, goodput=Slo(ttft_s=1e-9)))
    assert strict["best"] is None and strict["goodput"] == "ttft:1e-06"
    assert all(r["summary"]["goodput"] == 0 for r in strict["rows"])
    assert repick(strict, spec)["best"] is not None
    old = dict(doc, rows=[{k: v for k, v in r.items() if k != "requests"} for r in doc["rows"]])
    with pytest.raises(ValueError, match="rerun"):
        repick(old, spec)
    for bad in (dict(ttft_p99_s=1.0, itl_p99_s=None), dict(ttft_p99_s=None, itl_p99_s=None)):
        with pytest.raises(ValueError, match="--ttft-p99"):
            TuneSpec(**bad)


def test_goodput_flags_combine_and_refuse_a_target_given_twice() -> None:
    import argparse

    from jaxserve.cli.bench.workload_flags import goodput_slo

    def ns(goodput: list[str] | None, ttft: float | None, itl: float | None) -> object:
        return argparse.Namespace(goodput=goodput, ttft_slo=ttft, itl_slo=itl)

    assert goodput_slo(ns(["tpot:50"], 3.0, 0.25)) == Slo(ttft_s=3.0, itl_s=0.25, tpot_s=0.05)
    assert goodput_slo(ns(None, None, None)) == Slo()
    with pytest.raises(ValueError, match="--itl-slo and --goodput itl"):
        goodput_slo(ns(["itl:200"], None, 0.3))
    with pytest.raises(ValueError, match="--ttft-slo -1.0 must be"):
        goodput_slo(ns(None, -1.0, None))


def test_slo_scheduling_gives_the_in_process_engine_the_goodput_targets() -> None:
    from jaxserve.cli.bench.cli import _engine_config
    from jaxserve.cli.main import build_parser

    parse = build_parser().parse_args
    cfg = _engine_config(parse(["bench", "--slo-scheduling", "--goodput", "ttft:1500",
                                "itl:150", "tpot:40"]))
    assert (str(cfg.ttft_slo), str(cfg.itl_slo)) == ("1.5", "0.15")
    cfg = _engine_config(parse(["bench", "--slo-scheduling", "--itl-slo", "0.2"]))
    assert cfg.ttft_slo is None and str(cfg.itl_slo) == "0.2"
    assert _engine_config(parse(["bench", "--goodput", "ttft:1500"])).ttft_slo is None
    with pytest.raises(ValueError, match="--slo-scheduling needs"):
        _engine_config(parse(["bench", "--slo-scheduling", "--goodput", "tpot:40"]))
