"""What batch-invariant mode costs: offline decode tokens/s with and without it.

Two offline engines (`LLM`) over the bundled model, one with `batch_invariant=True`, the
other without, built once each; then rounds alternating between them (the host is shared
and noisy: alternate, do not run one mode's rounds back to back). Each round: `batch`
prompts of `--prompt-len` random ordinary-text tokens, generating `--max-tokens` each
(ignore_eos, greedy), with and without per-token logprobs (the mode changes the logprobs'
sum, so a run without them shows what the rest of the mode costs). Tokens/s = generated
tokens / wall time of the generate call (prefill included; the prompts are short).

    python scripts/bench/bench_batch_invariant.py --json bench_batch_invariant.json
    python scripts/bench/bench_batch_invariant.py --int8-activations off --json off.json

Prints a table and writes every round's figure, the median tokens/s per (mode, batch,
logprobs) and the median over rounds of each round's ratio (mode on / off, measured back to
back: the figure that survives the host's drift between rounds).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M")
    ap.add_argument("--batches", default="1,16", help="comma-separated concurrencies")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--int8-activations", default="auto",
                    help="off: the bundled model's int4 weights with float activations, the "
                         "dense path whose decode the mode slows (QuantPanels.fast)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from jaxserve import LLM, SamplingParams

    batches = [int(b) for b in args.batches.split(",")]
    common = dict(max_num_seqs=max(batches), max_num_batched_tokens=256,
                  decode_token_budget=None, max_model_len=512,
                  # Fewer buckets than the default set: start-up, not what is measured
                  # (the decode batches here fill buckets 1 and 16 exactly).
                  token_buckets=(1, 16, 64, 256), int8_activations=args.int8_activations)
    llms = {mode: LLM(args.model, batch_invariant=mode, **common) for mode in (False, True)}
    vocab = llms[False].engine.runner.shape.vocab_size
    rng = np.random.default_rng(0)
    rows = []
    for rnd in range(args.rounds):
        for batch in batches:
            for logprobs in (None, 1):
                for mode in ((False, True) if rnd % 2 == 0 else (True, False)):
                    prompts = [{"prompt_token_ids": [int(t) for t in rng.integers(
                        100, vocab - 100, args.prompt_len)]} for _ in range(batch)]
                    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                        ignore_eos=True, logprobs=logprobs)
                    t0 = time.perf_counter()
                    outs = llms[mode].generate(prompts, sp, use_tqdm=False)
                    dt = time.perf_counter() - t0
                    n = sum(len(o.outputs[0].token_ids) for o in outs)
                    rows.append(dict(round=rnd, batch_invariant=mode, batch=batch,
                                     logprobs=logprobs is not None, tokens=n, seconds=dt,
                                     tokens_per_s=n / dt))
                    print(f"round {rnd} batch {batch:3d} logprobs {logprobs is not None!s:5} "
                          f"batch_invariant {mode!s:5}: {n / dt:8.1f} tok/s", flush=True)
    summary = []
    for batch in batches:
        for lp in (False, True):
            med = {mode: statistics.median(r["tokens_per_s"] for r in rows if r["batch"] ==
                                           batch and r["logprobs"] == lp and
                                           r["batch_invariant"] == mode)
                   for mode in (False, True)}
            by_round = {(r["round"], r["batch_invariant"]): r["tokens_per_s"] for r in rows
                        if r["batch"] == batch and r["logprobs"] == lp}
            ratios = [by_round[(k, True)] / by_round[(k, False)] for k in range(args.rounds)]
            summary.append(dict(batch=batch, logprobs=lp, default_tok_s=med[False],
                                invariant_tok_s=med[True], round_ratios=ratios,
                                ratio=statistics.median(ratios)))
    print("\nbatch  logprobs  default tok/s  batch_invariant tok/s  ratio (median of rounds)")
    for s in summary:
        print(f"{s['batch']:5d}  {s['logprobs']!s:8}  {s['default_tok_s']:13.1f}  "
              f"{s['invariant_tok_s']:21.1f}  {s['ratio']:5.2f}x  "
              f"({', '.join(f'{r:.2f}' for r in s['round_ratios'])})")
    for llm in llms.values():
        llm.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), engine=common, host=platform.node(),
                           machine=platform.machine(), rounds=rows, summary=summary), f,
                      indent=1)


if __name__ == "__main__":
    main()
