"""What each serving front costs: OpenAI chat vs OpenAI completions vs gRPC, on one server.

Data flow: a model (default: a tiny random 2-layer Llama written to a temporary folder, so the
engine's own time is small and the fronts' costs show; `--model bundled` for SmolLM2-135M, or
a path) -> ONE `jaxserve serve` subprocess with gRPC, HTTP and Prometheus metrics each on an
explicit free loopback port (prefix caching off: every front sends the same prompts, and a
later front must not find them cached) -> this process drives it with the bench library's own
clients (`jaxserve.cli.bench.targets`: GrpcTarget = jaxserve.v1.Generation/Generate,
OpenAITarget = /v1/completions, OpenAIChatTarget = /v1/chat/completions, all streaming) ->
per (concurrency, front): warmup requests, then the measured requests in a closed loop, the
server's /metrics scraped before and after (after: once it has counted every request);
`--rounds N` repeats it all, each round starting with the next front, and pools the rounds ->
  (a) per request, at --request-concurrency (default 1 and 32): client-observed TTFT and
      end-to-end latency next to the server's own (the engine's metrics: arrival at the front
      -> first token / finish, means over the phase); overhead = client - server, the time
      outside the server's clock (connection, framing, event-loop delivery, client parsing);
      the difference of each front to gRPC;
  (b) per token, at --token-concurrency (default 64): client ITL and TPOT next to the
      server's TPOT, and output tokens/s, per front (an HTTP front that cannot keep up with
      one event per token per sequence shows here, and in the engine's own TPOT when its
      work takes the engine thread's GIL).
-> two tables on stdout, everything in --json.

Requests: token-id prompts (`--input-len`), `--output-len` new tokens with ignore_eos, greedy;
the same prompts for every front at a given concurrency. The chat front sends each prompt as
a system message + a user turn (the ids rendered as text by the server's /detokenize), so its
prompts are longer by the template's tokens; the tables show each front's prompt tokens.
Client and server share this machine's cores: on a small machine the client's own parsing
competes with the server, and the figures say so only relative to gRPC, measured alike.

    python scripts/bench/front_overhead.py --json front_overhead.json
    python scripts/bench/front_overhead.py --model bundled --output-len fixed:64
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import pathlib
import sys
import tempfile
import time

import aiohttp
# Its sibling in scripts/bench/: Python puts a script's own folder first on sys.path.
from front_overhead_server import Ports, free_port, serve
from tqdm.auto import tqdm

from jaxserve.cli.bench.load import LoadSpec, run_load
from jaxserve.cli.bench.report import RequestRecord, summarize
from jaxserve.cli.bench.sweep import machine_facts
from jaxserve.cli.bench.targets import GrpcTarget, OpenAIChatTarget, OpenAITarget, Target
from jaxserve.cli.bench.workload import WorkloadSpec, build_requests, parse_length_dist
from jaxserve.models.tiny import write_tiny_checkpoint

FRONTS = ("grpc", "completions", "chat")
# Engine histograms (sum, count) read from /metrics; vLLM's names with jaxserve's prefix.
SERVER_FIGURES = {"ttft": "time_to_first_token_seconds", "e2e": "e2e_request_latency_seconds",
                  "queue": "request_queue_time_seconds", "tpot": "time_per_output_token_seconds",
                  "itl": "inter_token_latency_seconds"}


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[str, tuple[float, float]]:
    """{figure: (sum of seconds, count)} of the engine's histograms over every label set, and
    "compiles": (XLA compiles after warmup, 0)."""
    from prometheus_client.parser import text_string_to_metric_families

    async with session.get(url) as resp:
        resp.raise_for_status()
        text = await resp.text()
    out = {k: [0.0, 0.0] for k in (*SERVER_FIGURES, "compiles")}
    names = {"jaxserve:" + v: k for k, v in SERVER_FIGURES.items()}
    for fam in text_string_to_metric_families(text):
        if fam.name == "jaxserve:compiles_after_warmup":
            out["compiles"][0] += sum(x.value for x in fam.samples)
        key = names.get(fam.name)
        for x in fam.samples if key else ():
            if x.name.endswith("_sum"):
                out[key][0] += x.value
            elif x.name.endswith("_count"):
                out[key][1] += x.value
    return {k: (v[0], v[1]) for k, v in out.items()}


async def settled(session: aiohttp.ClientSession, url: str, finished: int,
                  timeout: float = 30.0) -> dict[str, tuple[float, float]]:
    """The scrape once the engine has counted `finished` requests (its metrics are fed after
    each step, a moment after the last chunk may have left)."""
    t0 = time.monotonic()
    while True:
        m = await scrape(session, url)
        if m["e2e"][1] >= finished or time.monotonic() - t0 > timeout:
            return m
        await asyncio.sleep(0.01)


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


@dataclasses.dataclass
class Phase:
    """One measured run of one front at one concurrency."""

    records: list[RequestRecord]
    duration_s: float
    server: dict[str, tuple[float, float]]  # figure -> (sum of s, count) within the phase


class Driver:
    """One server, three targets; `phase` measures one (front, concurrency)."""

    def __init__(self, ports: Ports, workload: WorkloadSpec, warmup: int, min_requests: int):
        self.metrics_url = f"http://127.0.0.1:{ports.metrics}/metrics"
        http = f"http://127.0.0.1:{ports.http}"
        self.targets: dict[str, Target] = {"grpc": GrpcTarget(f"127.0.0.1:{ports.grpc}"),
                                           "completions": OpenAITarget(http),
                                           "chat": OpenAIChatTarget(http)}
        self.workload, self.warmup, self.min_requests = workload, warmup, min_requests
        self.finished = 0  # requests sent so far (all n=1): what the engine's count reaches
        self.session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> "Driver":
        self.session = aiohttp.ClientSession()
        for t in self.targets.values():
            await t.open()
        grpc = self.targets["grpc"]
        self.workload = dataclasses.replace(self.workload, vocab_size=grpc.vocab_size or 32000,
                                            max_prompt_len=grpc.max_model_len)
        return self

    async def __aexit__(self, *_exc: object) -> None:
        for t in self.targets.values():
            await t.close()
        if self.session is not None:
            await self.session.close()

    async def phase(self, front: str, concurrency: int) -> Phase:
        assert self.session is not None
        target = self.targets[front]
        n = max(self.min_requests, 2 * concurrency)
        reqs = build_requests(self.workload, n, seed=concurrency)  # same for every front
        warm = build_requests(self.workload, max(self.warmup, 1), seed=10_000 + concurrency)
        await run_load(target, warm, LoadSpec(concurrency=min(concurrency, len(warm)),
                                              warmup=0), progress=False)
        self.finished += len(warm)
        before = await settled(self.session, self.metrics_url, self.finished)
        res = await run_load(target, reqs, LoadSpec(concurrency=concurrency, warmup=0))
        self.finished += len(reqs)
        after = await settled(self.session, self.metrics_url, self.finished)
        return Phase(res.records, res.duration_s,
                     {k: (after[k][0] - before[k][0], after[k][1] - before[k][1])
                      for k in after})


def point(kind: str, front: str, concurrency: int, phases: list[Phase]) -> dict:
    """A front's figures at one concurrency, pooled over its phases (rounds)."""
    records = [r for ph in phases for r in ph.records]
    s = summarize(records, sum(ph.duration_s for ph in phases))
    pooled = {k: (sum(ph.server[k][0] for ph in phases), sum(ph.server[k][1] for ph in phases))
              for k in phases[0].server}
    server: dict[str, float | None] = {
        f"{k}_ms": 1e3 * pooled[k][0] / pooled[k][1] if pooled[k][1] > 0 else None
        for k in SERVER_FIGURES}
    server["requests"] = pooled["e2e"][1]
    client = {"ttft_ms": s.ttft_ms.mean, "e2e_ms": s.e2e_ms.mean, "tpot_ms": s.tpot_ms.mean,
              "itl_ms": s.itl_ms.mean, "itl_p50_ms": s.itl_ms.p50, "itl_p99_ms": s.itl_ms.p99,
              "output_throughput": s.output_throughput,
              "prompt_tokens_mean": s.prompt_tokens / max(s.completed, 1)}
    return {"kind": kind, "front": front, "concurrency": concurrency, "rounds": len(phases),
            "requests": len(records), "completed": s.completed,
            "failed": s.failed + s.incomplete, "output_tokens": s.output_tokens,
            "errors": list(s.errors), "compiles_during": pooled["compiles"][0],
            "client": client, "server": server,
            "overhead": {k: _minus(client[f"{k}_ms"], server[f"{k}_ms"])
                         for k in ("ttft", "e2e", "tpot")}}


