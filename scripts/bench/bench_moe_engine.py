#!/usr/bin/env python
"""Whole-engine tokens/s of a small Qwen3-MoE against a dense Qwen3 of the same active
parameters, offline (`LLM.generate`, greedy), random weights. Writes JSON.

Models (defaults): hidden 512, 4 layers, 8 heads of 64 (4 KV heads), vocabulary 4096; the
MoE model's MLP 8 experts of 1024, top-2 (`norm_topk_prob`); the dense model's MLP 2048
wide, the width of the two experts a token uses. Each run: --prompts prompts of
--prompt-len random tokens, --max-tokens generated each, after one warmup batch; the
engines are started and timed one after the other (the host may be shared: compare rows of
one run). Reported: generated tokens / s and the end-to-end seconds, per model.

    python scripts/bench/bench_moe_engine.py --prompts 16 --max-tokens 32 --json out.json
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np

from jaxserve import LLM, SamplingParams
from jaxserve.models import families, tiny


def configs(hidden: int, layers: int, experts: int, width: int, top_k: int,
            vocab: int) -> dict[str, dict]:
    base = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                num_attention_heads=8, num_key_value_heads=4, head_dim=hidden // 8,
                max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1e6,
                bos_token_id=1, eos_token_id=2)
    return {
        "qwen3_moe": dict(base, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                          intermediate_size=top_k * width, num_experts=experts,
                          num_experts_per_tok=top_k, moe_intermediate_size=width,
                          norm_topk_prob=True),
        "qwen3_dense": dict(base, architectures=["Qwen3ForCausalLM"], model_type="qwen3",
                            intermediate_size=top_k * width),
    }


def run(name: str, d: dict, prompts: list[list[int]], max_tokens: int,
        engine_kw: dict) -> dict:
    cfg = families.config_from_hf(d, f"{name}/config.json")
    model = tiny.random_model(cfg, seed=0, scale=0.05)
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    with LLM(loaded=model, max_num_seqs=len(prompts), max_model_len=512, **engine_kw) as llm:
        llm.generate(prompts[:2], sp, use_tqdm=False)  # warm the host paths
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"model": name, "generated_tokens": n, "seconds": dt, "tokens_per_s": n / dt}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--token-buckets", default=None,
                    help="comma-separated token buckets (default: the engine's, ~80 "
                         "compiles per model; a few keep a shared host's run short)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    engine_kw: dict = {}
    if a.token_buckets:
        engine_kw["token_buckets"] = tuple(int(t) for t in a.token_buckets.split(","))
    if a.max_num_batched_tokens:
        engine_kw["max_num_batched_tokens"] = a.max_num_batched_tokens
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, a.vocab, a.prompt_len).tolist() for _ in range(a.prompts)]
    rows = [run(name, d, prompts, a.max_tokens, engine_kw) for name, d in configs(
        a.hidden, a.layers, a.experts, a.width, a.top_k, a.vocab).items()]
    for r in rows:
        print(f"{r['model']:12s} {r['tokens_per_s']:8.1f} tok/s  ({r['generated_tokens']} "
              f"tokens in {r['seconds']:.2f} s)")
    if a.json:
        import jaxserve  # which checkout ran (before / after comparisons run two)

        meta = {"backend": jax.default_backend(), "jax": jax.__version__,
                "jaxserve": str(jaxserve.__file__), **vars(a)}
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
