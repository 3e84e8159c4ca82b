#!/usr/bin/env python
"""One projection per layer over L stacked weights: XLA's dot vs the C++ dense kernel on
packed panels (kernels_pallas/dense_cpu.py), float32 and quantized (int8 per column, int4 in
groups of 32, fp8 per column: kernels_pallas/dense_quant_cpu.py). Prints a table, writes JSON.

For each (M, K x N) it times a `fori_loop` over L = 30 distinct layers (so the weights come
from memory, as in the engine's step, not from cache) computing x @ w[layer] each way: XLA
slices w[layer] out of the stack and runs its dot; the kernel reads the layer's packed
panels in place. Best of --runs; per-call milliseconds and GFLOP/s.

    python scripts/bench/bench_dense.py --rows 1,8,32,128,512,2048 --shapes 576x1536,1536x576
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.kernels_pallas.dense_cpu import dense_packed, pack_panels
from jaxserve.kernels_pallas.dense_quant_cpu import dense_quant_packed, pack_quant
from jaxserve.models.quant import quantize_weight

SCHEMES = {"int8": None, "int4": 32, "fp8": None}  # scheme -> group size

LAYERS = 30


def best_ms(fn, *args, runs: int) -> float:  # noqa: ANN001
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(runs):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t)
    return 1e3 * best / LAYERS


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,32,128,512,2048")
    ap.add_argument("--shapes", default="576x1536,1536x576", help="KxN, comma-separated")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    for shape in args.shapes.split(","):
        k, n = map(int, shape.split("x"))
        w = rng.standard_normal((LAYERS, k, n), np.float32)
        stacked, panels = jnp.asarray(w), jnp.asarray(pack_panels(w))
        quant = {}
        for scheme, group in SCHEMES.items():
            q = quantize_weight(w, scheme, group)
            quant[scheme] = jax.tree.map(jnp.asarray, pack_quant(
                np.asarray(q.values), q.scales, q.zeros, scheme))
        del w
        for m in map(int, args.rows.split(",")):
            x = jnp.asarray(rng.standard_normal((m, k), np.float32))
            zero = jnp.zeros((m, n), jnp.float32)

            @jax.jit
            def xla(x, w):  # noqa: ANN001, ANN202
                return jax.lax.fori_loop(0, LAYERS, lambda i, acc: acc + x @ w[i], zero)

            @jax.jit
            def packed(x, p):  # noqa: ANN001, ANN202
                return jax.lax.fori_loop(
                    0, LAYERS, lambda i, acc: acc + dense_packed(x, p, i, n), zero)

            @jax.jit
            def quantized(x, q):  # noqa: ANN001, ANN202
                return jax.lax.fori_loop(
                    0, LAYERS, lambda i, acc: acc + dense_quant_packed(x, q, i, n), zero)

            r = {"m": m, "k": k, "n": n,
                 "xla_ms": best_ms(xla, x, stacked, runs=args.runs),
                 "packed_ms": best_ms(packed, x, panels, runs=args.runs)}
            for scheme, q in quant.items():
                r[f"{scheme}_ms"] = best_ms(quantized, x, q, runs=args.runs)
            flop = 2 * m * k * n
            print(f"{k}x{n} M={m:5d}: XLA {r['xla_ms']:7.3f} ms "
                  f"({flop / r['xla_ms'] / 1e6:4.0f} GFLOP/s)  packed {r['packed_ms']:7.3f} ms "
                  f"({flop / r['packed_ms'] / 1e6:4.0f} GFLOP/s)  " + "  ".join(
                      f"{s} {r[s + '_ms']:7.3f}" for s in quant), flush=True)
            rows.append(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "layers": LAYERS, "jax": jax.__version__}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
