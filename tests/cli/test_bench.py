"""The benchmark tools: workloads, figures, load shapes, and short end-to-end runs on a tiny model.

Oracles: hand-computed percentiles / throughput / goodput for records with known timestamps; a
fake target that counts what it was sent and how many were in flight; the workload spec itself
(lengths asked for = tokens the server reports); the tune verdict recomputed from its rows.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import re

import numpy as np
import pytest
from support.engine_fixtures import tiny_model

from jaxserve.cli.bench import plots
from jaxserve.cli.bench.launch import local_server
from jaxserve.cli.bench.load import LoadSpec, run_load
from jaxserve.cli.bench.report import RequestRecord, Slo, summarize
from jaxserve.cli.bench.scenario import ChunkedPrefillSpec, run_chunked_prefill, table
from jaxserve.cli.bench.sweep import run_sweep, table_of, write_outputs
from jaxserve.cli.bench.targets import (DEFAULT_SYSTEM_PROMPT, GrpcTarget, OpenAIChatTarget,
                                        OpenAITarget, chat_delta_carries_tokens, open_target)
from jaxserve.cli.bench.tune import TuneSpec, meets, tune, verdict
from jaxserve.cli.bench.workload import (TOKEN_LOW, BenchRequest, LengthDist, WorkloadSpec,
                                         build_requests, parse_length_dist)
from jaxserve.config import EngineConfig

# Two token buckets: each costs several compiles at warmup (forward, sampler variants, prompt
# logprobs pass), most of these end-to-end tests' time; the tune grid's budgets (8, 32) fit.
FEW_BUCKETS = (8, 32)
TINY = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, page_size=8, max_model_len=256,
                    attention_impl="reference", token_buckets=FEW_BUCKETS)


# ----------------------------------------------------------------------------- workloads
def test_length_distributions_parse_and_sample() -> None:
    rng = np.random.default_rng(0)
    assert parse_length_dist("64") == LengthDist("fixed", 64)
    assert (parse_length_dist("fixed:7").sample(rng, 5) == 7).all()
    u = parse_length_dist("uniform:10-20").sample(rng, 2000)
    assert u.min() >= 10 and u.max() <= 20 and len(set(u.tolist())) == 11
    ln = parse_length_dist("lognormal:200,0.5").sample(rng, 4000)
    assert 180 < np.median(ln) < 220 and ln.max() <= 1600 and ln.min() >= 1
    for bad in ("uniform:20-10", "gauss:3", "lognormal:1", "", "fixed:0"):
        with pytest.raises(ValueError):
            parse_length_dist(bad)


def test_workloads_are_deterministic_and_shaped() -> None:
    spec = WorkloadSpec(input_len=LengthDist("uniform", 5, 9), output_len=LengthDist("fixed", 3),
                        vocab_size=5000)
    a, b = build_requests(spec, 50, seed=1), build_requests(spec, 50, seed=1)
    assert a == b and a != build_requests(spec, 50, seed=2)
    assert all(5 <= r.prompt_len <= 9 and r.max_tokens == 3 for r in a)
    assert all(TOKEN_LOW <= t < 5000 for r in a for t in r.prompt)

    tail = WorkloadSpec("longtail", input_len=LengthDist("fixed", 8),
                        long_input_len=LengthDist("fixed", 100), long_fraction=0.2,
                        vocab_size=5000)
    reqs = build_requests(tail, 1000, seed=0)
    longs = [r for r in reqs if r.kind == "long"]
    assert 150 < len(longs) < 250 and all(r.prompt_len == 100 for r in longs)
    assert all(r.prompt_len == 8 for r in reqs if r.kind == "chat")

    shared = WorkloadSpec("shared-prefix", input_len=LengthDist("fixed", 4), prefix_len=30,
                          vocab_size=5000)
    reqs = build_requests(shared, 5, seed=0)
    assert len({r.prompt[:30] for r in reqs}) == 1 and len({r.prompt[30:] for r in reqs}) == 5
    assert {r.system_len for r in reqs} == {30} and {r.system_len for r in a} == {0}

    clipped = dataclasses.replace(spec, input_len=LengthDist("fixed", 500), max_prompt_len=40)
    assert all(r.prompt_len == 37 for r in build_requests(clipped, 3))  # 40 - 3 new tokens


def test_jsonl_workload(tmp_path) -> None:  # noqa: ANN001
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hello there", "max_tokens": 5}\n\n{"prompt": [1200, 1300]}\n')
    reqs = build_requests(WorkloadSpec("jsonl", dataset=str(f),
                                       output_len=LengthDist("fixed", 9)), 3)
    assert [r.prompt for r in reqs] == ["hello there", (1200, 1300), "hello there"]
    assert [r.max_tokens for r in reqs] == [5, 9, 5]
    f.write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match="p.jsonl:1"):
        build_requests(WorkloadSpec("jsonl", dataset=str(f)), 1)


# ----------------------------------------------------------------------------- figures
def _record(start: float, times: list[float], end: float, kind: str = "default",
            prompt: int = 10) -> RequestRecord:
    return RequestRecord(kind=kind, start=start, end=end, token_times=times,
                         prompt_tokens=prompt, output_tokens=len(times))


def test_summarize_matches_hand_computed_figures() -> None:
    recs = [_record(0.0, [0.5, 0.6, 0.7, 0.8], 0.8),      # ttft 0.5, gaps 0.1 x3
            _record(1.0, [1.2, 1.5, 2.5], 2.6),           # ttft 0.2, gaps 0.3, 1.0
            RequestRecord(error="UNAVAILABLE: nope"),
            RequestRecord(start=3.0)]                      # cut off: incomplete
    s = summarize(recs, duration_s=4.0, slo=Slo(ttft_s=0.4, itl_s=0.5))
    assert (s.completed, s.failed, s.incomplete) == (2, 1, 1)
    assert s.output_tokens == 7 and s.prompt_tokens == 20
    assert math.isclose(s.output_throughput, 7 / 4) and math.isclose(s.request_throughput, 0.5)
    assert math.isclose(s.total_throughput, 27 / 4)
    assert math.isclose(s.ttft_ms.mean, 350) and math.isclose(s.ttft_ms.max, 500)
    gaps = np.array([0.1, 0.1, 0.1, 0.3, 1.0]) * 1e3
    assert math.isclose(s.itl_ms.p50, np.percentile(gaps, 50))
    assert math.isclose(s.itl_ms.p99, np.percentile(gaps, 99))
    assert math.isclose(s.tpot_ms.p50, np.percentile([100.0, 650.0], 50))
    assert math.isclose(s.e2e_ms.max, 1600)
    # request 1: TTFT 0.5 > 0.4 fails; request 2: TTFT ok but its p99 gap ~1.0 > 0.5 fails
    assert s.goodput == 0.0
    assert summarize(recs, 4.0, Slo(ttft_s=0.6)).goodput == 0.5
    assert summarize(recs, 4.0).goodput is None and s.errors == ("UNAVAILABLE: nope",)
    d = summarize([], 1.0).to_dict()
    assert d["ttft_ms"]["p99"] is None and json.dumps(d)


# ----------------------------------------------------------------------------- load shapes
class CountingTarget:
    """Fake target: one token event per max_tokens, after yielding to the loop; counts
    concurrency. `hold` (an Event) keeps every request open until set."""

    name, endpoint, model, vocab_size, max_model_len = "fake", "fake", "fake", None, None

    def __init__(self, hold: asyncio.Event | None = None):
        self.prepared: list[BenchRequest] = []
        self.sent: list[BenchRequest] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.hold = hold

    async def open(self) -> None: ...

    async def close(self) -> None: ...

    async def prepare(self, reqs: list[BenchRequest]) -> None:
        assert not self.sent, "prepare comes before the first request"
        self.prepared += reqs

    async def send(self, req: BenchRequest, rec: RequestRecord) -> None:
        self.sent.append(req)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        rec.begin()
        try:
            if self.hold is not None:
                await self.hold.wait()
            for _ in range(req.max_tokens):
                await asyncio.sleep(0)
                rec.on_tokens(1)
            rec.prompt_tokens = req.prompt_len or 0
            rec.finish()
        finally:
            self.in_flight -= 1


def _reqs(n: int) -> list[BenchRequest]:
    return [BenchRequest(tuple(range(1000, 1000 + i + 1)), 3) for i in range(n)]


def test_closed_loop_keeps_concurrency_and_skips_warmup() -> None:
    t = CountingTarget()
    res = asyncio.run(run_load(t, _reqs(20), LoadSpec(concurrency=3, warmup=2), False))
    assert len(t.sent) == 20 and t.max_in_flight == 3 and t.prepared == _reqs(20)
    assert len(res.records) == 18 and all(r.ok and r.output_tokens == 3 for r in res.records)
    assert sorted(r.prompt_tokens for r in res.records) == list(range(3, 21))


def test_open_loop_all_at_once_and_time_bound() -> None:
    t = CountingTarget()
    asyncio.run(run_load(t, _reqs(12), LoadSpec(rate=math.inf, warmup=0), False))
    assert t.max_in_flight == 12

    async def bounded():  # noqa: ANN202 - never-finishing requests, cut off by the bound
        return await run_load(CountingTarget(asyncio.Event()), _reqs(5),
                              LoadSpec(concurrency=2, warmup=0, max_duration_s=0.2), False)

    res = asyncio.run(bounded())
    s = summarize(res.records, res.duration_s)
    assert (s.completed, s.failed, s.incomplete) == (0, 0, 2)
    for bad in (dict(), dict(concurrency=1, rate=1.0), dict(concurrency=0), dict(rate=-1)):
        with pytest.raises(ValueError):
            LoadSpec(**bad)


def test_open_target_parses_urls() -> None:
    assert isinstance(open_target("grpc://h:1"), GrpcTarget)
    assert isinstance(open_target("h:1"), GrpcTarget)
    t = open_target("http://h:8000/v1")
    assert isinstance(t, OpenAITarget) and t.base_url == "http://h:8000"
    assert (t.endpoint, t.path) == ("completions", "/v1/completions")
    chat = open_target("http://h:8000", endpoint="chat")
    assert isinstance(chat, OpenAIChatTarget) and chat.path == "/v1/chat/completions"
    with pytest.raises(ValueError, match="target"):
        open_target("nohost")
    with pytest.raises(ValueError, match="http"):
        open_target("grpc://h:1", endpoint="chat")
    with pytest.raises(ValueError, match="endpoint"):
        open_target("http://h:1", endpoint="embeddings")


def test_chat_token_events() -> None:
    """Which chat.completion.chunk choices are token events: OpenAI's and jaxserve's own
    shapes, and a server that repeats the role in every delta."""
    role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
    assert not chat_delta_carries_tokens(role)
    assert not chat_delta_carries_tokens({"delta": {"role": "assistant", "content": None}})
    assert not chat_delta_carries_tokens({"delta": {"role": "assistant"}})
    assert chat_delta_carries_tokens({"index": 0, "delta": {"content": "w5"}})
    # jaxserve: a token whose text is still an incomplete multi-byte character
    assert chat_delta_carries_tokens({"index": 0, "delta": {"content": ""}})
    assert chat_delta_carries_tokens({"delta": {"role": "assistant", "content": "hi"}})
    assert chat_delta_carries_tokens({"delta": {"reasoning_content": "hmm"}})
    assert not chat_delta_carries_tokens({"index": 0, "delta": {}, "finish_reason": "stop"})
    assert not chat_delta_carries_tokens({"index": 0, "finish_reason": "length"})


# ----------------------------------------------------------------------------- end to end
def test_sweep_against_a_real_server_writes_json_and_plots(tmp_path) -> None:  # noqa: ANN001
    wl = WorkloadSpec(input_len=LengthDist("uniform", 3, 40), output_len=LengthDist("fixed", 5))

    async def main() -> dict:
        async with local_server(TINY, tiny_model()) as address:
            target = GrpcTarget(address)
            await target.open()
            try:
                return await run_sweep(target, wl, [LoadSpec(concurrency=1, warmup=1),
                                                    LoadSpec(rate=math.inf, warmup=1)],
                                       num_requests=6, slo=Slo(ttft_s=60, itl_s=60),
                                       progress=False)
            finally:
                await target.close()

    doc = asyncio.run(main())
    fitted = dataclasses.replace(wl, vocab_size=211, max_prompt_len=256)
    for i, point in enumerate(doc["points"]):
        expected = build_requests(fitted, 7, seed=i)[1:]  # point i draws with seed + i
        s = point["summary"]
        assert (s["completed"], s["failed"], s["incomplete"]) == (6, 0, 0)
        assert s["output_tokens"] == 30 and s["goodput"] == s["request_throughput"]
        # the server's own prompt-token count equals what the workload drew
        assert s["prompt_tokens"] == sum(r.prompt_len for r in expected)
        assert len(point["samples"]["ttft_s"]) == 6
        # one gap per streamed event after each first; the server may coalesce tokens that
        # were already queued into one message, never split them
        assert 6 <= len(point["samples"]["itl_s"]) <= 24
    written = write_outputs(doc, str(tmp_path / "r.json"), str(tmp_path / "p"))
    assert len(written) == 3 and all((tmp_path / n).stat().st_size > 1000
                                     for n in ("r.json", "p_sweep.png", "p_cdf.png"))
    reread = json.loads((tmp_path / "r.json").read_text())
    assert "concurrency=1" in table_of(reread) and "rate=inf/s" in table_of(reread)


@pytest.mark.slow(reason="a tuning sweep of real engines: test_cli_tune_end_to_end runs "
                  "the tuner in the default tier")
def test_tune_picks_the_fastest_setting_that_meets_the_slo(tmp_path) -> None:  # noqa: ANN001
    wl = WorkloadSpec(input_len=LengthDist("uniform", 3, 30), output_len=LengthDist("fixed", 4))
    spec = TuneSpec(ttft_p99_s=120, itl_p99_s=120, batched_tokens=(8, 32), max_seqs=(4, 16),
                    num_requests=6)
    doc = asyncio.run(tune(TINY, tiny_model(), wl, LoadSpec(concurrency=4, warmup=1), spec,
                           progress=False))
    rows = doc["rows"]
    # (8, 16) cannot decode 16 sequences in an 8-token step: not in the grid.
    assert [(r["max_num_batched_tokens"], r["max_num_seqs"]) for r in rows] == \
        [(8, 4), (32, 4), (32, 16)]
    assert all(r["status"] == "ok" and r["meets_slo"] for r in rows)
    best = max(rows, key=lambda r: r["summary"]["output_throughput"])
    assert doc["best"] == best and "--max-num-batched-tokens" in verdict(doc)
    assert plots.plot_grid(rows, tmp_path / "g.png", 120, 120)[0].stat().st_size > 1000

    strict = dataclasses.replace(spec, ttft_p99_s=1e-6, batched_tokens=(32,), max_seqs=(4,))
    doc = asyncio.run(tune(TINY, tiny_model(), wl, LoadSpec(concurrency=4, warmup=1), strict,
                           progress=False))
    assert doc["best"] is None and not meets(doc["rows"][0]["summary"], strict)
    assert verdict(doc).startswith("no setting met")
    out = dataclasses.replace(spec, max_time_s=1e-9)
    doc = asyncio.run(tune(TINY, tiny_model(), wl, LoadSpec(concurrency=4, warmup=1), out,
                           progress=False))
    assert all(r["status"].startswith("not run") for r in doc["rows"]) and doc["best"] is None


def test_chunked_prefill_scenario_runs_both_budgets() -> None:
    spec = ChunkedPrefillSpec(long_len=150, num_long=2, long_out=3, lead_s=0.3,
                              long_interval_s=0.3, tail_s=0.2, chat_concurrency=2, chat_out=4,
                              small_budget=16)
    assert spec.budgets == (16, 256)
    # Both budgets' engines compile the same two buckets (16 and 256), which fit either budget.
    base = dataclasses.replace(TINY, max_num_batched_tokens=16, max_model_len=None,
                               token_buckets=spec.budgets)
    doc = asyncio.run(run_chunked_prefill(base, tiny_model(), spec, progress=False))
    assert [p["label"] for p in doc["points"]] == ["budget=16 (chunked)",
                                                   "budget=256 (whole prompt)"]
    for p in doc["points"]:
        assert p["by_kind"]["long"]["completed"] == 2
        assert p["by_kind"]["long"]["prompt_tokens"] == 300
        assert p["by_kind"]["chat"]["completed"] >= 2 and p["summary"]["failed"] == 0
    assert "chat ITL p99" in table(doc["points"])
    with pytest.raises(ValueError, match="small_budget"):
        ChunkedPrefillSpec(long_len=100, small_budget=100)


# ----------------------------------------------------------------------------- command line
@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> str:  # noqa: ANN001
    from support.engine_fixtures import VOCAB
    from support.hf_models import save_tiny_tokenizer

    from jaxserve.models.hf_loader import save_hf_dir

    d = tmp_path_factory.mktemp("tiny-hf")
    model = tiny_model()
    save_hf_dir(d, model.config, model.params)
    save_tiny_tokenizer(d, VOCAB)
    return str(d)


FAULT = 7  # the served engine fails a prompt that starts with this id: an SSE error event


@pytest.fixture(scope="module")
def served():  # noqa: ANN201 - a BackgroundServer
    """One tiny-model server, gRPC and HTTP on free loopback ports, for the tests below."""
    from support.engine_fixtures import tiny_engine

    from jaxserve.server.background import BackgroundServer
    from jaxserve.server.config import ServerConfig
    from jaxserve.serving.served import ServedModel

    srv = BackgroundServer(ServerConfig(port=0, http_port=0), lambda: ServedModel(
        tiny_engine(max_num_seqs=4, max_num_batched_tokens=32, token_buckets=FEW_BUCKETS,
                    fault_injection_token=FAULT),
        "tiny", "hf")).start()
    yield srv
    srv.stop()


ENGINE_FLAGS = ["--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--page-size", "8",
                "--max-model-len", "128", "--attention-impl", "reference",
                "--token-buckets", ",".join(map(str, FEW_BUCKETS))]


def test_cli_bench_against_a_server_then_compare(tmp_path, served, capsys) -> None:  # noqa: ANN001
    from jaxserve.cli.main import main

    rc = main(["bench", "--target", f"grpc://{served.target}", "--name", "tiny",
               "--concurrency", "1,2", "--num-requests", "3,4", "--input-len", "fixed:9",
               "--output-len", "fixed:3", "--output-json", str(tmp_path / "a.json")])
    assert rc == 0
    out = capsys.readouterr().out
    assert "concurrency=1" in out and "concurrency=2" in out and "endpoint=generate" in out
    doc = json.loads((tmp_path / "a.json").read_text())
    assert doc["endpoint"] == "generate"
    assert [p["summary"]["completed"] for p in doc["points"]] == [3, 4]
    assert doc["points"][1]["summary"]["prompt_tokens"] == 36

    rc = main(["bench", "--compare", str(tmp_path / "a.json"), str(tmp_path / "a.json"),
               "--plot-prefix", str(tmp_path / "cmp")])
    assert rc == 0 and (tmp_path / "cmp_sweep.png").exists()
    assert main(["bench", "--target", "grpc://127.0.0.1:1", "--concurrency", "1",
                 "--num-requests", "1,2"]) == 2  # 2 counts for 1 point: a usage error
    assert main(["bench", "--target", "grpc://127.0.0.1:1", "--concurrency", "1"]) == 2
    assert "GetModelInfo failed: UNAVAILABLE" in capsys.readouterr().err


def test_cli_two_phase_bench_against_a_server(tmp_path, served, capsys) -> None:  # noqa: ANN001
    """A phased run through the whole CLI (test_bench_phases.py tests its parts): goodput per
    phase and overall in the table and the JSON; flags a phased run has no use for refused."""
    from jaxserve.cli.main import main

    target = f"grpc://{served.target}"
    rc = main(["bench", "--target", target, "--goodput", "ttft:60000", "itl:60000",
               "--phase", "name=chat,duration=0.4,concurrency=2,input-len=fixed:6,"
               "output-len=fixed:3",
               "--phase", "name=long,duration=0.4,rate=10,input-len=fixed:40,output-len=fixed:2",
               "--output-json", str(tmp_path / "p.json")])
    assert rc == 0
    out = capsys.readouterr().out
    assert re.search(r"^\s*chat\s", out, re.M) and re.search(r"^\s*all\s", out, re.M)
    assert "ttft:60000 itl:60000" in out
    doc = json.loads((tmp_path / "p.json").read_text())
    assert [p["label"] for p in doc["points"]] == ["chat", "long", "all"]
    chat, long_, total = (p["summary"] for p in doc["points"])
    assert chat["completed"] > 0 and chat["prompt_tokens"] == 6 * chat["completed"]
    assert long_["prompt_tokens"] == 40 * long_["completed"]
    assert total["completed"] == chat["completed"] + long_["completed"]
    assert total["slo_attainment"] == 1.0
    assert math.isclose(total["goodput"], total["completed"] / 0.8)
    for extra, flag in ((["--concurrency", "2"], "--concurrency"),
                        (["--num-requests", "4"], "--num-requests"),
                        (["--scenario", "chunked-prefill"], "--scenario")):
        assert main(["bench", "--target", target, "--phase", "name=a,duration=1,rate=1",
                     *extra]) == 2
        assert flag in capsys.readouterr().err


def test_cli_tune_end_to_end(tmp_path, tiny_checkpoint, capsys) -> None:  # noqa: ANN001
    from jaxserve.cli.main import main

    rc = main(["tune", "--model", tiny_checkpoint, *ENGINE_FLAGS, "--ttft-p99", "100",
               "--itl-p99", "100", "--grid-batched-tokens", "16,32", "--grid-max-seqs", "4",
               "--concurrency", "4", "--num-requests", "4", "--input-len", "uniform:4-20",
               "--output-len", "fixed:3", "--output-json", str(tmp_path / "t.json"),
               "--plot-prefix", str(tmp_path / "t")])
    assert rc == 0
    out = capsys.readouterr().out
    doc = json.loads((tmp_path / "t.json").read_text())
    assert len(doc["rows"]) == 2 and doc["best"] is not None
    assert f"--max-num-batched-tokens {doc['best']['max_num_batched_tokens']}" in out
    assert (tmp_path / "t_grid.png").exists()
    # the saved grid judged against an impossible target: no rerun, no setting
    rc = main(["tune", "--ttft-p99", "1e-9", "--itl-p99", "1", "--from-json",
               str(tmp_path / "t.json")])
    assert rc == 0 and "no setting met" in capsys.readouterr().out


def test_openai_http_target_against_jaxserve_http_front(served) -> None:  # noqa: ANN001
    """The same client over OpenAI HTTP: jaxserve's own front, so usage can be checked."""
    url = f"http://127.0.0.1:{served.server.http_port}"

    async def one(req: BenchRequest) -> RequestRecord:
        t = OpenAITarget(url)
        await t.open()
        rec = RequestRecord()
        await t.send(req, rec)
        await t.close()
        return rec

    # An OpenAI server does not say its vocabulary: the user gives it (--vocab-size).
    wl = WorkloadSpec(input_len=LengthDist("uniform", 3, 20), output_len=LengthDist("fixed", 4),
                      vocab_size=211)
    target = OpenAITarget(f"{url}/v1")

    async def main() -> dict:
        await target.open()
        try:
            return await run_sweep(target, wl, [LoadSpec(concurrency=3, warmup=1)], 5,
                                   progress=False)
        finally:
            await target.close()

    doc = asyncio.run(main())
    rec = asyncio.run(one(BenchRequest((5000,), 2)))  # ids beyond the vocabulary: a 400
    assert rec.error is not None and rec.error.startswith("HTTP 400") and not rec.ok
    rec = asyncio.run(one(BenchRequest((FAULT, 60, 70), 3)))  # fails in the engine
    assert rec.error is not None and rec.error.startswith("error event") and not rec.ok
    assert target.model == "tiny" and doc["endpoint"] == "completions"
    s = doc["points"][0]["summary"]
    assert (s["completed"], s["failed"]) == (5, 0) and s["output_tokens"] == 20
    assert s["prompt_tokens"] == sum(r.prompt_len for r in build_requests(wl, 6)[1:])
    # One ITL per SSE event after a request's first: at most one event per token (15 gaps for 5
    # requests of 4 tokens), fewer when the handler fell behind and got coalesced deltas.
    assert 1 <= len(doc["points"][0]["samples"]["itl_s"]) <= 15


