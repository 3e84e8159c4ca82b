"""A short soak of `jaxserve serve` (`jaxserve.cli.bench.soak`, what scripts/soak/soak.py runs):
a few hundred mixed requests against a real server process, then nothing may be left behind.

The load: gRPC streams and whole answers, HTTP completions and streams, n > 1, logprobs, ~20%
cancelled calls and short deadlines / client timeouts, bad requests, and requests that fail
inside an engine step on purpose (the server runs with --fault-injection-token: a prompt that
starts with that token fails in its first step). Oracles: each request's
outcome against its kind's expected outcomes (bad requests refused with INVALID_ARGUMENT / 400,
no 5xx / UNKNOWN / INTERNAL / UNAVAILABLE outside the fault kinds, which get exactly INTERNAL /
500 / a stream error event, normal finishes within max_tokens), and the server's
own gauges read from /metrics once it is idle: 0 KV pages held, 0 running, 0 waiting, health
SERVING, a clean exit on SIGTERM. `scripts/soak/soak.py` runs the long version.
"""

from __future__ import annotations

import collections
import os

import pytest
from support.tiers import run_slow

from jaxserve.cli.bench import soak
from jaxserve.cli.bench.soak_kinds import FAULT_KINDS, KINDS

FAULT_TOKEN = 2  # the tiny model's EOS id: no normal soak prompt starts with it
BAD_LABELS = ("http:5", "grpc:UNKNOWN", "grpc:INTERNAL", "grpc:UNAVAILABLE", "error:",
              "client_hang")


# 150 requests in the default tier (~30 cancelled, every kind several times over), 300 in the
# slow tier. The server compiles into the session's XLA cache (conftest), like every process
# the tests start: the tiny server's flags with two token buckets (a decode bucket and the
# whole step) instead of the default set's 11, each a whole-model compile at warmup (what is
# soaked is the server's bookkeeping, not the bucket set).
REQUESTS = 300 if run_slow() else 150
SERVER_ARGS = (*soak.TINY_SERVER_ARGS, "--token-buckets", "8,64")


@pytest.fixture(scope="module")
def result() -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cfg = soak.SoakConfig(requests=REQUESTS, concurrency=8, max_tokens=8, seed=1,
                          progress=False, fault_token=FAULT_TOKEN, server_args=SERVER_ARGS)
    return soak.soak(cfg, env)


def test_every_request_got_an_expected_outcome(result: dict) -> None:
    assert result["requests"] == REQUESTS
    assert result["unexpected"] == []
    normal = {name: c for name, c in result["outcomes"].items() if name not in FAULT_KINDS}
    bad = [(name, lb) for name, c in normal.items() for lb in c if lb.startswith(BAD_LABELS)]
    assert not bad, normal
    assert set(result["outcomes"]) == set(KINDS) | set(FAULT_KINDS)  # every kind ran
    labels = collections.Counter()
    for c in normal.values():
        labels.update(c)
    # The hard cases really happened: cancellations, passed deadlines, refusals.
    assert labels.get("cancelled", 0) >= 10 and labels.get("deadline", 0) >= 1, labels
    assert result["outcomes"]["grpc_bad"] == {"grpc:INVALID_ARGUMENT":
                                              sum(result["outcomes"]["grpc_bad"].values())}
    assert result["outcomes"]["http_bad"] == {"http:400":
                                              sum(result["outcomes"]["http_bad"].values())}


def test_injected_step_failures_stayed_with_their_requests(result: dict) -> None:
    """Every fault request failed (INTERNAL / 500 / a stream error event; RESOURCE_EXHAUSTED
    or 429 when refused under load) and no other request noticed (the test above)."""
    for name in FAULT_KINDS:
        got = result["outcomes"][name]
        failed = sum(got.get(lb, 0) for lb in ("grpc:INTERNAL", "http:500", "stream_error"))
        assert failed >= 1 and set(got) <= FAULT_KINDS[name].expected, got


def test_nothing_left_behind(result: dict) -> None:
    after = result["after"]
    assert after["kv_pages_used"] == 0
    assert after["running"] == 0 and after["waiting"] == 0
    assert after["health"] == "SERVING"
    assert result["exit_code"] == 0
    assert result["passed"], result["checks"]


def test_checks_catch_a_leak_and_a_bad_outcome() -> None:
    """The pass conditions themselves, on made-up results (the oracle can fail)."""
    load = soak.LoadResult()
    load.outcomes["grpc_stream"] = collections.Counter(ok=5)
    idle = soak.Snapshot(running=0, waiting=0, kv_pages_used=0, rss_mb=1.0, fds=3,
                         health="SERVING")
    assert all(soak.checks(load, idle, 0).values())
    leaked = soak.Snapshot(running=0, waiting=1, kv_pages_used=3, rss_mb=1.0, fds=3,
                           health="NOT_SERVING")
    assert soak.checks(load, leaked, 1) == {
        "no unexpected outcome": True, "0 KV pages held": False, "0 running, 0 waiting": False,
        "health SERVING": False, "clean exit on SIGTERM": False}
    load.outcomes["grpc_bad"] = collections.Counter(ok=1)  # a bad request accepted
    assert not soak.checks(load, idle, 0)["no unexpected outcome"]


def test_metric_parsing_sums_label_sets() -> None:
    text = ('# HELP jaxserve:kv_cache_usage_perc x\n'
            'jaxserve:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
            'jaxserve:kv_cache_usage_perc{engine="1",model_name="m"} 0.5\n'
            'jaxserve:kv_cache_usage_perc_other 7.0\n'
            'jaxserve:num_requests_running 2.0\n')
    assert soak.metric(text, "jaxserve:kv_cache_usage_perc") == 0.75
    assert soak.metric(text, "jaxserve:num_requests_running") == 2.0
