"""The two test tiers: what the default suite runs and what only JAXSERVE_RUN_SLOW=1 adds.

The default tier must finish in 15 minutes on a 2-core machine; the slow tier holds the rest
of each grid (more kernel shapes, more models, more prompts, the soak), so that nothing the
suite checks stops being checked. A slow-tier test is skipped by conftest unless
JAXSERVE_RUN_SLOW=1, with the marker's reason in the skip line. This module is the one place
that reads the tier switches; conftest, the tests and the subprocess workers ask it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import pytest

SLOW_ENV = "JAXSERVE_RUN_SLOW"
FUZZ_ENV = "JAXSERVE_FUZZ_EXAMPLES"


def run_slow() -> bool:
    """JAXSERVE_RUN_SLOW=1: the slow tier runs too (subprocess workers inherit the variable
    and then run their full grids)."""
    return os.environ.get(SLOW_ENV) == "1"


def slow(reason: str) -> pytest.MarkDecorator:
    """The slow-tier marker, with the reason the skip line gives."""
    return pytest.mark.slow(reason=reason)


def split_tiers(cases: Sequence[Any], ids: Sequence[str], default: Iterable[str],
                reason: str, *, unpack: bool = False,
                marks: Callable[[str], tuple] = lambda _id: ()) -> list:
    """`cases` as pytest.params: those whose id is in `default` run in the default tier, the
    others in the slow tier. A case is one parametrized argument, or with `unpack` a tuple of
    several (`parametrize("a,b", split_tiers([(a, b), ...], ...))`). Every id in `default`
    must exist (a renamed case would otherwise drop out of the default tier silently)."""
    default = set(default)
    unknown = default - set(ids)
    if unknown:
        raise ValueError(f"default-tier ids not among the cases: {sorted(unknown)}")
    if len(ids) != len(cases):
        raise ValueError(f"{len(cases)} cases but {len(ids)} ids")
    return [pytest.param(*(c if unpack else (c,)), id=i,
                         marks=(*marks(i), *(() if i in default else (slow(reason),))))
            for c, i in zip(cases, ids)]


def grid(axes: Sequence[Sequence[tuple[str, Any]]], default: Iterable[str],
         reason: str, *, flatten: bool = False) -> list:
    """The product of several parametrize axes, each a list of (id, value), as unpacked
    pytest.params with ids joined by '-' (first axis first, as pytest joins the ids of
    stacked parametrize decorators); `default` names the ids of the default tier. With
    `flatten`, a tuple value fills several arguments (`"kind,dtype,q"` from axes
    `[(id, (kind, dtype))], [(id, q)]`)."""
    import itertools

    def values(combo: tuple) -> tuple:
        out: list = []
        for _, v in combo:
            out.extend(v if flatten and isinstance(v, tuple) else (v,))
        return tuple(out)

    combos = list(itertools.product(*axes))
    return split_tiers([values(c) for c in combos], ["-".join(i for i, _ in c) for c in combos],
                       default, reason, unpack=True)


def fuzz_examples(full: int) -> int:
    """Hypothesis examples per property: JAXSERVE_FUZZ_EXAMPLES if set; else `full` in the
    slow tier and a quarter of it (at least 10) in the default one. The default tier's
    examples are derandomized, so the quarter is the same cases every run; the full count
    and the env var explore further."""
    if os.environ.get(FUZZ_ENV):
        return int(os.environ[FUZZ_ENV])
    return full if run_slow() else max(10, full // 4)
