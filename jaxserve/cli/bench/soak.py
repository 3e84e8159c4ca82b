"""Soak `jaxserve serve`: thousands of mixed requests, then check that nothing leaked.

    python scripts/soak/soak.py --requests 5000 --concurrency 32 --json soak.json
    python scripts/soak/soak.py --model PATH --duration 600 --server-args "--max-num-seqs 16"

Data flow: start `jaxserve serve` as a subprocess (gRPC, OpenAI HTTP and /metrics on free
ports; the test suite's tiny random-weight model, `models.tiny.TEST_SHAPE`, unless --model)
-> wait for its ready line -> a baseline `Snapshot` (/metrics: running, waiting, KV usage x GetModelInfo's num_kv_pages = KV
pages held; /proc/PID: RSS and open fds; gRPC health) -> `run_load`: --requests calls (or until
--duration), --concurrency at a time, each of a kind drawn from `soak_kinds.KINDS` (gRPC
streams and whole answers, HTTP completions and streams, n > 1, logprobs, ~20% cancellations
and short deadlines, bad requests), each labelled with its outcome; RSS and fds sampled every
--sample-interval seconds meanwhile -> `settle`: wait (bounded) until the server holds no
request and no KV page -> a final snapshot -> `checks`: no unexpected outcome (no 5xx, no
UNKNOWN / INTERNAL / UNAVAILABLE, bad requests refused), 0 KV pages, 0 running / waiting,
health SERVING -> summary table (+ JSON with --json); SIGTERM, and the exit code is checked.
Exit status 0 when every check passed. `scripts/soak/soak.py` is this module's `main`;
`tests/scripts/test_soak.py` runs a short version through `soak(SoakConfig(...))`.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import os
import pathlib
import queue
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from typing import Any

import aiohttp
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tqdm import tqdm

from jaxserve.cli.bench.soak_kinds import FAULT_KINDS, KINDS, Ctx
from jaxserve.server.client import AsyncClient

ALL_KINDS = {**KINDS, **FAULT_KINDS}

# Small engine for the tiny model: a small KV cache so preemption happens under load.
TINY_SERVER_ARGS = ["--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--page-size", "8",
                    "--max-model-len", "256", "--attention-impl", "reference",
                    "--kv-cache-memory", "1MiB", "--shutdown-grace", "10"]
READY = re.compile(r"ready: serving .* on (\S+:\d+) http=(\S+) metrics=http://(\S+)/metrics")


@dataclasses.dataclass(frozen=True)
class SoakConfig:
    model: str | None = None  # None: the tiny random-weight test model
    server_args: tuple[str, ...] = ()
    requests: int = 2000
    concurrency: int = 16
    duration_s: float | None = None  # stop issuing requests after this long
    max_prompt: int = 24
    max_tokens: int = 16
    deadline_s: tuple[float, float] = (0.02, 0.5)
    mix: tuple[tuple[str, float], ...] = ()  # kind -> weight overrides
    seed: int = 0
    sample_interval_s: float = 1.0
    request_timeout_s: float = 120.0  # a call taking longer is a hang ("client_hang")
    settle_s: float = 60.0
    start_timeout_s: float = 300.0
    progress: bool = True
    fault_token: int | None = None  # --fault-injection-token for the server; adds FAULT_KINDS


@dataclasses.dataclass(frozen=True)
class Snapshot:
    running: float
    waiting: float
    kv_pages_used: int
    rss_mb: float
    fds: int
    health: str


class ServeProcess:
    """`jaxserve serve` on free ports; the ready line gives the addresses."""

    def __init__(self, model: str, args: list[str], timeout_s: float, env: dict | None = None):
        cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--model", model, "--port", "0",
               "--http-port", "0", "--metrics-port", "0", *args]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                     text=True, env=env)
        self.log: collections.deque[str] = collections.deque(maxlen=200)
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.proc.kill()
                raise RuntimeError("no ready line; stderr:\n" + "".join(self.log)) from None
            m = READY.search(line)
            if m:
                self.target, self.http_url = m.group(1), m.group(2)
                self.metrics_url = f"http://{m.group(3)}/metrics"
                return

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line)
            self._lines.put(line)

    def stop(self, timeout_s: float = 60.0) -> int:
        self.proc.terminate()
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def tiny_model_dir(out: pathlib.Path) -> str:
    """The test suite's tiny random-weight model (`models.tiny.TEST_SHAPE`, the weights
    `tests/support/engine_fixtures.tiny_model()` makes) saved as an HF folder."""
    from jaxserve.models.tiny import TEST_INIT_SCALE, TEST_SHAPE, tiny_config, write_tiny_checkpoint

    write_tiny_checkpoint(out, tiny_config(**TEST_SHAPE), scale=TEST_INIT_SCALE)
    return str(out)


# ---------------------------------------------------------------------------- observation
def proc_usage(pid: int) -> tuple[float, int]:
    """(RSS in MiB, open file descriptors) of a process, from /proc."""
    status = pathlib.Path(f"/proc/{pid}/status").read_text()
    rss_kb = int(re.search(r"VmRSS:\s+(\d+)", status).group(1))  # type: ignore[union-attr]
    return rss_kb / 1024, len(os.listdir(f"/proc/{pid}/fd"))


def metric(text: str, name: str) -> float:
    """Sum of a Prometheus family's samples (over its label sets)."""
    pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", re.M)
    return sum(float(v) for v in pattern.findall(text))


