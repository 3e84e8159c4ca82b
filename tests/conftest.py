"""Shared pytest set-up: test helpers importable, slow/device markers honoured."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

# The CLI turns on JAX's persistent compilation cache (default ~/.cache/jaxserve/xla) for the
# whole process; a test that calls the CLI in-process would leave it on for every later test,
# in a directory shared with the user and with the servers other tests start. Tests that
# exercise the cache give their own subprocess a private directory; the rest run uncached.
os.environ.setdefault("JAXSERVE_COMPILATION_CACHE_DIR", "")


def _num_memory_maps() -> int | None:
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux
        return None


def _max_map_count() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65530


# Every XLA:CPU executable holds a few memory maps, and Linux caps a process's maps
# (vm.max_map_count, 65530 by default). The suite compiles thousands of executables in one
# process; past the cap LLVM cannot allocate ("LLVM compilation error: Cannot allocate memory")
# and the process dies: a segfault inside a compile, an abort inside a cache read (both seen
# on CI). So between test modules, once the count passes half the cap, JAX's compiled
# executables are dropped (their engines went with the module's fixtures; later modules
# compile what they need again).
_CLEAR_ABOVE = _max_map_count() // 2


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):  # noqa: ANN201
    yield  # the fixtures of `item` (its module's too, at a module's end) are torn down here
    if nextitem is not None and nextitem.module is item.module:
        return
    maps = _num_memory_maps()
    if maps is not None and maps > _CLEAR_ABOVE:
        import gc

        import jax

        jax.clear_caches()
        gc.collect()


def _has_accelerator() -> bool:
    try:
        import jax

        return jax.default_backend() in ("gpu", "tpu")
    except Exception:  # noqa: BLE001 - no jax or no backend means no device
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    run_slow = os.environ.get("JAXSERVE_RUN_SLOW") == "1"
    has_device = None
    for item in items:
        slow = item.get_closest_marker("slow")
        if slow is not None and not run_slow:
            # `@pytest.mark.slow(reason="...")` says why in the skip line
            why = f" ({slow.kwargs['reason']})" if "reason" in slow.kwargs else ""
            item.add_marker(pytest.mark.skip(
                reason=f"slow test{why}: set JAXSERVE_RUN_SLOW=1 to run it"))
        if "device" in item.keywords:
            if has_device is None:
                has_device = _has_accelerator()
            if not has_device:
                item.add_marker(pytest.mark.skip(reason="needs a GPU/TPU; this machine is CPU-only"))
