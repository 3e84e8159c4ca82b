"""Multi-LoRA under tensor parallelism equals one device (tests/support/workers/lora_tp_worker.py
runs the engines in a subprocess with 4 virtual CPU devices). One device's outputs are checked
against HF transformers with the adapters merged in tests/serving/test_lora_llm.py."""

from __future__ import annotations

import pytest
from support.engine_fixtures import run_device_worker
from support.tiers import slow

pytestmark = pytest.mark.timeout(960)


def _check(doc: dict) -> None:
    one = doc["tp1"]
    for name, run in doc.items():
        assert run["tokens"] == one["tokens"], name
        assert run["compiles"] == 0 and run["leaked"] == 0, name


@slow("two engines compiled in a subprocess with torch and peft (~30 s); the sharded delta's "
      "lowering over 8 devices runs by default in test_export_lora.py")
def test_lora_tp2_equals_one_device() -> None:
    """Column-split projections (q/k/v, gate/up: b split by outputs) and row-split ones
    (o, down: x and a split by inputs, partial deltas summed) over 2 devices."""
    doc = run_device_worker("lora_tp_worker.py", num_devices=4)
    assert set(doc) == {"tp1", "tp2"}
    _check(doc)


@slow("three engines (TP 1, 2, 4) compiled in a subprocess (~1.5 min); TP 2 runs by default")
def test_lora_tp4_replicated_kv_heads_equals_one_device() -> None:
    """TP 4 over 2 KV heads: each KV head (and each adapter's k/v output columns) replicated
    twice, as placement repeats the base weights'."""
    _check(run_device_worker("lora_tp_worker.py", num_devices=4, args=("all",)))
