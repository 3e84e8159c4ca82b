#!/usr/bin/env python
"""Host time of the n-gram proposer (`jaxserve.engine.spec_ngram`) for a whole batch: the
cost speculation adds to every step's host work before the verification step is built.

Shapes (issue 33): 256 sequences of 2,048 tokens and 8 of 8,192, k=5, n in [2, 5]. Token
streams, from easiest to hardest for the proposer (the work grows with the candidate
positions, i.e. the places holding the sequence's last token):
  random    uniform over a 32,000-token vocabulary (few candidates);
  copying   a 64-token vocabulary, the second half of each row copying spans of the first
            (many candidates, long matches: what a summary quoting its prompt looks like);
  run       one token repeated (every position a candidate that survives all n passes).
Per stream: the median of --repeats calls of `propose_ngram` on the packed array, ms per
batch and us per sequence, and `pack` (Python lists -> the padded array) separately, since
an engine that keeps a numpy token buffer per sequence does not pay it.

    python scripts/bench/bench_ngram.py
    python scripts/bench/bench_ngram.py --repeats 20 --json ngram.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import numpy as np

from jaxserve.engine.spec_ngram import pack, propose_ngram


def stream(kind: str, rng: np.random.Generator, length: int) -> np.ndarray:
    if kind == "random":
        return rng.integers(0, 32000, length)
    if kind == "run":
        return np.full(length, 7)
    half = rng.integers(0, 64, length // 2)
    out = [half]
    while sum(len(x) for x in out) < length:
        a = int(rng.integers(0, len(half) - 40))
        out.append(half[a:a + int(rng.integers(8, 40))])
        out.append(rng.integers(0, 64, int(rng.integers(1, 6))))
    return np.concatenate(out)[:length]


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    print("| sequences x tokens | stream | propose ms | us / sequence | pack ms | drafts |")
    print("|---|---|---|---|---|---|")
    for bsz, length in ((256, 2048), (8, 8192)):
        for kind in ("random", "copying", "run"):
            seqs = [stream(kind, rng, length).tolist() for _ in range(bsz)]
            ids, n = pack(seqs)
            propose_ngram(ids, n, k=5, min_n=2, max_n=5)  # warm numpy's code paths
            ms = median_ms(lambda: propose_ngram(ids, n, k=5, min_n=2, max_n=5), args.repeats)
            pack_ms = median_ms(lambda: pack(seqs), max(1, args.repeats // 2))
            _, counts = propose_ngram(ids, n, k=5, min_n=2, max_n=5)
            rows.append({"batch": bsz, "tokens": length, "stream": kind, "propose_ms": ms,
                         "us_per_seq": ms * 1e3 / bsz, "pack_ms": pack_ms,
                         "mean_drafts": float(counts.mean())})
            print(f"| {bsz} x {length} | {kind} | {ms:.2f} | {ms * 1e3 / bsz:.1f} | "
                  f"{pack_ms:.1f} | {counts.mean():.2f} |")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