def snapshot(server: ServeProcess, num_kv_pages: int) -> Snapshot:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as resp:
        text = resp.read().decode()
    with grpc.insecure_channel(server.target) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=10).status
    rss, fds = proc_usage(server.proc.pid)
    usage = metric(text, "jaxserve:kv_cache_usage_perc")
    return Snapshot(running=metric(text, "jaxserve:num_requests_running"),
                    waiting=metric(text, "jaxserve:num_requests_waiting"),
                    kv_pages_used=round(usage * num_kv_pages), rss_mb=round(rss, 1), fds=fds,
                    health=health_pb2.HealthCheckResponse.ServingStatus.Name(status))


def settle(server: ServeProcess, num_kv_pages: int, timeout_s: float) -> Snapshot:
    """The first snapshot with nothing running, waiting or held (or the last one at timeout):
    aborts of cancelled calls reach the engine after the client has moved on."""
    deadline = time.monotonic() + timeout_s
    while True:
        snap = snapshot(server, num_kv_pages)
        idle = snap.running == 0 and snap.waiting == 0 and snap.kv_pages_used == 0
        if idle or time.monotonic() > deadline:
            return snap
        time.sleep(0.1)


# ----------------------------------------------------------------------------------- load
@dataclasses.dataclass
class LoadResult:
    outcomes: dict[str, collections.Counter] = dataclasses.field(
        default_factory=lambda: collections.defaultdict(collections.Counter))
    unexpected: list[dict[str, str]] = dataclasses.field(default_factory=list)
    usage_samples: list[tuple[float, float, int]] = dataclasses.field(default_factory=list)
    seconds: float = 0.0

    @property
    def total(self) -> int:
        return sum(sum(c.values()) for c in self.outcomes.values())


async def _one(ctx: Ctx, name: str, rng: random.Random, timeout_s: float) -> tuple[str, str]:
    """(label, detail) of one request of kind `name`; client-side failures are labelled too."""
    try:
        return await asyncio.wait_for(ALL_KINDS[name].send(ctx, rng), timeout_s), ""
    except asyncio.TimeoutError:
        return "client_hang", f"no answer within {timeout_s} s"
    except Exception as e:  # noqa: BLE001 - every failure is an outcome to report
        return f"error:{type(e).__name__}", str(e)[:300]


