"""KV bytes per 8k sequence with and without window-aware pages, for a Gemma-3-shaped model.

Host only (the engine layer, no jax, no weights): the KV footprint is a property of the
planner and the allocator, not of the device.

Model: Gemma 3 1B's KV shape: 26 layers, five sliding-window layers (window 512) per global
one, 1 KV head, head_dim 256, bfloat16 pages of 16 tokens. "Without" is the same shape with
every layer global (what the engine did before KV groups, and what a model without groups
still does).

Figures, each with and without window-aware pages:
  planner    `EnginePlan.kv_bytes_per_seq`: what one max_model_len (8192) sequence holds at
             most (sliding groups: ceil(window / page_size) + 1 pages), and how many such
             sequences a fixed KV budget holds (budget // bytes per sequence).
  allocator  the allocator's live page count (pages held, cached free pages not counted)
             with one sequence whose 8192 prompt tokens are computed, times the bytes of a
             page id (its layer slots).
  run        the scheduler with the fixed budget and more 8k sequences than fit (prompt
             8192 tokens, 256 generated, chunked prefill of 2048): the most sequences decoding
             at once (context >= 8192) and the preemptions it took. No model: the tokens
             are arithmetic (only the pages matter).
  prefix     prefix-cache hit rate with the same budget: one request computes a 4096-token
             prefix and goes on (its windows slide off the prefix), then 0, 2, ..., 40 unrelated
             1k-token requests (cache pressure), then fit + 4 more sharing that prefix (+1024 own
             tokens) arrive at once: the share of their prefix served from the cache, and
             the pages a hit was cut back by because a sliding group no longer had its
             window pages cached (served shorter, never with missing KV).

  sharing    Gemma 4 E2B's shape: the planner's bytes per 8k sequence when the 20 layers that
             reuse an earlier layer's K/V read its pages, against each holding its own.

    python scripts/bench/bench_window_kv.py --json benchmarks/results/window_kv.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time

from jaxserve.config import EngineConfig
from jaxserve.engine.sequence import Sequence
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.sizing import EnginePlan, plan_engine
from jaxserve.models.config import LayerSpec, ModelConfig

CONTEXT = 8192


def gemma3_1b_shape(windowed: bool, window: int = 512, num_layers: int = 26) -> ModelConfig:
    """Gemma 3 1B's KV shape (layer i global when (i + 1) % 6 == 0); `windowed=False`: every
    layer global."""
    specs = tuple(LayerSpec(sliding_window=window if windowed and (i + 1) % 6 else None)
                  for i in range(num_layers))
    return ModelConfig(model_type="gemma3_text", vocab_size=262144, hidden_size=1152,
                       intermediate_size=6912, num_layers=num_layers, num_heads=4,
                       num_kv_heads=1, head_dim=256, rms_norm_eps=1e-6, rope_theta=1e6,
                       max_position_embeddings=32768, tie_word_embeddings=True,
                       attention_bias=False, qk_norm=True, per_layer=specs)


def gemma4_e2b_shape(shared: bool, window: int = 512) -> ModelConfig:
    """Gemma 4 E2B's KV shape: 35 layers (every fifth global), the last 20 reusing the K/V of
    the last earlier layer of their type (`num_kv_shared_layers`), 1 KV head at the widest
    head dim (512, the global layers'; the sliding layers' 256 padded to it). `shared=False`:
    the same layers each holding pages of their own (what the engine did before)."""
    types = ["full" if i % 5 == 4 else "sliding" for i in range(35)]
    first, slot = 15, {"full": 0, "sliding": 1}
    last = {t: max(i for i in range(first) if types[i] == t) for t in slot}
    specs = tuple(LayerSpec(sliding_window=None if t == "full" else window,
                            kv_store=slot[t] if shared and i == last[t] else None,
                            kv_reuse=slot[t] if shared and i >= first else None)
                  for i, t in enumerate(types))
    return ModelConfig(model_type="gemma4_text", vocab_size=262144, hidden_size=1536,
                       intermediate_size=6144, num_layers=35, num_heads=8, num_kv_heads=1,
                       head_dim=512, rms_norm_eps=1e-6, rope_theta=1e6,
                       max_position_embeddings=32768, tie_word_embeddings=True,
                       attention_bias=False, qk_norm=True, per_layer=specs)


def plan(windowed: bool, budget: int, page_size: int, max_num_seqs: int,
         chunk: int) -> EnginePlan:
    cfg = EngineConfig(max_model_len=CONTEXT, page_size=page_size, max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=chunk, kv_cache_memory=budget,
                       decode_token_budget=chunk)  # prefill at full speed beside decodes
    return plan_engine(cfg, gemma3_1b_shape(windowed), 2, 0)  # bfloat16 pages


def kv_sharing(budget: int, page_size: int, max_num_seqs: int, chunk: int) -> dict:
    """Planner KV bytes per 8k sequence of the Gemma 4 E2B shape, shared-KV layers reading
    their source layer's pages vs holding their own, and the sequences the budget fits."""
    cfg = EngineConfig(max_model_len=CONTEXT, page_size=page_size, max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=chunk, kv_cache_memory=budget,
                       decode_token_budget=chunk)
    out = {}
    for name, shared in (("shared_pages", True), ("own_pages", False)):
        p = plan_engine(cfg, gemma4_e2b_shape(shared), 2, 0)
        out[name] = {"planner_kv_bytes_per_seq": p.kv_bytes_per_seq,
                     "planner_seqs_fit": budget // p.kv_bytes_per_seq,
                     "layer_slots_per_page": p.scheduler.kv_groups.slots}
    out["ratio"] = (out["own_pages"]["planner_kv_bytes_per_seq"]
                    / out["shared_pages"]["planner_kv_bytes_per_seq"])
    return out


