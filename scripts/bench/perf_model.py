#!/usr/bin/env python
"""The roofline model of the engine's step (`jaxserve.cli.bench.perf_model`) for Llama-3-8B on
H200, TPU v5e and TPU v6e, as tables: per chip, weight format and batch, the decode step, its
bound and output tokens/s, the 2k prefill; the published peer figures beside the model's; what
`scripts/device/device_engine_check.py` should report on one H200. Plain arithmetic, no jax
(docs/benchmarks/perf-model.md).

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
from jaxserve.models import shapes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None, help="write every figure here")
    ap.add_argument("--eta-bw", type=float, default=Assumptions.eta_bw)
    ap.add_argument("--eta-flops", type=float, default=Assumptions.eta_flops)
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
    if args.json:
        out = {"assumptions": dataclasses.asdict(a),
               "chips": {k: dataclasses.asdict(c) for k, c in CHIPS.items()},
               "weights": {"params": w.params, "bf16_bytes": w.bytes("bf16"),
                           "int8_bytes": w.bytes("int8")},
               "kv_bytes_per_token": kv_bytes_per_token(cfg), "table": rows,
               "peers": [{k: v for k, v in p.items() if k != "model"} for p in peers],
               "device_check_h200": dev}
        pathlib.Path(args.json).write_text(json.dumps(out, indent=2, default=str))


if __name__ == "__main__":
    main()
