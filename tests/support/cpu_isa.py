"""The CPU dense kernels' instruction sets as pytest parameters: every variant this machine
could be built for (cpu_build.dense_variants()), each skipped, with the reason, where this
CPU cannot run it (an AVX2-only host skips "avx512"), so the kernel tests run every path the
host has, not only the one the runtime check picks."""

from __future__ import annotations

import pytest

from jaxserve.kernels_pallas import cpu_build


def isa_params() -> list:
    """pytest.param(isa) per dense variant, skipped where this CPU does not run it."""
    runnable = cpu_build.dense_isas()
    return [pytest.param(isa, id=isa, marks=pytest.mark.skipif(
        isa not in runnable, reason=f"this CPU does not run the {isa} dense kernel "
                                     f"(it runs {list(runnable)})"))
            for isa, _ in cpu_build.dense_variants()]


def cpuinfo_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (Linux; empty elsewhere): an oracle for the
    runtime check that is independent of cpuid through the compiler."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()
