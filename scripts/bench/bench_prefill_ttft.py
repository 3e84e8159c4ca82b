#!/usr/bin/env python
"""Prefill time (TTFT offline) of the bundled model through the engine, per dense-kernel
instruction set: one request of a --lengths-token prompt and max_tokens=1, timed from
`LLM.generate` to its return (the prefill steps plus the first sample), with
EngineConfig.dense_isa forcing each variant (AVX-512 / AVX2: kernels_pallas/cpu_build.py).
One LLM per ISA, built (and warmed up: every bucket compiled) before any timing; then the
ISAs alternate, --runs times per length, each run a fresh random prompt (prefix caching off,
so every token is prefilled). Best and median seconds, JSON with --json.
--decode-tokens D also times batch-1 decode: a 16-token prompt with max_tokens = 1 + D against
max_tokens = 1, the difference / D per output token (best of --runs, alternating).

    python scripts/bench/bench_prefill_ttft.py --lengths 256,2048 --runs 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from jaxserve import LLM
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.kernels_pallas import cpu_build


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="256,2048")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--decode-tokens", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    isas = cpu_build.dense_isas()
    if not isas:
        raise SystemExit("the CPU dense kernels could not be built here (see the log)")
    llms = {isa: LLM(dense_isa=isa, max_num_seqs=4,
                     max_num_batched_tokens=args.max_num_batched_tokens,
                     max_model_len=max(lengths) + 16, enable_prefix_caching=False)
            for isa in isas}
    vocab = llms[isas[0]].engine.runner.model_cfg.vocab_size
    rng = np.random.default_rng(0)
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    times = {(isa, n): [] for isa in isas for n in lengths}
    for n in lengths:  # one untimed run each: first-call costs out of the figures
        for llm in llms.values():
            llm.generate({"prompt_token_ids": rng.integers(0, vocab, n).tolist()}, sp,
                         use_tqdm=False)
    for _ in range(args.runs):
        for n in lengths:
            for isa, llm in llms.items():
                ids = rng.integers(0, vocab, n).tolist()
                t = time.perf_counter()
                llm.generate({"prompt_token_ids": ids}, sp, use_tqdm=False)
                times[(isa, n)].append(time.perf_counter() - t)
    decode = {isa: [] for isa in isas}
    for _ in range(args.runs if args.decode_tokens else 0):
        for isa, llm in llms.items():
            ids = rng.integers(0, vocab, 16).tolist()
            lap = []
            for d in (0, args.decode_tokens):
                t = time.perf_counter()
                out = llm.generate({"prompt_token_ids": ids}, SamplingParams(
                    max_tokens=1 + d, temperature=0.0, ignore_eos=True), use_tqdm=False)
                lap.append(time.perf_counter() - t)
                assert len(out[0].outputs[0].token_ids) == 1 + d
            decode[isa].append((lap[1] - lap[0]) / args.decode_tokens)
    rows = []
    for isa, ts in decode.items():
        if ts:
            rows.append({"isa": isa, "decode_s_per_token": min(ts), "runs": ts})
            print(f"decode {isa:7s}: best {1e3 * min(ts):7.2f} ms / token, median "
                  f"{1e3 * statistics.median(ts):7.2f}", flush=True)
    for (isa, n), ts in times.items():
        rows.append({"isa": isa, "prompt_tokens": n, "best_s": min(ts),
                     "median_s": statistics.median(ts), "runs": ts})
        print(f"{n:5d} tokens {isa:7s}: best {min(ts):7.3f} s, median "
              f"{statistics.median(ts):7.3f} s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "max_num_batched_tokens": args.max_num_batched_tokens},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
