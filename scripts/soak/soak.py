#!/usr/bin/env python
"""Soak `jaxserve serve`: thousands of mixed requests, then check that nothing leaked.

    python scripts/soak/soak.py --requests 5000 --concurrency 32 --json soak.json
    python scripts/soak/soak.py --model PATH --duration 600 --server-args "--max-num-seqs 16"
    python scripts/soak/soak.py --requests 300 --fault-token 2   # + steps that fail on purpose

The soak itself (server process, request kinds, load, settle, checks, summary) is
`jaxserve.cli.bench.soak` with its kinds in `jaxserve.cli.bench.soak_kinds`;
`tests/scripts/test_soak.py` runs a short one. Without --model the server loads the test
suite's tiny random-weight model (`jaxserve.models.tiny.TEST_SHAPE`) with a small engine and
KV cache (`soak.TINY_SERVER_ARGS`), so preemption happens under load. Exit status 0 when
every check passed.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shlex
import sys

from jaxserve.cli.bench.soak import ALL_KINDS, SoakConfig, print_summary, soak


def parse_args(argv: list[str] | None = None) -> tuple[SoakConfig, str | None]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model path (default: a tiny random model)")
    ap.add_argument("--server-args", default="",
                    help="extra `jaxserve serve` flags, one string (replaces the tiny defaults)")
    ap.add_argument("--requests", type=int, default=None,
                    help="how many (default 2000; with --duration and no --requests: no limit)")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--duration", type=float, default=None, help="seconds; stops issuing then")
    ap.add_argument("--max-prompt", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--mix", default="",
                    help="kind=weight,... (kinds: " + ", ".join(ALL_KINDS) + ")")
    ap.add_argument("--fault-token", type=int, default=None,
                    help="start the server with --fault-injection-token and send requests that "
                         "fail on purpose (the tiny model's EOS id 2 is a good choice)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sample-interval", type=float, default=1.0)
    ap.add_argument("--json", default=None, help="write the summary here")
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    mix = tuple((k, float(w)) for k, w in (kv.split("=") for kv in a.mix.split(",") if kv))
    unknown = [k for k, _ in mix if k not in ALL_KINDS]
    if unknown:
        ap.error(f"--mix: unknown kinds {unknown}; known: {', '.join(ALL_KINDS)}")
    requests = a.requests if a.requests is not None else (
        2000 if a.duration is None else sys.maxsize)
    cfg = SoakConfig(model=a.model, server_args=tuple(shlex.split(a.server_args)),
                     requests=requests, concurrency=a.concurrency, duration_s=a.duration,
                     max_prompt=a.max_prompt, max_tokens=a.max_tokens, mix=mix, seed=a.seed,
                     sample_interval_s=a.sample_interval, progress=not a.no_progress,
                     fault_token=a.fault_token)
    return cfg, a.json


def main(argv: list[str] | None = None) -> int:
    cfg, json_path = parse_args(argv)
    result = soak(cfg)
    print_summary(result)
    if json_path:
        pathlib.Path(json_path).write_text(json.dumps(result, indent=2))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
