"""Shared pytest set-up: test helpers importable, slow/device markers honoured."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

# The CLI turns on JAX's persistent compilation cache (default ~/.cache/jaxserve/xla) for the
# whole process. A test that calls the CLI in-process would leave it on for every later test,
# sharing one directory with the servers other tests start and with earlier runs: CI aborted
# inside XLA's deserializer on such an entry. Tests that exercise the cache give their own
# subprocess a private directory; everything else runs uncached unless the caller says so.
os.environ.setdefault("JAXSERVE_COMPILATION_CACHE_DIR", "")


def _has_accelerator() -> bool:
    try:
        import jax

        return jax.default_backend() in ("gpu", "tpu")
    except Exception:  # noqa: BLE001 - no jax or no backend means no device
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    run_slow = os.environ.get("JAXSERVE_RUN_SLOW") == "1"
    skip_slow = pytest.mark.skip(reason="slow test: set JAXSERVE_RUN_SLOW=1 to run it")
    has_device = None
    for item in items:
        if "slow" in item.keywords and not run_slow:
            item.add_marker(skip_slow)
        if "device" in item.keywords:
            if has_device is None:
                has_device = _has_accelerator()
            if not has_device:
                item.add_marker(pytest.mark.skip(reason="needs a GPU/TPU; this machine is CPU-only"))
