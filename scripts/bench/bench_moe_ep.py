#!/usr/bin/env python
"""Expert parallelism against tensor parallelism for a small Qwen3-MoE on one host's devices:
whole-engine tokens/s (offline `LLM.generate`, greedy, random weights), each device's expert
bytes, and the all-reduces of the compiled step (in its layer bodies, and inside the grouped
matmul's tile loop, where XLA puts TP's expert all-reduce on CPU). Writes JSON.

Model (defaults): hidden 512, 4 layers, 8 heads of 64 (8 KV heads), vocabulary 4096, 8
experts of 1024, top-2. Rows: one device; TP N (each expert's width split); EP N (experts
split whole, `--enable-expert-parallel`). On a CPU, run with virtual devices; they share
the host's cores, so the figures compare the step's structure (collectives per layer, work
per device), not chips (compare rows of one run).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python scripts/bench/bench_moe_ep.py \\
        --devices 8 --prompts 16 --max-tokens 32 --json out.json
"""

from __future__ import annotations

import argparse
import json
import re
import time

import jax
import numpy as np

from jaxserve import LLM, SamplingParams
from jaxserve.device.model_runner import empty_batch, forward_jit, to_step_inputs
from jaxserve.models import families, tiny


def config(hidden: int, layers: int, experts: int, width: int, top_k: int, vocab: int) -> dict:
    return dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                num_attention_heads=8, num_key_value_heads=8, head_dim=hidden // 8,
                max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1e6,
                bos_token_id=1, eos_token_id=2, intermediate_size=top_k * width,
                num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=width,
                norm_topk_prob=True)


def all_reduces(llm: LLM) -> dict:
    """All-reduces in the compiled forward of the smallest bucket, by the op_name XLA keeps:
    in a while body twice (a loop inside the layer scan: the CPU tile loop) or not."""
    r = llm.engine.runner
    t, s = r.shape.buckets[0]
    inputs, _, _ = jax.device_put(to_step_inputs(empty_batch(r.shape, t, s, False)),
                                  r.inputs_sharding)
    hlo = forward_jit.lower(r.params, r.kv_pages, inputs, r._feed, cfg=r.model_cfg,
                            attn_impl=r.attn_impl, mesh=r.mesh,
                            expert_parallel=r.expert_parallel).compile().as_text()
    names = re.findall(r"all-reduce(?:-start)?\([^\n]*op_name=\"([^\"]*)\"", hlo)
    return {"total": len(names),
            "in_tile_loop": sum(n.count("while/body") >= 2 for n in names),
            "experts_psum": sum("shard_map/psum" in n for n in names)}


def run(name: str, model, prompts: list[list[int]], max_tokens: int,  # noqa: ANN001
        tp: int, ep: bool, buckets: tuple[int, ...]) -> dict:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    # A few token buckets: every bucket is compiled at start, per engine.
    with LLM(loaded=model, max_num_seqs=len(prompts), max_model_len=512,
             max_num_batched_tokens=buckets[-1], token_buckets=buckets,
             tensor_parallel_size=tp, enable_expert_parallel=ep) as llm:
        llm.generate(prompts[:2], sp, use_tqdm=False)  # warm the host paths
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        stack = llm.engine.runner.params.layers.we_gate
        device0 = sum(s.data.nbytes for s in stack.addressable_shards
                      if s.device == jax.devices()[0])
        collectives = all_reduces(llm) if tp > 1 else {}
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"mode": name, "devices": tp, "generated_tokens": n, "seconds": dt,
            "tokens_per_s": n / dt, "we_gate_bytes_device0": device0,
            "we_gate_bytes": stack.nbytes, "all_reduces": collectives,
            "tokens": [o.outputs[0].token_ids for o in outs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--token-buckets", default="8,128")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    d = config(args.hidden, args.layers, args.experts, args.width, args.top_k, args.vocab)
    model = tiny.random_model(families.config_from_hf(d, "qwen3_moe/config.json"), seed=0,
                              scale=0.05)
    rng = np.random.default_rng(0)
    prompts = [[int(x) for x in rng.integers(3, args.vocab, args.prompt_len)]
               for _ in range(args.prompts)]
    buckets = tuple(int(b) for b in args.token_buckets.split(","))
    rows = [run(name, model, prompts, args.max_tokens, tp, ep, buckets)
            for name, tp, ep in (("1 device", 1, False), (f"TP {args.devices}", args.devices,
                                                          False),
                                 (f"EP {args.devices}", args.devices, True))]
    base = rows[0]["tokens"]
    for r in rows:
        r["same_tokens_as_one_device"] = r.pop("tokens") == base
        print(f"{r['mode']:>10}: {r['tokens_per_s']:8.1f} tok/s ({r['generated_tokens']} in "
              f"{r['seconds']:.2f} s), we_gate on device 0: {r['we_gate_bytes_device0']} of "
              f"{r['we_gate_bytes']} B, all-reduces {r['all_reduces']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "jax_devices": len(jax.devices()),
                       "platform": jax.devices()[0].platform, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
