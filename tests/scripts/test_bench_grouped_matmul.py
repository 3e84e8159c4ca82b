"""scripts/bench/bench_grouped_matmul.py at tiny sizes through both interpreters (CPU): it runs,
its kernels agree with the ragged dot (it exits non-zero otherwise) and the JSON holds a row
per (projection, implementation)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "bench" / "bench_grouped_matmul.py"


@pytest.mark.slow(reason="three interpreted compiles per projection (~30 s on 2 cores)")
def test_interpreted_smoke_run(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "gmm.json"
    subprocess.run([sys.executable, str(SCRIPT), "--interpret", "--tokens", "3", "--experts", "8",
                    "--top-k", "2", "--hidden", "128", "--width", "64", "--iters", "1",
                    "--json", str(out)], check=True, capture_output=True, text=True, timeout=600)
    rows = json.loads(out.read_text())["rows"]
    assert {(r["proj"], r["impl"]) for r in rows} == {
        (p, i) for p in ("gate", "down") for i in ("ragged_dot", "pallas_tpu", "pallas_gpu")}
    assert all(r["rel_err"] < 1e-2 and r["rows"] == 6 for r in rows)
