#!/usr/bin/env python
"""What the decode token budget does to inter-token latency under a steady stream of arrivals.

The engine (`LLMEngine`, the bundled model, the serving defaults but for the budget) is kept at
--concurrency requests in flight, a new random --prompt-len prompt added as each one finishes
(--max-tokens new tokens each, ignore_eos, greedy), until --requests have finished: the closed
loop of `vllm bench serve --max-concurrency`, without the HTTP front. For each budget in
--budgets ("none": no separate cap) it reports output tokens/s, the inter-token gaps (p50 /
p90 / p99 over every stream's consecutive tokens, timed where `step()` returns them) and the
steps by their token count (how many, and their median / max time), which shows which steps
stall the streams: at concurrency 32 a third of the gaps are steps that carry a prefill chunk,
so p99 ITL is those steps' length.

    python scripts/bench/bench_decode_budget.py --budgets 512,256,128 --json budget.json
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from jaxserve import LLM
from jaxserve.engine.sampling_params import SamplingParams

TOKEN_BANDS = ((0, 64), (64, 160), (160, 320), (320, 640), (640, 1280), (1280, 4097))


def run(budget: int | None, concurrency: int, requests: int, prompt_len: int,
        max_tokens: int) -> dict:
    llm = LLM(max_num_seqs=concurrency, max_model_len=prompt_len + max_tokens + 16,
              decode_token_budget=budget)
    eng = llm.engine
    sizes: list[int] = []
    schedule = eng.scheduler.schedule

    def recorded():  # the token count of every scheduled step, in order
        out = schedule()
        sizes.append(out.num_tokens)
        return out

    eng.scheduler.schedule = recorded
    rng = np.random.default_rng(0)
    sent = finished = 0
    last: dict[str, float] = {}
    counts: dict[str, int] = {}
    gaps: list[float] = []
    steps: list[tuple[float, int]] = []

    def add() -> None:
        nonlocal sent
        eng.add_request(f"r{sent}", [int(x) for x in rng.integers(100, 40000, prompt_len)],
                        SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0))
        sent += 1

    for _ in range(concurrency):
        add()
    start = time.perf_counter()
    while finished < requests:
        t0 = time.perf_counter()
        outs = eng.step()
        t1 = time.perf_counter()
        # With async scheduling, step() returns the previous step's tokens: the time of a
        # call is (mostly) the device time of the step launched one call earlier.
        steps.append((t1 - t0, sizes[-2] if len(sizes) > 1 else 0))
        for o in outs:
            n = len(o.outputs[0].token_ids)
            if n > counts.get(o.request_id, 0):
                if o.request_id in last:
                    gaps.append(t1 - last[o.request_id])
                last[o.request_id], counts[o.request_id] = t1, n
            if o.finished:
                finished += 1
                if sent < requests:
                    add()
    elapsed = time.perf_counter() - start
    while eng.has_unfinished():
        eng.step()
    itl = np.asarray(gaps) * 1e3
    ms = np.asarray([s for s, _ in steps]) * 1e3
    tok = np.asarray([t for _, t in steps])
    bands = []
    for lo, hi in TOKEN_BANDS:
        m = (tok >= lo) & (tok < hi)
        if m.any():
            bands.append({"tokens": [lo, hi], "steps": int(m.sum()),
                          "p50_ms": float(np.median(ms[m])), "max_ms": float(ms[m].max())})
    return {"decode_token_budget": budget, "concurrency": concurrency, "requests": requests,
            "prompt_len": prompt_len, "max_tokens": max_tokens,
            "output_tok_s": requests * max_tokens / elapsed,
            "itl_ms": {p: float(np.percentile(itl, q)) for p, q in
                       (("p50", 50), ("p90", 90), ("p99", 99))},
            "share_of_gaps_over_2x_p50": float(np.mean(itl > 2 * np.median(itl))),
            "steps_by_tokens": bands}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budgets", default="512,256,128")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for b in args.budgets.split(","):
        r = run(None if b == "none" else int(b), args.concurrency, args.requests,
                args.prompt_len, args.max_tokens)
        rows.append(r)
        i = r["itl_ms"]
        print(f"budget {b:>4}: {r['output_tok_s']:6.1f} out tok/s, ITL p50 {i['p50']:5.0f} "
              f"p90 {i['p90']:5.0f} p99 {i['p99']:5.0f} ms, gaps > 2x p50: "
              f"{r['share_of_gaps_over_2x_p50']:.0%}")
        for band in r["steps_by_tokens"]:
            lo, hi = band["tokens"]
            print(f"    steps of [{lo}, {hi}) tokens: {band['steps']:4d}, "
                  f"p50 {band['p50_ms']:6.0f} ms, max {band['max_ms']:6.0f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
