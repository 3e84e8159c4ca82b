"""`SloTargets.parse`: every form a user writes (flag text, a number, a mapping) and every bad
one refused naming the flag and the bad part; the config checks that tie the SLO fields."""

from __future__ import annotations

import pytest

from jaxserve.config import EngineConfig, SchedulerConfig, SloTargets


@pytest.mark.parametrize("value, default, levels", [
    ("2", 2.0, ()),
    (0.5, 0.5, ()),
    ("0=0.5,1=2", None, ((0, 0.5), (1, 2.0))),
    ("2, 0=0.5", 2.0, ((0, 0.5),)),
    ({"default": 1, "3": 0.25, "-1": 0.1}, 1.0, ((-1, 0.1), (3, 0.25))),
])
def test_parse_forms(value: object, default: float | None, levels: tuple) -> None:
    got = SloTargets.parse(value, "ttft_slo")
    assert (got.default, got.per_priority) == (default, levels)
    assert SloTargets.parse(got.to_json()) == got  # the admin endpoint's round trip
    assert SloTargets.parse(str(got)) == got  # and the flag's
    for p, s in levels:
        assert got.for_priority(p) == s
    assert got.for_priority(99) == default


@pytest.mark.parametrize("value, message", [
    ("0", "ttft_slo='0' must be seconds in (0, 3600]"),
    ("-1", "must be seconds"),
    ("nan", "must be seconds"),
    ("fast", "is not a number of seconds"),
    ("x=1", "'x' is not a priority level"),
    ("0=1,0=2", "gives priority 0 twice"),
    ("1,2", "gives a default target twice"),
    (True, "must be seconds, 'LEVEL=SECONDS,...' or a mapping"),
    ({"1": "a" * 500}, "priority 1"),
])
def test_bad_values_are_refused_by_name(value: object, message: str) -> None:
    with pytest.raises(ValueError, match="ttft_slo") as e:
        SloTargets.parse(value, "ttft_slo")
    assert message in str(e.value) and len(str(e.value)) < 200


def test_config_ties() -> None:
    cfg = EngineConfig(ttft_slo="1,0=0.2", itl_slo=0.05, slo_admission="reject")
    assert cfg.ttft_slo.for_priority(0) == 0.2 and cfg.itl_slo.default == 0.05
    with pytest.raises(ValueError, match="slo_admission='reject' needs ttft_slo"):
        EngineConfig(itl_slo=0.05, slo_admission="reject")
    with pytest.raises(ValueError, match="slo_admission='later' must be one of"):
        EngineConfig(slo_admission="later")
    with pytest.raises(ValueError, match="scheduling_policy='sjf' must be one of"):
        EngineConfig(scheduling_policy="sjf")
    with pytest.raises(ValueError, match="itl_slo must be an SloTargets"):
        SchedulerConfig(itl_slo=0.05)  # type: ignore[arg-type]
    assert not SchedulerConfig().slo_enabled
    assert SchedulerConfig(itl_slo=SloTargets(0.1)).slo_enabled
