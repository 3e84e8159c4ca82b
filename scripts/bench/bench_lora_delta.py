#!/usr/bin/env python
"""The multi-LoRA delta on CPU (`kernels_pallas/lora.py`'s contract): the C++ kernel
(`kernels_pallas/lora_cpu.py`) against XLA's masked path, beside the base projection it is
added to, so the delta's share of a step is visible. Writes JSON.

Shapes (defaults): the bundled model's MLP projections, in x out = 576 x 1536 (gate / up)
and 1536 x 576 (down), 30 layers; adapter stacks of S = 9 slots (8 adapters of rank R = 16
plus slot 0). Row mixes:

  - "decode32":      32 rows, row t on adapter 1 + t % 8 (every adapter, 4 rows each: a
                     decode step at concurrency 32 with the requests spread over adapters);
  - "decode32-none": the same 32 rows all on slot 0 (no adapter: what the delta costs a
                     base-model batch);
  - "prefill512":    512 rows, 300 on adapter 3 and 212 on adapter 6 (two prompts).

Variants, each one jitted call that runs the L layers' products in a loop over the layer
index, the whole stacks passed in (as the model's scan does: each layer's weights come from
memory, not from a cache one layer would fit); the figure is the call's time / L:

  - "cpp" / "cpp_bf16": `lora_delta_cpu` on float32 / bfloat16 stacks (what `lora_delta`
    runs on CPU);
  - "masked" / "masked_bf16": `lora_delta_masked` (every row times every slot, XLA:CPU);
  - "base": the base projection x @ W through the C++ dense kernel on packed panels
    (`kernels_pallas/dense_cpu.py`), float32: what a CPU engine runs for the projection.

Variants run interleaved (--rounds rounds of --runs calls each; the host may be shared):
per round each variant's best call; each ratio is the median over rounds of the per-round
ratios. No timed assertions.

    python scripts/bench/bench_lora_delta.py --json /tmp/lora_delta.json
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
from jaxserve.kernels_pallas.lora import lora_delta_masked, lora_delta_reference
from jaxserve.kernels_pallas.lora_cpu import lora_delta_cpu


def mixes(adapters: int) -> dict[str, np.ndarray]:
    return {"decode32": 1 + np.arange(32) % adapters,
            "decode32-none": np.zeros(32),
            "prefill512": np.concatenate([np.full(300, 3), np.full(212, 6)])}


def _over_layers(delta, layers: int):  # noqa: ANN001, ANN202
    """A jitted call running `delta(x, *weights, layer)` for every layer, summed (the sum
    keeps every layer's result live)."""
    @jax.jit
    def run(x, *weights):  # noqa: ANN001, ANN202
        def body(layer, acc):  # noqa: ANN001, ANN202
            return acc + delta(x, *weights, layer).astype(jnp.float32)

        out = jax.eval_shape(lambda: delta(x, *weights, jnp.int32(0)))
        return jax.lax.fori_loop(0, layers, body, jnp.zeros(out.shape, jnp.float32))

    return run


def _best(fn, args: tuple, runs: int) -> float:  # noqa: ANN001
    jax.block_until_ready(fn(*args))  # compile + warm
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        out.append(time.perf_counter() - t0)
    return min(out)


def bench(mix: str, slots: np.ndarray, k: int, n: int, layers: int, slots_total: int,
          rank: int, runs: int, rounds: int, isa: str | None, seed: int = 0
          ) -> dict[str, object]:
    rng = np.random.default_rng(seed)
    f32 = np.float32
    t = len(slots)
    x = jnp.asarray(rng.standard_normal((t, k), f32))
    a = 0.02 * rng.standard_normal((layers, slots_total, k, rank), f32)
    b = 0.02 * rng.standard_normal((layers, slots_total, rank, n), f32)
    a[:, 0] = 0.0  # slot 0: zeros, as the engine keeps it
    b[:, 0] = 0.0
    a32, b32 = jnp.asarray(a), jnp.asarray(b)
    a16, b16 = a32.astype(jnp.bfloat16), b32.astype(jnp.bfloat16)
    w = jnp.asarray(pack_panels(0.02 * rng.standard_normal((layers, k, n), f32)))
    s = jnp.asarray(slots.astype(np.int32))

    def cpp(x, a, b, s, layer):  # noqa: ANN001, ANN202
        return lora_delta_cpu(x, a, b, s, layer, isa=isa)

    def base(x, w, layer):  # noqa: ANN001, ANN202
        return dense_packed(x, w, layer, n, isa=isa)

    variants = {"cpp": (_over_layers(cpp, layers), (x, a32, b32, s)),
                "cpp_bf16": (_over_layers(cpp, layers), (x, a16, b16, s)),
                "masked": (_over_layers(lora_delta_masked, layers), (x, a32, b32, s)),
                "masked_bf16": (_over_layers(lora_delta_masked, layers), (x, a16, b16, s)),
                "base": (_over_layers(base, layers), (x, w))}
    # The timed paths compute the same sums (a layer's delta against the reference).
    want = _over_layers(lora_delta_reference, layers)(x, a32, b32, s)
    for name in ("cpp", "masked"):
        got = variants[name][0](*variants[name][1])
        assert np.abs(np.asarray(got - want)).max() <= 1e-4 * np.abs(np.asarray(want)).max() \
            + 1e-6, name
    best: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(rounds):
        for name, (fn, args) in variants.items():
            best[name].append(_best(fn, args, runs) / layers)
    row: dict[str, object] = {"mix": mix, "rows": t, "in": k, "out": n, "layers": layers,
                              "slots": slots_total, "rank": rank,
                              "adapters_used": int(len(set(slots.tolist()) - {0}))}
    for name, ts in best.items():
        row[f"{name}_best_ms"] = 1e3 * min(ts)
        row[f"{name}_median_ms"] = 1e3 * statistics.median(ts)
    for name in best:
        if name != "base":
            row[f"{name}_over_base"] = statistics.median(
                v / w for v, w in zip(best[name], best["base"]))
    row["masked_over_cpp"] = statistics.median(
        v / w for v, w in zip(best["masked"], best["cpp"]))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--shapes", default="576x1536,1536x576",
                    help="comma-separated in x out projection shapes")
    ap.add_argument("--mixes", default="decode32,decode32-none,prefill512")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--adapters", type=int, default=8, help="adapter slots (S = this + 1)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--runs", type=int, default=5, help="timed calls per variant per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--isa", default=None,
                    help="the C++ kernels' instruction set (cpu_build.dense_isas(); default: "
                         "the best this CPU runs)")
    ap.add_argument("--json", default=None, help="write the rows here")
    a = ap.parse_args()
    rows = []
    table = mixes(a.adapters)
    for shape in a.shapes.split(","):
        k, n = (int(v) for v in shape.split("x"))
        for mix in a.mixes.split(","):
            r = bench(mix, table[mix], k, n, a.layers, a.adapters + 1, a.rank, a.runs,
                      a.rounds, a.isa)
            rows.append(r)
            print(f"{k}x{n} {mix:13s} T={r['rows']:3d} ({r['adapters_used']} adapters)  "
                  f"per layer: base {r['base_best_ms']:.4f} ms  cpp {r['cpp_best_ms']:.4f}  "
                  f"cpp_bf16 {r['cpp_bf16_best_ms']:.4f}  masked {r['masked_best_ms']:.4f}  "
                  f"masked_bf16 {r['masked_bf16_best_ms']:.4f}  | medians of ratios: "
                  f"cpp/base {r['cpp_over_base']:.3f}x  "
                  f"cpp_bf16/base {r['cpp_bf16_over_base']:.3f}x  "
                  f"masked/base {r['masked_over_base']:.3f}x  "
                  f"masked/cpp {r['masked_over_cpp']:.1f}x", flush=True)
    meta = {"backend": jax.default_backend(), "jax": jax.__version__,
            "devices": [str(d) for d in jax.devices()],
            "isa": a.isa or (dense_isas() or [None])[0], "cpus": os.cpu_count(), **vars(a)}
    if a.json:
        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
