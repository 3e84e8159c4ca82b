#!/usr/bin/env python3
"""Benchmark ragged paged attention (and write_kv) on decode-heavy / prefill-heavy / mixed steps.

Per mix: milliseconds per call (median), achieved GB/s (K/V read over each sequence's kv_len
+ q read + output written; page reads past kv_len are not counted) and TFLOP/s (4 * Hq * D per
causal query-key pair), and -- with --measure-ceilings -- their ratio to this device's
measured HBM copy bandwidth and bf16 matmul throughput. Writes everything to --json.

    python scripts/bench/bench_attention.py                    # small CPU-sized mixes, reference
    python scripts/bench/bench_attention.py --size full --impl pallas_gpu --dtype bfloat16 \\
        --measure-ceilings --json out.json               # full size: 64 x 2048, 4 x 2048
    python scripts/bench/bench_attention.py --size cpu --impl reference cpu --dtype float32 \\
        --num-q-heads 9 --num-kv-heads 3 --head-dim 64   # SmolLM2-135M's heads on CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.kernels_pallas import (AttentionMetadata, ragged_paged_attention, select_impl,
                                     write_kv)

# mix -> size -> list of (context_len, q_len) per sequence
# "cpu": the engine's CPU workload (32 decodes at context 256, one 2048-token prefill, 30
# decodes beside a 512-token prefill chunk).
MIXES = {
    "decode": {"small": [(256, 1)] * 8, "cpu": [(256, 1)] * 32, "full": [(2048, 1)] * 64},
    "prefill": {"small": [(0, 256)] * 2, "cpu": [(0, 2048)], "full": [(0, 2048)] * 4},
    "mixed": {"small": [(128, 1)] * 6 + [(64, 128)], "cpu": [(256, 1)] * 30 + [(0, 512)],
              "full": [(2048, 1)] * 48 + [(1024, 512)] * 2},
}


# --check tolerance on max |kernel - reference|, relative to max |reference| (at least 1):
# online-softmax rounding in the page dtype.
CHECK_TOL = {"float32": 2e-3, "bfloat16": 3e-2, "float16": 5e-3}


def build_step(specs: list[tuple[int, int]], *, hq: int, hkv: int, d: int, ps: int,
               dtype: jnp.dtype, seed: int = 0) -> tuple[Any, ...]:
    """A step with pages scattered at random (fragmented cache) and random contents."""
    rng = np.random.default_rng(seed)
    kv_lens = np.array([c + n for c, n in specs], np.int32)
    q_lens = np.array([n for _, n in specs], np.int32)
    n_pages = -(-kv_lens // ps)
    max_pages = int(n_pages.max())
    num_pages = 1 + int(n_pages.sum())
    perm = rng.permutation(np.arange(1, num_pages)).astype(np.int32)
    bt = np.zeros((len(specs), max_pages), np.int32)
    slots, used = [], 0
    for s, (ctx, n) in enumerate(specs):
        own = perm[used:used + n_pages[s]]
        used += n_pages[s]
        bt[s, : len(own)] = own
        pos = np.arange(ctx, ctx + n)
        slots.append(own[pos // ps] * ps + pos % ps)
    t = int(q_lens.sum())
    md = AttentionMetadata(
        slot_mapping=jnp.asarray(np.concatenate(slots).astype(np.int32)),
        block_tables=jnp.asarray(bt), kv_lens=jnp.asarray(kv_lens),
        cu_q_lens=jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)),
        num_seqs=jnp.asarray([len(specs)], jnp.int32))
    keys = jax.random.split(jax.random.key(seed), 3)
    pages = jax.random.normal(keys[0], (num_pages, 2 * hkv, ps, d), jnp.float32).astype(dtype)
    q = jax.random.normal(keys[1], (t, hq, d), jnp.float32).astype(dtype)
    kv_new = jax.random.normal(keys[2], (2, t, hkv, d), jnp.float32).astype(dtype)
    return q, pages, kv_new[0], kv_new[1], md


def step_cost(specs: list[tuple[int, int]], *, hq: int, hkv: int, d: int, itemsize: int,
              sliding_window: int | None) -> tuple[float, float]:
    """(bytes moved, flops) of one attention call, counting only what a perfect kernel needs."""
    t = sum(n for _, n in specs)
    kv_bytes = sum((c + n) for c, n in specs) * 2 * hkv * d * itemsize
    pairs = 0
    for c, n in specs:
        seen = np.arange(c + 1, c + n + 1)
        pairs += int(np.minimum(seen, sliding_window).sum() if sliding_window else seen.sum())
    return kv_bytes + 2 * t * hq * d * itemsize, 4.0 * hq * d * pairs


def timed(fn, *args, iters: int, warmup: int = 2) -> float:
    """Median seconds per call of an already-jitted function."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_ceilings(platform: str, iters: int) -> dict[str, float]:
    """HBM bandwidth of a large elementwise copy and bf16 matmul TFLOP/s on this device."""
    n_bytes = (2 << 30) if platform != "cpu" else (64 << 20)
    x = jnp.ones((n_bytes // 4,), jnp.float32)
    copy_s = timed(jax.jit(lambda x: x * 1.0001), x, iters=iters)
    n = 8192 if platform != "cpu" else 1024
    a = jnp.ones((n, n), jnp.bfloat16)
    mm_s = timed(jax.jit(lambda a: a @ a), a, iters=iters)
    del x, a
    return {"hbm_gbps": 2 * n_bytes / copy_s / 1e9, "matmul_tflops": 2 * n**3 / mm_s / 1e12}


def run_config(mix: str, specs, args, impl: str, tuning: dict[str, int]) -> dict[str, Any]:
    dtype = jnp.dtype(args.dtype)
    q, pages, k_new, v_new, md = build_step(specs, hq=args.num_q_heads, hkv=args.num_kv_heads,
                                            d=args.head_dim, ps=args.page_size, dtype=dtype)
    # write_kv with donated pages, chained call to call the way the engine uses it (in place).
    write = jax.jit(write_kv, donate_argnums=0)
    write_times = []
    for _ in range(args.iters + 1):
        t0 = time.perf_counter()
        pages = jax.block_until_ready(write(pages, k_new, v_new, md.slot_mapping))
        write_times.append(time.perf_counter() - t0)
    # --sinks: gpt-oss's attention sinks, one random logit per query head.
    sinks = (jnp.asarray(np.random.default_rng(1).standard_normal(args.num_q_heads),
                         jnp.float32) if args.sinks else None)
    attn = jax.jit(lambda q, p, m: ragged_paged_attention(
        q, p, m, sm_scale=args.head_dim ** -0.5, sliding_window=args.sliding_window,
        impl=impl, interpret=args.interpret, sinks=sinks, **tuning))
    check = None
    if args.check and impl != "reference":  # correctness at this very shape, before timing
        ref = jax.jit(lambda q, p, m: ragged_paged_attention(
            q, p, m, sm_scale=args.head_dim ** -0.5, sliding_window=args.sliding_window,
            impl="reference", sinks=sinks))(q, pages, md)
        got = attn(q, pages, md)
        err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - ref.astype(jnp.float32))))
        scale = float(jnp.max(jnp.abs(ref.astype(jnp.float32))))
        # The GPU kernel's WGMMA takes 16-bit operands: f32 pages are rounded to bf16.
        tol = CHECK_TOL["bfloat16" if impl == "pallas_gpu" else dtype.name] * max(scale, 1.0)
        check = {"max_abs_err": err, "ref_max_abs": scale, "tol": tol,
                 "ok": bool(err <= tol and np.isfinite(err))}
        del ref, got
    secs = timed(attn, q, pages, md, iters=args.iters)
    n_bytes, flops = step_cost(specs, hq=args.num_q_heads, hkv=args.num_kv_heads,
                               d=args.head_dim, itemsize=dtype.itemsize,
                               sliding_window=args.sliding_window)
    return {"mix": mix, "impl": impl, "tuning": tuning, "dtype": dtype.name,
            "num_tokens": int(q.shape[0]), "num_seqs": len(specs),
            "max_kv_len": max(c + n for c, n in specs), "ms": secs * 1e3,
            "gbps": n_bytes / secs / 1e9, "tflops": flops / secs / 1e12,
            "write_kv_ms": statistics.median(write_times[1:]) * 1e3,
            **({"check": check} if check else {})}


