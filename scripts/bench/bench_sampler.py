#!/usr/bin/env python
"""The serving sampler's time per step: greedy or sampled rows, with no row or every row under
a grammar bitmask.

Times model_runner's jitted sampler (the executable the engine runs) on f32[S, V] logits
already on the device, median of --runs after a compile run, for each S in --seqs. The
bitmask is random (30% of tokens allowed per row). Numbers on a CPU are not accelerator
numbers; what a grammar adds to a step, and what a step without one pays, is the point.

    python scripts/bench/bench_sampler.py --seqs 32,256 --vocab 49152 --json sampler.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.device.model_runner import sample_jit
from jaxserve.device.sampler import SamplingTensors
from jaxserve.engine.batch import bitmask_words


def time_sampler(S: int, V: int, constrained: bool, temperature: float, runs: int) -> float:
    rng = np.random.default_rng(S)
    logits = jnp.asarray(rng.normal(size=(S, V)).astype(np.float32))
    words = bitmask_words(V)
    bits = rng.random((S, words * 32)) < 0.3
    weights = np.uint64(1) << np.arange(32, dtype=np.uint64)
    bitmask = (bits.reshape(S, words, 32) * weights).sum(-1).astype(np.uint32).view(np.int32)
    st = SamplingTensors.of(
        jnp.stack([jnp.zeros(S, jnp.uint32), jnp.arange(S, dtype=jnp.uint32)], 1),
        jnp.zeros((S, 0), jnp.int32), jnp.zeros((S, 0), bool),
        bitmask=jnp.asarray(bitmask), constrained=jnp.full((S,), constrained),
        temperature=jnp.full((S,), temperature, jnp.float32))
    jax.block_until_ready(sample_jit(logits, st, apply_penalty=False, feed_len=S))
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(sample_jit(logits, st, apply_penalty=False, feed_len=S))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", default="32,256")
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rows = []
    for S in (int(x) for x in args.seqs.split(",")):
        for temperature in (0.0, 1.0):
            row = {"seqs": S, "vocab": args.vocab, "temperature": temperature}
            for constrained in (False, True):
                key = "grammar_ms" if constrained else "plain_ms"
                row[key] = time_sampler(S, args.vocab, constrained, temperature, args.runs)
            rows.append(row)
            print(f"S={S:4d} temperature={temperature}: {row['plain_ms']:7.2f} ms without a "
                  f"grammar, {row['grammar_ms']:7.2f} ms with every row under one")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "backend": jax.default_backend()}, f, indent=1)


if __name__ == "__main__":
    main()
