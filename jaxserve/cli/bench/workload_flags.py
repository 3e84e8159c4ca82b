"""The workload flags `jaxserve bench` and `jaxserve tune` share, and what they turn into.

Data flow: argparse (`add_workload_flags`) -> Namespace -> `workload_spec` (what requests
look like), `load_specs` + `num_requests` (a sweep's load points) or `phase_specs` (a phased
workload: `phases.parse_phases`, refusing the sweep flags it has no use for), and
`goodput_slo` (--goodput, with --ttft-slo / --itl-slo for its ttft / itl keys) -> the bench
and tune drivers in `cli.py`.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Any

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
    w.add_argument("--num-requests", type=parse_int_list, default=None,
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
    w.add_argument("--phase", action="append", default=None, metavar="KEY=VALUE,...",
                   help="a phase of a phased workload (repeat: the phases run back to back "
                        "on one server): name=NAME,duration=SECONDS, then rate=REQ_PER_S "
                        "[,burstiness=B] (open loop; B=1 Poisson, as vLLM's --burstiness) or "
                        "concurrency=N (closed loop), and optional input-len=DIST, "
                        "output-len=DIST (default: --input-len / --output-len); e.g. "
                        "name=chat,duration=180,rate=2,input-len=uniform:64-256,"
                        "output-len=uniform:64-128. Figures per phase and for the whole run")
    w.add_argument("--max-duration", type=float, default=None,
                   help="seconds one load point may run; then in-flight requests are cut off "
                        "and counted as incomplete (default 600; with --phase: the whole "
                        "run, default the phases' durations + 120)")
    w.add_argument("--ttft-slo", type=float, default=None,
                   help="goodput: TTFT target (s); the same as --goodput ttft:MS")
    w.add_argument("--itl-slo", type=float, default=None,
                   help="goodput: target for each request's p99 ITL (s); the same as "
                        "--goodput itl:MS")
    w.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLO targets in ms, as vLLM's --goodput: a request counts toward "
                        "goodput when every one given holds for it. Keys: ttft, tpot, e2el "
                        "(vLLM's), itl (the request's own p99 inter-token gap), e.g. "
                        "--goodput ttft:2000 itl:250")
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
    n = tuple(args.num_requests or (64,))
    if len(n) == 1:
        return n * num_points
    if len(n) != num_points:
        raise ValueError(f"--num-requests has {len(n)} values for {num_points} load points")
    return n


def goodput_slo(args: argparse.Namespace) -> Any:
    """The goodput targets: --goodput's, with --ttft-slo / --itl-slo (seconds) for their keys."""
    from jaxserve.cli.bench.report import parse_goodput

    slo = parse_goodput(args.goodput)
    extra = {}
    for key, value in (("ttft", args.ttft_slo), ("itl", args.itl_slo)):
        if value is None:
            continue
        if not 0 < value < math.inf:
            raise ValueError(f"--{key}-slo {value} must be seconds > 0")
        if getattr(slo, f"{key}_s") is not None:
            raise ValueError(f"--{key}-slo and --goodput {key}:MS give the same target: give "
                             "one")
        extra[f"{key}_s"] = value
    return dataclasses.replace(slo, **extra)


def phase_specs(args: argparse.Namespace) -> list[Any]:
    """The --phase list ([] without); refuses the flags that a phased run has no use for."""
    from jaxserve.cli.bench.phases import parse_phases

    if not args.phase:
        return []
    clash = [flag for flag, v in (("--concurrency", args.concurrency),
                                  ("--request-rate", args.request_rate),
                                  ("--num-requests", args.num_requests)) if v]
    if clash:
        raise ValueError(f"--phase gives each phase's load and length: drop {', '.join(clash)}")
    if args.workload == "jsonl":
        raise ValueError("--phase draws synthetic prompts per phase: it does not take "
                         "--workload jsonl")
    return parse_phases(args.phase)


def load_specs(args: argparse.Namespace, default_concurrency: tuple[int, ...]) -> list[Any]:
    from jaxserve.cli.bench.load import LoadSpec

    if args.concurrency and args.request_rate:
        raise ValueError("give --concurrency or --request-rate, not both")
    common = {"warmup": args.warmup, "seed": args.seed,
              "max_duration_s": 600.0 if args.max_duration is None else args.max_duration}
    if args.request_rate:
        return [LoadSpec(rate=r, **common) for r in args.request_rate]
    return [LoadSpec(concurrency=c, **common)
            for c in (args.concurrency or default_concurrency)]
