#!/usr/bin/env python
"""Where a decode step's time goes, on the bundled model (or --model): prints and writes JSON.

For S live decode sequences of context C in a (T=S, S) step it times, each as the best of
several runs of a freshly jitted function (KV donated, as the engine runs it):
  full        the engine's paged_forward (embed, 30 layers, KV write, attention, lm_head)
  no_attn     the same with the KV write and attention replaced by identity (what is left:
              the dense projections, MLP, norms, RoPE and the lm_head)
  write_only  the same with only the attention replaced (the KV write kept)
  lm_head     the vocabulary projection of S rows alone
so attention + KV write = full - no_attn (KV write ~ write_only - no_attn), per attention implementation (--impl: the jnp
reference, the C++ CPU kernel, ...). Also the XLA:CPU f32 GEMM rate at M = S.

    python scripts/profile_step.py --seqs 1,8,32 --context 256 --json profile.json
    python scripts/profile_step.py --seqs 32 --impl reference,cpu     # before / after
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.kernels_pallas import AttentionMetadata, select_impl
from jaxserve.models import loading
from jaxserve.models import paged as P
from jaxserve.models.llama import lm_logits


def best_ms(step, kv, runs: int = 6) -> tuple[float, jax.Array]:  # noqa: ANN001
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        logits, kv = step(kv)
        logits.block_until_ready()
        times.append(time.perf_counter() - t)
    return 1e3 * min(times[1:]), kv


def decode_metadata(seqs: int, ctx: int, page_size: int) -> AttentionMetadata:
    pages = ctx // page_size + 1
    tables = 1 + np.arange(seqs * pages, dtype=np.int32).reshape(seqs, pages)
    slots = tables[:, -1] * page_size + ctx % page_size
    return AttentionMetadata(
        slot_mapping=jnp.asarray(slots), block_tables=jnp.asarray(tables),
        kv_lens=jnp.full(seqs, ctx + 1, jnp.int32),
        cu_q_lens=jnp.arange(seqs + 1, dtype=jnp.int32),
        num_seqs=jnp.asarray([seqs], jnp.int32))


def profile(model: loading.LoadedModel, seqs: int, ctx: int, impl: str,
            page_size: int = 16) -> dict:
    cfg, params = model.config, model.params
    md = decode_metadata(seqs, ctx, page_size)
    num_pages = 1 + seqs * (ctx // page_size + 1)
    tok = jnp.ones(seqs, jnp.int32)
    pos = jnp.full(seqs, ctx, jnp.int32)
    rows = jnp.arange(seqs, dtype=jnp.int32)

    def make(stub: bool):  # noqa: ANN202 - a fresh function object per variant: no stale traces
        def fwd(params, kv, tok, pos, md, rows):  # noqa: ANN001, ANN202
            return P.paged_forward(params, kv, tok, pos, md, rows, cfg, impl)
        jitted = jax.jit(fwd, donate_argnums=1)
        return lambda kv: jitted(params, kv, tok, pos, md, rows)

    out = {"seqs": seqs, "context": ctx, "impl": impl}
    kv = jnp.zeros(P.kv_cache_shape(cfg, num_pages, page_size), jnp.float32)
    saved = P.ragged_paged_attention, P.write_kv
    try:
        P.ragged_paged_attention = lambda q, kv_pages, md, **kw: q
        out["write_only_ms"], kv = best_ms(make(True), kv)
        P.write_kv = lambda pages, k, v, slots: pages
        out["no_attn_ms"], kv = best_ms(make(True), kv)
    finally:
        P.ragged_paged_attention, P.write_kv = saved
    out["full_ms"], kv = best_ms(make(False), kv)
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
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    model = loading.load_model(args.model, "float32")
    rows = []
    impls = [select_impl(name) for name in args.impl.split(",")]
    for s, impl in ((int(x), i) for x in args.seqs.split(",") for i in impls):
        r = profile(model, s, args.context, impl)
        r["gemm_gflops_at_m"] = gemm_gflops(s)
        rows.append(r)
        share = r["attention_and_kv_write_ms"] / r["full_ms"]
        print(f"S={s:3d} ctx={args.context} {impl}: step {r['full_ms']:.1f} ms = attention + KV "
              f"write {r['attention_and_kv_write_ms']:.1f} ({100 * share:.0f}%; KV write "
              f"{r['kv_write_ms']:.1f}) "
              f"+ dense/norms/lm_head "
              f"{r['no_attn_ms']:.1f} (of which lm_head {r['lm_head_ms']:.1f}); "
              f"XLA GEMM at M={s}: {r['gemm_gflops_at_m']:.0f} GFLOP/s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "jax": jax.__version__}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
