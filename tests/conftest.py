"""Shared pytest set-up: test helpers importable, one compilation cache per test session,
slow/device markers honoured.

The tests mirror the package, a folder per layer: kernels/ (kernels_pallas), models/
(models), engine/ (jaxserve/engine), device/ (jaxserve/device), serving/ (jaxserve/serving
and jaxserve/llm.py), server/ (server), cli/ (jaxserve/cli) and scripts/ (scripts); a
module's tests are tests/<layer>/test_<module>.py. Helpers shared across layers live in the
support/ package (tiny models and engines, fake runners, oracles), the scripts the tests run
in subprocesses in support/workers/. This folder is on sys.path, so tests and workers
import them as `support.<name>` (scripts never do: what they share with the tests, such as
the tiny models of `jaxserve.models.tiny`, lives in the package).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from support.order import heaviest_first  # noqa: E402 - importable once this folder is on sys.path
from support.tiers import run_slow

# One persistent XLA compilation cache per test session, private to it (never the user's
# ~/.cache/jaxserve/xla), shared by every module and by every process the tests start: the
# subprocess workers, the `jaxserve serve` processes and pytest-xdist workers inherit these
# variables. Tests build many engines of the same tiny configurations; after the first, each
# warmup's lowerings find their executables here instead of compiling them again (and so do
# the modules after conftest's jax.clear_caches below). Every compile is cached, however
# short: on CPU a tiny model's compiles take 0.1-1 s, under JAX's default 1 s floor.
# compile_guard counts lowerings, which still happen on a cache hit, so the tests'
# `compiles_after_warmup == 0` checks are unaffected. Tests of the cache itself give their
# subprocesses a directory of their own. JAXSERVE_TEST_XLA_CACHE names the directory (a
# directory that outlives the session, to reuse compiles across runs), or "" for none.
_OWN_CACHE_DIR: str | None = None
if "JAXSERVE_TEST_XLA_CACHE" not in os.environ:
    _OWN_CACHE_DIR = tempfile.mkdtemp(prefix="jaxserve-test-xla-")
    os.environ["JAXSERVE_TEST_XLA_CACHE"] = _OWN_CACHE_DIR
if os.environ["JAXSERVE_TEST_XLA_CACHE"]:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ["JAXSERVE_TEST_XLA_CACHE"]
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
# XLA compiles with LLVM's optimisations off (backend optimisation level 0) on a CPU-only
# host: the tests' models are tiny, so compiling is most of the suite's time and running the
# executables little of it, and level 0 takes ~30% less CPU per compile (measured on the
# 2-core host: test_quant_engine 96 s -> 64 s of CPU, test_kv_quant 63 s -> 45 s). The code
# under test and its oracles are the same; XLA:CPU does not reassociate float arithmetic at
# either level (no fast-math), so the numbers are too. JAXSERVE_TEST_XLA_FLAGS replaces the
# flags ("" for none: XLA's default optimisation); hosts with a GPU / TPU keep XLA's default.
# Appended to XLA_FLAGS, which every subprocess inherits (the device workers and the
# multi-host jobs add their device counts to it).
_TEST_XLA_FLAGS = os.environ.get("JAXSERVE_TEST_XLA_FLAGS")
if _TEST_XLA_FLAGS is None:
    # (jax cannot be asked yet: XLA reads its flags once, when its first backend starts)
    _accelerator = os.environ.get("JAX_PLATFORMS") != "cpu" and any(
        os.path.exists(d) for d in ("/dev/nvidia0", "/dev/kfd", "/dev/accel0", "/dev/vfio"))
    _TEST_XLA_FLAGS = "" if _accelerator else "--xla_backend_optimization_level=0"
if _TEST_XLA_FLAGS and _TEST_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_TEST_XLA_FLAGS}".strip()
# One scratch directory per test session, shared by the xdist workers (they inherit it), for
# what is expensive to make and the same for every test: transformers' conversion of the
# bundled GGUF (support/bundled_hf.py). Removed at the session's end.
_OWN_SESSION_DIR = tempfile.mkdtemp(prefix="jaxserve-test-session-")
if "JAXSERVE_TEST_SESSION_DIR" in os.environ:  # set by the controller: an xdist worker
    os.rmdir(_OWN_SESSION_DIR)
    _OWN_SESSION_DIR = None
else:
    os.environ["JAXSERVE_TEST_SESSION_DIR"] = _OWN_SESSION_DIR
# The CLI sets JAX's cache directory from JAXSERVE_COMPILATION_CACHE_DIR (default
# ~/.cache/jaxserve/xla); empty leaves JAX's setting, the session's directory, as it is.
os.environ.setdefault("JAXSERVE_COMPILATION_CACHE_DIR", "")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # Only the process that made the directories removes them (not an xdist worker).
    if hasattr(session.config, "workerinput"):
        return
    for own in (_OWN_CACHE_DIR, _OWN_SESSION_DIR):
        if own is not None:
            shutil.rmtree(own, ignore_errors=True)


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
    slow_tier = run_slow()
    has_device = None
    for item in items:
        slow = item.get_closest_marker("slow")
        if slow is not None and not slow_tier:
            # `@pytest.mark.slow(reason="...")` says why in the skip line
            why = f" ({slow.kwargs['reason']})" if "reason" in slow.kwargs else ""
            item.add_marker(pytest.mark.skip(
                reason=f"slow test{why}: set JAXSERVE_RUN_SLOW=1 to run it"))
        # The marker, not `item.keywords`: keywords hold the names of the test's folders too,
        # and every test in tests/device/ would be taken for a device-only one.
        if item.get_closest_marker("device") is not None:
            if has_device is None:
                has_device = _has_accelerator()
            if not has_device:
                item.add_marker(pytest.mark.skip(reason="needs a GPU/TPU; this machine is CPU-only"))
    # The heaviest modules first, so that two xdist workers finish together (support/order.py).
    items[:] = heaviest_first(items)
