"""Multi-LoRA's throughput cost, offline and interleaved: output tokens/s of one engine
without LoRA and engines with 8 adapters (stacks of the default dtype, `--lora-dtype auto`,
and of float32 and bfloat16 named) over the same 32
prompts, every prompt on an adapter (round-robin), rounds alternating between the engines in
one process so that a shared host's drift falls on all of them alike; prints each round's
ratios and their median, writes JSON.

    python scripts/bench/bench_lora_offline.py ADAPTERS_DIR --rounds 5 --json out.json

ADAPTERS_DIR: lora0 .. lora7 from scripts/bench/make_lora_adapters.py (rank 16, every
projection). The bundled model, 32 sequences, 128 new tokens (ignore_eos), greedy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from jaxserve import LLM, LoRARequest, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("adapters")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seqs", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--quantization", default="auto",
                   help="the base weights (auto: the bundled GGUF's own Q4_1 blocks; none: "
                   "float32)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    common = dict(max_num_seqs=args.seqs, max_num_batched_tokens=512, max_model_len=1024,
                  quantization=args.quantization)
    lora = dict(enable_lora=True, max_loras=8, max_lora_rank=16)
    engines = {"none": LLM(**common), "lora": LLM(**common, **lora),
               "lora_f32": LLM(**common, **lora, lora_dtype="float32"),
               "lora_bf16": LLM(**common, **lora, lora_dtype="bfloat16")}
    variants = [k for k in engines if k != "none"]
    reqs = [LoRARequest(f"l{i}", i + 1, f"{args.adapters}/lora{i}") for i in range(8)]
    prompts = [f"Tell me a story about the number {i} and a cat called Tom." for i in
               range(args.seqs)]
    sp = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0)

    def run(name: str) -> float:
        lr = None if name == "none" else [reqs[i % 8] for i in range(args.seqs)]
        t = time.perf_counter()
        outs = engines[name].generate(prompts, sp, use_tqdm=False, lora_request=lr)
        return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)

    for name in engines:  # the adapters loaded and every path run once
        run(name)
    rounds = []
    for r in range(args.rounds):
        tps = {name: run(name) for name in engines}
        rounds.append(tps)
        print(f"round {r + 1}: " + ", ".join(f"{k} {v:.1f} tok/s" for k, v in tps.items())
              + "; ratios " + ", ".join(f"{k} {tps[k] / tps['none']:.3f}" for k in variants),
              flush=True)
    summary = {k: statistics.median(r[k] / r["none"] for r in rounds) for k in variants}
    print("median ratio to no LoRA: " + ", ".join(f"{k} {v:.3f}" for k, v in summary.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rounds": rounds, "median_ratio": summary, "seqs": args.seqs,
                       "max_tokens": args.max_tokens, "quantization": args.quantization},
                      f, indent=1)


if __name__ == "__main__":
    main()