def with_grpc_deltas(points: list[dict]) -> None:
    """Each point's client figures minus gRPC's of the same kind and concurrency."""
    grpc = {(p["kind"], p["concurrency"]): p for p in points if p["front"] == "grpc"}
    for p in points:
        g = grpc.get((p["kind"], p["concurrency"]))
        p["vs_grpc"] = {k: _minus(p["client"][k], g["client"][k]) if g else None
                        for k in ("ttft_ms", "e2e_ms", "tpot_ms", "itl_ms")}


def _f(x: float | None, digits: int = 1) -> str:
    return "-" if x is None or x != x else f"{x:.{digits}f}"


def _table(head: tuple[str, ...], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths))]
    return "\n".join(lines + ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows])


def tables(doc: dict) -> str:
    per_req = [p for p in doc["points"] if p["kind"] == "request"]
    per_tok = [p for p in doc["points"] if p["kind"] == "token"]
    a = _table(("conc", "front", "ok/req", "prompt tok", "TTFT client", "TTFT server",
                "TTFT ovh", "E2E client", "E2E server", "E2E ovh", "E2E vs gRPC"),
               [[str(p["concurrency"]), p["front"], f"{p['completed']}/{p['requests']}",
                 _f(p["client"]["prompt_tokens_mean"]), _f(p["client"]["ttft_ms"]),
                 _f(p["server"]["ttft_ms"]), _f(p["overhead"]["ttft"]),
                 _f(p["client"]["e2e_ms"]), _f(p["server"]["e2e_ms"]),
                 _f(p["overhead"]["e2e"]), _f(p["vs_grpc"]["e2e_ms"])] for p in per_req])
    b = _table(("conc", "front", "ok/req", "out tok/s", "ITL p50", "ITL p99", "TPOT client",
                "TPOT server", "TPOT ovh", "TPOT vs gRPC"),
               [[str(p["concurrency"]), p["front"], f"{p['completed']}/{p['requests']}",
                 _f(p["client"]["output_throughput"]), _f(p["client"]["itl_p50_ms"], 2),
                 _f(p["client"]["itl_p99_ms"], 2), _f(p["client"]["tpot_ms"], 2),
                 _f(p["server"]["tpot_ms"], 2), _f(p["overhead"]["tpot"], 2),
                 _f(p["vs_grpc"]["tpot_ms"], 2)] for p in per_tok])
    compiled = [f"{p['front']}@{p['concurrency']}" for p in doc["points"]
                if p["compiles_during"]]
    note = f"\nXLA compiled during {', '.join(compiled)}: those figures include it" \
        if compiled else ""
    return (f"model={doc['model']}  workload={doc['workload']}  rounds={doc['rounds']}\n"
            f"(a) per request (means, ms; server = the engine's clock from arrival at the "
            f"front; ovh = client - server)\n{a}\n\n"
            f"(b) per token (ms; TPOT = (last token - first token) / (tokens - 1), means)\n{b}"
            f"{note}")


