#!/usr/bin/env python
"""What structured output costs: output tokens/s at a concurrency with 0%, 50% and 100% of the
requests under a JSON schema, and the host time spent filling grammar bitmasks per step.

Offline (`LLM.generate`), the bundled model unless --model: --concurrency requests at once
(max_num_seqs = concurrency), each generating exactly --max-tokens tokens (ignore_eos; the
schema is an array of at least 1000 records, so a constrained output cannot end early and
every mix does the same work). Greedy by default (--temperature), like the side-by-side
runs. Each mix runs --runs times, mixes interleaved, after one warm-up generate; the figure
is the median run. The bitmask host time is measured by wrapping `batch_mask.fill_bitmask` (the
one place the engine fills masks): per step that has a constrained row, and in all.

    python scripts/bench/bench_structured.py --concurrency 32 --max-tokens 128 \
        --json benchmarks/results/structured/bench_structured.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from tqdm.auto import tqdm

from jaxserve import LLM, SamplingParams
from jaxserve.engine import batch_mask as batch_mod

SCHEMA = {"type": "array", "minItems": 1000, "items": {
    "type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3}},
    "required": ["name", "age", "tags"], "additionalProperties": False}}
PROMPT = "List people as JSON records with name, age and tags:"


class FillTimer:
    """Wraps batch_mask.fill_bitmask: seconds spent and steps that filled a mask."""

    def __init__(self) -> None:
        self.seconds, self.steps = 0.0, 0
        self._real = getattr(batch_mod, "fill_bitmask", None)

    def __enter__(self) -> "FillTimer":
        if self._real is None:  # a build without structured output (--fractions 0 only)
            return self

        def timed(num_seqs, vocab_size, rows, *rest):  # noqa: ANN001, ANN002, ANN202
            t0 = time.perf_counter()
            try:
                return self._real(num_seqs, vocab_size, rows, *rest)
            finally:
                if rows:
                    self.seconds += time.perf_counter() - t0
                    self.steps += 1
        batch_mod.fill_bitmask = timed
        return self

    def __exit__(self, *_exc: object) -> None:
        if self._real is not None:
            batch_mod.fill_bitmask = self._real


def run(llm: LLM, n: int, constrained: int, args: argparse.Namespace) -> dict:
    spec = [{"structured_outputs": {"json": SCHEMA}}] * constrained + [{}] * (n - constrained)
    params = [SamplingParams(max_tokens=args.max_tokens, ignore_eos=True,
                             temperature=args.temperature, seed=i, **spec[i])
              for i in range(n)]
    steps0 = llm.engine.stats().num_steps
    with FillTimer() as fill:
        t0 = time.perf_counter()
        outs = llm.generate([PROMPT] * n, params, use_tqdm=False)
        wall = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    steps = llm.engine.stats().num_steps - steps0
    return {"constrained": constrained, "output_tokens": tokens, "wall_s": wall,
            "output_tok_s": tokens / wall, "steps": steps,
            "mask_steps": fill.steps, "fill_s": fill.seconds,
            "fill_ms_per_mask_step": 1e3 * fill.seconds / max(fill.steps, 1),
            "errors": sum(o.outputs[0].error is not None for o in outs)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model path (default: the bundled model)")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--fractions", default="0,0.5,1", help="constrained shares to run")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    n = args.concurrency
    mixes = [round(float(f) * n) for f in args.fractions.split(",")]
    llm = LLM(args.model, max_num_seqs=n)
    run(llm, n, max(mixes) // 2, args)  # warm-up: grammar caches, first-step effects
    results: dict[int, list[dict]] = {m: [] for m in mixes}
    with tqdm(total=args.runs * len(mixes), desc="structured bench", unit="run") as bar:
        for _ in range(args.runs):
            for m in mixes:
                results[m].append(run(llm, n, m, args))
                bar.update()
    base = statistics.median(r["output_tok_s"] for r in results[mixes[0]])
    summary = []
    for m in mixes:
        med = statistics.median(r["output_tok_s"] for r in results[m])
        fills = [r["fill_ms_per_mask_step"] for r in results[m] if r["mask_steps"]]
        row = {"constrained": m, "share": m / n, "output_tok_s_median": med,
               "vs_unconstrained": med / base,
               "fill_ms_per_mask_step_median": statistics.median(fills) if fills else 0.0,
               "runs": results[m]}
        summary.append(row)
        print(f"{m:3d}/{n} constrained: {med:7.1f} out tok/s ({med / base:.3f}x of 0%), "
              f"bitmask fill {row['fill_ms_per_mask_step_median']:.2f} ms per step")
    doc = {"concurrency": n, "max_tokens": args.max_tokens, "temperature": args.temperature,
           "model": args.model or "bundled", "schema": SCHEMA, "results": summary}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    llm.close()


if __name__ == "__main__":
    main()
