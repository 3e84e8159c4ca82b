"""PNG plots of benchmark results (matplotlib, headless Agg backend).

Data flow: the JSON-able result documents that `jaxserve bench` / `tune` write (each with
`points`: label, summary, raw TTFT / ITL samples) -> `plot_sweep` (output tokens/s vs p99
TTFT and p99 ITL across a sweep, one line per document, so several targets compare on one
figure) and `plot_cdfs` (TTFT and ITL CDFs, one line per point). matplotlib is optional
(`pip install jaxserve[bench]`): without it the functions say so and return no paths.
"""

from __future__ import annotations

import logging
import pathlib
from typing import Any, Sequence

import numpy as np

log = logging.getLogger(__name__)


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        log.warning("matplotlib is not installed (pip install 'jaxserve[bench]'): no plots")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, path: str | pathlib.Path) -> list[pathlib.Path]:
    fig.tight_layout()
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return [out]


def _style(ax: Any, xlabel: str, ylabel: str, title: str, log_x: bool = False,
           log_y: bool = False, legend_size: int = 8) -> None:
    if log_x:
        ax.set_xscale("log")
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=legend_size)


def plot_sweep(docs: Sequence[dict], path: str | pathlib.Path) -> list[pathlib.Path]:
    """Output tokens/s (x) against p99 TTFT and p99 ITL (y, log) for each document's points."""
    plt = _pyplot()
    if plt is None:
        return []
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for doc in docs:
        pts = doc["points"]
        x = [p["summary"]["output_throughput"] for p in pts]
        name = doc.get("name") or doc.get("target", "")
        for ax, key in zip(axes, ("ttft_ms", "itl_ms")):
            y = [p["summary"][key]["p99"] for p in pts]
            ax.plot(x, y, marker="o", label=name)
            for xi, yi, p in zip(x, y, pts):
                ax.annotate(p["label"].split("=")[-1], (xi, yi), textcoords="offset points",
                            xytext=(4, 4), fontsize=8)
    for ax, title in zip(axes, ("p99 time to first token", "p99 inter-token latency")):
        _style(ax, "output tokens/s", f"{title} (ms)", f"{title} vs throughput (labels: load)",
               log_y=True)
    return _save(plt, fig, path)


def plot_cdfs(docs: Sequence[dict], path: str | pathlib.Path) -> list[pathlib.Path]:
    """Empirical CDFs of TTFT and ITL, one line per (document, point)."""
    plt = _pyplot()
    if plt is None:
        return []
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for doc in docs:
        name = doc.get("name") or doc.get("target", "")
        for p in doc["points"]:
            for ax, key in zip(axes, ("ttft_s", "itl_s")):
                v = np.sort(np.asarray(p["samples"][key], dtype=np.float64)) * 1e3
                if v.size:
                    ax.plot(v, np.arange(1, v.size + 1) / v.size,
                            label=f"{name} {p['label']}".strip())
    for ax, title in zip(axes, ("time to first token", "inter-token latency")):
        _style(ax, f"{title} (ms)", "fraction of samples", f"CDF of {title}", log_x=True,
               legend_size=7)
    return _save(plt, fig, path)


def plot_grid(rows: Sequence[dict], path: str | pathlib.Path, ttft_slo_s: float | None,
              itl_slo_s: float | None) -> list[pathlib.Path]:
    """The tuner's grid: p99 ITL vs output tokens/s per point, SLO lines, qualifying (and,
    with goodput, best-ranked) points marked green."""
    plt = _pyplot()
    if plt is None:
        return []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        s = r["summary"]
        if s is None:
            continue
        ok = r["meets_slo"]
        ax.scatter(s["output_throughput"], s["itl_ms"]["p99"], marker="o" if ok else "x",
                   color="tab:green" if ok else "tab:red")
        ax.annotate(f"{r['max_num_batched_tokens']}/{r['max_num_seqs']}",
                    (s["output_throughput"], s["itl_ms"]["p99"]), textcoords="offset points",
                    xytext=(4, 4), fontsize=8)
    if itl_slo_s is not None:
        ax.axhline(itl_slo_s * 1e3, color="gray", linestyle="--", label="ITL p99 target")
    green = (f"TTFT p99 <= {ttft_slo_s:g}s and ITL p99 <= {itl_slo_s:g}s"
             if ttft_slo_s is not None and itl_slo_s is not None else "ran")
    _style(ax, "output tokens/s", "p99 inter-token latency (ms)",
           f"tuner grid (labels: batched tokens/max seqs; green: {green})", log_y=True)
    ax.title.set_fontsize(9)
    return _save(plt, fig, path)
