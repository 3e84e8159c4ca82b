#!/usr/bin/env python
"""The roofline model of the engine's step (`jaxserve.cli.bench.perf_model`) for Llama-3-8B on
H200, TPU v5e and TPU v6e, as tables: per chip, weight format and batch, the decode step, its
bound and output tokens/s, the 2k prefill; the published peer figures beside the model's; what
`scripts/device/device_engine_check.py` should report on one H200. Then the mixture-of-experts
rows (`perf_model_moe`): Qwen3-30B-A3B bf16 decode on one H200 and on v6e-8 with expert
parallelism, and its published peer figure. Then speculative decoding (`perf_model_spec`):
Llama-3-8B with an EAGLE-3 head on one H200, output tokens/s and speed-up over plain decode
at acceptance lengths 2, 3, 4. Plain arithmetic, no jax (docs/benchmarks/perf-model.md).

    python scripts/bench/perf_model.py                 # the tables
    python scripts/bench/perf_model.py --json out.json # and every figure as JSON
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib

from jaxserve.cli.bench.perf_model import (CHIPS, Assumptions, Weights, device_check_expectation,
                                           kv_bytes_per_token, peer_rows, table)
from jaxserve.cli.bench import perf_model_moe as moe
from jaxserve.cli.bench import perf_model_spec as spec
from jaxserve.models import shapes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None, help="write every figure here")
    ap.add_argument("--eta-bw", type=float, default=Assumptions.eta_bw)
    ap.add_argument("--eta-flops", type=float, default=Assumptions.eta_flops)
    ap.add_argument("--draft-overhead-us", type=float, default=spec.DRAFT_OVERHEAD_S * 1e6,
                    help="fixed cost of one EAGLE-3 draft forward inside the step (us)")
    args = ap.parse_args()
    a = Assumptions(eta_bw=args.eta_bw, eta_flops=args.eta_flops)
    cfg = shapes.llama3_8b()
    w = Weights.of(cfg)
    print(f"Llama-3-8B: {w.params / 1e9:.2f} B params; weights {w.bytes('bf16') / 1e9:.2f} GB "
          f"bf16, {w.bytes('int8') / 1e9:.2f} GB int8; KV {kv_bytes_per_token(cfg) / 1024:.0f}"
          f" KiB/token bf16; eta_bw {a.eta_bw}, eta_flops {a.eta_flops}")
    rows = table(cfg, a=a)
    print("| chip | weights | batch | chips (TP) | bucket | decode step ms | bound | "
          "out tok/s | 2k prefill ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        name = CHIPS[r["chip"]].name
        if r["tp"] is None:
            print(f"| {name} | {r['fmt']} | {r['batch']} | > 8 | | | | | |")
            continue
        print(f"| {name} | {r['fmt']} | {r['batch']} | {r['tp']} | {r['bucket'][0]} | "
              f"{r['decode_ms']:.2f} | {r['decode_bound']} | {r['out_tok_s']:,.0f} | "
              f"{r['prefill_2k_ms']:.1f} |")
    peers = peer_rows(cfg, a)
    print("\n| engine | chip x n | weights | conc | in/out | published out tok/s | "
          "model out tok/s | published / model |")
    print("|---|---|---|---|---|---|---|---|")
    for p in peers:
        print(f"| {p['engine']} | {CHIPS[p['chip']].name} x {p['tp']} | {p['fmt']} | "
              f"{p['conc_modelled']} | {p['in_len']}/{p['out_len']} | {p['measured']:,.0f} | "
              f"{p['predicted']:,.0f} | {p['measured_over_predicted']:.2f} |")
    dev = device_check_expectation(cfg, a)
    print("\ndevice_engine_check on one H200 (64 x 2048, bf16): " + ", ".join(
        f"{k} {v:,.1f}" for k, v in dev.items()))
    moe_out = print_moe(a)
    spec_rows = print_spec(cfg, a, args.draft_overhead_us * 1e-6)
    if args.json:
        out = {"moe": moe_out, "speculative_eagle3_h200": spec_rows,
               "assumptions": dataclasses.asdict(a),
               "chips": {k: dataclasses.asdict(c) for k, c in CHIPS.items()},
               "weights": {"params": w.params, "bf16_bytes": w.bytes("bf16"),
                           "int8_bytes": w.bytes("int8")},
               "kv_bytes_per_token": kv_bytes_per_token(cfg), "table": rows,
               "peers": [{k: v for k, v in p.items() if k != "model"} for p in peers],
               "device_check_h200": dev}
        pathlib.Path(args.json).write_text(json.dumps(out, indent=2, default=str))


def print_moe(a: Assumptions) -> dict:
    """The MoE tables; returns their figures for the JSON."""
    shape = moe.qwen3_30b_a3b()
    print(f"\n{shape.name}: {shape.params / 1e9:.2f} B params ({shape.params * 2 / 1e9:.2f} GB "
          f"bf16), {shape.active_params / 1e9:.2f} B active per token "
          f"({shape.active_params * 2 / 1e9:.2f} GB); KV "
          f"{shape.kv_bytes_per_token() / 1024:.0f} KiB/token; decode at context 2048")
    rows = moe.table(shape, a=a)
    print("| setup | batch | weights GB/chip | distinct experts/layer | busiest chip's | "
          "GB read/chip/step (experts) | step ms | bound | comm ms | out tok/s | "
          "ICI all-reduce MB/chip | all-to-all MB/chip |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        name = f"{CHIPS[r['chip']].name} x {r['chips']}"
        print(f"| {name} | {r['batch']} | {r['weights_gb_per_chip']:.2f} | "
              f"{r['distinct_experts']:.1f} | {r['busiest_chip_experts']:.2f} | "
              f"{r['bytes_per_chip'] / 1e9:.2f} ({r['expert_bytes_read'] / 1e9:.2f}) | "
              f"{r['step_ms']:.2f} | {r['bound']} | {r['comm_s'] * 1e3:.2f} | "
              f"{r['out_tok_s']:,.0f} | {r['ici_allreduce_bytes'] / 1e6:.1f} | "
              f"{r['ici_all_to_all_bytes'] / 1e6:.1f} |")
    peers = moe.peer_rows(shape, a)
    print("\n| engine | chip | conc | in/out | published out tok/s (TPOT ms) | "
          "model out tok/s (TPOT ms) | published / model |")
    print("|---|---|---|---|---|---|---|")
    for p in peers:
        print(f"| {p['engine']} | {CHIPS[p['chip']].name} | {p['conc']} | "
              f"{p['in_len']}/{p['out_len']} | {p['measured']:,.0f} ({p['tpot_ms']:.2f}) | "
              f"{p['predicted']:,.0f} ({p['predicted_tpot_ms']:.2f}) | "
              f"{p['measured_over_predicted']:.2f} |")
    return {"shape": dataclasses.asdict(shape), "params": shape.params,
            "active_params": shape.active_params, "table": rows, "peers": peers}


def print_spec(cfg, a: Assumptions, overhead_s: float) -> list[dict]:
    """The EAGLE-3 speculative-decoding table; returns its rows for the JSON."""
    head = spec.Eagle3Head.of(cfg)
    print(f"\nSpeculative decoding, EAGLE-3 head ({head.params / 1e6:.0f} M params, draft vocab "
          f"{spec.DRAFT_VOCAB:,}) on Llama-3-8B bf16, one H200, context 2048; draft forward "
          f"overhead {overhead_s * 1e6:.0f} us; tau = tokens emitted per target step")
    rows = spec.table(cfg, a=a, overhead_s=overhead_s)
    print("| batch | k | decode ms | verify ms (bound) | k drafts ms | break-even tau | "
          "tau 2: tok/s (x) | tau 3: tok/s (x) | tau 4: tok/s (x) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        cells = " | ".join(f"{r['tau'][t]['out_tok_s']:,.0f} ({r['tau'][t]['speedup']:.2f}x)"
                           for t in spec.TAUS)
        print(f"| {r['batch']} | {r['k']} | {r['decode_ms']:.2f} | {r['verify_ms']:.2f} "
              f"({r['verify_bound']}) | {r['draft_ms']:.2f} | {r['break_even_tau']:.2f} | "
              f"{cells} |")
    return rows


if __name__ == "__main__":
    main()
