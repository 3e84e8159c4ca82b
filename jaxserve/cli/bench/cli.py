"""`jaxserve bench` (load generator, chunked-prefill scenario, comparisons) and `jaxserve tune`.

Data flow: argv -> (`workload_flags`) WorkloadSpec + LoadSpecs or phases + goodput targets
(+ EngineConfig from the engine flags when the server is launched in-process) -> asyncio:
open the target (`--target grpc://...` or `http://...` with `--endpoint completions|chat`,
else an in-process jaxserve server over the loaded model) -> `sweep.run_sweep` /
`sweep.run_phased` / `scenario.run_chunked_prefill` / `tune.tune` -> a table on stdout, JSON
(`--output-json`) and PNG plots (`--plot-prefix`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import sys
from typing import Any

from jaxserve.cli.bench.workload_flags import (add_workload_flags, goodput_slo, load_specs,
                                               num_requests, phase_specs, workload_spec)
from jaxserve.config import EngineConfig


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
                   help="in-process server: give the engine the goodput TTFT / ITL targets "
                        "(--ttft-slo / --itl-slo, or --goodput ttft: / itl:) as its own (the "
                        "SLO-driven token budget; without it they only judge goodput)")
    add_workload_flags(b)
    # --ttft-slo / --itl-slo are the goodput targets here (add_workload_flags); the engine's
    # fields of those names take them with --slo-scheduling.
    add_engine_flags(b, exclude=("ttft_slo", "itl_slo"))


def add_tune_parser(sub: Any) -> None:
    from jaxserve.cli.flags import add_engine_flags, parse_int_list

    t = sub.add_parser(
        "tune", help="pick max_num_batched_tokens / max_num_seqs from p99 SLOs or goodput",
        description="Sweep max_num_batched_tokens x max_num_seqs on a workload (in-process "
                    "server, same requests each point; one --phase for a timed open-loop "
                    "load) and print the setting with the most output tokens/s whose p99 "
                    "TTFT and p99 ITL meet --ttft-p99 / --itl-p99, or, with --goodput, the "
                    "one with the most goodput (among those meeting the p99 targets when "
                    "given too).")
    t.add_argument("--ttft-p99", type=float, default=None,
                   help="p99 TTFT target (s): with --itl-p99, a setting qualifies when the "
                        "p99 of all its requests' TTFTs and of all their gaps meet them")
    t.add_argument("--itl-p99", type=float, default=None, help="p99 ITL target (s)")
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


async def _bench(args: argparse.Namespace) -> dict:
    from jaxserve.cli.bench.sweep import run_phased, run_sweep
    from jaxserve.cli.bench.targets import open_target

    workload = workload_spec(args)
    slo = goodput_slo(args)
    phases = phase_specs(args)
    if phases and args.scenario != "sweep":
        raise ValueError(f"--phase is a workload of its own: it does not take --scenario "
                         f"{args.scenario}")
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
        if slo.given:
            raise ValueError("--scenario chunked-prefill reports chat ITL against long-prompt "
                             "TTFT, not goodput: drop --goodput")
        spec = ChunkedPrefillSpec(long_len=args.long_len, num_long=args.num_long,
                                  small_budget=args.small_budget,
                                  chat_concurrency=args.chat_concurrency, seed=args.seed,
                                  max_duration_s=600.0 if args.max_duration is None
                                  else args.max_duration)
        return await run_chunked_prefill(_engine_config(args), _load(args), spec)
    loads = [] if phases else load_specs(args, (1, 4, 16, 64))
    counts = num_requests(args, len(loads)) if loads else []
    if args.target:
        target = open_target(args.target, args.model_name, args.api_key,
                             endpoint=args.endpoint)
        await target.open()
        try:
            if phases:
                return await run_phased(target, workload, phases, args.seed, slo,
                                        args.warmup, args.max_duration, name=args.name)
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
            if phases:
                return await run_phased(target, workload, phases, args.seed, slo,
                                        args.warmup, args.max_duration,
                                        name=args.name or "jaxserve (in-process)")
            return await run_sweep(target, workload, loads, counts,
                                   args.seed, slo,
                                   name=args.name or "jaxserve (in-process)")
        finally:
            await target.close()


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    from jaxserve.cli.flags import engine_config_from_args

    if not getattr(args, "slo_scheduling", False):
        return engine_config_from_args(args)
    slo = goodput_slo(args)  # the engine schedules for the TTFT / ITL targets it judges by
    if slo.ttft_s is None and slo.itl_s is None:
        raise ValueError("--slo-scheduling needs --ttft-slo and/or --itl-slo (or --goodput "
                         "ttft:MS / itl:MS): the targets the engine schedules for")
    return engine_config_from_args(args, ttft_slo=slo.ttft_s, itl_slo=slo.itl_s)


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
    from jaxserve.cli.bench.load import LoadSpec
    from jaxserve.cli.bench.phases import DRAIN_S
    from jaxserve.cli.bench.tune import TuneSpec, repick, table, tune, verdict

    phases = phase_specs(args)
    if len(phases) > 1:
        raise ValueError(f"tune runs one phase (the best static setting for that traffic); "
                         f"got {len(phases)} --phase")
    spec = TuneSpec(ttft_p99_s=args.ttft_p99, itl_p99_s=args.itl_p99,
                    batched_tokens=args.grid_batched_tokens, max_seqs=args.grid_max_seqs,
                    num_requests=(args.num_requests or (48,))[0], max_time_s=args.max_time,
                    goodput=goodput_slo(args), phase=phases[0] if phases else None)
    if args.from_json:
        doc = repick(json.loads(pathlib.Path(args.from_json).read_text()), spec)
    else:
        if phases:  # the phase is the load; this LoadSpec carries its warmup, seed, bound
            d = phases[0].duration_s
            if args.max_duration is not None and args.max_duration < d:
                raise ValueError(f"--max-duration {args.max_duration:g} is shorter than the "
                                 f"phase's {d:g} s")
            loads = [LoadSpec(concurrency=phases[0].concurrency, rate=phases[0].rate,
                              warmup=args.warmup, seed=args.seed,
                              max_duration_s=args.max_duration or d + DRAIN_S)]
        else:
            loads = load_specs(args, (16,))
        if len(loads) != 1:
            raise ValueError("tune runs one load: give one --concurrency or one "
                             "--request-rate")
        doc = asyncio.run(tune(_engine_config(args), _load(args), workload_spec(args),
                               loads[0], spec))
    print(f"tune: workload={doc['workload']} load={doc['load']} "
          f"(elapsed {doc['elapsed_s']:.0f} s)\n"
          f"{table(doc['rows'], spec.ttft_p99_s is not None)}\n{verdict(doc)}")
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
