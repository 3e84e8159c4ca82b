"""End-to-end overhead of the gRPC path over the offline API, on the same workload.

Data flow: a seeded workload (N requests, token-id prompts of random lengths, greedy, fixed
output lengths with ignore_eos so both paths generate exactly the same tokens) ->
  offline  one Engine built in this process (what `LLM.generate` drives): all requests added
           at t0, stepped to completion; TTFT = first token time - t0 per request.
  grpc     `jaxserve serve` as a separate process on 127.0.0.1 with the same engine flags;
           this process opens N concurrent streams (asyncio client) at t0; TTFT = first
           chunk received - t0, measured by the client.
-> output tokens/s (all output tokens / wall time) and TTFT p50 / p90 for both, the relative
overhead, and a check that both paths produced identical tokens; printed and written to --json.

    python scripts/bench/bench_grpc_overhead.py --model tiny --json bench_grpc.json
    python scripts/bench/bench_grpc_overhead.py --json bench_grpc_smollm.json   # bundled SmolLM2
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import pathlib
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np


def workload(n: int, seed: int, vocab: int, in_range: tuple[int, int],
             out_range: tuple[int, int]) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(seed)
    lo = 3 if vocab < 1000 else 100  # skip special tokens
    prompts = [[int(x) for x in rng.integers(lo, vocab - 1, int(k))]
               for k in rng.integers(in_range[0], in_range[1] + 1, n)]
    outs = [int(x) for x in rng.integers(out_range[0], out_range[1] + 1, n)]
    return prompts, outs


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def summary(wall: float, ttfts: list[float], tokens: int) -> dict:
    return {"wall_s": wall, "output_tokens": tokens, "output_tokens_per_s": tokens / wall,
            "ttft_p50_s": statistics.median(ttfts), "ttft_p90_s": pct(ttfts, 90)}


def run_offline(engine, prompts: list[list[int]],  # noqa: ANN001 - an Engine
                outs: list[int]) -> tuple[dict, list]:
    from jaxserve import SamplingParams

    t0 = time.monotonic()
    for i, (p, m) in enumerate(zip(prompts, outs)):
        engine.add_request(f"b{i}", p, SamplingParams(temperature=0.0, max_tokens=m,
                                                      ignore_eos=True), arrival_time=t0)
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    wall = time.monotonic() - t0
    results = [finals[f"b{i}"].outputs[0] for i in range(len(prompts))]
    ttfts = [r.metrics.first_token_time - t0 for r in results]
    return summary(wall, ttfts, sum(len(r.token_ids) for r in results)), \
        [r.token_ids for r in results]


async def _grpc_workload(client, prompts: list[list[int]], outs: list[int]  # noqa: ANN001
                         ) -> tuple[dict, list]:
    from jaxserve import SamplingParams

    t0 = time.monotonic()

    async def one(p: list[int], m: int) -> tuple[float, list[int], float]:
        first = None
        ids: list[int] = []
        server_ttft = float("nan")
        async for msg in client.stream(p, SamplingParams(temperature=0.0, max_tokens=m,
                                                         ignore_eos=True)):
            if msg.HasField("chunk"):
                first = first or time.monotonic()
                ids.extend(msg.chunk.token_ids)
            elif msg.HasField("finished"):
                server_ttft = msg.finished.timing.ttft_s
        return (first or time.monotonic()) - t0, ids, server_ttft

    results = await asyncio.gather(*(one(p, m) for p, m in zip(prompts, outs)))
    wall = time.monotonic() - t0
    res = summary(wall, [r[0] for r in results], sum(len(r[1]) for r in results))
    # The server's own view (call arrival -> first token), without the network legs.
    res["server_side_ttft_p50_s"] = statistics.median(r[2] for r in results)
    return res, [r[1] for r in results]


async def run_grpc(target: str, prompts: list[list[int]], outs: list[int]
                   ) -> tuple[dict, list]:
    from jaxserve.server.client import AsyncClient

    # One channel for warmup and measurement: connection setup is not per-request cost.
    async with AsyncClient(target) as client:
        await _grpc_workload(client, prompts[:4], [4] * 4)
        return await _grpc_workload(client, prompts, outs)


def engine_flags(cfg) -> list[str]:  # noqa: ANN001 - EngineConfig
    flags = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if value is None:
            continue
        name = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(name if value else "--no-" + f.name.replace("_", "-"))
        elif isinstance(value, tuple):
            flags += [name, ",".join(map(str, value))]
        else:
            flags += [name, str(value)]
    return flags


class ServerProcess:
    """`jaxserve serve --port 0 --no-http` in a subprocess; `target` once its ready line
    appears."""

    def __init__(self, flags: list[str], timeout: float = 900.0):
        cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--port", "0", "--no-http", *flags]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                     text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.ready = threading.Event()
        self.target = ""
        self.log: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        if not self.ready.wait(timeout) or not self.target:
            self.proc.kill()
            raise RuntimeError("server did not become ready:\n" + "".join(self.log))

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line)
            m = re.search(r"ready: serving .* on (\S+:\d+)", line)
            if m:
                self.target = m.group(1)
                self.ready.set()
        self.ready.set()  # exited

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="bundled",
                    help="'bundled' (SmolLM2-135M), 'tiny' (the tests' random 2-layer model) or a path")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--input-len", type=int, nargs=2, default=(16, 256))
    ap.add_argument("--output-len", type=int, nargs=2, default=(32, 128))
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--attention-impl", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stream-interval", type=int, default=1,
                    help="the server's --stream-interval (tokens per chunk after the first)")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()

    from jaxserve.config import EngineConfig, RuntimeConfig, apply_runtime
    from jaxserve.models.loading import load_model
    from jaxserve.serving.build import build_engine

    apply_runtime(RuntimeConfig.from_env())
    tmp = None
    if args.model == "tiny":
        from jaxserve.models.tiny import (TEST_INIT_SCALE, TEST_SHAPE, tiny_config,
                                          write_tiny_checkpoint)

        tmp = tempfile.TemporaryDirectory(prefix="jaxserve-bench-")
        write_tiny_checkpoint(pathlib.Path(tmp.name), tiny_config(**TEST_SHAPE),
                              scale=TEST_INIT_SCALE)
        model_path: str | None = tmp.name
    else:
        model_path = None if args.model == "bundled" else args.model
    cfg = EngineConfig(model=model_path, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens,
                       max_model_len=args.max_model_len, attention_impl=args.attention_impl)
    model = load_model(model_path, cfg.dtype)
    prompts, outs = workload(args.requests, args.seed, model.config.vocab_size,
                             tuple(args.input_len), tuple(args.output_len))

    engine = build_engine(cfg, model, warmup=True, progress=False)
    run_offline(engine, prompts[:4], [4] * 4)  # first-step effects out of the way
    offline, offline_ids = run_offline(engine, prompts, outs)
    del engine

    server = ServerProcess(engine_flags(cfg) + ["--max-waiting", "0", "--stream-interval",
                                                str(args.stream_interval)])
    try:
        grpc_res, grpc_ids = asyncio.run(run_grpc(server.target, prompts, outs))
    finally:
        server.stop()
    result = {
        "model": args.model, "requests": args.requests, "input_len": args.input_len,
        "output_len": args.output_len, "stream_interval": args.stream_interval,
        "engine": {k: v for k, v in dataclasses.asdict(cfg).items() if k != "model"},
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(),
                 "python": platform.python_version()},
        "offline": offline, "grpc": grpc_res,
        "tokens_identical": offline_ids == grpc_ids,
        "throughput_overhead_pct": 100 * (1 - grpc_res["output_tokens_per_s"]
                                          / offline["output_tokens_per_s"]),
        "ttft_p50_overhead_s": grpc_res["ttft_p50_s"] - offline["ttft_p50_s"],
    }
    print(f"{'path':8} {'tok/s':>10} {'TTFT p50 ms':>12} {'TTFT p90 ms':>12} {'wall s':>8}")
    for name in ("offline", "grpc"):
        r = result[name]
        print(f"{name:8} {r['output_tokens_per_s']:10.1f} {1e3 * r['ttft_p50_s']:12.1f} "
              f"{1e3 * r['ttft_p90_s']:12.1f} {r['wall_s']:8.2f}")
    print(f"throughput overhead {result['throughput_overhead_pct']:.1f}%, TTFT p50 "
          f"+{1e3 * result['ttft_p50_overhead_s']:.1f} ms, identical tokens: "
          f"{result['tokens_identical']}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=2))
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
