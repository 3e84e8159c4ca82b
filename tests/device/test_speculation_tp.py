"""Speculative decoding under tensor parallelism: the proposals are tokens of the step's batch,
so an engine split over 2 devices verifies them exactly as one device does; a draft model or
an EAGLE-3 head runs whole on each device (replicated over the mesh). Oracle: the same
engine at tensor_parallel_size=1 (`tests/support/workers/spec_tp_worker.py`, a subprocess
with 2 virtual CPU devices): greedy and seeded sampled requests give the same tokens, the
same proposals are made and accepted, nothing compiles after warmup, no page leaks.
"""

from __future__ import annotations

import pytest
from support.engine_fixtures import run_device_worker
from support.tiers import slow

pytestmark = pytest.mark.timeout(960)


@slow("two tiny engines compiled in a subprocess (~1 min); the fake runner's and the tiny "
      "model's speculation tests run the verification itself, test_tensor_parallel the "
      "sharded step")
def test_tensor_parallel_speculation_equals_one_device() -> None:
    doc = run_device_worker("spec_tp_worker.py", num_devices=2)
    for name in ("ngram", "replay"):
        one, two = doc["tp1"][name], doc["tp2"][name]
        assert two["tokens"] == one["tokens"] == doc["tp1"]["ngram"]["tokens"], name
        assert (two["drafts"], two["accepted"]) == (one["drafts"], one["accepted"]), name
        assert one["drafts"] > 0
        assert one["compiles"] == two["compiles"] == 0
        assert one["leaked"] == two["leaked"] == 0
    assert 0 < doc["tp1"]["replay"]["accepted"] < doc["tp1"]["replay"]["drafts"]


@slow("eight tiny engines with drafters compiled in a subprocess (~4 min); the drafters' "
      "rounds run on one device in tests/serving/test_spec_*_build.py")
def test_tensor_parallel_drafters_equal_one_device() -> None:
    """A draft model and an EAGLE-3 head, replicated over the TP mesh, and beside each of two
    data-parallel replicas (the second on device 1): the same tokens as one device (greedy
    and seeded sampling), proposals made, nothing compiled after warmup (the head reads the
    step's aux states in the layout warmup compiled for), no page leaked."""
    doc = run_device_worker("spec_tp_worker.py", num_devices=2, args=("drafters",))
    for name in ("draft_model", "eagle3"):
        (one,), runs = doc["tp1"][name], doc["tp2"][name] + doc["dp2"][name]
        assert len(runs) == 3, name  # TP 2, then each of the two data-parallel replicas
        for run in [one, *runs]:
            assert run["tokens"] == one["tokens"], name
            assert run["drafts"] > 0, name
            assert run["compiles"] == 0 and run["leaked"] == 0, name