def _request(rid: str, prompt: list[int], max_tokens: int) -> Sequence:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return Sequence(rid, prompt, sp, eos_token_ids=(), arrival_time=0.0, max_tokens=max_tokens)


def _step(sched: Scheduler) -> None:
    out = sched.schedule()
    sched.update(out, [7 if s.samples else None for s in out.seqs])


def live_pages_at_context(p: EnginePlan, seed: int) -> int:
    """Page ids the allocator holds for one sequence once its CONTEXT prompt tokens are
    computed (before its next step)."""
    # (max_model_len raised past CONTEXT so that the sequence goes on after its prompt)
    sched = Scheduler(dataclasses.replace(p.scheduler, max_model_len=CONTEXT + 2))
    rng = random.Random(seed)
    req = _request("one", [rng.randrange(1, 200_000) for _ in range(CONTEXT)], 2)
    sched.add_request(req)
    while req.num_computed_tokens < CONTEXT:
        _step(sched)
    alloc = sched.allocator
    return alloc.num_usable_pages - alloc.num_free_pages


def concurrent_run(p: EnginePlan, num_requests: int, gen: int, seed: int) -> dict:
    """The most sequences decoding at >= CONTEXT tokens at once under the plan's budget."""
    sched = Scheduler(dataclasses.replace(p.scheduler, max_model_len=CONTEXT + gen))
    rng = random.Random(seed)
    for i in range(num_requests):
        sched.add_request(_request(f"r{i}", [rng.randrange(1, 200_000)
                                             for _ in range(CONTEXT)], gen))
    most, steps = 0, 0
    t0 = time.perf_counter()
    while sched.has_unfinished():
        _step(sched)
        steps += 1
        most = max(most, sum(r.num_computed_tokens >= CONTEXT for r in sched.running))
    alloc = sched.allocator
    assert alloc.num_free_pages == alloc.num_usable_pages, "pages leaked"
    return {"max_concurrent_at_8k": most, "preemptions": sched.num_preemptions,
            "steps": steps, "host_seconds": round(time.perf_counter() - t0, 2)}