async def measure(args: argparse.Namespace, ports: Ports) -> tuple[list[dict], str]:
    """Every (kind, concurrency, front)'s point, pooled over `--rounds` rounds (each round
    starts with the next front, so none always goes first), and the workload as drawn."""
    loads = [("request", c) for c in args.request_concurrency]
    loads += [("token", c) for c in args.token_concurrency]
    fronts = args.fronts
    plan = [(kind, c, fronts[(r + i) % len(fronts)]) for r in range(args.rounds)
            for kind, c in loads for i in range(len(fronts))]
    phases: dict[tuple[str, int, str], list[Phase]] = {}
    async with Driver(ports, WorkloadSpec(input_len=args.input_len,
                                          output_len=args.output_len),
                      args.warmup, args.num_requests) as driver:
        for kind, c, front in tqdm(plan, desc="phases", unit="phase"):
            phases.setdefault((kind, c, front), []).append(await driver.phase(front, c))
        described = driver.workload.describe()
    points = [point(kind, front, c, phases[kind, c, front])
              for kind, c in loads for front in fronts]
    with_grpc_deltas(points)
    return points, described


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _fronts(text: str) -> tuple[str, ...]:
    out = tuple(x.strip() for x in text.split(",") if x.strip())
    if not out or set(out) - set(FRONTS) or len(set(out)) < len(out):
        raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated subset of {FRONTS}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--model", default="tiny",
                    help="tiny (random 2-layer Llama, default), bundled (SmolLM2-135M) or a "
                         "checkpoint path")
    ap.add_argument("--input-len", type=parse_length_dist, default=parse_length_dist(
        "uniform:32-128"), help="prompt tokens (default uniform:32-128)")
    ap.add_argument("--output-len", type=parse_length_dist,
                    default=parse_length_dist("fixed:32"), help="new tokens (default fixed:32)")
    ap.add_argument("--request-concurrency", type=_ints, default=(1, 32),
                    help="(a) per-request overhead at these concurrencies (default 1,32)")
    ap.add_argument("--token-concurrency", type=_ints, default=(64,),
                    help="(b) per-token overhead at these concurrencies (default 64)")
    ap.add_argument("--fronts", type=_fronts, default=FRONTS,
                    help="which fronts, in this order at each concurrency (default "
                         "grpc,completions,chat)")
    ap.add_argument("--num-requests", type=int, default=16,
                    help="measured requests per phase: this many, at least 2 x the "
                         "concurrency (default 16)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="measure every point this many times, each round starting with the "
                         "next front (figures pooled): order effects cancel and noise evens out "
                         "(default 3)")
    ap.add_argument("--warmup", type=int, default=4, help="unmeasured requests first, per "
                    "phase (default 4)")
    ap.add_argument("--max-num-seqs", type=int, default=64,
                    help="the server's; >= the largest concurrency (default 64)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512,
                    help="the server's (default 512)")
    ap.add_argument("--max-model-len", type=int, default=512, help="the server's (default 512)")
    ap.add_argument("--kv-cache-memory", default="256MiB", help="the server's (default 256MiB)")
    ap.add_argument("--attention-impl", default="auto", help="the server's (default auto)")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="one more `jaxserve serve` argument (repeatable), e.g. "
                         "--server-arg=--stream-interval=4")
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    ap.add_argument("--json", default=None, help="write every figure here")
    args = ap.parse_args(argv)

    ports = Ports(free_port(), free_port(), free_port())
    flags = ["--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens",
             str(args.max_num_batched_tokens), "--max-model-len", str(args.max_model_len),
             "--kv-cache-memory", args.kv_cache_memory, "--attention-impl",
             args.attention_impl, "--no-enable-prefix-caching", *args.server_arg]
    with tempfile.TemporaryDirectory(prefix="jaxserve-front-") as tmp:
        model = None if args.model == "bundled" else args.model
        if args.model == "tiny":
            model = str(pathlib.Path(tmp) / "tiny")
            write_tiny_checkpoint(pathlib.Path(model))
        with serve(model, ports, flags, args.startup_timeout):
            points, described = asyncio.run(measure(args, ports))
    doc = {"model": args.model, "workload": described, "rounds": args.rounds,
           "server_flags": flags,
           "ports": dataclasses.asdict(ports), "points": points, "machine": machine_facts(),
           "command": [sys.argv[0], *(sys.argv[1:] if argv is None else argv)]}
    print(tables(doc))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    bad = [p for p in points if p["failed"]]
    for p in bad:
        print(f"{p['front']} at concurrency {p['concurrency']}: {p['failed']} failed: "
              f"{p['errors']}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