def _chat_prompt_tokens(system: str, user: str) -> int:
    """Oracle: the tiny tokenizer's template rendered by hand ("role: content" lines, then
    "assistant:"), split as its Whitespace pre-tokenizer splits (each word or punctuation
    run one token: "w5" is in the vocabulary, the rest are <unk>)."""
    rendered = f"system: {system}\nuser: {user}\nassistant:"
    return len(re.findall(r"\w+|[^\w\s]+", rendered))


def _words(ids: tuple[int, ...]) -> str:
    """Oracle: the tiny word-level vocabulary spells id i as "w{i}"."""
    return " ".join(f"w{i}" for i in ids)


def test_chat_endpoint_against_jaxserve_front(tmp_path, served, capsys) -> None:  # noqa: ANN001
    """`--endpoint chat`: message lists to /v1/chat/completions, usage exact (the prompt as
    the template renders the system + user messages, every requested token)."""
    from jaxserve.cli.main import main

    url = f"http://127.0.0.1:{served.server.http_port}"
    wl = WorkloadSpec(input_len=LengthDist("uniform", 3, 20), output_len=LengthDist("fixed", 4),
                      vocab_size=211)
    target = open_target(url, endpoint="chat")

    async def sweep() -> dict:
        await target.open()
        try:
            return await run_sweep(target, wl, [LoadSpec(concurrency=3, warmup=1)], 5,
                                   progress=False)
        finally:
            await target.close()

    doc = asyncio.run(sweep())
    assert doc["endpoint"] == "chat" and target.model == "tiny"
    s = doc["points"][0]["summary"]
    assert (s["completed"], s["failed"], s["incomplete"]) == (5, 0, 0)
    assert s["output_tokens"] == 20
    sent = build_requests(wl, 6)[1:]
    assert s["prompt_tokens"] == sum(_chat_prompt_tokens(DEFAULT_SYSTEM_PROMPT, _words(r.prompt))
                                     for r in sent)
    # Token events only: at most 3 gaps per 4-token request (the role chunk is not a token).
    assert 1 <= len(doc["points"][0]["samples"]["itl_s"]) <= 15

    rc = main(["bench", "--target", url, "--endpoint", "chat", "--workload", "shared-prefix",
               "--prefix-len", "6", "--input-len", "fixed:5", "--output-len", "fixed:3",
               "--vocab-size", "211", "--concurrency", "2", "--num-requests", "4",
               "--warmup", "1", "--output-json", str(tmp_path / "chat.json")])
    assert rc == 0 and "endpoint=chat" in capsys.readouterr().out
    saved = json.loads((tmp_path / "chat.json").read_text())
    assert saved["endpoint"] == "chat"
    s = saved["points"][0]["summary"]
    assert (s["completed"], s["output_tokens"]) == (4, 12)
    spec = WorkloadSpec("shared-prefix", input_len=LengthDist("fixed", 5),
                        output_len=LengthDist("fixed", 3), prefix_len=6, vocab_size=211,
                        max_prompt_len=256)
    sent = build_requests(spec, 5)[1:]  # the CLI's first point: seed 0, one warmup request
    # the shared prefix is the system message, the rest the user turn
    assert s["prompt_tokens"] == sum(_chat_prompt_tokens(_words(r.prompt[:6]),
                                                         _words(r.prompt[6:])) for r in sent)
    assert main(["bench", "--target", "grpc://127.0.0.1:1", "--endpoint", "chat"]) == 2
    assert "needs --target http" in capsys.readouterr().err
