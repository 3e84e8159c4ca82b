#!/usr/bin/env python
"""Where a decode step's time goes, on the bundled model (or --model): prints and writes JSON.

For S live decode sequences of context C in a (T=S, S) step it times, each as the best of
--runs runs taken round robin (KV donated, as the engine runs it):
  full        the engine's paged_forward (embed, 30 layers, KV write, attention, lm_head)
  no_attn     the same with the KV write and attention replaced by identity (what is left:
              the dense projections, MLP, norms, RoPE and the lm_head)
  write_only  the same with only the attention replaced, the KV written by write_kv (XLA's
              scatter: the reference's write; the CPU kernel writes inside its own call)
  lm_head     the vocabulary projection of S rows alone
so attention + KV write = full - no_attn (XLA's scatter alone: write_only - no_attn), per
attention implementation (--impl: the jnp reference, the C++ CPU kernel, ...). Also the
XLA:CPU f32 GEMM rate at M = S.

    python scripts/bench/profile_step.py --seqs 1,8,32 --context 256 --json profile.json
    python scripts/bench/profile_step.py --seqs 32 --impl reference,cpu     # before / after
    python scripts/bench/profile_step.py --seqs 1,8,32 --dense xla,cpu      # XLA's dot / C++ dense
    python scripts/bench/profile_step.py --seqs 1,32 --kv-dtype float32,int8,fp8  # quantized KV
    python scripts/bench/profile_step.py --seqs 1,32 --int8-activations auto,off  # integer dots

--prefill N,... profiles a prefill step instead: one sequence of N new tokens from an empty
context (a (T=N, 1) step, the last row's logits), so the same split says what a long prompt's
step spends on attention against the dense projections:

    python scripts/bench/profile_step.py --prefill 256,2048 --runs 3

It first prints the KV tokens one GiB holds for each --kv-dtype (values + the f32 row scales
of int8 / fp8 pages: `sizing.kv_bytes_per_token`). Decode tokens/s of a row = S / full step.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.engine.sizing import kv_bytes_per_token
from jaxserve.kernels_pallas import AttentionMetadata, is_quantized_dtype, select_impl, write_kv
from jaxserve.models import loading
from jaxserve.models import paged as P
from jaxserve.models.blocks import lm_logits
from jaxserve.models.packing import pack_params


def decode_metadata(seqs: int, ctx: int, page_size: int) -> AttentionMetadata:
    pages = ctx // page_size + 1
    tables = 1 + np.arange(seqs * pages, dtype=np.int32).reshape(seqs, pages)
    slots = tables[:, -1] * page_size + ctx % page_size
    return AttentionMetadata(
        slot_mapping=jnp.asarray(slots), block_tables=jnp.asarray(tables),
        kv_lens=jnp.full(seqs, ctx + 1, jnp.int32),
        cu_q_lens=jnp.arange(seqs + 1, dtype=jnp.int32),
        num_seqs=jnp.asarray([seqs], jnp.int32))


def prefill_metadata(n: int, page_size: int) -> AttentionMetadata:
    """One sequence of n new tokens from an empty context."""
    pages = -(-n // page_size)
    tables = 1 + np.arange(pages, dtype=np.int32)[None, :]
    slots = tables[0, np.arange(n) // page_size] * page_size + np.arange(n) % page_size
    return AttentionMetadata(
        slot_mapping=jnp.asarray(slots, jnp.int32), block_tables=jnp.asarray(tables),
        kv_lens=jnp.asarray([n], jnp.int32), cu_q_lens=jnp.asarray([0, n], jnp.int32),
        num_seqs=jnp.asarray([1], jnp.int32))


def profile(model: loading.LoadedModel, seqs: int, ctx: int, impl: str,
            page_size: int = 16, runs: int = 6, kv_dtype: str = "float32",
            dense: str = "xla", prefill: int = 0, int8_activations: str = "off") -> dict:
    """`prefill` > 0: one sequence of that many new tokens (seqs and ctx unused)."""
    cfg, params = model.config, model.params
    if dense == "cpu":
        params = pack_params(params, int8_activations=int8_activations)
    if prefill:
        md = prefill_metadata(prefill, page_size)
        num_pages = 1 + -(-prefill // page_size)
        tok = jnp.ones(prefill, jnp.int32)
        pos = jnp.arange(prefill, dtype=jnp.int32)
        rows = jnp.asarray([prefill - 1], jnp.int32)
    else:
        md = decode_metadata(seqs, ctx, page_size)
        num_pages = 1 + seqs * (ctx // page_size + 1)
        tok = jnp.ones(seqs, jnp.int32)
        pos = jnp.full(seqs, ctx, jnp.int32)
        rows = jnp.arange(seqs, dtype=jnp.int32)

    kv = P.init_kv_cache(cfg, num_pages, page_size, KV_DTYPES[kv_dtype])

    def compiled(stub_attention: bool, stub_write: bool):  # noqa: ANN202
        """The step compiled with the given parts replaced by identity (traced right here)."""
        def fwd(params, kv, tok, pos, md, rows):  # noqa: ANN001, ANN202 - fresh per variant:
            return P.paged_forward(params, kv, tok, pos, md, rows, cfg, impl)  # no stale trace

        saved = P.write_kv_and_attend
        try:
            if stub_attention and stub_write:
                P.write_kv_and_attend = lambda q, k, v, pages, md, **kw: (q, pages)
            elif stub_attention:
                P.write_kv_and_attend = lambda q, k, v, pages, md, **kw: (
                    q, write_kv(pages, k, v, md.slot_mapping))
            fn = jax.jit(fwd, donate_argnums=1).lower(params, kv, tok, pos, md, rows).compile()
        finally:
            P.write_kv_and_attend = saved
        return lambda kv: fn(params, kv, tok, pos, md, rows)

    variants = {"full_ms": compiled(False, False), "write_only_ms": compiled(True, False),
                "no_attn_ms": compiled(True, True)}
    # Round robin, best of `runs` (after one warm-up round): a burst of load on a shared host
    # then hits every variant alike instead of one.
    out = {"seqs": seqs, "context": ctx, "prefill": prefill, "impl": impl,
           "kv_dtype": kv_dtype, "dense": dense, "int8_activations": int8_activations,
           **{k: float("inf") for k in variants}}
    for i in range(runs + 1):
        for name, step in variants.items():
            t = time.perf_counter()
            logits, kv = step(kv)
            logits.block_until_ready()
            if i:
                out[name] = min(out[name], 1e3 * (time.perf_counter() - t))
    head = jax.jit(lambda p, x: lm_logits(cfg, p, x))
    x = jnp.ones((seqs, cfg.hidden_size), jnp.float32)
    head(params, x).block_until_ready()
    t = time.perf_counter()
    for _ in range(5):
        head(params, x).block_until_ready()
    out["lm_head_ms"] = 1e3 * (time.perf_counter() - t) / 5
    out["attention_and_kv_write_ms"] = out["full_ms"] - out["no_attn_ms"]
    out["kv_write_ms"] = out["write_only_ms"] - out["no_attn_ms"]
    return out


KV_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "int8": jnp.int8,
             "fp8": jnp.float8_e4m3fn}


def kv_tokens_per_gib(cfg, kv_dtype: str) -> float:  # noqa: ANN001
    dt = jnp.dtype(KV_DTYPES[kv_dtype])
    return 2**30 / kv_bytes_per_token(cfg, dt.itemsize, None,
                                      4 if is_quantized_dtype(dt) else 0)


def gemm_gflops(m: int, k: int = 576, n: int = 1536) -> float:
    w = jnp.ones((k, n), jnp.float32)
    x = jnp.ones((m, k), jnp.float32)
    f = jax.jit(lambda x, w: x @ w)
    f(x, w).block_until_ready()
    t = time.perf_counter()
    for _ in range(50):
        f(x, w).block_until_ready()
    return 50 * 2 * m * k * n / (time.perf_counter() - t) / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M")
    ap.add_argument("--seqs", default="1,8,32")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--impl", default="auto",
                    help="comma-separated attention impls to profile (auto | reference | cpu)")
    ap.add_argument("--kv-dtype", default="float32",
                    help="comma-separated dtypes of the KV pages: float32 | bfloat16 | int8 | "
                         "fp8 (the model runs in float32 either way)")
    ap.add_argument("--dense", default="cpu",
                    help="comma-separated dense impls: xla (XLA's dot) | cpu (packed weights, "
                         "the C++ kernel: what the engine runs on CPU)")
    ap.add_argument("--int8-activations", default="auto",
                    help="comma-separated EngineConfig.int8_activations values for --dense cpu "
                         "(auto | off): int8 / int4 weights as integer dots, or float "
                         "activations")
    ap.add_argument("--runs", type=int, default=6,
                    help="timed runs per variant (the best counts; raise it on a busy host)")
    ap.add_argument("--prefill", default=None,
                    help="comma-separated prompt lengths: profile a prefill step of one "
                         "sequence of that many tokens instead of decode steps")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    model = loading.load_model(args.model, "float32")
    rows = []
    impls = [select_impl(name) for name in args.impl.split(",")]
    kv_dtypes = args.kv_dtype.split(",")
    per_gib = {d: kv_tokens_per_gib(model.config, d) for d in kv_dtypes}
    for d, n in per_gib.items():
        print(f"KV {d}: {n:,.0f} tokens per GiB", flush=True)
    sizes = args.prefill.split(",") if args.prefill else args.seqs.split(",")
    for s, impl, dense, kvd, a8 in ((int(x), i, d, k, a) for x in sizes for i in impls
                                    for d in args.dense.split(",") for k in kv_dtypes
                                    for a in args.int8_activations.split(",")):
        n = s if args.prefill else 0
        r = profile(model, 1 if n else s, args.context, impl, runs=args.runs, kv_dtype=kvd,
                    dense=dense, prefill=n, int8_activations=a8)
        dense = f"{dense} (int8 activations {a8})" if dense == "cpu" else dense
        r["gemm_gflops_at_m"] = gemm_gflops(s)
        if n:
            share = r["attention_and_kv_write_ms"] / r["full_ms"]
            r["prefill_tok_s"] = 1e3 * n / r["full_ms"]
            rows.append(r)
            print(f"prefill {n} tokens {impl} dense {dense} KV {kvd}: "
                  f"{r['prefill_tok_s']:.0f} tok/s, step {r['full_ms']:.1f} ms = attention + "
                  f"KV write {r['attention_and_kv_write_ms']:.1f} ({100 * share:.0f}%) + "
                  f"dense/norms/lm_head {r['no_attn_ms']:.1f}; XLA GEMM at M={n}: "
                  f"{r['gemm_gflops_at_m']:.0f} GFLOP/s", flush=True)
            continue
        rows.append(r)
        share = r["attention_and_kv_write_ms"] / r["full_ms"]
        r["decode_tok_s"] = 1e3 * s / r["full_ms"]
        print(f"S={s:3d} ctx={args.context} {impl} dense {dense} KV {kvd}: "
              f"{r['decode_tok_s']:.1f} tok/s, step "
              f"{r['full_ms']:.1f} ms = attention + KV "
              f"write {r['attention_and_kv_write_ms']:.1f} ({100 * share:.0f}%; XLA scatter "
              f"{r['kv_write_ms']:.1f}) "
              f"+ dense/norms/lm_head "
              f"{r['no_attn_ms']:.1f} (of which lm_head {r['lm_head_ms']:.1f}); "
              f"XLA GEMM at M={s}: {r['gemm_gflops_at_m']:.0f} GFLOP/s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "kv_tokens_per_gib": per_gib, "jax": jax.__version__}, f,
                  indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
