#!/usr/bin/env python
"""The side-by-side table from `scripts/peer/side_by_side.sh`'s results (vLLM's `bench serve` JSON):
per workload and server (vllm, jaxserve, jaxserve-f32), output tokens/s, TTFT p50 / p99, ITL
p50 / p99, TPOT p50 (ms), and each jaxserve server's ratios to vLLM; the host line
(`host.txt`) and start-up seconds under it. Prints Markdown; --json writes the rows.

    python scripts/peer/side_by_side_table.py side_by_side [--json table.json]
"""

from __future__ import annotations

import argparse
import json
import pathlib

SERVERS = ("vllm", "jaxserve", "jaxserve-f32")
FIELDS = [("output_throughput", "out tok/s"), ("median_ttft_ms", "TTFT p50"),
          ("p99_ttft_ms", "TTFT p99"), ("median_itl_ms", "ITL p50"), ("p99_itl_ms", "ITL p99"),
          ("median_tpot_ms", "TPOT p50")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    d = pathlib.Path(args.dir)
    results: dict[tuple[str, str], dict] = {}
    for f in sorted(d.glob("*_*.json")):
        server, workload = f.stem.split("_", 1)
        results[(workload, server)] = json.loads(f.read_text())
    order = ["A1", "A8", "A32", "S1", "S8", "S32", "C8"]
    workloads = sorted({w for w, _ in results},
                       key=lambda w: (order.index(w) if w in order else len(order), w))
    print("| workload | server | " + " | ".join(h for _, h in FIELDS) + " |")
    print("|" + "---|" * (2 + len(FIELDS)))
    rows = []
    for w in workloads:
        for server in SERVERS:
            r = results.get((w, server))
            if r is None:
                continue
            vals = [r.get(k) for k, _ in FIELDS]
            rows.append({"workload": w, "server": server, **dict(zip([k for k, _ in FIELDS],
                                                                       vals))})
            print(f"| {w} | {server} | " + " | ".join(
                "-" if v is None else f"{v:.1f}" for v in vals) + " |")
        b = results.get((w, "vllm"))
        for server in SERVERS[1:]:
            a = results.get((w, server))
            if a and b:
                ratios = [a[k] / b[k] if b.get(k) else None for k, _ in FIELDS]
                print(f"| {w} | {server} / vllm | " + " | ".join(
                    "-" if v is None else f"{v:.2f}x" for v in ratios) + " |")
    host = d / "host.txt"
    if host.exists():
        print("\nhost: " + " · ".join(host.read_text().split("\n")).strip(" ·"))
    for server in SERVERS:
        f = d / f"{server}_startup.txt"
        if f.exists():
            print(f"\n{server} start-up (process start to /health 200): {f.read_text().strip()} s")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
