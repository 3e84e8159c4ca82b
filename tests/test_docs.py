"""The documentation site builds: `mkdocs build --strict` over mkdocs.yml and docs/ fails on a
broken link, a page left out of the nav or a generated page (the configuration reference,
made from EngineConfig and the sampling registry at build time) that cannot be made."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_docs_build_strict(tmp_path: pathlib.Path) -> None:
    site = tmp_path / "site"
    # No --quiet: it drops warnings below the level that --strict counts, so a warning (an
    # undocumented environment variable, a stale reference) would pass.
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                           "-f", str(ROOT / "mkdocs.yml"), "-d", str(site)],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("WARNING")]
    assert proc.returncode == 0 and not warnings, (warnings, proc.stderr[-4000:])
    assert (site / "index.html").is_file()
