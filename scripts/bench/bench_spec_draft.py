#!/usr/bin/env python
"""Time of one speculative proposal round (`jaxserve.device.spec_draft_model`) against one
target decode step, on this machine.

Draft: the bundled model (SmolLM2-135M, 30 layers) truncated to its first --draft-layers
layers (`truncated_draft`: the same embedding, head and first layers; an honestly labelled
truncated copy, not a trained draft), packed for the CPU dense kernel where the engine packs
the target. Target: the engine's own compiled step (`build_engine`, the serving runner),
`runner.execute` of a batch of S live decode sequences at context --context (forward, sampler
and the copy of the tokens to the host). Round: S sequences at the same context, each
catching up --catch-up tokens (1: after proposal 1 was rejected; k + 1: after all k were
accepted), then the greedy chain of k - 1 single-token draft steps, proposals copied to the
host. Best of --runs wall times after a first (compiling) call, per (k, S). Buckets: the
engine's (tokens, seqs) pairs, or with --round-buckets `spec_draft.round_buckets` (small
seqs buckets beside the token buckets a decode round needs).

    python scripts/bench/bench_spec_draft.py
    python scripts/bench/bench_spec_draft.py --ks 3,5 --seqs 1,8 --draft-layers 4 --json out.json
    python scripts/bench/bench_spec_draft.py --catch-up k1 --round-buckets
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from jaxserve.config import EngineConfig


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def best_ms(fn, runs: int) -> float:  # noqa: ANN001
    fn()  # the first call compiles
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        best = min(best, 1e3 * (time.perf_counter() - t0))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M")
    ap.add_argument("--draft-layers", type=int, default=4)
    ap.add_argument("--ks", default="3,5")
    ap.add_argument("--seqs", default="1,8")
    ap.add_argument("--catch-up", default="1", help="tokens caught up per sequence; 'k1': k+1")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--round-buckets", action="store_true",
                    help="the round's own buckets (spec_draft.round_buckets), not the engine's")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from bench_buckets import decode_batch

    from jaxserve.device.model_runner import empty_batch
    from jaxserve.device.spec_draft import DraftSeq, round_buckets, truncated_draft
    from jaxserve.device.spec_draft_model import DraftModelProposer
    from jaxserve.models import loading
    from jaxserve.models.packing import can_pack, pack_params
    from jaxserve.serving.build import build_engine

    seqs, ks, ctx = ints(args.seqs), ints(args.ks), args.context
    model = loading.load_model(args.model)
    dcfg, dparams = truncated_draft(model.params, model.config, args.draft_layers)
    cfg = EngineConfig(model=args.model, max_num_seqs=max(seqs), max_model_len=ctx + 64,
                       kv_cache_memory=1 << 28, enable_prefix_caching=False,
                       async_scheduling=False)
    engine = build_engine(cfg, model, warmup=False, progress=False)
    runner = engine.runner
    shape, ps = runner.shape, runner.shape.page_size
    packed = runner.params is not model.params and can_pack(dparams) is None
    if packed:  # as the engine packed the target (`build._dense_params`)
        dparams = pack_params(dparams)
    num_pages = runner.kv_pages.shape[0] // model.config.num_layers
    rows = []
    for s in seqs:
        target_ms = best_ms(lambda: runner.execute(decode_batch(
            empty_batch(shape, *_bucket(shape, s), False), s, ctx, ps)), args.runs)
        for k in ks:
            buckets = round_buckets(shape.buckets, k) if args.round_buckets else shape.buckets
            prop = DraftModelProposer(dcfg, dparams, num_pages, ps, runner.kv_pages.dtype, k,
                                      buckets, shape.max_pages_per_seq,
                                      runner.attn_impl, model.config,
                                      runner.kv_pages.shape[-1])
            n = k + 1 if args.catch_up == "k1" else int(args.catch_up)
            pages = (ctx + n + k) // ps + 1
            tables = [list(range(1 + i * pages, 1 + (i + 1) * pages)) for i in range(s)]
            rnd = prop.pack([DraftSeq([7] * n, ctx + 1 - n, t) for t in tables])
            round_ms = best_ms(lambda: np.asarray(prop.propose(rnd)), args.runs)
            rows.append({"seqs": s, "k": k, "catch_up": n, "round_ms": round_ms,
                         "target_decode_ms": target_ms, "ratio": round_ms / target_ms})
            print(f"S={s:3d} k={k} catch-up {n}: round {round_ms:7.2f} ms, target decode step "
                  f"{target_ms:7.2f} ms, ratio {round_ms / target_ms:.2f}", flush=True)
    out = {"model": str(model.source), "draft_layers": args.draft_layers,
           "target_layers": model.config.num_layers, "context": ctx, "runs": args.runs,
           "packed": packed, "attn_impl": runner.attn_impl,
           "round_buckets": args.round_buckets, "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    engine.close()


def _bucket(shape, s: int) -> tuple[int, int]:  # noqa: ANN001
    from jaxserve.engine.batch import bucket_for

    bucket = bucket_for(s, s, shape.buckets)
    if bucket != (s, s):  # decode_batch fills a (S, S) bucket exactly
        raise SystemExit(f"no ({s}, {s}) bucket among {shape.buckets}")
    return bucket


if __name__ == "__main__":
    main()
