"""scripts/bench/front_overhead.py end to end at tiny sizes: one `jaxserve serve` subprocess, every
front driven in two rounds, the engine's metrics scraped per phase.

Oracles: the workload itself (requests asked for = requests the engine's metrics counted in
that phase; tokens asked for = output tokens), the tiny tokenizer's chat template rendered by
hand (the chat front's prompt tokens), and the arithmetic the tables claim (overhead = client
- server, gRPC's difference to itself 0).
"""

from __future__ import annotations

import json
import math
import pathlib
import re
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "bench" / "front_overhead.py"


def test_help_lists_the_knobs() -> None:
    out = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    for flag in ("--model", "--request-concurrency", "--token-concurrency", "--json",
                 "--server-arg", "--rounds", "--fronts"):
        assert flag in out


@pytest.mark.timeout(960)  # past the worker's own 900 s subprocess limit
@pytest.mark.slow
def test_front_overhead_smoke(tmp_path) -> None:  # noqa: ANN001
    out_json = tmp_path / "fo.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--input-len", "fixed:8", "--output-len", "fixed:4",
         "--request-concurrency", "1,2", "--token-concurrency", "4", "--num-requests", "3",
         "--warmup", "1", "--rounds", "2", "--max-num-seqs", "4", "--max-num-batched-tokens", "32",
         "--max-model-len", "64", "--attention-impl", "reference", "--json", str(out_json)],
        capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "(a) per request" in proc.stdout and "(b) per token" in proc.stdout
    doc = json.loads(out_json.read_text())
    points = doc["points"]
    assert [(p["kind"], p["concurrency"], p["front"]) for p in points] == [
        (k, c, f) for k, cs in (("request", (1, 2)), ("token", (4,)))
        for c in cs for f in ("grpc", "completions", "chat")]
    # "You are a helpful assistant." + 8 words, as the template renders and the word-level
    # pre-tokenizer splits them
    rendered = "system: You are a helpful assistant.\nuser: " + " ".join(["w9"] * 8) + \
        "\nassistant:"
    chat_prompt = len(re.findall(r"\w+|[^\w\s]+", rendered))
    for p in points:
        n = 2 * max(3, 2 * p["concurrency"])  # two rounds
        assert (p["rounds"], p["requests"], p["completed"], p["failed"]) == (2, n, n, 0), p
        assert p["output_tokens"] == 4 * n and p["compiles_during"] == 0
        assert p["server"]["requests"] == n  # the scrapes bracket exactly its phases
        assert p["client"]["prompt_tokens_mean"] == (chat_prompt if p["front"] == "chat"
                                                     else 8)
        for k in ("ttft", "e2e", "tpot"):
            assert math.isclose(p["overhead"][k],
                                p["client"][f"{k}_ms"] - p["server"][f"{k}_ms"])
        if p["front"] == "grpc":
            assert all(v == 0.0 for v in p["vs_grpc"].values())
        # nothing is measured by the server that the client did not wait for
        assert p["client"]["e2e_ms"] > p["server"]["e2e_ms"] > 0
