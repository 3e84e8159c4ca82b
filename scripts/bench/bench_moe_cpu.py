#!/usr/bin/env python
"""The MoE block's grouped expert MLP on CPU: the C++ grouped kernel over packed expert panels
(`kernels_pallas/moe_grouped_cpu.py`), the tile loop and XLA:CPU's `jax.lax.ragged_dot`,
against a dense MLP of the same active parameters. Writes JSON.

Shapes (defaults): hidden 1024, 16 experts of width 768, top-2, N tokens 1, 8, 32, 128, 512
(--tokens). Rows timed, each one jitted call on weights already on the device:

  - "cpp":          the C++ grouped kernel on float32 panels (one FFI call: gate, up, SwiGLU,
                    down) on rows already sorted by expert, group sizes from a random routing;
  - "cpp_bf16":     the same on bfloat16 panels (half the weight bytes);
  - "tiled":        the XLA fallback (`moe.grouped_mlp_tiled`): groups padded to row tiles, a
                    loop over the data's tile count, each tile through its expert's matmuls;
  - "grouped":      (--ragged) the three `jax.lax.ragged_dot`s (`moe.grouped_mlp_ragged`): JAX
                    lowers ragged_dot on CPU by masking every row against every group (E
                    times the work); TPU / GPU get XLA's ragged dot;
  - "expert_mlp":   the whole `moe.expert_mlp` as a CPU engine serves it (packed float32
                    experts: sort by expert, the C++ kernel, un-sort, weight and sum);
  - "dense_active": a dense SwiGLU MLP of width k * I on the N tokens through XLA's dot: the
                    same FLOPs as the grouped rows, the "dense model of the same active
                    parameters" the issue's 1.5x target is against;
  - "dense_cpp":    the same dense MLP through the C++ dense kernel on packed panels (what a
                    CPU engine runs for a dense float32 model).

What no kernel removes: at N * k >= E the grouped rows read all E experts' weights (E / k
times the dense rows' bytes), so at small N past decode the gap is memory, not arithmetic.
Variants run interleaved (--rounds rounds of --runs calls each; the host may be shared): per
round each variant's best call, and each ratio is the median over rounds of the per-round
ratios (load that hits a round hits both sides alike). Calls cycle through --copies distinct
weight sets, so no variant's weights sit in a cache that a model's many layers would not fit.

    python scripts/bench/bench_moe_cpu.py --tokens 1,8,32,128,512 --top-k 2 \
        --json benchmarks/results/moe_cpu_grouped_2026-12-06/top2.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.kernels_pallas.cpu_build import dense_isas
from jaxserve.kernels_pallas.dense_cpu import dense_packed, pack_panels
from jaxserve.kernels_pallas.moe_grouped_cpu import pack_expert_panels
from jaxserve.models import moe
from jaxserve.models.linear import PackedExperts


def _timed(fn, argsets: list[tuple], runs: int) -> list[float]:  # noqa: ANN001
    """`runs` timed calls, call i on weight copy i % len(argsets) (so the weights come from
    memory, as a model's many layers do, not from a cache they would fit alone)."""
    for args in argsets:
        jax.block_until_ready(fn(*args))  # compile + warm
    out = []
    for i in range(runs):
        args = argsets[i % len(argsets)]
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        out.append(time.perf_counter() - t0)
    return out


def bench(tokens: int, hidden: int, experts: int, width: int, top_k: int, runs: int,
          rounds: int, ragged: bool, copies: int, isa: str | None = None, seed: int = 0
          ) -> dict[str, object]:
    rng = np.random.default_rng(seed)
    f32 = np.float32

    def normal(*shape: int) -> np.ndarray:
        return 0.02 * rng.standard_normal(shape, f32)

    x = jnp.asarray(rng.standard_normal((tokens, hidden), f32))
    plain, pf32, pbf16, dense, packed = [], [], [], [], []
    for _ in range(copies):  # distinct weights per copy (a layer each)
        ws = [normal(experts, hidden, width), normal(experts, hidden, width),
              normal(experts, width, hidden)]
        plain.append(tuple(map(jnp.asarray, ws)))
        pf32.append(tuple(PackedExperts(jnp.asarray(pack_expert_panels(w)), w.shape[-1],
                                        isa=isa) for w in ws))
        pbf16.append(tuple(PackedExperts(jnp.asarray(pack_expert_panels(w, "bfloat16")),
                                         w.shape[-1], isa=isa) for w in ws))
        dw = [normal(hidden, top_k * width), normal(hidden, top_k * width),
              normal(top_k * width, hidden)]
        dense.append(tuple(map(jnp.asarray, dw)))
        packed.append(tuple(jnp.asarray(pack_panels(w)) for w in dw))
    # a random routing: k distinct experts per token
    choice = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)])
    ids = jnp.asarray(choice.astype(np.int32))
    weights = jnp.asarray(rng.dirichlet(np.ones(top_k), tokens).astype(f32))
    sizes = jnp.asarray(np.bincount(choice.reshape(-1), minlength=experts).astype(np.int32))
    order = np.argsort(choice.reshape(-1), kind="stable")
    xs = jnp.take(x, jnp.asarray(order // top_k), axis=0)

    grouped = jax.jit(lambda xs, s, g, u, d: moe.grouped_mlp(xs, s, g, u, d))
    tiled = jax.jit(moe.grouped_mlp_tiled)
    ragged_mlp = jax.jit(moe.grouped_mlp_ragged)
    expert_mlp = jax.jit(moe.expert_mlp)

    @jax.jit
    def dense_active(x, dg, du, dd):  # noqa: ANN001, ANN202
        return (jax.nn.silu(x @ dg) * (x @ du)) @ dd

    @jax.jit
    def dense_cpp(x, pg, pu, pd):  # noqa: ANN001, ANN202
        n = top_k * width
        h = (jax.nn.silu(dense_packed(x, pg, None, n, isa=isa))
             * dense_packed(x, pu, None, n, isa=isa))
        return dense_packed(h, pd, None, hidden, isa=isa)

    variants = {"cpp": (grouped, [(xs, sizes, *w) for w in pf32]),
                "cpp_bf16": (grouped, [(xs, sizes, *w) for w in pbf16]),
                "tiled": (tiled, [(xs, sizes, *w) for w in plain]),
                "expert_mlp": (expert_mlp, [(x, weights, ids, *w) for w in pf32]),
                "dense_active": (dense_active, [(x, *w) for w in dense]),
                "dense_cpp": (dense_cpp, [(x, *w) for w in packed])}
    if ragged:
        variants["grouped"] = (ragged_mlp, [(xs, sizes, *w) for w in plain])
    want = np.asarray(tiled(xs, sizes, *plain[0]))  # the kernel computes the same rows
    got = np.asarray(grouped(xs, sizes, *pf32[0]))
    assert np.abs(got - want).max() <= 1e-3 * np.abs(want).max() + 1e-6
    best: dict[str, list[float]] = {k: [] for k in variants}  # per round
    for _ in range(rounds):  # interleaved: load from other processes hits all alike
        for name, (fn, args) in variants.items():
            best[name].append(min(_timed(fn, args, runs)))
    row: dict[str, object] = {"tokens": tokens, "rows": tokens * top_k, "hidden": hidden,
                              "experts": experts, "width": width, "top_k": top_k,
                              "experts_read": int((np.asarray(sizes) > 0).sum()),
                              "flops": 2 * tokens * top_k * 3 * hidden * width}
    for name, ts in best.items():
        row[f"{name}_best_ms"] = 1e3 * min(ts)
        row[f"{name}_median_ms"] = 1e3 * statistics.median(ts)
    for name in best:
        for base in ("dense_active", "dense_cpp"):
            if name not in ("dense_active", "dense_cpp"):
                row[f"{name}_over_{base}"] = statistics.median(
                    a / b for a, b in zip(best[name], best[base]))
    row["tiled_over_cpp"] = statistics.median(a / b for a, b in zip(best["tiled"], best["cpp"]))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--tokens", default="1,8,32,128,512", help="comma-separated token counts N")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--width", type=int, default=768, help="each expert's intermediate size")
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--runs", type=int, default=6, help="timed calls per variant per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ragged", action="store_true", help="also time XLA:CPU's ragged_dot")
    ap.add_argument("--copies", type=int, default=3,
                    help="distinct weight sets the calls cycle through (3 x the dense MLP's "
                         "19 MB at the defaults is past a 32 MB L3: weights from memory)")
    ap.add_argument("--isa", default=None,
                    help="the C++ kernels' instruction set (cpu_build.dense_isas(); default: "
                         "the best this CPU runs)")
    ap.add_argument("--json", default=None, help="write the rows here")
    a = ap.parse_args()
    rows = []
    for n in a.tokens.split(","):
        r = bench(int(n), a.hidden, a.experts, a.width, a.top_k, a.runs, a.rounds, a.ragged,
                  a.copies, a.isa)
        rows.append(r)
        print(f"N={r['tokens']:4d} ({r['experts_read']:2d} experts read)  "
              f"cpp {r['cpp_best_ms']:.3f} ms  cpp_bf16 {r['cpp_bf16_best_ms']:.3f}  "
              f"tiled {r['tiled_best_ms']:.3f}  expert_mlp {r['expert_mlp_best_ms']:.3f}  "
              f"dense_active {r['dense_active_best_ms']:.3f}  "
              f"dense_cpp {r['dense_cpp_best_ms']:.3f}  | medians of ratios: "
              f"cpp/dense_active {r['cpp_over_dense_active']:.2f}x  "
              f"cpp/dense_cpp {r['cpp_over_dense_cpp']:.2f}x  "
              f"cpp_bf16/dense_cpp {r['cpp_bf16_over_dense_cpp']:.2f}x  "
              f"tiled/dense_active {r['tiled_over_dense_active']:.2f}x  "
              f"tiled/cpp {r['tiled_over_cpp']:.2f}x", flush=True)
    meta = {"backend": jax.default_backend(), "jax": jax.__version__,
            "devices": [str(d) for d in jax.devices()], "isa": a.isa or (dense_isas() or [None])[0],
            "cpus": os.cpu_count(), **vars(a)}
    if a.json:
        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
