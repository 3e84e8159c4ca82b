"""Offline throughput benchmark: continuous batching vs static batching vs HF transformers.

Sections (each can be skipped):
  host      schedule + batch-build time per step with N running sequences on the arithmetic
            fake runner (no device work): the engine's host overhead.
  decode    decode step time at 1/8/32/64 sequences beside two floors: (weight + KV bytes) /
            measured memory bandwidth, and matmul FLOPs / measured matmul FLOP/s.
  e2e       a mixed workload (input lengths 16..1024, outputs 32..256, seeded) through
            jaxserve with continuous batching, jaxserve with static batches of 8 (continuous
            batching off: a batch runs until its longest member ends), and HF transformers
            `generate` with the same static batches.
  collectives  with --tensor-parallel-size N: the collectives in the compiled decode step
            (all-reduce, all-gather, ...), counted in XLA's optimized HLO.
Writes every figure to --json and prints tables. Numbers on a CPU are not GPU numbers.

    python scripts/bench/bench_offline.py --json bench_offline.json
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python scripts/bench/bench_offline.py \
        --tensor-parallel-size 3 --sections decode,collectives --json bench_tp3.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import numpy as np


def workload(n: int, seed: int, vocab: int, in_range: tuple[int, int],
             out_range: tuple[int, int]) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(seed)
    ins = rng.integers(in_range[0], in_range[1] + 1, n)
    outs = rng.integers(out_range[0], out_range[1] + 1, n)
    # Token ids from the ordinary-text part of the vocabulary (no special tokens).
    prompts = [[int(x) for x in rng.integers(100, vocab - 100, int(k))] for k in ins]
    return prompts, [int(x) for x in outs]


# ----------------------------------------------------------------------------- host overhead
def bench_host(num_seqs: int, steps: int) -> dict:
    from jaxserve.config import SchedulerConfig
    from jaxserve.engine.batch import BatchShape, build_batch
    from jaxserve.engine.fake_runner import ArithmeticRunner
    from jaxserve.engine.sequence import Sequence
    from jaxserve.engine.sampling_params import SamplingParams
    from jaxserve.engine.scheduler import Scheduler

    cfg = SchedulerConfig(max_num_seqs=num_seqs, max_num_batched_tokens=max(512, num_seqs),
                          max_model_len=2048, page_size=16, num_pages=num_seqs * 128 + 1)
    shape = BatchShape(buckets=((512, min(512, num_seqs)),) if num_seqs <= 512 else
                       ((num_seqs, num_seqs),), page_size=16, max_pages_per_seq=128,
                       vocab_size=49152, history_len=2048)
    sched = Scheduler(cfg)
    runner = ArithmeticRunner(49152)
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=1500, ignore_eos=True)
    for i in range(num_seqs):
        prompt = [int(x) for x in rng.integers(0, 49152, int(rng.integers(64, 512)))]
        sched.add_request(Sequence(f"r{i}", prompt, params, (2,), 0.0, max_tokens=1500))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.requests.values()):
        out = sched.schedule()
        res = runner.execute(build_batch(out, shape))
        sched.update(out, [int(t) if s.samples else None for s, t in zip(out.seqs, res.tokens)])
    build, update = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        batch = build_batch(out, shape)
        t1 = time.perf_counter()
        res = runner.execute(batch)
        t2 = time.perf_counter()
        sched.update(out, [int(t) if s.samples else None for s, t in zip(out.seqs, res.tokens)])
        t3 = time.perf_counter()
        build.append((t1 - t0) * 1e3)
        update.append((t3 - t2) * 1e3)
        assert out.num_seqs == num_seqs
    return {"num_running_seqs": num_seqs, "steps": steps,
            "schedule_and_build_ms_median": statistics.median(build),
            "schedule_and_build_ms_p90": float(np.percentile(build, 90)),
            "update_ms_median": statistics.median(update),
            "total_host_ms_median": statistics.median([a + b for a, b in zip(build, update)])}


# ----------------------------------------------------------------------------- decode floors
def measure_bandwidth_gbs() -> float:
    a = np.ones(64 << 20, np.float32)  # 256 MiB
    b = np.empty_like(a)
    best = 0.0
    for _ in range(5):
        t = time.perf_counter()
        np.copyto(b, a)
        best = max(best, 2 * a.nbytes / (time.perf_counter() - t))
    return best / 1e9


def measure_matmul_gflops() -> float:
    import jax
    import jax.numpy as jnp

    x = jnp.ones((64, 2048), jnp.float32)
    w = jnp.ones((2048, 2048), jnp.float32)
    f = jax.jit(lambda x, w: x @ w)
    f(x, w).block_until_ready()
    t = time.perf_counter()
    for _ in range(20):
        f(x, w).block_until_ready()
    return 20 * 2 * 64 * 2048 * 2048 / (time.perf_counter() - t) / 1e9


def forward_only():  # noqa: ANN201
    """The runner's forward without the sampler, jitted as the runner jits it (KV pages
    donated): `f(params, kv_pages, inputs, cfg=, attn_impl=, mesh=) -> (kv_pages, logits, hidden, aux)`."""
    import jax

    from jaxserve.device.model_runner import forward_step

    return jax.jit(forward_step, static_argnames=("cfg", "attn_impl", "mesh"),
                   donate_argnames=("kv_pages",))


def bench_decode(llm, batch_sizes: list[int], ctx: int) -> list[dict]:
    import jax

    from jaxserve.device.model_runner import to_step_inputs
    from jaxserve.engine.batch import build_batch
    from jaxserve.engine.sampling_params import SamplingParams
    from jaxserve.models.llama import param_shapes

    eng = llm.engine
    cfg = eng.runner.model_cfg
    params_bytes = sum(x.nbytes for x in jax.tree.leaves(eng.runner.params))
    # Weights counted from the config: a quantized embedding's bytes are not its size.
    non_embed = sum(int(np.prod(s)) for name, s in param_shapes(cfg).items() if name != "embed")
    bw = measure_bandwidth_gbs()
    gflops = measure_matmul_gflops()
    forward = forward_only()
    rows = []
    rng = np.random.default_rng(1)
    for bs in batch_sizes:
        ids = []
        for i in range(bs):
            rid = f"dec{bs}-{i}"
            eng.add_request(rid, [int(x) for x in rng.integers(100, 40000, ctx)],
                            SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
            ids.append(rid)
        while any(r.num_computed_tokens < r.num_prompt_tokens - 1 or r.num_output_tokens == 0
                  for r in eng.scheduler.requests.values()):
            eng.step()
        out = eng.scheduler.schedule()
        assert out.num_seqs == bs and out.num_tokens == bs, (out.num_seqs, out.num_tokens)
        r = eng.runner
        inputs, _, _ = jax.device_put(to_step_inputs(build_batch(out, eng.plan.batch_shape)),
                                   r.inputs_sharding)
        times = []
        for _ in range(5):
            t = time.perf_counter()
            r.kv_pages, logits, *_ = forward(r.params, r.kv_pages, inputs, cfg=cfg,
                                            attn_impl=r.attn_impl, mesh=r.mesh)
            logits.block_until_ready()
            times.append(time.perf_counter() - t)
        eng.scheduler.update(out, [None] * out.num_seqs)  # nothing sampled: recompute-safe
        for rid in ids:
            eng.abort(rid)
        while eng.has_unfinished():
            eng.step()
        kv_bytes = bs * (ctx + 1) * eng.plan.kv_bytes_per_page / eng.plan.scheduler.page_size
        flops = 2 * bs * (non_embed + cfg.vocab_size * cfg.hidden_size)
        rows.append({"num_seqs": bs, "context": ctx, "step_ms": 1e3 * min(times),
                     "decode_tok_s": bs / min(times),
                     "bandwidth_floor_ms": 1e3 * (params_bytes + kv_bytes) / (bw * 1e9),
                     "compute_floor_ms": 1e3 * flops / (gflops * 1e9)})
    return [{"measured_bandwidth_gbs": bw, "measured_matmul_gflops": gflops}] + rows


# ----------------------------------------------------------------------------- collectives
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")


def count_collectives(llm) -> dict:  # noqa: ANN001
    """Collective ops in the compiled forward of the smallest (decode) bucket."""
    import re

    import jax

    from jaxserve.device.model_runner import empty_batch, to_step_inputs

    r = llm.engine.runner
    t, s_ = r.shape.buckets[0]
    inputs, _, _ = jax.device_put(to_step_inputs(empty_batch(r.shape, t, s_, False)),
                               r.inputs_sharding)
    hlo = forward_only().lower(r.params, r.kv_pages, inputs, cfg=r.model_cfg,
                               attn_impl=r.attn_impl, mesh=r.mesh).compile().as_text()
    counts = {op: len(re.findall(rf"\b{op}(?:-start)?\(", hlo)) for op in _COLLECTIVES}
    # The layer loop's body holds one copy of each per-layer collective.
    return {"bucket": [t, s_], "num_devices": 1 if r.mesh is None else r.mesh.size,
            "counts_in_hlo": counts}


# ----------------------------------------------------------------------------- end to end
def run_jaxserve(llm, prompts, outs, static_batch: int | None) -> dict:
    from jaxserve.engine.sampling_params import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for o in outs]
    t = time.perf_counter()
    if static_batch is None:
        res = llm.generate(prompts, params, use_tqdm=True)
    else:
        res = []
        for i in range(0, len(prompts), static_batch):
            # Static batching: the whole group runs to its longest member before the next.
            group_max = max(outs[i:i + static_batch])
            group = [SamplingParams(temperature=0.0, max_tokens=group_max, ignore_eos=True)
                     for _ in outs[i:i + static_batch]]
            res += llm.generate(prompts[i:i + static_batch], group, use_tqdm=False)
    dt = time.perf_counter() - t
    useful = sum(min(len(r.outputs[0].token_ids), o) for r, o in zip(res, outs))
    return {"seconds": dt, "output_tokens": useful, "output_tokens_per_s": useful / dt}


def run_hf(prompts, outs, batch: int) -> dict:
    import torch
    import transformers

    from jaxserve.models.bundled import bundled_model_path

    path = bundled_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                              dtype=torch.float32)
    model.eval()
    torch.set_num_threads(2)
    t = time.perf_counter()
    useful = 0
    for i in range(0, len(prompts), batch):
        group = prompts[i:i + batch]
        width = max(len(p) for p in group)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in group])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        n = max(outs[i:i + batch])
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)
        useful += sum(outs[i:i + batch])
        print(f"  hf batch {i // batch + 1}: {time.perf_counter() - t:.0f}s", file=sys.stderr)
    dt = time.perf_counter() - t
    return {"seconds": dt, "output_tokens": useful, "output_tokens_per_s": useful / dt}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default="bench_offline.json")
    ap.add_argument("--sections", default="host,decode,e2e")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", default="16,1024")
    ap.add_argument("--output-len", default="32,256")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--host-seqs", type=int, default=256)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-static", action="store_true")
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="split each step over N devices (set XLA_FLAGS="
                         "--xla_force_host_platform_device_count=N on a CPU)")
    args = ap.parse_args()
    sections = set(args.sections.split(","))
    report: dict = {"machine": {"platform": platform.platform(), "python": sys.version.split()[0]}}

    if "host" in sections:
        report["host"] = bench_host(args.host_seqs, steps=200)
        h = report["host"]
        print(f"host overhead, {args.host_seqs} running seqs (arithmetic fake runner): "
              f"schedule + batch build median {h['schedule_and_build_ms_median']:.3f} ms "
              f"(p90 {h['schedule_and_build_ms_p90']:.3f}); update median "
              f"{h['update_ms_median']:.3f} ms; total {h['total_host_ms_median']:.3f} ms")
    if sections & {"decode", "e2e", "collectives"}:
        from jaxserve import LLM

        in_r = tuple(int(x) for x in args.input_len.split(","))
        out_r = tuple(int(x) for x in args.output_len.split(","))
        llm = LLM(max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  max_model_len=in_r[1] + out_r[1],
                  tensor_parallel_size=args.tensor_parallel_size)
        import jax
        report["machine"]["jax"] = jax.__version__
        report["machine"]["device"] = str(jax.devices()[0])
        if "decode" in sections:
            rows = bench_decode(llm, [b for b in (1, 8, 32, 64) if b <= args.max_num_seqs], 256)
            report["decode"] = rows
            print(f"measured: {rows[0]['measured_bandwidth_gbs']:.1f} GB/s copy, "
                  f"{rows[0]['measured_matmul_gflops']:.1f} GFLOP/s f32 matmul")
            print(f"{'seqs':>5} {'step ms':>9} {'tok/s':>8} {'bw floor':>9} {'flop floor':>10}")
            for r in rows[1:]:
                print(f"{r['num_seqs']:>5} {r['step_ms']:>9.1f} {r['decode_tok_s']:>8.1f} "
                      f"{r['bandwidth_floor_ms']:>9.1f} {r['compute_floor_ms']:>10.1f}")
        report["machine"]["tensor_parallel_size"] = args.tensor_parallel_size
        if "collectives" in sections:
            report["collectives"] = c = count_collectives(llm)
            print(f"compiled decode step {tuple(c['bucket'])} over {c['num_devices']} device(s): "
                  + ", ".join(f"{k} x{v}" for k, v in c["counts_in_hlo"].items() if v)
                  + " (the layer loop body holds one copy of each per-layer collective)")
        if "e2e" in sections:
            prompts, outs = workload(args.num_prompts, 0, 49152, in_r, out_r)
            e2e = {"workload": {"num_prompts": len(prompts), "input_tokens": sum(map(len, prompts)),
                                "output_tokens": sum(outs), "input_range": in_r,
                                "output_range": out_r}}
            e2e["jaxserve_continuous"] = run_jaxserve(llm, prompts, outs, None)
            if not args.skip_static:
                e2e["jaxserve_static8"] = run_jaxserve(llm, prompts, outs, 8)
            if not args.skip_hf:
                e2e["hf_static8"] = run_hf(prompts, outs, 8)
            report["e2e"] = e2e
            base = e2e["jaxserve_continuous"]["output_tokens_per_s"]
            print(f"{'system':<22} {'seconds':>8} {'out tok/s':>10} {'jaxserve x':>10}")
            for k, v in e2e.items():
                if k == "workload":
                    continue
                print(f"{k:<22} {v['seconds']:>8.1f} {v['output_tokens_per_s']:>10.1f} "
                      f"{base / v['output_tokens_per_s']:>10.2f}")
    with open(args.json, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