async def run_load(cfg: SoakConfig, server: ServeProcess, info: Any) -> LoadResult:
    kinds = ALL_KINDS if cfg.fault_token is not None else KINDS
    weights = {name: kind.weight for name, kind in kinds.items()} | dict(cfg.mix)
    names = [n for n, w in weights.items() if w > 0]
    result, rng = LoadResult(), random.Random(cfg.seed)
    issued = 0
    start = time.monotonic()
    bar = tqdm(total=cfg.requests if cfg.requests < sys.maxsize else None,
               disable=not cfg.progress, unit="req", smoothing=0.05)

    async def sampler() -> None:
        while True:
            rss, fds = proc_usage(server.proc.pid)
            result.usage_samples.append((round(time.monotonic() - start, 2), round(rss, 1), fds))
            await asyncio.sleep(cfg.sample_interval_s)

    async def worker(ctx: Ctx, wrng: random.Random) -> None:
        nonlocal issued
        while issued < cfg.requests and (cfg.duration_s is None
                                         or time.monotonic() - start < cfg.duration_s):
            issued += 1
            name = wrng.choices(names, [weights[n] for n in names])[0]
            label, detail = await _one(ctx, name, wrng, cfg.request_timeout_s)
            result.outcomes[name][label] += 1
            if label not in ALL_KINDS[name].expected and len(result.unexpected) < 50:
                result.unexpected.append({"kind": name, "outcome": label, "detail": detail})
            bar.update()

    conn = aiohttp.TCPConnector(limit=cfg.concurrency * 2)
    async with AsyncClient(server.target) as client, aiohttp.ClientSession(connector=conn) as http:
        max_prompt = min(cfg.max_prompt, info.max_model_len // 2)
        ctx = Ctx(grpc=client, http=http, http_url=server.http_url, model=info.model,
                  vocab_size=info.vocab_size, max_prompt=max_prompt, max_tokens=cfg.max_tokens,
                  long_tokens=min(8 * cfg.max_tokens, info.max_model_len - max_prompt),
                  max_n=info.max_n, deadline_s=cfg.deadline_s, fault_token=cfg.fault_token)
        sampling = asyncio.create_task(sampler())
        await asyncio.gather(*(worker(ctx, random.Random(rng.random()))
                               for _ in range(cfg.concurrency)))
        sampling.cancel()
        info_after = await client.model_info()  # the server still answers
    bar.close()
    result.seconds = time.monotonic() - start
    assert info_after.model == info.model
    return result


# --------------------------------------------------------------------------------- report
def checks(load: LoadResult, after: Snapshot, exit_code: int | None) -> dict[str, bool]:
    """The soak's pass conditions (see the module docstring)."""
    out = {"no unexpected outcome": not load.unexpected and all(
               label in ALL_KINDS[name].expected for name, c in load.outcomes.items() for label in c),
           "0 KV pages held": after.kv_pages_used == 0,
           "0 running, 0 waiting": after.running == 0 and after.waiting == 0,
           "health SERVING": after.health == "SERVING"}
    if exit_code is not None:
        out["clean exit on SIGTERM"] = exit_code == 0
    return out


def summary(cfg: SoakConfig, load: LoadResult, before: Snapshot, after: Snapshot,
            exit_code: int | None) -> dict[str, Any]:
    rss = [s[1] for s in load.usage_samples] or [after.rss_mb]
    fds = [s[2] for s in load.usage_samples] or [after.fds]
    result = {
        "config": dataclasses.asdict(cfg), "requests": load.total,
        "seconds": round(load.seconds, 1),
        "outcomes": {k: dict(v) for k, v in sorted(load.outcomes.items())},
        "by_outcome": dict(sum(load.outcomes.values(), collections.Counter())),
        "unexpected": load.unexpected, "before": dataclasses.asdict(before),
        "after": dataclasses.asdict(after),
        "rss_mb": {"min": min(rss), "max": max(rss)}, "fds": {"min": min(fds), "max": max(fds)},
        "usage_samples": load.usage_samples, "exit_code": exit_code,
        "checks": checks(load, after, exit_code),
    }
    result["passed"] = all(result["checks"].values())
    return result


def print_summary(r: dict[str, Any]) -> None:
    print(f"\nsoak: {r['requests']} requests in {r['seconds']} s")
    labels = sorted(r["by_outcome"])
    print(f"{'kind':16}" + "".join(f"{lb[:14]:>15}" for lb in labels))
    for kind, counts in r["outcomes"].items():
        print(f"{kind:16}" + "".join(f"{counts.get(lb, 0):>15}" for lb in labels))
    print(f"{'total':16}" + "".join(f"{r['by_outcome'][lb]:>15}" for lb in labels))
    print(f"\n{'':16}{'before':>12}{'after':>12}")
    for key in ("running", "waiting", "kv_pages_used", "rss_mb", "fds", "health"):
        print(f"{key:16}{r['before'][key]!s:>12}{r['after'][key]!s:>12}")
    print(f"RSS during the run: {r['rss_mb']['min']}-{r['rss_mb']['max']} MiB; "
          f"fds {r['fds']['min']}-{r['fds']['max']}; exit code {r['exit_code']}")
    for u in r["unexpected"][:10]:
        print(f"unexpected: {u['kind']}: {u['outcome']} {u['detail']}")
    for name, ok in r["checks"].items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")


def soak(cfg: SoakConfig, env: dict | None = None) -> dict[str, Any]:
    """Start the server, run the load, settle, stop the server; the summary dict."""
    with tempfile.TemporaryDirectory(prefix="jaxserve-soak-") as tmp:
        model = cfg.model or tiny_model_dir(pathlib.Path(tmp))
        args = list(cfg.server_args) or (TINY_SERVER_ARGS if cfg.model is None else [])
        if cfg.fault_token is not None:
            args += ["--fault-injection-token", str(cfg.fault_token)]
        server = ServeProcess(model, args, cfg.start_timeout_s, env)
        exit_code = None
        try:
            info = _model_info(server.target)
            before = snapshot(server, info.num_kv_pages)
            load = asyncio.run(run_load(cfg, server, info))
            after = settle(server, info.num_kv_pages, cfg.settle_s)
        finally:
            exit_code = server.stop()
    return summary(cfg, load, before, after, exit_code)


def _model_info(target: str) -> Any:
    async def get() -> Any:
        async with AsyncClient(target) as client:
            return await client.model_info()
    return asyncio.run(get())
