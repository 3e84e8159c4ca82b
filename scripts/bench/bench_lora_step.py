#!/usr/bin/env python
"""The multi-LoRA delta's share of one decode step on CPU: every adapted projection of the
bundled model (q, k, v, o, gate, up, down: 576 -> 576 / 192 / 192 / 576 / 1536 / 1536 and
1536 -> 576) in every one of its 30 layers, through `lora_delta_cpu` (the C++ kernel), as
one jitted call over the layers -- the stacks whole, as the model's scan passes them, so each
layer's adapters come from memory the way a step finds them (8 adapters of rank 16 in 9
slots: 156 MB of float32 stacks, 78 MB of bfloat16, past any cache). Writes JSON.

Row mixes (32 rows, concurrency 32's decode step):
  - "8_adapters": row t on adapter 1 + t % 8 (4 rows an adapter: every adapter's bytes);
  - "1_adapter":  every row on adapter 1 (the same FMAs, one adapter's bytes);
  - "none":       every row on slot 0 (what the delta costs a base-model batch).

Variants run interleaved (--rounds rounds of --runs calls each; the host may be shared): the
figure is each round's best call, median over rounds. No timed assertions.

    python scripts/bench/bench_lora_step.py --json /tmp/lora_step.json
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
from jaxserve.kernels_pallas.lora_cpu import lora_delta_cpu

SHAPES = {"q": (576, 576), "k": (576, 192), "v": (576, 192), "o": (576, 576),
          "gate": (576, 1536), "up": (576, 1536), "down": (1536, 576)}


def _step(layers: int, isa: str | None):  # noqa: ANN202
    """A jitted call: every projection's delta in every layer, summed (keeps each live)."""
    @jax.jit
    def run(xs, stacks, slots):  # noqa: ANN001, ANN202
        def body(layer, acc):  # noqa: ANN001, ANN202
            for name, (a, b) in stacks.items():
                acc = acc + lora_delta_cpu(xs[SHAPES[name][0]], a, b, slots, layer,
                                           isa=isa)[:, :8].sum()
            return acc

        return jax.lax.fori_loop(0, layers, body, jnp.zeros((), jnp.float32))

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--adapters", type=int, default=8, help="adapter slots (S = this + 1)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--runs", type=int, default=5, help="timed calls per variant per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--isa", default=None, help="the C++ kernels' instruction set "
                    "(cpu_build.dense_isas(); default: the best this CPU runs)")
    ap.add_argument("--json", default=None, help="write the figures here")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    s_total, t = a.adapters + 1, a.rows
    xs = {k: jnp.asarray(rng.standard_normal((t, k), np.float32)) for k in (576, 1536)}
    stacks = {}
    for dt in a.dtypes.split(","):
        stacks[dt] = {}
        for name, (k, n) in SHAPES.items():
            sa = 0.02 * rng.standard_normal((a.layers, s_total, k, a.rank), np.float32)
            sb = 0.02 * rng.standard_normal((a.layers, s_total, a.rank, n), np.float32)
            sa[:, 0] = sb[:, 0] = 0.0  # slot 0: zeros, as the engine keeps it
            stacks[dt][name] = (jnp.asarray(sa, dt), jnp.asarray(sb, dt))
    mixes = {"8_adapters": 1 + np.arange(t) % a.adapters, "1_adapter": np.ones(t),
             "none": np.zeros(t)}
    mixes = {k: jnp.asarray(v.astype(np.int32)) for k, v in mixes.items()}
    run = _step(a.layers, a.isa)
    best: dict[str, list[float]] = {}
    for _ in range(a.rounds):
        for mix, slots in mixes.items():
            for dt, st in stacks.items():
                jax.block_until_ready(run(xs, st, slots))
                times = []
                for _ in range(a.runs):
                    t0 = time.perf_counter()
                    jax.block_until_ready(run(xs, st, slots))
                    times.append(time.perf_counter() - t0)
                best.setdefault(f"{mix}/{dt}", []).append(1e3 * min(times))
    rows = {k: {"median_ms": statistics.median(v), "best_ms": min(v)} for k, v in best.items()}
    for k, v in rows.items():
        print(f"{k:22s} delta per step: median {v['median_ms']:.2f} ms  best {v['best_ms']:.2f}")
    meta = {"backend": jax.default_backend(), "jax": jax.__version__,
            "isa": a.isa or (dense_isas() or [None])[0], "cpus": os.cpu_count(), **vars(a)}
    if a.json:
        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "figures": rows}, f, indent=2)


if __name__ == "__main__":
    main()
