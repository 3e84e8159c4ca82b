#!/usr/bin/env python
"""The table of `bench_spec.sh`'s results: per workload and concurrency, output tokens/s and
median TPOT without and with speculation, the ratio, and the acceptance (accepted / proposed
tokens, and mean tokens emitted per draft) from the server's spec_decode counters (deltas
between consecutive runs of one server). Writes <dir>/spec_table.json too.

    python scripts/bench/spec_table.py spec_bench

The speculating server is the one whose files are not named `none_*` (`ngram`, `eagle3`,
... as bench_spec.sh's SERVERS names it). With ROUNDS > 1, bench_spec.sh writes one folder
per round (<dir>/r1, <dir>/r2, ...: both servers, one after the other, each round): each
round's ratio is taken within the round, and the table gives the median ratio with the
lowest and highest, the median tokens/s of each server, and the acceptance over all rounds.
"""

from __future__ import annotations

import json
import pathlib
import re
import statistics
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


def one_round(d: pathlib.Path) -> tuple[str, dict[tuple[str, int], dict]]:
    """(the speculating server's name, (workload, concurrency) -> that cell's figures)."""
    runs = sorted(d.glob("*_c*.json"))
    servers = sorted({p.stem.split("_")[0] for p in runs} - {"none"})
    if len(servers) != 1:
        raise SystemExit(f"{d}: expected runs of 'none' and one speculating server, found "
                         f"{servers or 'none'}")
    spec_name = servers[0]
    keys = sorted({(p.stem.split("_")[1], int(p.stem.rsplit("_c", 1)[1])) for p in runs})
    deltas: dict[tuple[str, int], dict[str, float]] = {}
    prev = {n: 0.0 for n in COUNTERS}
    for w, c in keys:  # the order bench_spec.sh runs them in
        m = counters(d / f"{spec_name}_{w}_c{c}.metrics")
        deltas[(w, c)] = {n: m[n] - prev[n] for n in COUNTERS}
        prev = m or prev
    cells = {}
    for w, c in keys:
        r = {}
        for server in ("none", spec_name):
            p = d / f"{server}_{w}_c{c}.json"
            r[server] = json.loads(p.read_text()) if p.exists() else None
        if all(r.values()):
            cells[(w, c)] = dict(none=r["none"], spec=r[spec_name], counters=deltas[(w, c)])
    return spec_name, cells


def main() -> None:
    d = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "spec_bench")
    dirs = sorted(p for p in d.glob("r*") if p.is_dir()) or [d]
    rounds = [one_round(r) for r in dirs]
    name = rounds[0][0]
    keys = sorted(set.intersection(*(set(cells) for _, cells in rounds)))
    rows = []
    print(f"{len(dirs)} round(s); ratio: {name} / none output tokens/s within a round "
          "(median [lowest, highest] over rounds)")
    print(f"{'workload':8} {'conc':>4} {'none tok/s':>10} {name + ' tok/s':>11} "
          f"{'ratio':>20} {'TPOT none':>9} {'TPOT ' + name:>11} {'accepted':>9} "
          f"{'tokens/draft':>12}")
    for w, c in keys:
        got = [cells[(w, c)] for _, cells in rounds]
        ratios = [g["spec"]["output_throughput"] / g["none"]["output_throughput"] for g in got]
        drafts, proposed, accepted = (sum(g["counters"][n] for g in got) for n in COUNTERS)
        row = dict(workload=w, concurrency=c, rounds=len(got),
                   none_tok_s=statistics.median(g["none"]["output_throughput"] for g in got),
                   spec_tok_s=statistics.median(g["spec"]["output_throughput"] for g in got),
                   ratio=statistics.median(ratios), ratio_min=min(ratios),
                   ratio_max=max(ratios), ratios=ratios,
                   none_tpot_ms=statistics.median(g["none"]["median_tpot_ms"] for g in got),
                   spec_tpot_ms=statistics.median(g["spec"]["median_tpot_ms"] for g in got),
                   acceptance=accepted / proposed if proposed else None,
                   tokens_per_draft=1 + accepted / drafts if drafts else None, method=name)
        rows.append(row)
        acc = "-" if row["acceptance"] is None else f"{row['acceptance']:.0%}"
        tpd = "-" if row["tokens_per_draft"] is None else f"{row['tokens_per_draft']:.2f}"
        spread = f"{row['ratio']:.2f}x [{row['ratio_min']:.2f}, {row['ratio_max']:.2f}]"
        print(f"{w:8} {c:>4} {row['none_tok_s']:>10.1f} {row['spec_tok_s']:>11.1f} "
              f"{spread:>20} {row['none_tpot_ms']:>9.1f} {row['spec_tpot_ms']:>11.1f} "
              f"{acc:>9} {tpd:>12}")
    (d / "spec_table.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
