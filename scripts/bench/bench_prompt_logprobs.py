#!/usr/bin/env python
"""What prompt logprobs cost: end to end, per device pass, and at warmup.

On the bundled SmolLM2-135M-Instruct (V = 49152) unless --model says otherwise:
  e2e        `LLM.generate` of --prompts random prompts of --prompt-len tokens, max_tokens=1,
             with prompt_logprobs None / 0 / 5 (best of --rounds; the prefix cache off, since
             a request with prompt logprobs skips it anyway)
  pass       the jitted prompt logprobs pass alone on hidden states already on the device,
             every position of a token bucket scored, next to that bucket's forward step
             (`ModelRunner.execute` of a batch of one prefill filling the bucket)
  compile    the pass's compile time per token bucket (what warmup adds)
CPU numbers are not accelerator numbers; the ratios are the point.

    python scripts/bench/bench_prompt_logprobs.py --json plp.json
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np
from tqdm.auto import tqdm

from jaxserve import LLM, SamplingParams
from jaxserve.device.model_runner import prompt_logprobs_jit
from jaxserve.device.prompt_logprobs import PromptLogprobsInputs


def e2e(llm: LLM, prompts: list[list[int]], k: int | None, rounds: int) -> float:
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=k)
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        outs = llm.generate(prompts, params,
                            use_tqdm=False)
        best = min(best, time.perf_counter() - t)
        if k is not None:
            assert all(len(o.prompt_logprobs) == len(p) for o, p in zip(outs, prompts))
    return best


def device_pass(llm: LLM, T: int, runs: int) -> dict:
    r = llm.engine.runner
    hidden = jax.device_put(np.random.default_rng(T).normal(
        0, 1, (T, r.model_cfg.hidden_size)).astype(r.params.final_norm.dtype))
    plp = jax.device_put(PromptLogprobsInputs(
        indices=np.arange(T, dtype=np.int32), targets=np.full(T, 5, np.int32),
        num=np.array([T], np.int32)))
    t = time.perf_counter()
    compiled = prompt_logprobs_jit.lower(r.params, hidden, plp, cfg=r.model_cfg).compile()
    compile_s = time.perf_counter() - t
    jax.block_until_ready(compiled(r.params, hidden, plp))
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        jax.block_until_ready(compiled(r.params, hidden, plp))
        times.append(time.perf_counter() - t)
    return {"tokens": T, "pass_ms": 1e3 * min(times), "compile_s": compile_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    llm = LLM(a.model, enable_prefix_caching=False, max_model_len=a.prompt_len + 8,
              max_num_batched_tokens=a.max_num_batched_tokens)
    vocab = llm.engine.limits.vocab_size
    rng = np.random.default_rng(0)
    prompts = [[int(x) for x in rng.integers(100, vocab, a.prompt_len)]
               for _ in range(a.prompts)]
    e2e_rows = []
    for k in tqdm((None, 0, 5), desc="end to end", unit="setting"):
        e2e_rows.append({"prompt_logprobs": k, "seconds": e2e(llm, prompts, k, a.rounds)})
    buckets = sorted({t for t, _ in llm.engine.runner.shape.buckets})
    pass_rows = [device_pass(llm, T, a.runs) for T in tqdm(buckets, desc="pass", unit="bucket")]
    base = e2e_rows[0]["seconds"]
    print(f"end to end: {a.prompts} prompts x {a.prompt_len} tokens, max_tokens=1 "
          f"(V = {vocab}, {jax.default_backend()})")
    for row in e2e_rows:
        print(f"  prompt_logprobs={row['prompt_logprobs']!s:>4}: {row['seconds']:.3f} s "
              f"({row['seconds'] / base:.2f}x)")
    print(f"{'tokens':>7} {'pass ms':>8} {'compile s':>10}")
    for row in pass_rows:
        print(f"{row['tokens']:7d} {row['pass_ms']:8.2f} {row['compile_s']:10.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"vocab": vocab, "backend": jax.default_backend(),
                       "prompts": a.prompts, "prompt_len": a.prompt_len,
                       "e2e": e2e_rows, "pass": pass_rows}, f, indent=1)
    llm.close()


if __name__ == "__main__":
    main()
