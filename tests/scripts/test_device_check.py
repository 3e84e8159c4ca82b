"""The device run rehearsed on CPU: `scripts/device/device_check.sh --dry-run` runs every phase
(versions, kernel tests, kernels checked against the reference then timed, the whole engine
through LLM.generate, the summary) at CPU size, so the script a lent GPU runs cannot rot.

Slow tier: the rehearsal is one ~45 s subprocess (the kernel bench and the engine check
compile their own shapes, shared with nothing else in the suite) for a script that runs
only when a session is lent an accelerator; JAXSERVE_RUN_SLOW=1 runs it before that."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
from support.tiers import slow

ROOT = pathlib.Path(__file__).resolve().parents[2]


@slow("a ~45 s subprocess rehearsing the accelerator check at CPU size")
@pytest.mark.timeout(960)  # past the worker's own 900 s subprocess limit
def test_device_check_dry_run(tmp_path: pathlib.Path) -> None:
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    script = ROOT / "scripts" / "device" / "device_check.sh"
    proc = subprocess.run(["bash", str(script), "--dry-run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    summary = (tmp_path / "summary.txt").read_text()
    assert "DEVICE CHECK SUMMARY" in summary and "jaxlib" in summary, summary
    kernels = json.loads((tmp_path / "bench_kernel.json").read_text())["results"]
    assert kernels and all("error" not in r for r in kernels), kernels
    assert all(r["check"]["ok"] for r in kernels if r["impl"] != "reference"), kernels
    assert "0 failed" in summary.split("kernel vs reference")[1].splitlines()[0]
    engine = json.loads((tmp_path / "engine_check.json").read_text())
    assert engine["dry_run"] and engine["compiles_after_warmup"] == 0, engine
    assert engine["decode"]["step_ms"] > 0 and engine["mixed"]["output_tok_s"] > 0, engine
    assert "engine (dry run" in summary, summary
