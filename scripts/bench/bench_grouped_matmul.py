#!/usr/bin/env python3
"""Benchmark the MoE grouped matmul: the Pallas kernel of this backend (Mosaic TPU / Triton)
against XLA's ragged dot, on Qwen3-30B-A3B's expert shapes, with a check that they agree.

Per (rows, projection): the routed rows of a step of T tokens (top-8 of 128 experts, uniform
random routing, so rows = 8 T), the gate projection (2048 -> 768) and the down projection
(768 -> 2048), bf16. Prints milliseconds per call (median of --iters), the weight bytes the
step must read (the experts touched) over that time as GB/s, and the kernel's max |difference|
from the ragged dot relative to the ragged dot's max |value|. Writes everything to --json.

    python scripts/bench/bench_grouped_matmul.py                       # on a GPU / TPU
    python scripts/bench/bench_grouped_matmul.py --tokens 1 32 256 2048 --json out.json
    python scripts/bench/bench_grouped_matmul.py --interpret --tokens 2 --experts 8 --top-k 2 \\
        --hidden 256 --width 128                                       # CPU smoke run

Not run on a device yet (no accelerator was lent when it was written): its figures belong in
docs/benchmarks/perf-model.md beside the model's expert bytes when one is.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.kernels_pallas.grouped_matmul_gpu import grouped_matmul_gpu
from jaxserve.kernels_pallas.grouped_matmul_tpu import grouped_matmul_tpu


def ragged(x: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
    return jax.lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32).astype(x.dtype)


def timed(fn, *args, iters: int) -> float:  # noqa: ANN001
    jax.block_until_ready(fn(*args))  # compile + warm
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 32, 256, 2048])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--interpret", action="store_true", help="the CPU interpreters (smoke)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    platform = jax.default_backend()
    if args.interpret:
        kernels = {"pallas_tpu": grouped_matmul_tpu, "pallas_gpu": grouped_matmul_gpu}
    elif platform == "tpu":
        kernels = {"pallas_tpu": grouped_matmul_tpu}
    elif platform == "gpu":
        kernels = {"pallas_gpu": grouped_matmul_gpu}
    else:
        raise SystemExit(f"backend {platform!r} has no Pallas grouped matmul: pass --interpret")
    rng = np.random.default_rng(0)
    e, h, i, k = args.experts, args.hidden, args.width, args.top_k
    rows = []
    print(f"{platform} ({jax.devices()[0].device_kind}); E={e} top-{k} hidden {h} width {i}")
    print("| tokens | rows | proj | experts touched | impl | ms | weight GB/s | rel err |")
    print("|---|---|---|---|---|---|---|---|")
    for t in args.tokens:
        choice = np.argsort(rng.random((t, e)), axis=1)[:, :k]
        sizes = jnp.asarray(np.bincount(choice.ravel(), minlength=e), jnp.int32)
        touched = int((np.asarray(sizes) > 0).sum())
        m = t * k
        for proj, (kin, kout) in (("gate", (h, i)), ("down", (i, h))):
            x = jnp.asarray(rng.standard_normal((m, kin)), jnp.bfloat16)
            w = jnp.asarray(rng.standard_normal((e, kin, kout)) * kin ** -0.5, jnp.bfloat16)
            want = np.asarray(jax.jit(ragged)(x, w, sizes), np.float32)
            scale = float(np.abs(want).max()) or 1.0
            impls = {"ragged_dot": jax.jit(ragged)}
            impls.update({name: jax.jit(lambda a, b, c, f=f: f(a, b, c,
                                                                 interpret=args.interpret))
                          for name, f in kernels.items()})
            for name, fn in impls.items():
                got = np.asarray(fn(x, w, sizes), np.float32)
                err = float(np.abs(got - want).max()) / scale
                ms = timed(fn, x, w, sizes, iters=args.iters) * 1e3
                gbs = touched * kin * kout * 2 / (ms * 1e-3) / 1e9
                rows.append({"tokens": t, "rows": m, "proj": proj, "touched": touched,
                             "impl": name, "ms": ms, "weight_gbps": gbs, "rel_err": err})
                print(f"| {t} | {m} | {proj} | {touched} | {name} | {ms:.3f} | {gbs:,.0f} | "
                      f"{err:.1e} |")
                if err > 2e-2:
                    raise SystemExit(f"{name} differs from the ragged dot by {err:.3g} "
                                     f"(relative) at {t} tokens, {proj}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"platform": platform, "device": jax.devices()[0].device_kind,
                       "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