def parse_tuning(items: list[str]) -> list[dict[str, int]]:
    """--tuning 'block_kv=128,num_stages=3' (repeatable) -> list of kwargs dicts."""
    out = []
    for item in items or [""]:
        out.append({k: int(v) for k, v in (kv.split("=") for kv in item.split(",") if kv)})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impl", nargs="+", default=["auto"],
                    help="auto | reference | cpu | pallas_tpu | pallas_gpu (several: compared)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--mix", nargs="+", default=["decode", "prefill", "mixed"],
                    choices=sorted(MIXES))
    ap.add_argument("--size", default="small", choices=["small", "cpu", "full"],
                    help="small: quick; cpu: 32 x 256 decode, 1 x 2048 prefill; full: 64 x "
                         "2048 decode, 4 x 2048 prefill")
    ap.add_argument("--num-q-heads", type=int, default=32)
    ap.add_argument("--num-kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--sliding-window", type=int, default=None)
    ap.add_argument("--sinks", action="store_true",
                    help="with attention sinks (gpt-oss): one random logit per query head")
    ap.add_argument("--iters", type=int, default=None, help="timed calls (default 3 CPU, 20)")
    ap.add_argument("--tuning", action="append",
                    help="kernel knobs, e.g. block_kv=128,num_stages=3; repeat to sweep")
    ap.add_argument("--interpret", action="store_true",
                    help="run a Pallas kernel in its CPU interpreter (smoke test; slow timings)")
    ap.add_argument("--measure-ceilings", action="store_true")
    ap.add_argument("--check", action="store_true",
                    help="compare each kernel's output with the jnp reference at the same "
                         "shape before timing it (max abs error vs a dtype tolerance)")
    ap.add_argument("--json", default=None, help="write results here")
    args = ap.parse_args(argv)

    platform = jax.default_backend()
    args.iters = args.iters or (3 if platform == "cpu" else 20)
    impls = [select_impl(name) for name in args.impl]
    device = str(jax.devices()[0].device_kind)
    ceilings = measure_ceilings(platform, args.iters) if args.measure_ceilings else None
    results = []
    for mix, impl, tuning in ((m, i, t) for m in args.mix for i in impls
                              for t in parse_tuning(args.tuning)):
        try:
            r = run_config(mix, MIXES[mix][args.size], args, impl, tuning)
        except Exception as e:  # noqa: BLE001 -- one bad config must not sink the sweep
            print(f"  {mix} {impl} {tuning}: {type(e).__name__}: {e}", file=sys.stderr)
            results.append({"mix": mix, "impl": impl, "tuning": tuning,
                            "error": f"{type(e).__name__}: {e}"[:2000]})
            continue
        if ceilings:
            r["bw_fraction"] = r["gbps"] / ceilings["hbm_gbps"]
            r["flops_fraction"] = r["tflops"] / ceilings["matmul_tflops"]
        results.append(r)
        print(f"  {mix:8s} {impl} {tuning or ''}: {r['ms']:.3f} ms", file=sys.stderr)

    print(f"device: {device} ({platform}), jax {jax.__version__}, dtype {args.dtype}, "
          f"Hq {args.num_q_heads}, Hkv {args.num_kv_heads}, D {args.head_dim}, "
          f"page {args.page_size}")
    if ceilings:
        print(f"ceilings: HBM copy {ceilings['hbm_gbps']:.0f} GB/s, "
              f"bf16 matmul {ceilings['matmul_tflops']:.1f} TFLOP/s")
    head = f"{'mix':8s} {'impl':11s} {'tuning':24s} {'T':>6s} {'S':>4s} {'ms':>9s} " \
           f"{'GB/s':>8s} {'TFLOP/s':>8s} {'%BW':>6s} {'%MXU':>6s} {'write_kv ms':>11s}"
    print(head)
    for r in results:
        tun = ",".join(f"{k}={v}" for k, v in r["tuning"].items()) or "default"
        if "error" in r:
            print(f"{r['mix']:8s} {r['impl']:11s} {tun:24s} ERROR {r['error'][:60]}")
            continue
        frac = (f"{100 * r['bw_fraction']:6.1f} {100 * r['flops_fraction']:6.1f}"
                if ceilings else f"{'-':>6s} {'-':>6s}")
        chk = "" if "check" not in r else \
            f"  check {'ok' if r['check']['ok'] else 'FAILED'} (err {r['check']['max_abs_err']:.2e})"
        print(f"{r['mix']:8s} {r['impl']:11s} {tun:24s} {r['num_tokens']:6d} {r['num_seqs']:4d} "
              f"{r['ms']:9.3f} {r['gbps']:8.1f} {r['tflops']:8.3f} {frac} {r['write_kv_ms']:11.3f}"
              f"{chk}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "platform": platform, "jax": jax.__version__,
                       "args": vars(args), "ceilings": ceilings, "results": results}, f,
                      indent=2)
        print(f"wrote {args.json}")
    failed = any("error" in r or not r.get("check", {"ok": True})["ok"] for r in results)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
