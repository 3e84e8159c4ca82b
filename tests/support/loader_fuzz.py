"""The loader fuzz tests' contract (tests/models/test_loader_fuzz*.py): the Hypothesis
settings and example budget, and the `outcome` oracle of one read of a damaged file."""

from __future__ import annotations

import pathlib
import tracemalloc
from typing import Callable

from hypothesis import HealthCheck, settings
from support.tiers import fuzz_examples

from jaxserve.models.config import ConfigError
from jaxserve.models.safetensors_io import CheckpointError

FUZZ_EXAMPLES = fuzz_examples(60)
FUZZ = settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])
PEAK_SLACK = 32 << 20  # bytes beyond a small multiple of the file size


def outcome(fn: Callable[[pathlib.Path], object], path: pathlib.Path) -> object:
    """`fn(path)`'s result, or the clean error it raised (a ValueError naming `path`).

    Fails on any other exception type, on an error that names no file, and on a peak
    allocation out of proportion to the file (an unchecked size field would show here).
    """
    size = path.stat().st_size
    tracemalloc.start()
    try:
        return fn(path)
    except (CheckpointError, ConfigError) as e:
        assert str(path) in str(e), f"error does not name the file: {e}"
        return e
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak < 64 * size + PEAK_SLACK, f"peak allocation {peak} for a {size}-byte file"


def failed(result: object) -> bool:
    """`outcome` returned a clean error."""
    return isinstance(result, ValueError)
