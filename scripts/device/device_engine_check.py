#!/usr/bin/env python
"""The whole engine on this machine's device: a Llama-3-8B-shaped model with random bf16
weights through `LLM.generate`, judged against the device's measured memory bandwidth.

Steps (each figure printed and written to --json):
  1. ceiling   HBM bandwidth of a large copy (read + write bytes / time)
  2. load      random weights made on the device (`models.tiny.random_model`, nothing read
               from disk), a word-level tokenizer over the vocabulary; `LLM(loaded=...)`
               sizes the KV pages, places everything and compiles every bucket (warmup
               seconds)
  3. decode    --seqs prompts of --context tokens: once with max_tokens=1 (prefill + one
               token), once with 1 + --decode-tokens; the difference over --decode-tokens is
               the decode step time with every sequence decoding, next to its floor
               (weight bytes + KV bytes read per step) / measured bandwidth
  4. mixed     --seqs prompts of --mixed-prompt tokens arriving together, so chunked prefills
               share steps with decodes: output and total tokens/s
  5. compiles  `compiles_after_warmup` (must be 0: nothing compiles while serving)
--dry-run: a tiny model and small workload, for the CPU rehearsal in the slow tier (figures meaningless).

    python scripts/device/device_engine_check.py --json $OUT/engine_check.json
    python scripts/device/device_engine_check.py --dry-run
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve import LLM, SamplingParams
from jaxserve.models import shapes
from jaxserve.models.tiny import random_model

WORD_IDS = dict(bos_token_id=1, eos_token_ids=(2,))  # the word tokenizer's special ids
TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=64, max_position_embeddings=1024)


def hbm_gbps(n_bytes: int, iters: int = 10) -> float:
    x = jnp.ones((n_bytes // 4,), jnp.float32)
    f = jax.jit(lambda x: x * 1.0001)
    jax.block_until_ready(f(x))
    t = time.perf_counter()
    for _ in range(iters):
        y = f(x)
    jax.block_until_ready(y)
    return 2 * n_bytes * iters / (time.perf_counter() - t) / 1e9


def timed_generate(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t, sum(len(o.outputs[0].token_ids) for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny model and workload (CPU)")
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--mixed-prompt", type=int, default=1024)
    ap.add_argument("--mixed-tokens", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.dry_run:
        args.seqs, args.context, args.decode_tokens = 4, 64, 4
        args.mixed_prompt, args.mixed_tokens, args.max_num_batched_tokens = 48, 4, 64
    cfg = dataclasses.replace(shapes.llama3_8b(), **WORD_IDS, **(TINY if args.dry_run else {}))
    platform = jax.default_backend()
    report: dict = {"platform": platform, "device": str(jax.devices()[0].device_kind),
                    "jax": jax.__version__, "dry_run": args.dry_run, "args": vars(args)}
    bw = hbm_gbps((64 << 20) if args.dry_run or platform == "cpu" else (2 << 30))
    report["hbm_gbps"] = bw
    print(f"measured copy bandwidth {bw:.0f} GB/s on {report['device']}", flush=True)

    t = time.perf_counter()
    model = random_model(cfg, dtype=jnp.bfloat16, jit=True)  # made on the device
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(model.params))
    max_len = args.context + args.decode_tokens + 8
    # Prefix caching off: the decode measurement runs the same prompts twice.
    llm = LLM(loaded=model, dtype="bfloat16", max_num_seqs=args.seqs,
              max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=max(max_len, args.mixed_prompt + args.mixed_tokens + 8),
              enable_prefix_caching=False,
              # Three token buckets: the decode step (seqs), a mid chunk and the full budget,
              # so warmup stays within the device run's minutes (each is a full-model compile).
              token_buckets=(4, 16, 64) if args.dry_run else tuple(sorted(
                  {args.seqs, 512, args.max_num_batched_tokens})))
    report["load_and_warmup_s"] = time.perf_counter() - t
    report["weight_gb"] = weight_bytes / 1e9
    print(f"weights {weight_bytes / 1e9:.2f} GB; load + warmup {report['load_and_warmup_s']:.1f}"
          " s", flush=True)

    rng = np.random.default_rng(0)
    prompts = [[int(x) for x in rng.integers(3, cfg.vocab_size, args.context)]
               for _ in range(args.seqs)]
    timed_generate(llm, prompts, 2)  # first-call costs (host caches) out of the timings
    t1, _ = timed_generate(llm, prompts, 1)
    t2, n2 = timed_generate(llm, prompts, 1 + args.decode_tokens)
    step_s = (t2 - t1) / args.decode_tokens
    ctx = args.context + args.decode_tokens // 2
    kv_bytes = args.seqs * ctx * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2
    floor_s = (weight_bytes + kv_bytes) / (bw * 1e9)
    report["decode"] = {"seqs": args.seqs, "context": args.context, "step_ms": step_s * 1e3,
                        "floor_ms": floor_s * 1e3, "fraction_of_bandwidth": floor_s / step_s,
                        "output_tok_s": args.seqs / step_s, "prefill_s": t1}
    d = report["decode"]
    print(f"decode {args.seqs} x ctx {args.context}: {d['step_ms']:.2f} ms/step (floor "
          f"{d['floor_ms']:.2f} ms = weights + KV at measured bandwidth: "
          f"{100 * d['fraction_of_bandwidth']:.0f}%), {d['output_tok_s']:.0f} out tok/s",
          flush=True)

    mixed = [[int(x) for x in rng.integers(3, cfg.vocab_size, args.mixed_prompt)]
             for _ in range(args.seqs)]
    t3, n3 = timed_generate(llm, mixed, args.mixed_tokens)
    report["mixed"] = {"seqs": args.seqs, "prompt": args.mixed_prompt,
                       "max_tokens": args.mixed_tokens, "seconds": t3,
                       "output_tok_s": n3 / t3,
                       "total_tok_s": (n3 + args.seqs * args.mixed_prompt) / t3}
    m = report["mixed"]
    print(f"mixed {args.seqs} x {args.mixed_prompt}-token prompts, {args.mixed_tokens} new: "
          f"{m['output_tok_s']:.0f} out tok/s, {m['total_tok_s']:.0f} total tok/s", flush=True)
    stats = llm.engine.stats()
    report["compiles_after_warmup"] = stats.compiles_after_warmup
    report["num_preemptions"] = stats.num_preemptions
    print(f"compiles after warmup: {stats.compiles_after_warmup}; preemptions "
          f"{stats.num_preemptions}", flush=True)
    llm.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
