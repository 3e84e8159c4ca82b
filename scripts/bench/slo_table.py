"""The table of `bench_slo.sh`: goodput per phase and overall for each server it ran.

Reads DIR/run_<leg>.json (`jaxserve bench --phase ... --output-json` documents) and
DIR/tune_<phase>.json (the tuner's verdicts) and prints markdown: the best static setting the
tuner found per phase, then one row per leg with, per phase and for the whole run, goodput
(req/s meeting every SLO, over the phase's window) with the share of sent requests that met
them, and p99 TTFT / p99 ITL; with several rounds (run_<leg>_r<i>.json), one row per round
and each leg's median and range. Legs that did not run are left out. `--goodput KEY:MS ...`
re-judges every saved run and tune under other targets (from the per-request samples the
documents keep; no rerun).

    python scripts/bench/slo_table.py benchmarks/results/slo_2026-12-07
    python scripts/bench/slo_table.py DIR --goodput ttft:3000 itl:250
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics

from jaxserve.cli.bench.report import Slo, parse_goodput, rejudge
from jaxserve.cli.bench.tune import TuneSpec, repick

LEG_ORDER = ("chat-best", "long-best", "default", "adaptive")


def _cell(s: dict) -> str:
    good, att = s.get("goodput"), s.get("slo_attainment")
    if good is None:
        return "-"
    return f"{good:.2f} ({100 * (att or 0):.0f}%)"


def _lat(s: dict) -> str:
    def ms(d: dict) -> str:
        return "-" if d.get("p99") is None else f"{d['p99']:,.0f}"

    return f"{ms(s['ttft_ms'])} / {ms(s['itl_ms'])}"


def tune_lines(root: pathlib.Path, slo: Slo) -> list[str]:
    lines = []
    for path in sorted(root.glob("tune_*.json")):
        doc = json.loads(path.read_text())
        if slo.given:
            doc = repick(doc, TuneSpec(None, None, goodput=slo))
        best = doc["best"]
        setting = "none met the SLOs" if best is None else (
            f"max_num_batched_tokens={best['max_num_batched_tokens']}, "
            f"max_num_seqs={best['max_num_seqs']} (goodput {best['summary']['goodput']:.2f} "
            "req/s)")
        grid = ", ".join(
            f"{r['max_num_batched_tokens']}/{r['max_num_seqs']}: "
            + ("-" if r["summary"] is None else f"{r['summary']['goodput'] or 0:.2f}")
            for r in doc["rows"])
        lines.append(f"- tune, {path.stem[5:]} phase alone ({doc['load']}): best {setting}; "
                     f"goodput per point (tokens/seqs): {grid}")
    return lines


def _order(label: str) -> tuple:
    leg, _, r = label.partition("_r")
    return (LEG_ORDER.index(leg) if leg in LEG_ORDER else 99, leg, int(r or 0))


def medians(docs: dict[str, dict], labels: list[str]) -> list[str]:
    """Per leg over its rounds: median goodput per phase [min-max]."""
    by_leg: dict[str, list[dict]] = {}
    for name, doc in docs.items():
        by_leg.setdefault(name.partition("_r")[0], []).append(doc)
    if all(len(v) < 2 for v in by_leg.values()):
        return []
    head = ["server (rounds)"] + [f"{lb} goodput median [min-max]" for lb in labels]
    lines = ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for leg in sorted(by_leg, key=_order):
        cells = [f"{leg} ({len(by_leg[leg])})"]
        for lb in labels:
            v = sorted(p["summary"]["goodput"] or 0.0 for d in by_leg[leg]
                       for p in d["points"] if p["label"] == lb)
            cells.append("-" if not v else
                         f"{statistics.median(v):.2f} [{v[0]:.2f}-{v[-1]:.2f}]")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def run_table(root: pathlib.Path, slo: Slo) -> list[str]:
    docs = {}
    for path in root.glob("run_*.json"):
        doc = json.loads(path.read_text())
        if slo.given:
            doc["goodput"] = slo.describe()
            doc["points"] = [dict(p, summary=rejudge(p["summary"], p["samples"]["requests"],
                                                     slo)) for p in doc["points"]]
        docs[path.stem[4:]] = doc  # the leg, and _r<i> for a round
    if not docs:
        return [f"(no run_*.json in {root})"]
    legs = sorted(docs, key=_order)
    labels = [p["label"] for p in docs[legs[0]]["points"]]
    first = docs[legs[0]]
    lines = [f"workload: {first['workload']}; goodput targets (ms): {first.get('goodput')}",
             ""]
    head = ["server"] + [f"{lb} goodput (SLO met)" for lb in labels] + \
        [f"{lb} p99 TTFT / ITL ms" for lb in labels if lb != "all"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for leg in legs:
        pts = {p["label"]: p["summary"] for p in docs[leg]["points"]}
        cells = [leg] + [_cell(pts[lb]) if lb in pts else "-" for lb in labels] + \
            [_lat(pts[lb]) if lb in pts else "-" for lb in labels if lb != "all"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += medians(docs, labels)
    lines += ["", "goodput: requests/s meeting every target over the phase's window (all: the "
              "sum of windows); SLO met: share of the requests sent in that phase"]
    drains = {leg: docs[leg].get("drain_s") for leg in legs}
    lines.append("drain past the last window (s): " + ", ".join(
        f"{leg} {d:.1f}" for leg, d in drains.items() if d is not None))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", help="bench_slo.sh's $OUT")
    ap.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                    help="re-judge under these targets (as jaxserve bench --goodput)")
    args = ap.parse_args()
    root, slo = pathlib.Path(args.dir), parse_goodput(args.goodput)
    print("\n".join(tune_lines(root, slo) + [""] + run_table(root, slo)))


if __name__ == "__main__":
    main()
