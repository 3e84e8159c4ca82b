#!/usr/bin/env python
"""The CPU dense kernel's achieved GFLOP/s against the host's measured FMA peak, per
instruction set (AVX-512 / AVX2: kernels_pallas/cpu_build.py's variants, forced with isa=),
float32 and quantized weights (int8 per column, int4 in groups of 32, fp8 per column), at
decode (M = 1, 8) and prefill (M = 256, 2048) row counts, for the bundled model's shapes
(hidden 576, intermediate 1536; the LM head 576 x 49152 at M <= 256). Writes JSON.

Peak: scripts/bench/fma_peak.cc (12 independent FMA chains per thread, ymm and zmm, on 1 and
on all hardware threads), compiled and run first; the best of 3.

Tile: scripts/bench/dense_tile_bench.cc, the kernels' float tile and chunk loop alone (one
thread, hot weights, no XLA), per ISA and shape at M = 256 and 2048: the kernel's own ceiling,
to read against the single-thread peak; the jitted figures below add the thread pool, weights
from memory and whatever else the host runs.

Timing: each call is one jitted `fori_loop` over L stacked layers (the weights come from
memory, as in the engine's step; L = 1 for the LM head) computing x @ w[layer] (and, for
float32, XLA:CPU's own dot on the unpacked stack, isa "xla"); for each
(shape, M) the variants run interleaved, --runs times each, so load from other processes
on a shared host hits them alike; the best (and the median) per-layer time is reported.

Quantized kinds also get an "<isa>+fast" row: the few-row path of the engine's default mode
(QuantPanels.fast, per-group sums), against the row-invariant one batch-invariant mode runs.

--baseline-src DIR adds "before" rows: DIR holds an older kernels_pallas/csrc (e.g.
`git archive <commit> kernels_pallas/csrc | tar -x -C DIR`), built with the old flags into a
library of its own whose dense targets are registered under baseline names and timed
interleaved with the current ones.

    python scripts/bench/bench_dense_cpu.py --rows 1,8,256,2048 --json out.json \
        --baseline-src /tmp/old/kernels_pallas/csrc
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import pathlib
import statistics
import subprocess
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.kernels_pallas import cpu_build
from jaxserve.kernels_pallas.dense_cpu import pack_panels
from jaxserve.kernels_pallas.dense_qdot_cpu import ISAS as QDOT_ISAS
from jaxserve.kernels_pallas.dense_qdot_cpu import QdotPanels, pack_qdot
from jaxserve.kernels_pallas.dense_quant_cpu import QuantPanels, pack_quant
from jaxserve.models.quant import quantize_weight

SCHEMES = {"int8": None, "int4": 32, "fp8": None}  # scheme -> group size
# The integer-dot kinds (csrc/dense_qdot_cpu.cc: activations quantized to int8 per row):
# kind -> (scheme, group size); int8 in groups of 32 as a GGUF's Q8_0 blocks are.
QDOT = {"int8q": ("int8", 32), "int4q": ("int4", 32)}
HERE = pathlib.Path(__file__).parent


def fma_peak(avx512: bool) -> list[dict]:
    """Runs fma_peak.cc: [{isa, threads, gflops}]."""
    with tempfile.TemporaryDirectory() as d:
        exe = pathlib.Path(d) / "fma_peak"
        subprocess.run(["g++", "-O2", "-mavx512f", "-mfma", "-pthread",
                        str(HERE / "fma_peak.cc"), "-o", str(exe)], check=True)
        out = subprocess.run([str(exe), "1" if avx512 else "0"], check=True,
                             capture_output=True, text=True).stdout
    return [json.loads(line) for line in out.splitlines()]


def tile_bench(shapes: list[tuple[int, int]], rows: list[int], isas: tuple[str, ...]
               ) -> list[dict]:
    """Runs dense_tile_bench.cc per ISA variant, shape and M: [{isa, m, k, n, gflops}]."""
    out = []
    with tempfile.TemporaryDirectory() as d:
        for isa, flags in cpu_build.dense_variants():
            if isa not in isas:
                continue
            exe = pathlib.Path(d) / f"tile_{isa}"
            subprocess.run(["g++", "-O3", "-march=native", "-std=c++17", "-w", *flags,
                            f"-I{jax.ffi.include_dir()}", f"-I{cpu_build.CSRC}",
                            str(HERE / "dense_tile_bench.cc"), "-o", str(exe)], check=True)
            for k, n in shapes:
                for m in rows:
                    res = subprocess.run([str(exe), str(m), str(k), str(n)], check=True,
                                         capture_output=True, text=True).stdout
                    out.append(json.loads(res))
    return out


def register_baseline(src: pathlib.Path) -> dict[str, str]:
    """Builds the old sources (their .cc files, the old flags) and registers their dense
    targets as baseline_<target>; returns {kind: target}."""
    lib = pathlib.Path(tempfile.mkdtemp()) / "baseline.so"
    cmd = ["g++", *cpu_build.FLAGS, f"-I{jax.ffi.include_dir()}", "-o", str(lib),
           *map(str, sorted(src.glob("*.cc")))]
    subprocess.run(cmd, check=True)
    handle = ctypes.cdll.LoadLibrary(str(lib))
    names = {"f32": "JaxserveDenseCpu", "int8": "JaxserveDenseInt8Cpu",
             "fp8": "JaxserveDenseFp8Cpu", "int4": "JaxserveDenseInt4Cpu"}
    targets = {}
    for kind, symbol in names.items():
        targets[kind] = f"baseline_{symbol}"
        jax.ffi.register_ffi_target(targets[kind], jax.ffi.pycapsule(getattr(handle, symbol)),
                                    platform="cpu")
    return targets


def call(target: str, x: jax.Array, w, layer: jax.Array, n: int) -> jax.Array:  # noqa: ANN001
    """The FFI call itself (both the current and the baseline targets take these operands)."""
    args = (x, w) if not isinstance(w, (QuantPanels, QdotPanels)) else (
        (x, w.values, w.scales) + (() if w.zeros is None else (w.zeros,)))
    attrs = {"act_group": np.int64(w.act_group)} if isinstance(w, QdotPanels) else {}
    if isinstance(w, QuantPanels) and not target.startswith("baseline_"):
        attrs = {"fast": w.fast}  # the default mode's few-row path, or the row-invariant one
    return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))(
        *args, layer, **attrs)


def timer(target: str | None, x: jax.Array, w, layers: int, n: int):  # noqa: ANN001, ANN201
    """A function timing one layer's product (target None: XLA's dot on the [L, K, N] stack)."""
    zero = jnp.zeros((x.shape[0], n), jnp.float32)

    def one(i, x, w):  # noqa: ANN001, ANN202
        return x @ w[i] if target is None else call(target, x, w, i, n)

    @jax.jit
    def run(x, w):  # noqa: ANN001, ANN202
        return jax.lax.fori_loop(0, layers, lambda i, acc: acc + one(i, x, w), zero)

    jax.block_until_ready(run(x, w))

    def once() -> float:
        t = time.perf_counter()
        jax.block_until_ready(run(x, w))
        return (time.perf_counter() - t) / layers

    return once


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,256,2048")
    ap.add_argument("--shapes", default="576x1536,1536x576,576x49152", help="KxN, comma-sep.")
    ap.add_argument("--kinds", default="f32,int8,int4,fp8")
    ap.add_argument("--layers", type=int, default=8, help="stacked layers (LM head: 1)")
    ap.add_argument("--head-max-rows", type=int, default=256, help="LM head: M up to this")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--baseline-src", type=pathlib.Path, default=None)
    ap.add_argument("--no-xla", action="store_true", help="skip XLA's dot rows")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    isas = cpu_build.dense_isas()
    if not isas:
        raise SystemExit("the CPU dense kernels could not be built here (see the log)")
    peak = fma_peak("avx512" in isas)
    for p in peak:
        print(f"FMA peak {p['isa']:6s} {p['threads']} thread(s): {p['gflops']:.1f} GFLOP/s")
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    tiles = tile_bench([s for s in shapes if s[1] <= 8192],
                       [m for m in map(int, args.rows.split(",")) if m >= 256], isas)
    for t in tiles:
        print(f"tile {t['isa']:6s} {t['k']}x{t['n']} M={t['m']:5d}: {t['gflops']:.1f} GFLOP/s "
              f"(1 thread, hot weights)")
    baseline = register_baseline(args.baseline_src) if args.baseline_src else {}
    kinds = args.kinds.split(",")
    rng = np.random.default_rng(0)
    rows = []
    for shape in args.shapes.split(","):
        k, n = map(int, shape.split("x"))
        layers = 1 if n > 8192 else args.layers
        w = rng.standard_normal((layers, k, n), np.float32)
        weights = {"f32": jnp.asarray(pack_panels(w)), "xla": jnp.asarray(w)}
        for scheme, group in SCHEMES.items():
            if scheme in kinds:
                q = quantize_weight(w, scheme, group)
                weights[scheme] = jax.tree.map(jnp.asarray, pack_quant(
                    np.asarray(q.values), q.scales, q.zeros, scheme))
        for kind, (scheme, group) in QDOT.items():
            if kind in kinds:
                q = quantize_weight(w, scheme, group)
                weights[kind] = jax.tree.map(jnp.asarray, pack_qdot(
                    np.asarray(q.values), q.scales, q.zeros, scheme))
        del w
        for m in map(int, args.rows.split(",")):
            if layers == 1 and m > args.head_max_rows:
                continue
            x = jnp.asarray(rng.standard_normal((m, k), np.float32))
            variants = {}
            for kind in kinds:
                if kind in QDOT:
                    scheme = QDOT[kind][0]
                    for isa in (i for i in isas if i in QDOT_ISAS[scheme]):
                        variants[(kind, isa)] = timer(cpu_build.dense_target(
                            cpu_build.DENSE_QDOT_TARGETS[scheme], isa), x, weights[kind],
                            layers, n)
                    continue
                base = cpu_build.DENSE_TARGET if kind == "f32" else \
                    cpu_build.DENSE_QUANT_TARGETS[kind]
                for isa in isas:
                    variants[(kind, isa)] = timer(cpu_build.dense_target(base, isa), x,
                                                  weights[kind], layers, n)
                if kind != "f32":  # the engine's default mode (not batch invariant)
                    variants[(kind, f"{isas[0]}+fast")] = timer(
                        cpu_build.dense_target(base, isas[0]), x,
                        dataclasses.replace(weights[kind], fast=True), layers, n)
                if kind in baseline:
                    variants[(kind, "before")] = timer(baseline[kind], x, weights[kind],
                                                       layers, n)
            if "f32" in kinds and not args.no_xla:  # XLA:CPU's own dot, the same load
                variants[("f32", "xla")] = timer(None, x, weights["xla"], layers, n)
            times = {v: [] for v in variants}
            for _ in range(args.runs):  # interleaved
                for v, once in variants.items():
                    times[v].append(once())
            flop = 2 * m * k * n
            for (kind, isa), ts in times.items():
                best, med = min(ts), statistics.median(ts)
                r = {"k": k, "n": n, "m": m, "kind": kind, "isa": isa, "layers": layers,
                     "best_ms": 1e3 * best, "median_ms": 1e3 * med,
                     "gflops": flop / best / 1e9, "median_gflops": flop / med / 1e9}
                rows.append(r)
                print(f"{k}x{n} M={m:5d} {kind:5s} {isa:11s} {r['best_ms']:8.3f} ms "
                      f"{r['gflops']:6.1f} GFLOP/s (median {r['median_gflops']:6.1f})",
                      flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"peak": peak, "tile": tiles, "rows": rows, "runs": args.runs, "jax": jax.__version__,
                       "isas": list(isas)}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
