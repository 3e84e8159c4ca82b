#!/usr/bin/env python
"""Compiled bucket sets traded off: padding vs warmup compiles and start-up; prints tables and
writes JSON.

Sections (--sections, default all three):
  cost     the bundled model's (or --model's) compiled step on this machine, per bucket, best of
           --runs runs taken round robin, as wall ms and as CPU ms (the process's CPU time over
           all threads: steadier than wall time on a shared host, and what padding costs in
           work): kind `pad` for an all-padding batch of bucket (T, S) (what padding rows cost:
           the dense layers and norms on T rows, lm_head and sampler on S rows, nothing in
           attention), kind `decode` for T = S live decode sequences at context --context (a
           real decode step). Also each variant's first call (its compile; a new S compiles
           the sampler too) and a least-squares fit cpu_ms ~ a + b * T + r * S. The curve
           decides where finer buckets pay.
  padding  the scheduler over the benchmark workloads (docs/benchmarks/: 256-token prompts and
           128 new tokens at concurrency 1, 8, 32; 2048-token prompts at concurrency 8; closed
           loop, random prompts, every request to its max_tokens) with the arithmetic fake runner
           and the buckets `sizing.plan_engine` derives for each bucket set; each step's
           (tokens, seqs) and the bucket it ran in give
             token padding = sum(T_b - tokens) / sum(T_b)
             time padding  = sum(D(T_b, S_b) - D(tokens, seqs)) / sum(D(T_b, S_b))
           where D is the all-padding cost curve (CPU ms, interpolated linearly between the
           measured points; `CostCurve`). D leaves out attention, which only live rows cost
           and padding does not change, so the time fraction is an upper bound on the share
           of the steps' time spent on padding. Also the worst step of each workload.
  startup  a fresh process per bucket set builds the serving engine (load, size, compile every
           bucket: `ModelRunner.buckets()`), twice with one new persistent compilation cache
           dir: cold (empty cache) and warm (second start); seconds from process start to ready.

Bucket sets (--sets): `pow2` the former default (powers of two up to the token budget, one
seqs bucket per token bucket, min(T, max_num_seqs)); `default` what `plan_engine` derives now;
`octN` the default rule with N buckets per octave above 64 tokens (the default is oct4).

    python scripts/bench/bench_buckets.py --json buckets.json
    python scripts/bench/bench_buckets.py --sections padding --cost-from buckets.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np
# Its sibling in scripts/bench/: Python puts a script's own folder first on sys.path.
from bucket_padding import WORKLOADS, CostCurve, padding_figures, run_workload, worst_steps

from jaxserve.config import EngineConfig
from jaxserve.engine.batch import StepBatch, default_buckets, default_token_buckets

# The former default: powers of two from 1 to the token budget (as plan_engine derived them).
POW2 = "pow2"
DEFAULT = "default"
# What the cost section measures: every multiple of 8 to 64, then steps of 1/8 to 1/4 of an
# octave up to the default token budget.
COST_TOKENS = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256,
               320, 384, 448, 512)


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def set_config(name: str, base: EngineConfig) -> EngineConfig:
    """`base` with the token / seqs buckets of bucket set `name`: `pow2`, `default`, or
    `octN` (the default rule with N steps per octave above 64 tokens)."""
    if name == POW2:
        return dataclasses.replace(
            base, token_buckets=default_buckets(base.max_num_batched_tokens, 1),
            seq_buckets=None)
    if name == DEFAULT:
        return base
    if name.startswith("oct"):
        return dataclasses.replace(base, token_buckets=default_token_buckets(
            base.max_num_batched_tokens, int(name[3:])), seq_buckets=None)
    raise ValueError(f"unknown bucket set {name!r}")


# ---------------------------------------------------------------------------------------- cost

def decode_batch(empty: StepBatch, n: int, ctx: int, page_size: int) -> StepBatch:
    """`empty` (an all-padding batch of bucket (n, n)) filled with n live decode sequences of
    context `ctx`, each on its own pages."""
    pages = ctx // page_size + 1
    tables = 1 + np.arange(n * pages, dtype=np.int32).reshape(n, pages)
    b = empty.forward
    b.token_ids[:] = 1
    b.positions[:] = ctx
    b.slot_mapping[:] = tables[:, -1] * page_size + ctx % page_size
    b.block_tables[:, :pages] = tables
    b.kv_lens[:] = ctx + 1
    b.cu_q_lens[:] = np.arange(n + 1)
    b.num_seqs[:] = n
    b.logits_indices[:] = np.arange(n)
    return empty


def measure_cost(args: argparse.Namespace) -> dict:
    from jaxserve.device.model_runner import empty_batch
    from jaxserve.models import loading
    from jaxserve.serving.build import build_engine

    tokens = ints(args.cost_tokens)
    ctx = args.context
    model = loading.load_model(args.model)
    cfg = EngineConfig(model=args.model, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=max(tokens), token_buckets=tuple(tokens),
                       max_model_len=max(1024, ctx + 16), kv_cache_memory=1 << 29,
                       enable_prefix_caching=False, async_scheduling=False)
    engine = build_engine(cfg, model, warmup=False, progress=False)
    runner = engine.runner
    shape = runner.shape
    ps = shape.page_size
    # (kind, T, S) -> a batch factory (fresh arrays each run: the step donates nothing of them,
    # but the runner may keep references).
    variants: dict[tuple[str, int, int], object] = {}
    for t in tokens:
        s = min(t, args.max_num_seqs)
        variants[("pad", t, s)] = lambda t=t, s=s: empty_batch(shape, t, s, False)
        if t <= args.max_num_seqs and t * (ctx // ps + 1) <= engine.limits.num_kv_pages:
            variants[("decode", t, t)] = lambda t=t: decode_batch(
                empty_batch(shape, t, t, False), t, ctx, ps)
    for t in ints(args.cost_prefill_tokens):
        for s in ints(args.cost_prefill_seqs):
            variants[("pad", t, s)] = lambda t=t, s=s: empty_batch(shape, t, s, False)
    compile_s: dict = {}
    for key, make in variants.items():
        t0 = time.perf_counter()
        runner.execute(make())
        compile_s[key] = time.perf_counter() - t0
        print(f"  first call {key}: {compile_s[key]:.1f} s", flush=True)
    best = {k: float("inf") for k in variants}
    cpu = {k: float("inf") for k in variants}
    for i in range(args.runs + 1):
        for key, make in variants.items():
            b = make()
            t0, c0 = time.perf_counter(), time.process_time()
            runner.execute(b)
            if i:
                best[key] = min(best[key], 1e3 * (time.perf_counter() - t0))
                cpu[key] = min(cpu[key], 1e3 * (time.process_time() - c0))
    rows = [{"kind": k, "tokens": t, "seqs": s, "ms": best[(k, t, s)], "cpu_ms": cpu[(k, t, s)],
             "first_call_s": compile_s[(k, t, s)]} for (k, t, s) in variants]
    return {"context": ctx, "max_num_seqs": args.max_num_seqs, "runs": args.runs,
            "rows": rows}


def fit_cost(cost: dict) -> dict:
    """Least squares cpu_ms ~ a + b * T + r * S over the all-padding rows with T >= 2 (one
    token runs a cheaper matrix-vector path): the fixed part, per token, per sequence row."""
    rows = [r for r in cost["rows"] if r["kind"] == "pad" and r["tokens"] >= 2]
    x = np.array([[1.0, r["tokens"], r["seqs"]] for r in rows])
    y = np.array([r["cpu_ms"] for r in rows])
    (a, b, r), *_ = np.linalg.lstsq(x, y, rcond=None)
    worst = float(np.max(np.abs(x @ np.array([a, b, r]) - y) / y))
    return {"a_ms": float(a), "b_ms_per_token": float(b), "r_ms_per_seq": float(r),
            "worst_relative_error": worst}


def print_cost(cost: dict) -> None:
    print(f"\nstep time per bucket, best of {cost['runs']} (decode: live sequences at context "
          f"{cost['context']}; pad: all padding)")
    print(f"{'kind':7s} {'T':>5s} {'S':>4s} {'wall ms':>9s} {'cpu ms':>9s} {'cpu ms/token':>13s} "
          f"{'first call s':>13s}")
    for r in sorted(cost["rows"], key=lambda r: (r["kind"], r["tokens"], r["seqs"])):
        print(f"{r['kind']:7s} {r['tokens']:5d} {r['seqs']:4d} {r['ms']:9.1f} {r['cpu_ms']:9.1f} "
              f"{r['cpu_ms'] / r['tokens']:13.2f} {r['first_call_s']:13.1f}")
    f = fit_cost(cost)
    print(f"fit (all padding, T >= 2): cpu ms = {f['a_ms']:.1f} + {f['b_ms_per_token']:.2f} * T "
          f"+ {f['r_ms_per_seq']:.2f} * S (worst error {100 * f['worst_relative_error']:.0f}%)")


# ------------------------------------------------------------------------------------ padding

def measure_padding(args: argparse.Namespace, base: EngineConfig,
                    curve: CostCurve | None) -> dict:
    out: dict = {}
    for name in args.sets.split(","):
        cfg = set_config(name, base)
        out[name] = {}
        for wl, prompt, new, conc, num in WORKLOADS:
            steps = run_workload(cfg, prompt, new, conc, num)
            out[name][wl] = padding_figures(steps, curve)
        if curve is not None:
            out[name]["every step"] = worst_steps(cfg, curve)
    return out


def print_padding(padding: dict) -> None:
    print("\npadding on the benchmark workloads (fake runner; time from the all-padding cost "
          "curve)")
    print(f"{'set':8s} {'workload':16s} {'steps':>6s} {'tokens':>8s} {'tok pad':>8s} "
          f"{'worst':>6s} {'time pad':>9s} {'worst':>6s}")
    for name, wls in padding.items():
        for wl, r in wls.items():
            if wl == "every step":
                continue
            tp = f"{100 * r['time_padding']:8.1f}%" if "time_padding" in r else f"{'-':>9s}"
            tw = (f"{100 * r['worst_step_time_padding']:5.1f}%"
                  if "time_padding" in r else f"{'-':>6s}")
            print(f"{name:8s} {wl:16s} {r['steps']:6d} {r['tokens']:8d} "
                  f"{100 * r['token_padding']:7.1f}% {100 * r['worst_step_token_padding']:5.1f}% "
                  f"{tp} {tw}")
    print("\nworst time padding over every (tokens, seqs) a step can have (step -> bucket)")
    for name, wls in padding.items():
        w = wls.get("every step")
        if w:
            print(f"{name:8s} {w['forward_buckets']:3d} forward buckets  " + "  ".join(
                f"{kind} {100 * w[kind]['time_padding']:4.1f}% {tuple(w[kind]['step_and_bucket'])}"
                for kind in ("decode", "full", "any")))


# ------------------------------------------------------------------------------------ startup

# Run in a fresh process: build the serving engine (load, size, compile every bucket, arm the
# compile guard) and print what warmup ran and how long it took. The whole start is timed by
# the parent, from the child's start to its exit, so imports and JAX's start count as they do
# for a server; also its CPU seconds (steadier than wall time on a shared host).
_CHILD = """
import json, sys, time
from jaxserve.config import EngineConfig
from jaxserve.serving.build import build_engine, warm_up
cfg = EngineConfig(**json.loads(sys.argv[1]))
engine = build_engine(cfg, warmup=False, progress=False)
t0 = time.perf_counter()
warm_up([engine], False)
warmup_s = time.perf_counter() - t0
runner = engine.runner
print("RESULT " + json.dumps({"forward_buckets": len(runner.shape.buckets),
      "warmup_runs": len(runner.buckets()), "warmup_s": warmup_s,
      "seq_buckets": len({s for _, s in runner.shape.buckets}),
      "compiles_after_warmup": runner.compiles_after_warmup}), flush=True)
