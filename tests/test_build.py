"""serving.build: the process-wide JAX settings are applied once per build, before any
replica is placed."""

from __future__ import annotations

import jax
import pytest

from jaxserve.config import EngineConfig
from jaxserve.serving import build


class _Stop(Exception):
    pass


@pytest.mark.parametrize("dp", [1, 3])
def test_runtime_applied_once_before_placing(monkeypatch: pytest.MonkeyPatch, tmp_path,
                                             dp: int) -> None:
    events = []
    monkeypatch.setattr(build, "apply_runtime", lambda cfg: events.append(("runtime", cfg)))
    monkeypatch.setattr(build, "replica_device_rows",
                        lambda dp, tp: [[jax.local_devices()[0]]] * dp)

    def place(config, model, devices):  # noqa: ANN001, ANN202
        events.append(("place", devices))
        if sum(e[0] == "place" for e in events) == dp:
            raise _Stop  # every replica placed; no need to load a model
        return None

    monkeypatch.setattr(build, "_place", place)
    config = EngineConfig(compilation_cache_dir=str(tmp_path / "xla"), data_parallel_size=dp)
    with pytest.raises(_Stop):
        build.build_engines(config, warmup=False)
    assert [e[0] for e in events] == ["runtime"] + ["place"] * dp
    assert events[0][1].compilation_cache_dir == str(tmp_path / "xla")
