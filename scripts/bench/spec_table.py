#!/usr/bin/env python
"""The table of `bench_spec.sh`'s results: per workload and concurrency, output tokens/s and
median TPOT without and with speculation, the ratio, and the acceptance (accepted / proposed
tokens, and mean tokens emitted per draft) from the server's spec_decode counters (deltas
between consecutive runs of one server). Writes <dir>/spec_table.json too.

    python scripts/bench/spec_table.py spec_bench
"""

from __future__ import annotations

import json
import pathlib
import re
import sys

COUNTERS = ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
            "spec_decode_num_accepted_tokens_total")


def counters(path: pathlib.Path) -> dict[str, float]:
    """The spec_decode counters of one /metrics dump (0 when absent: no speculation)."""
    text = path.read_text() if path.exists() else ""
    out = {}
    for name in COUNTERS:
        vals = re.findall(rf"^\S*{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
        out[name] = sum(float(v) for v in vals)
    return out


def main() -> None:
    d = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "spec_bench")
    runs = sorted(d.glob("*_c*.json"))
    keys = sorted({(p.stem.split("_")[1], int(p.stem.split("_c")[1])) for p in runs})
    prev: dict[str, dict[str, float]] = {}
    spec: dict[tuple, dict] = {}
    for server in ("none", "ngram"):
        prev = {n: 0.0 for n in COUNTERS}
        for w, c in keys:  # the order bench_spec.sh runs them in
            m = counters(d / f"{server}_{w}_c{c}.metrics")
            spec[(server, w, c)] = {n: m[n] - prev[n] for n in COUNTERS}
            prev = m or prev
    rows = []
    print(f"{'workload':8} {'conc':>4} {'none tok/s':>10} {'ngram tok/s':>11} {'ratio':>6} "
          f"{'TPOT none':>9} {'TPOT ngram':>10} {'accepted':>9} {'tokens/draft':>12}")
    for w, c in keys:
        r = {}
        for server in ("none", "ngram"):
            p = d / f"{server}_{w}_c{c}.json"
            r[server] = json.loads(p.read_text()) if p.exists() else None
        if not all(r.values()):
            continue
        a, b = r["none"], r["ngram"]
        s = spec[("ngram", w, c)]
        drafts, proposed, accepted = (s[n] for n in COUNTERS)
        row = dict(workload=w, concurrency=c, none_tok_s=a["output_throughput"],
                   ngram_tok_s=b["output_throughput"],
                   ratio=b["output_throughput"] / a["output_throughput"],
                   none_tpot_ms=a["median_tpot_ms"], ngram_tpot_ms=b["median_tpot_ms"],
                   acceptance=accepted / proposed if proposed else None,
                   tokens_per_draft=1 + accepted / drafts if drafts else None)
        rows.append(row)
        acc = "-" if row["acceptance"] is None else f"{row['acceptance']:.0%}"
        tpd = "-" if row["tokens_per_draft"] is None else f"{row['tokens_per_draft']:.2f}"
        print(f"{w:8} {c:>4} {row['none_tok_s']:>10.1f} {row['ngram_tok_s']:>11.1f} "
              f"{row['ratio']:>5.2f}x {row['none_tpot_ms']:>9.1f} {row['ngram_tpot_ms']:>10.1f} "
              f"{acc:>9} {tpd:>12}")
    (d / "spec_table.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