def prefix_run(p: EnginePlan, num_requests: int, prefix_len: int, suffix_len: int, gen: int,
               filler: int, seed: int) -> dict:
    """Prefix-cache hits on a shared prefix: one request computes it (and goes on past it,
    so a sliding group's window slides off the prefix's end); then `filler` unrelated
    1024-token requests (cache pressure: once the free pages are used up they evict the
    oldest cached pages, the shared prefix's slid-out window pages first); then `num_requests`
    that share the prefix arrive at once. hit_rate = prefix tokens those requests were
    served from the cache on admission / their shareable prefix tokens (full pages);
    window_cut_pages: pages the global group could have served but a sliding group had lost
    its window pages (the hit was cut back there, not served with missing KV)."""
    sched = Scheduler(dataclasses.replace(
        p.scheduler, max_model_len=max(prefix_len + suffix_len, CONTEXT) + gen))
    rng = random.Random(seed)
    prefix = [rng.randrange(1, 200_000) for _ in range(prefix_len)]

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1, 200_000) for _ in range(n)]

    def run(reqs: list[Sequence]) -> None:
        for r in reqs:
            sched.add_request(r)
        while sched.has_unfinished():
            _step(sched)

    run([_request("warm", prefix + tokens(suffix_len), gen)])
    run([_request(f"f{i}", tokens(1024), gen) for i in range(filler)])
    sharers = [_request(f"p{i}", prefix + tokens(suffix_len), gen) for i in range(num_requests)]
    run(sharers)
    ps = sched.cfg.page_size
    served = sum(r.metrics.num_cached_tokens for r in sharers)
    return {"sharers": num_requests, "filler_1k_requests": filler, "prefix_tokens": prefix_len,
            "hit_rate": round(served / (num_requests * (prefix_len // ps * ps)), 4),
            "window_cut_pages": sched.kv.window_cut_pages,
            "preemptions": sched.num_preemptions}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-gib", type=float, default=1.0, help="fixed KV budget")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--gen", type=int, default=256, help="tokens generated per sequence "
                    "(enough that the first is still decoding when the last has prefilled)")
    ap.add_argument("--no-run", action="store_true", help="skip the scheduler run")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    budget = int(args.budget_gib * 2**30)
    result: dict = {"model": "Gemma 3 1B KV shape: 26 layers (22 sliding w=512, 4 global), "
                             "1 KV head, head_dim 256, bf16",
                    "context": CONTEXT, "page_size": args.page_size, "kv_budget_bytes": budget,
                    "max_num_batched_tokens": args.chunk}
    plans = {}
    for name, windowed in (("window_aware", True), ("all_pages", False)):
        p = plan(windowed, budget, args.page_size, args.max_num_seqs, args.chunk)
        plans[name] = p
        live = live_pages_at_context(p, seed=1)
        groups = p.scheduler.kv_groups
        row = {
            "kv_groups": None if groups is None else {
                "windows": groups.windows, "layer_slots_per_page": groups.slots},
            "bytes_per_page_id": p.kv_bytes_per_page,
            "page_ids": p.scheduler.num_pages - 1,
            "planner_kv_bytes_per_seq": p.kv_bytes_per_seq,
            "planner_seqs_fit": budget // p.kv_bytes_per_seq,
            "allocator_live_page_ids_at_8k": live,
            "allocator_kv_bytes_per_seq": live * p.kv_bytes_per_page,
        }
        result[name] = row
    w, a = result["window_aware"], result["all_pages"]
    result["ratio_planner"] = a["planner_kv_bytes_per_seq"] / w["planner_kv_bytes_per_seq"]
    result["ratio_allocator"] = a["allocator_kv_bytes_per_seq"] / w["allocator_kv_bytes_per_seq"]
    if not args.no_run:
        n = w["planner_seqs_fit"] + 4  # more than fit: the budget, not the queue, binds
        for name in ("window_aware", "all_pages"):
            result[name]["run"] = concurrent_run(plans[name], n, args.gen, seed=2)
        result["run_requests"] = n
        for name in ("window_aware", "all_pages"):
            result[name]["prefix"] = [prefix_run(plans[name], n, 4096, 1024, args.gen,
                                                 filler, seed=3)
                                      for filler in range(0, 41, 2)]

    result["gemma4_e2b_kv_sharing"] = kv_sharing(budget, args.page_size, args.max_num_seqs,
                                                 args.chunk)
    mib = 2**20
    print(f"{result['model']}; context {CONTEXT}, pages of {args.page_size}, "
          f"budget {budget / mib:.0f} MiB")
    print(f"{'':14} {'planner MiB/seq':>16} {'fit':>5} {'alloc live ids':>15} "
          f"{'alloc MiB/seq':>14} {'run: max at 8k':>15} {'preempt':>8}")
    for name in ("window_aware", "all_pages"):
        r = result[name]
        run = r.get("run", {})
        print(f"{name:14} {r['planner_kv_bytes_per_seq'] / mib:16.1f} "
              f"{r['planner_seqs_fit']:5d} {r['allocator_live_page_ids_at_8k']:15d} "
              f"{r['allocator_kv_bytes_per_seq'] / mib:14.1f} "
              f"{run.get('max_concurrent_at_8k', '-'):>15} {run.get('preemptions', '-'):>8}")
    print(f"ratio (all pages / window-aware): planner {result['ratio_planner']:.2f}x, "
          f"allocator {result['ratio_allocator']:.2f}x")
    if "prefix" in w:
        first = w["prefix"][0]
        print(f"prefix cache: {first['sharers']} requests sharing {first['prefix_tokens']} "
              "tokens after N unrelated 1k-token requests (hit rate: share of their prefix "
              "served from the cache; cut: pages cut back for lost window pages)")
        print(f"{'N':>4} {'window-aware hit':>17} {'cut':>5} {'all-pages hit':>14}")
        for pw, pa in zip(w["prefix"], a["prefix"]):
            print(f"{pw['filler_1k_requests']:4d} {pw['hit_rate']:17.3f} "
                  f"{pw['window_cut_pages']:5d} {pa['hit_rate']:14.3f}")
    share = result["gemma4_e2b_kv_sharing"]
    print("Gemma 4 E2B KV shape (35 layers, 20 reusing K/V, head dim 512, bf16), 8k context: "
          + ", ".join(f"{k} {v['planner_kv_bytes_per_seq'] / mib:.1f} MiB/seq "
                      f"({v['planner_seqs_fit']} fit)"
                      for k, v in share.items() if isinstance(v, dict))
          + f"; {share['ratio']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, default=lambda o: dataclasses.asdict(o))
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
