"""The table of `bench_lora.sh`: output tokens/s with every request on an adapter against the
same server without LoRA, per concurrency, and the adapter load time.

Reads DIR/<server>_c<C>.json (vLLM's `bench serve` result documents; with several rounds
DIR/r<i>/...: one ratio per round, then the median and range) and DIR/load_times.txt (seconds
per POST /v1/load_lora_adapter), and prints markdown.

    python scripts/bench/lora_table.py benchmarks/results/lora_2026-12-07
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import statistics


def _runs(root: pathlib.Path) -> list[pathlib.Path]:
    rounds = sorted(p for p in root.glob("r*") if p.is_dir() and re.fullmatch(r"r\d+", p.name))
    return rounds or [root]


def _doc(d: pathlib.Path, server: str, c: int) -> dict | None:
    p = d / f"{server}_c{c}.json"
    return json.loads(p.read_text()) if p.exists() else None


def table(root: pathlib.Path) -> str:
    runs = _runs(root)
    cs = sorted({int(m.group(1)) for d in runs for p in d.glob("*_c*.json")
                 if (m := re.search(r"_c(\d+)\.json$", p.name))})
    servers = sorted({p.name.split("_c")[0] for d in runs for p in d.glob("*_c*.json")}
                     - {"none"})
    lines = ["| server | concurrency | round | no LoRA tok/s | 8 adapters tok/s | ratio | "
             "TPOT p50 ms (none / LoRA) | TTFT p50 ms (none / LoRA) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for server in servers:
        for c in cs:
            ratios = []
            for i, d in enumerate(runs, 1):
                none, lora = _doc(d, "none", c), _doc(d, server, c)
                if none is None or lora is None:
                    continue
                r = lora["output_throughput"] / none["output_throughput"]
                ratios.append(r)
                lines.append(
                    f"| {server} | {c} | {i} | {none['output_throughput']:.1f} | "
                    f"{lora['output_throughput']:.1f} | {r:.2f} | "
                    f"{none['median_tpot_ms']:.1f} / {lora['median_tpot_ms']:.1f} | "
                    f"{none['median_ttft_ms']:.0f} / {lora['median_ttft_ms']:.0f} |")
            if len(ratios) > 1:
                lines.append(f"| {server} | {c} | median | | | {statistics.median(ratios):.2f} "
                             f"({min(ratios):.2f}-{max(ratios):.2f}) | | |")
    loads = root / "load_times.txt"
    if loads.exists():
        t = [float(x) for x in loads.read_text().split()]
        lines += ["", f"Adapter load (POST /v1/load_lora_adapter, {len(t)} loads): median "
                  f"{1000 * statistics.median(t):.0f} ms (min {1000 * min(t):.0f}, max "
                  f"{1000 * max(t):.0f})"]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dir", type=pathlib.Path)
    print(table(p.parse_args().dir))


if __name__ == "__main__":
    main()
