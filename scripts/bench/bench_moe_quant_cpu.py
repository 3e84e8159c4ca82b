#!/usr/bin/env python
"""The CPU grouped expert MLP (`moe.grouped_mlp_tiled`, the tile loop the MoE block runs on
CPU) over float32 and quantized expert stacks. Writes JSON.

Shapes (defaults): hidden 512, 8 experts of width 1024, top-2, N tokens (--tokens takes a
list), rows already sorted by expert from a random routing. Per variant: the stacks' bytes
(measured from the arrays) and the best / median time of one jitted call, variants
interleaved --rounds times (the host may be shared). Quantized stacks as
`--quantization` makes them (`quant.quantize_weight`: int8 / fp8 per column, int4 in groups
of 128 by default); each loop step converts and scales only its tile's expert.

    python scripts/bench/bench_moe_quant_cpu.py --tokens 8,64,256 --json moe_quant_cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models import moe
from jaxserve.models.quant import quantize_weight, weight_bytes

SCHEMES = ("float32", "int8", "int4", "fp8")


def bench(tokens: int, hidden: int, experts: int, width: int, top_k: int, runs: int,
          rounds: int, seed: int = 0) -> dict[str, object]:
    rng = np.random.default_rng(seed)
    f32 = np.float32
    stacks = [(0.02 * rng.standard_normal(s)).astype(f32) for s in
              ((experts, hidden, width), (experts, hidden, width), (experts, width, hidden))]
    choice = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)])
    sizes = jnp.asarray(np.bincount(choice.reshape(-1), minlength=experts).astype(np.int32))
    xs = jnp.asarray(rng.standard_normal((tokens * top_k, hidden), f32))
    weights = {s: [jnp.asarray(w) if s == "float32" else
                   jax.tree.map(jnp.asarray, quantize_weight(w, s)) for w in stacks]
               for s in SCHEMES}
    fn = jax.jit(lambda xs, sizes, g, u, d: moe.grouped_mlp_tiled(xs, sizes, g, u, d))
    times: dict[str, list[float]] = {s: [] for s in SCHEMES}
    for s in SCHEMES:
        jax.block_until_ready(fn(xs, sizes, *weights[s]))  # compile + warm
    for _ in range(rounds):
        for s in SCHEMES:
            for _ in range(runs):
                t0 = time.perf_counter()
                jax.block_until_ready(fn(xs, sizes, *weights[s]))
                times[s].append(time.perf_counter() - t0)
    row: dict[str, object] = {"tokens": tokens, "hidden": hidden, "experts": experts,
                              "width": width, "top_k": top_k}
    for s in SCHEMES:
        row[f"{s}_bytes"] = weight_bytes(weights[s])
        row[f"{s}_best_ms"] = 1e3 * min(times[s])
        row[f"{s}_median_ms"] = 1e3 * statistics.median(times[s])
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="8,64", help="comma-separated token counts N")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--width", type=int, default=1024, help="each expert's intermediate size")
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--runs", type=int, default=10, help="timed calls per variant per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None, help="write the rows here")
    a = ap.parse_args()
    rows = [bench(int(n), a.hidden, a.experts, a.width, a.top_k, a.runs, a.rounds)
            for n in a.tokens.split(",")]
    for r in rows:
        print(f"N={r['tokens']:5d}  " + "  ".join(
            f"{s} {r[f'{s}_best_ms']:.3f} ms ({r[f'{s}_bytes'] / 2**20:.1f} MiB)"
            for s in SCHEMES))
    if a.json:
        meta = {"backend": jax.default_backend(), "jax": jax.__version__}
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