"""


def start_once(cfg: EngineConfig, cache_dir: str) -> dict:
    fields = {"model": cfg.model, "max_num_seqs": cfg.max_num_seqs,
              "max_num_batched_tokens": cfg.max_num_batched_tokens,
              "token_buckets": cfg.token_buckets, "seq_buckets": cfg.seq_buckets,
              "compilation_cache_dir": cache_dir, "max_model_len": cfg.max_model_len,
              "kv_cache_memory": cfg.kv_cache_memory}
    env = dict(os.environ, JAXSERVE_COMPILATION_CACHE_DIR=cache_dir)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(fields)], env=env,
                          capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"start-up child failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return {"seconds": wall, "cpu_s": cpu, **json.loads(lines[-1][len("RESULT "):])}


def measure_startup(args: argparse.Namespace, base: EngineConfig) -> dict:
    out: dict = {}
    for name in args.sets.split(","):
        cfg = dataclasses.replace(set_config(name, base),
                                  kv_cache_memory=int(args.startup_kv_gib * 2**30))
        with tempfile.TemporaryDirectory(prefix="jaxserve-xla-") as cache:
            cold = start_once(cfg, cache)
            warm = start_once(cfg, cache)
        out[name] = {"cold_s": cold["seconds"], "warm_s": warm["seconds"],
                     "cold_cpu_s": cold["cpu_s"], "warm_cpu_s": warm["cpu_s"],
                     "cold_warmup_s": cold["warmup_s"], "warm_warmup_s": warm["warmup_s"],
                     **{k: v for k, v in cold.items()
                        if k not in ("seconds", "cpu_s", "warmup_s")}}
        print(f"  {name}: cold {cold['seconds']:.1f} s, warm {warm['seconds']:.1f} s",
              flush=True)
    return out


def print_startup(startup: dict) -> None:
    print("\nstart-up: fresh process to ready (every bucket compiled); warm = second start "
          "with the persistent compilation cache; (of which warmup); CPU s of the process")
    print(f"{'set':8s} {'forward':>7s} {'seqs':>4s} {'warmup runs':>11s} "
          f"{'cold s':>14s} {'warm s':>14s} {'cold cpu s':>10s} {'warm cpu s':>10s}")
    for name, r in startup.items():
        print(f"{name:8s} {r['forward_buckets']:7d} {r['seq_buckets']:4d} {r['warmup_runs']:11d} "
              f"{r['cold_s']:6.1f} ({r['cold_warmup_s']:5.1f}) "
              f"{r['warm_s']:6.1f} ({r['warm_warmup_s']:5.1f}) "
              f"{r['cold_cpu_s']:10.1f} {r['warm_cpu_s']:10.1f}")


# ------------------------------------------------------------------------------------- main

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sections", default="cost,padding,startup")
    ap.add_argument("--sets", default=f"{POW2},{DEFAULT}")
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int,
                    default=EngineConfig().max_num_batched_tokens)
    ap.add_argument("--context", type=int, default=256, help="decode steps' context (cost)")
    ap.add_argument("--cost-tokens", default=",".join(map(str, COST_TOKENS)))
    ap.add_argument("--cost-prefill-tokens", default="64,256,512",
                    help="token buckets also measured with the --cost-prefill-seqs seqs")
    ap.add_argument("--cost-prefill-seqs", default="1,8")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--startup-kv-gib", type=float, default=2.0,
                    help="KV cache of the start-up engines (default engines size it from RAM)")
    ap.add_argument("--cost-from", default=None, help="a JSON of an earlier run's cost section")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    sections = args.sections.split(",")
    results: dict = {"args": vars(args)}
    if "cost" in sections:
        results["cost"] = measure_cost(args)
        print_cost(results["cost"])
    base = EngineConfig(max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens)
    if args.cost_from:
        results["cost"] = json.loads(pathlib.Path(args.cost_from).read_text())["cost"]
    curve = CostCurve(results["cost"]) if "cost" in results else None
    if "padding" in sections:
        results["padding"] = measure_padding(args, base, curve)
        print_padding(results["padding"])
    if "startup" in sections:
        results["startup"] = measure_startup(args, base)
        print_startup(results["startup"])
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
