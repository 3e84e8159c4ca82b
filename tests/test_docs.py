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
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
                           "-f", str(ROOT / "mkdocs.yml"), "-d", str(site)],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (site / "index.html").is_file()
