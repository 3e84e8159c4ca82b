"""Where multi-LoRA's decode cost goes: one engine without LoRA and one with 8 rank-16 adapter
slots, over the same 32 prompts as (a) base requests on the LoRA engine (every row slot 0:
the LoRA path's fixed cost), (b) every request on one adapter (the per-row work, one
adapter's bytes), (c) round-robin over 8 adapters (the per-row work, 8 adapters' bytes);
rounds interleaved in one process, median ratio of each to no LoRA.

    python scripts/bench/bench_lora_decompose.py ADAPTERS_DIR [--rounds 4] [--lora-dtype auto]

ADAPTERS_DIR: lora0 .. lora7 from scripts/bench/make_lora_adapters.py. The bundled model,
96 new tokens a request (ignore_eos), greedy.
"""

from __future__ import annotations

import argparse
import statistics
import time

from jaxserve import LLM, LoRARequest, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("adapters")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--lora-dtype", default="auto")
    args = p.parse_args()
    common = dict(max_num_seqs=32, max_num_batched_tokens=512, max_model_len=1024)
    base = LLM(**common)
    lora = LLM(**common, enable_lora=True, max_loras=8, max_lora_rank=16,
               lora_dtype=args.lora_dtype)
    reqs = [LoRARequest(f"l{i}", i + 1, f"{args.adapters}/lora{i}") for i in range(8)]
    prompts = [f"Tell me a story about the number {i} and a cat called Tom." for i in range(32)]
    sp = SamplingParams(max_tokens=96, ignore_eos=True, temperature=0)
    cases = {"base": (base, None), "lora_slot0": (lora, None),
             "lora_1_adapter": (lora, [reqs[0]] * 32),
             "lora_8_adapters": (lora, [reqs[i % 8] for i in range(32)])}

    def run(name: str) -> float:
        llm, lr = cases[name]
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False, lora_request=lr)
        return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)

    for name in cases:
        run(name)
    res: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name in cases:
            res[name].append(run(name))
        print({n: round(v[-1], 1) for n, v in res.items()}, flush=True)
    for name in cases:
        ratio = statistics.median(x / y for x, y in zip(res[name], res["base"]))
        print(f"{name}: median ratio to no LoRA {ratio:.3f}")


if __name__ == "__main__":
    main()
