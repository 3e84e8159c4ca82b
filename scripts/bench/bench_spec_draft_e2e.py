#!/usr/bin/env python
"""End-to-end speculative decoding with a draft model (method draft_model) through `LLM`:
output tokens/s with and without, and the acceptance rate, at concurrency 1, greedy.

Target: the bundled model (`LLM()` default: SmolLM2-135M-Instruct, GGUF Q4_1, 30 layers).
Draft: its first --draft-layers layers (`spec_draft.truncated_draft`: the same embedding,
final norm and head; an honestly labelled truncated copy, NOT a trained draft), taken from
the checkpoint dequantized to float32 and written to a temporary HF directory that
`speculative_config.model` names (the build loads it with the target's loader; "auto"
quantization keeps it float32 unless --quantization requantizes both).
Prompts: one copying-style (the answer repeats the prompt's text) and one open-ended. Each
is generated once untimed (the prefix cache then holds its prompt in both runs), then timed
--runs times; output tokens / wall seconds of the best run. Acceptance: accepted / proposed
draft tokens over the timed runs (`EngineStats.spec_*`).

    python scripts/bench/bench_spec_draft_e2e.py
    python scripts/bench/bench_spec_draft_e2e.py --draft-layers 2 --k 3 --max-tokens 96 --json o.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import tempfile
import time

from jaxserve import LLM, SamplingParams
from jaxserve.device.spec_draft import truncated_draft
from jaxserve.models.hf_loader import save_hf_dir
from jaxserve.models.loading import load_model
from jaxserve.models.quant import WeightQuant

TEXT = ("The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins "
        "with a single step. All that glitters is not gold. Actions speak louder than words.")
PROMPTS = {  # user messages, sent through the model's chat template (`LLM.chat`)
    "copy": f"Repeat the following text exactly, word for word: {TEXT}",
    "open": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


def save_draft(layers: int, out: pathlib.Path) -> str:
    base = load_model(None, "float32", quant=WeightQuant("none"))
    cfg, params = truncated_draft(base.params, base.config, layers)
    save_hf_dir(out, cfg, params)
    base.tokenizer.save(out)
    return str(out)


def measure(llm: LLM, prompt: str, max_tokens: int, runs: int) -> dict:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    msgs = [{"role": "user", "content": prompt}]
    first = llm.chat(msgs, sp, use_tqdm=False)[0].outputs[0].token_ids  # untimed
    s0 = llm.engine.stats()
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        out = llm.chat(msgs, sp, use_tqdm=False)[0].outputs[0]
        best = min(best, time.perf_counter() - t0)
        assert list(out.token_ids) == list(first), "greedy output changed between runs"
    s1 = llm.engine.stats()
    row = {"output_tokens": len(first), "best_s": round(best, 3),
           "tok_per_s": round(len(first) / best, 2), "tokens": list(first)}
    if s1.spec_num_draft_tokens is not None:
        d = s1.spec_num_draft_tokens - s0.spec_num_draft_tokens
        a = s1.spec_num_accepted_tokens - s0.spec_num_accepted_tokens
        row |= {"draft_tokens": d, "accepted_tokens": a,
                "acceptance_rate": round(a / d, 3) if d else None,
                "mean_accepted_per_draft": round(
                    a / max(1, s1.spec_num_drafts - s0.spec_num_drafts), 2)}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft-layers", type=int, default=4)
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--quantization", default="auto", help="both models' weight storage")
    ap.add_argument("--int8-activations", default="auto", help="both engines' (off: float "
                    "activations, so a (1 + k)-row verify step rounds as a 1-row decode)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="both engines' (fewer buckets to compile); default: EngineConfig's")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    tmp = pathlib.Path(tempfile.mkdtemp()) / f"draft-{args.draft_layers}l"
    draft = save_draft(args.draft_layers, tmp)
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": args.k}
    results: dict = {"draft": f"bundled model truncated to its first {args.draft_layers} "
                              "layers (not a trained draft), float32", "k": args.k,
                     "quantization": args.quantization,
                     "int8_activations": args.int8_activations}
    for label, sc in [("plain", None), ("draft_model", spec)]:
        extra = {} if args.max_num_batched_tokens is None else {
            "max_num_batched_tokens": args.max_num_batched_tokens}
        llm = LLM(speculative_config=sc, quantization=args.quantization, max_num_seqs=4,
                  int8_activations=args.int8_activations, **extra)
        results[label] = {name: measure(llm, p, args.max_tokens, args.runs)
                          for name, p in PROMPTS.items()}
        assert llm.engine.stats().compiles_after_warmup == 0
        llm.close()
    for name in PROMPTS:
        same = results["plain"][name]["tokens"] == results["draft_model"][name]["tokens"]
        p, s = results["plain"][name], results["draft_model"][name]
        print(f"{name:5s} plain {p['tok_per_s']:7.2f} tok/s | draft_model {s['tok_per_s']:7.2f} "
              f"tok/s ({s['tok_per_s'] / p['tok_per_s']:.2f}x), acceptance "
              f"{s['acceptance_rate']}, accepted/draft {s['mean_accepted_per_draft']}, "
              f"same tokens: {same}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
