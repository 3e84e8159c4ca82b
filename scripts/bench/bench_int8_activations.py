#!/usr/bin/env python
"""What int8 activations buy a whole engine step: the bundled model's paged step (decode at
--seqs rows of context 256, and a prefill of --prefill tokens) with its weights packed for
float activations (int8_activations off) and for the integer dots in groups of 32 / 16 / 8
(kernels_pallas/dense_qdot_cpu.py). The variants are compiled once and timed round robin
(best of --runs after a warm-up round), so load from other processes hits them alike;
prints a table and writes JSON.

    python scripts/bench/bench_int8_activations.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp

from jaxserve.kernels_pallas.cpu_build import dense_isas
from jaxserve.models import loading
from jaxserve.models import paged as P
from jaxserve.models.packing import pack_params

from profile_step import decode_metadata, prefill_metadata  # scripts/bench: run from there

PAGE = 16


def step_inputs(seqs: int, prefill: int) -> tuple:
    """(tokens, positions, metadata, logits rows, pages) of a decode or a prefill step."""
    if prefill:
        md = prefill_metadata(prefill, PAGE)
        return (jnp.ones(prefill, jnp.int32), jnp.arange(prefill, dtype=jnp.int32), md,
                jnp.asarray([prefill - 1], jnp.int32), 1 + -(-prefill // PAGE))
    md = decode_metadata(seqs, 256, PAGE)
    return (jnp.ones(seqs, jnp.int32), jnp.full(seqs, 256, jnp.int32), md,
            jnp.arange(seqs, dtype=jnp.int32), 1 + seqs * (256 // PAGE + 1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="1,32", help="decode rows, comma-separated")
    ap.add_argument("--prefill", default="256", help="prefill lengths, comma-separated")
    ap.add_argument("--groups", default="off,32,16",
                    help="variants: off (float activations) or an activation group size")
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    model = loading.load_model(None, "float32")
    cfg = model.config
    packed = {}
    for v in args.groups.split(","):
        kw = ({"int8_activations": "off"} if v == "off" else
              {"int8_activations": "on", "int8_activation_group_size": int(v)})
        packed[v] = pack_params(model.params, **kw)
    shapes = [(int(s), 0) for s in args.seqs.split(",") if s] + \
        [(1, int(n)) for n in args.prefill.split(",") if n]
    rows = []
    for seqs, prefill in shapes:
        tok, pos, md, logit_rows, pages = step_inputs(seqs, prefill)
        step = jax.jit(lambda p, kv, t, po, m, r: P.paged_forward(p, kv, t, po, m, r, cfg, "cpu"),
                       donate_argnums=1)
        kv = {v: P.init_kv_cache(cfg, pages, PAGE, jnp.bfloat16) for v in packed}
        best = {v: float("inf") for v in packed}
        for i in range(args.runs + 1):
            for v, params in packed.items():
                t = time.perf_counter()
                logits, kv[v] = step(params, kv[v], tok, pos, md, logit_rows)
                logits.block_until_ready()
                if i:
                    best[v] = min(best[v], 1e3 * (time.perf_counter() - t))
        for v, ms in best.items():
            row = {"seqs": seqs, "prefill": prefill, "variant": v, "best_ms": ms,
                   "speedup_vs_off": best["off"] / ms if "off" in best else None}
            rows.append(row)
            what = f"prefill {prefill}" if prefill else f"decode {seqs} rows"
            print(f"{what:18s} activations {v:>3s}: {ms:8.1f} ms"
                  + (f"  ({row['speedup_vs_off']:.2f}x off)" if row["speedup_vs_off"] else ""),
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "runs": args.runs, "jax": jax.__version__,
                       "isas": list(dense_isas())}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
