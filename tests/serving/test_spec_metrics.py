"""The speculative-decoding Prometheus families (`serving.metrics`, issue 33), fed with
synthetic cumulative `EngineStats`: the oracle is a list of drafts drawn here (proposed and
accepted counts per draft), counted directly; the metrics only ever see the engine's
cumulative snapshots, as in serving."""

from __future__ import annotations

import random

import pytest
from prometheus_client import generate_latest

from jaxserve.engine.limits import EngineStats
from jaxserve.serving.metrics import EngineMetrics

K = 4
NAME = "tiny"


def _drafts(seed: int, n: int) -> list[tuple[int, int]]:
    """(proposed, accepted) per draft: proposals 1..K (n-gram may find fewer than K)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        proposed = rng.randint(1, K)
        out.append((proposed, rng.randint(0, proposed)))
    return out


def _stats(drafts: list[tuple[int, int]]) -> EngineStats:
    """The engine's cumulative snapshot after `drafts`."""
    counts = [0] * (K + 1)
    for _, accepted in drafts:
        counts[accepted] += 1  # emitted accepted + 1 tokens
    return EngineStats(0, 0, 0, 0, 16, 0, 0, 0, len(drafts), 1, 0,
                       spec_num_drafts=len(drafts),
                       spec_num_draft_tokens=sum(p for p, _ in drafts),
                       spec_num_accepted_tokens=sum(a for _, a in drafts),
                       spec_acceptance_counts=tuple(counts))


def _feed(m: EngineMetrics, drafts: list[tuple[int, int]], cuts: list[int]) -> None:
    """Snapshots after each prefix `drafts[:c]` (an idle step repeats the last one)."""
    m.on_step(EngineStats(0, 0, 0, 0, 16, 0, 0, 0, 0, 0, 0), [], stepped=False)  # () counts
    for c in cuts:
        m.on_step(_stats(drafts[:c]), [], stepped=True)
        m.on_step(_stats(drafts[:c]), [], stepped=False)


def _check(value, drafts: list[tuple[int, int]], **labels: str) -> None:  # noqa: ANN001
    """`value(name, labels)` -> sample; compared with counts made from the drafts."""
    lengths = [a + 1 for _, a in drafts]
    assert value("jaxserve:spec_decode_num_drafts_total", labels) == len(drafts)
    assert value("jaxserve:spec_decode_num_draft_tokens_total", labels) == sum(
        p for p, _ in drafts)
    assert value("jaxserve:spec_decode_num_accepted_tokens_total", labels) == sum(
        a for _, a in drafts)
    for j in range(K):  # position j accepted: the draft accepted more than j proposals
        assert value("jaxserve:spec_decode_num_accepted_tokens_per_pos_total",
                     {**labels, "position": str(j)}) == sum(1 for _, a in drafts if a > j)
    hist = "jaxserve:spec_decode_acceptance_length"
    for le in range(1, K + 2):
        assert value(f"{hist}_bucket", {**labels, "le": f"{float(le)}"}) == sum(
            1 for n in lengths if n <= le)
    assert value(f"{hist}_bucket", {**labels, "le": "+Inf"}) == len(lengths)
    assert value(f"{hist}_count", labels) == len(lengths)
    assert value(f"{hist}_sum", labels) == sum(lengths)


def test_counters_and_acceptance_histogram_match_the_drafts() -> None:
    m = EngineMetrics(NAME, 64, num_speculative_tokens=K)
    drafts = _drafts(0, 300)
    _feed(m, drafts, [0, 1, 7, 7, 50, 51, 199, 300])
    assert sum(a for _, a in drafts) > 0 and any(a == K for _, a in drafts)

    def value(name: str, labels: dict[str, str]) -> float | None:
        return m.registry.get_sample_value(name, {"model_name": NAME, **labels})

    _check(value, drafts)
    text = generate_latest(m.registry).decode()
    assert 'jaxserve:spec_decode_acceptance_length_bucket{le="5.0",model_name="tiny"}' in text


def test_replicas_are_labelled_and_sum_to_the_total() -> None:
    views = EngineMetrics.for_replicas(NAME, 64, 2, num_speculative_tokens=K)
    a, b = _drafts(1, 80), _drafts(2, 45)
    _feed(views[0], a, [10, 80])
    _feed(views[1], b, [45])
    reg = views[0].registry

    def per_engine(i: int):  # noqa: ANN202
        return lambda name, labels: reg.get_sample_value(
            name, {"model_name": NAME, "engine": str(i), **labels})

    _check(per_engine(0), a)
    _check(per_engine(1), b)

    def summed(name: str, labels: dict[str, str]) -> float:
        return sum(per_engine(i)(name, labels) for i in range(2))

    _check(summed, a + b)


def test_no_spec_families_without_speculation() -> None:
    m = EngineMetrics(NAME, 64)
    m.on_step(_stats(_drafts(3, 5)), [], stepped=True)  # ignored: families absent
    assert m.spec is None
    assert "spec_decode" not in generate_latest(m.registry).decode()


@pytest.mark.parametrize("k", [0, -1, True, 2.0])
def test_bad_k_is_refused(k: object) -> None:
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineMetrics(NAME, 64, num_speculative_tokens=k)  # type: ignore[arg-type]
