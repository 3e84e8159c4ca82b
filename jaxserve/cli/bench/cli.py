"""`jaxserve bench` (load generator, chunked-prefill scenario, comparisons) and `jaxserve tune`.

Data flow: argv -> WorkloadSpec + LoadSpecs (+ EngineConfig from the engine flags when the
server is launched in-process) -> asyncio: open the target (`--target grpc://...` or
`http://...` with `--endpoint completions|chat`, else an in-process jaxserve server over the
loaded model) -> `sweep.run_sweep` / `scenario.run_chunked_prefill` / `tune.tune` -> a table
on stdout, JSON (`--output-json`) and PNG plots (`--plot-prefix`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import pathlib
import sys
from typing import Any

from jaxserve.config import EngineConfig

_WORKLOAD_HELP = ("synthetic: random-token prompts of --input-len; longtail: the same plus "
                  "--long-fraction of prompts of --long-input-len; shared-prefix: a common "
                  "--prefix-len system prompt + --input-len distinct tokens; jsonl: --dataset")


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(math.inf if x.strip() == "inf" else float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers")


def add_workload_flags(p: argparse.ArgumentParser) -> None:
    from jaxserve.cli.bench.workload import WORKLOADS, parse_length_dist
    from jaxserve.cli.flags import parse_int_list

    def dist(text: str) -> Any:
        try:
            return parse_length_dist(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e))

    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=WORKLOADS, default="synthetic", help=_WORKLOAD_HELP)
    w.add_argument("--input-len", type=dist, default=dist("uniform:32-512"),
                   help="prompt tokens: fixed:N | uniform:LO-HI | lognormal:MEDIAN,SIGMA "
                        "(default uniform:32-512)")
    w.add_argument("--output-len", type=dist, default=dist("fixed:128"),
                   help="new tokens per request, same forms (default fixed:128)")
    w.add_argument("--long-fraction", type=float, default=0.05,
                   help="longtail: share of long prompts (default 0.05)")
    w.add_argument("--long-input-len", type=dist, default=dist("uniform:3000-6000"),
                   help="longtail: long prompt tokens (default uniform:3000-6000)")
    w.add_argument("--prefix-len", type=int, default=1024,
                   help="shared-prefix: tokens of the common prefix (default 1024)")
    w.add_argument("--dataset", default=None,
                   help='jsonl: file of {"prompt": text or ids, "max_tokens"?: n} lines')
    w.add_argument("--vocab-size", type=int, default=None,
                   help="draw token ids below this (default: the server's vocabulary; 32000 "
                        "for HTTP targets, which do not say)")
    w.add_argument("--num-requests", type=parse_int_list, default=(64,),
                   help="measured requests per load point: one value, or one per point of "
                        "the sweep, e.g. 8,32,64 (default 64; tune: 48)")
    w.add_argument("--warmup", type=int, default=2,
                   help="requests sent first and excluded from the figures (default 2)")
    w.add_argument("--workload-seed", dest="seed", type=int, default=0,
                   help="seed of the drawn requests and arrivals (default 0)")
    w.add_argument("--concurrency", type=parse_int_list, default=None,
                   help="closed loop at each of these concurrencies, e.g. 1,4,16,64")
    w.add_argument("--request-rate", type=_floats, default=None,
                   help="open loop: Poisson arrivals at each of these rates (req/s; inf: all "
                        "at once)")
    w.add_argument("--max-duration", type=float, default=600.0,
                   help="seconds one load point may run; then in-flight requests are cut off "
                        "and counted as incomplete (default 600)")
    w.add_argument("--ttft-slo", type=float, default=None, help="goodput: TTFT target (s)")
    w.add_argument("--itl-slo", type=float, default=None,
                   help="goodput: target for each request's p99 ITL (s)")
    w.add_argument("--output-json", default=None, help="write the result document here")
    w.add_argument("--plot-prefix", default=None,
                   help="write PREFIX_sweep.png and PREFIX_cdf.png (needs matplotlib)")


def workload_spec(args: argparse.Namespace) -> Any:
    from jaxserve.cli.bench.workload import WorkloadSpec

    return WorkloadSpec(kind=args.workload, input_len=args.input_len,
                        output_len=args.output_len, long_fraction=args.long_fraction,
                        long_input_len=args.long_input_len, prefix_len=args.prefix_len,
                        dataset=args.dataset, vocab_size=args.vocab_size or 32000)


def num_requests(args: argparse.Namespace, num_points: int) -> tuple[int, ...]:
    n = tuple(args.num_requests)
    if len(n) == 1:
        return n * num_points
    if len(n) != num_points:
        raise ValueError(f"--num-requests has {len(n)} values for {num_points} load points")
    return n


def load_specs(args: argparse.Namespace, default_concurrency: tuple[int, ...]) -> list[Any]:
    from jaxserve.cli.bench.load import LoadSpec

    if args.concurrency and args.request_rate:
        raise ValueError("give --concurrency or --request-rate, not both")
    common = {"warmup": args.warmup, "max_duration_s": args.max_duration, "seed": args.seed}
    if args.request_rate:
        return [LoadSpec(rate=r, **common) for r in args.request_rate]
    return [LoadSpec(concurrency=c, **common)
            for c in (args.concurrency or default_concurrency)]


def add_bench_parser(sub: Any) -> None:
    from jaxserve.cli.flags import add_engine_flags

    b = sub.add_parser(
        "bench", help="measure TTFT / ITL / TPOT / throughput under load",
        description="Load generator: closed-loop concurrency or Poisson-rate sweeps against a "
                    "jaxserve gRPC server, any OpenAI-compatible server (/v1/completions or "
                    "/v1/chat/completions), or "
                    "(no --target) a jaxserve server started in this process with the engine "
                    "flags below. Prints a table; writes JSON and PNG plots on request.")
    b.add_argument("--target", default=None,
                   help="grpc://HOST:PORT (jaxserve) or http://HOST:PORT (OpenAI API); "
                        "default: launch jaxserve in-process")
    b.add_argument("--name", default="", help="this run's name in tables and plot legends")
    b.add_argument("--endpoint", choices=("completions", "chat"), default=None,
                   help="http targets: /v1/completions (default; prompts as token ids or "
                        "text) or /v1/chat/completions (each prompt as a system message + a "
                        "user turn; token ids rendered as text by the server's /detokenize)")
    b.add_argument("--model-name", default=None,
                   help="the 'model' field sent to an OpenAI server (default: its first)")
    b.add_argument("--api-key", default=None, help="API key of the target")
    b.add_argument("--scenario", choices=("sweep", "chunked-prefill"), default="sweep",
                   help="sweep (default) or chunked-prefill: streaming chats while long "
                        "prompts arrive, at a small vs a whole-prompt step budget")
    b.add_argument("--long-len", type=int, default=4096,
                   help="chunked-prefill: long prompt tokens (default 4096)")
    b.add_argument("--num-long", type=int, default=3,
                   help="chunked-prefill: long prompts (default 3)")
    b.add_argument("--small-budget", type=int, default=256,
                   help="chunked-prefill: the chunked step budget (default 256)")
    b.add_argument("--chat-concurrency", type=int, default=4,
                   help="chunked-prefill: streaming chats (default 4)")
    b.add_argument("--compare", nargs="+", default=None, metavar="JSON",
                   help="no run: tabulate and plot saved result documents side by side")
    b.add_argument("--slo-scheduling", action="store_true",
                   help="in-process server: give the engine --ttft-slo / --itl-slo as its "
                        "targets (the SLO-driven token budget; without it they only judge "
                        "goodput)")
    add_workload_flags(b)
    # --ttft-slo / --itl-slo are the goodput targets here (add_workload_flags); the engine's
    # fields of those names take them with --slo-scheduling.
    add_engine_flags(b, exclude=("ttft_slo", "itl_slo"))


def add_tune_parser(sub: Any) -> None:
    from jaxserve.cli.flags import add_engine_flags, parse_int_list

    t = sub.add_parser(
        "tune", help="pick max_num_batched_tokens / max_num_seqs from p99 SLOs",
        description="Sweep max_num_batched_tokens x max_num_seqs on a workload (in-process "
                    "server, same requests each point) and print the setting with the most "
                    "output tokens/s whose p99 TTFT and p99 ITL meet the targets.")
    t.add_argument("--ttft-p99", type=float, required=True, help="p99 TTFT target (s)")
    t.add_argument("--itl-p99", type=float, required=True, help="p99 ITL target (s)")
    t.add_argument("--grid-batched-tokens", type=parse_int_list, default=(128, 256, 512, 1024),
                   help="max_num_batched_tokens values (default 128,256,512,1024)")
    t.add_argument("--grid-max-seqs", type=parse_int_list, default=(8, 32),
                   help="max_num_seqs values (default 8,32)")
    t.add_argument("--max-time", type=float, default=1800.0,
                   help="seconds for the whole tune (default 1800); points not reached are "
                        "listed as not run")
    t.add_argument("--from-json", default=None, metavar="JSON",
                   help="no run: judge a saved tune document (--output-json of an earlier "
                        "tune) against these SLO targets")
    add_workload_flags(t)
    from jaxserve.cli.bench.apply import add_apply_flags

    add_apply_flags(t)  # --apply grpc://HOST:PORT, --api-key
    # The tuner judges static settings: the engine's own SLO targets are not a tune axis.
    add_engine_flags(t, exclude=("ttft_slo", "itl_slo"))
    t.set_defaults(num_requests=(48,))


async def _bench(args: argparse.Namespace) -> dict:
    from jaxserve.cli.bench.report import Slo
    from jaxserve.cli.bench.sweep import run_sweep
    from jaxserve.cli.bench.targets import open_target

    workload = workload_spec(args)
    slo = Slo(args.ttft_slo, args.itl_slo)
    if args.slo_scheduling and args.target:
        raise ValueError("--slo-scheduling sets the in-process engine's targets; a --target "
                         "server takes them from its own --ttft-slo / --itl-slo")
    if args.endpoint is not None and not (args.target or "").startswith(("http://",
                                                                          "https://")):
        raise ValueError(f"--endpoint {args.endpoint} is an OpenAI HTTP endpoint: it needs "
                         "--target http(s)://HOST:PORT")
    if args.scenario == "chunked-prefill":
        from jaxserve.cli.bench.scenario import ChunkedPrefillSpec, run_chunked_prefill

        if args.target:
            raise ValueError("--scenario chunked-prefill launches its own servers (two step "
                             "budgets); drop --target")
        spec = ChunkedPrefillSpec(long_len=args.long_len, num_long=args.num_long,
                                  small_budget=args.small_budget,
                                  chat_concurrency=args.chat_concurrency, seed=args.seed,
                                  max_duration_s=args.max_duration)
        return await run_chunked_prefill(_engine_config(args), _load(args), spec)
    loads = load_specs(args, (1, 4, 16, 64))
    counts = num_requests(args, len(loads))
    if args.target:
        target = open_target(args.target, args.model_name, args.api_key,
                             endpoint=args.endpoint)
        await target.open()
        try:
            return await run_sweep(target, workload, loads, counts,
                                   args.seed, slo,
                                   name=args.name)
        finally:
            await target.close()
    from jaxserve.cli.bench.launch import local_server
    from jaxserve.cli.bench.targets import GrpcTarget

    async with local_server(_engine_config(args), _load(args), progress=True) as address:
        target = GrpcTarget(address)
        await target.open()
        try:
            return await run_sweep(target, workload, loads, counts,
                                   args.seed, slo,
                                   name=args.name or "jaxserve (in-process)")
        finally:
            await target.close()


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    from jaxserve.cli.flags import engine_config_from_args

    if not getattr(args, "slo_scheduling", False):
        return engine_config_from_args(args)
    if args.ttft_slo is None and args.itl_slo is None:
        raise ValueError("--slo-scheduling needs --ttft-slo and/or --itl-slo (the targets the "
                         "engine schedules for)")
    return engine_config_from_args(args, ttft_slo=args.ttft_slo, itl_slo=args.itl_slo)


def _load(args: argparse.Namespace) -> Any:
    from jaxserve.models.loading import load_model

    return load_model(args.engine_model, args.engine_dtype)


def _compare(args: argparse.Namespace) -> int:
    from jaxserve.cli.bench import plots
    from jaxserve.cli.bench.sweep import table_of

    docs = [json.loads(pathlib.Path(p).read_text()) for p in args.compare]
    for doc in docs:
        print(table_of(doc), end="\n\n")
    if args.plot_prefix:
        for path in plots.plot_sweep(docs, f"{args.plot_prefix}_sweep.png") + \
                plots.plot_cdfs(docs, f"{args.plot_prefix}_cdf.png"):
            print(f"wrote {path}", file=sys.stderr)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from jaxserve.cli.bench.sweep import table_of, write_outputs

    if args.compare:
        return _compare(args)
    doc = asyncio.run(_bench(args))
    if args.scenario == "chunked-prefill":
        from jaxserve.cli.bench.scenario import table

        print(f"chunked prefill: {doc['workload']}\n{table(doc['points'])}")
    else:
        print(table_of(doc))
    for path in write_outputs(doc, args.output_json, args.plot_prefix):
        print(f"wrote {path}", file=sys.stderr)
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    from jaxserve.cli.bench import plots
    from jaxserve.cli.bench.tune import TuneSpec, repick, table, tune, verdict

    spec = TuneSpec(ttft_p99_s=args.ttft_p99, itl_p99_s=args.itl_p99,
                    batched_tokens=args.grid_batched_tokens, max_seqs=args.grid_max_seqs,
                    num_requests=args.num_requests[0], max_time_s=args.max_time)
    if args.from_json:
        doc = repick(json.loads(pathlib.Path(args.from_json).read_text()), spec)
    else:
        loads = load_specs(args, (16,))
        if len(loads) != 1:
            raise ValueError("tune runs one load: give one --concurrency or one "
                             "--request-rate")
        doc = asyncio.run(tune(_engine_config(args), _load(args), workload_spec(args),
                               loads[0], spec))
    print(f"tune: workload={doc['workload']} load={doc['load']} "
          f"(elapsed {doc['elapsed_s']:.0f} s)\n{table(doc['rows'])}\n{verdict(doc)}")
    if args.output_json:
        pathlib.Path(args.output_json).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.output_json}", file=sys.stderr)
    if args.plot_prefix:
        for path in plots.plot_grid(doc["rows"], f"{args.plot_prefix}_grid.png",
                                    spec.ttft_p99_s, spec.itl_p99_s):
            print(f"wrote {path}", file=sys.stderr)
    if args.apply:
        from jaxserve.cli.bench.apply import apply_best

        return apply_best(doc, args.apply, args.api_key)
    return 0
