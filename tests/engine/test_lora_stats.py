"""Multi-LoRA's parts below the engine loop: the slot table's rules, the step's `LoraRows`,
the per-adapter stats and their Prometheus series (`serving/lora_metrics.py`)."""

from __future__ import annotations

import numpy as np
from prometheus_client import CollectorRegistry
from test_lora_engine import PROMPT, adapter, greedy, lora_engine, oracle

from jaxserve.engine.batch import BatchShape, build_batch, empty_batch
from jaxserve.engine.limits import EngineStats
from jaxserve.engine.lora_request import LoraBinding, LoRARequest
from jaxserve.engine.lora_slots import LoraSlots
from jaxserve.engine.lora_stats import LoraStats
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.engine.scheduled import ScheduledSeq, SchedulerOutput
from jaxserve.engine.sequence import Sequence
from jaxserve.serving.metrics import EngineMetrics


def seq(binding: LoraBinding | None, n: int = 4) -> Sequence:
    s = Sequence("r", list(range(1, n + 1)), SamplingParams(), (2,), 0.0, lora=binding)
    s.pages = [1, 2]
    return s


def binding(i: int) -> LoraBinding:
    return LoraBinding(LoRARequest(f"a{i}", i, f"/p/{i}"), i)


def test_slots_pin_hold_and_reuse_least_recently_used() -> None:
    slots = LoraSlots(2)
    a, b, c = (seq(binding(i)) for i in (1, 2, 3))
    assert slots.acquire(a) == (1, True) and slots.acquire(b) == (2, True)
    assert not slots.can_acquire(c.lora)  # both pinned
    a2 = seq(a.lora)
    assert slots.acquire(a2) == (1, False)  # same adapter: its slot, no load
    out = SchedulerOutput([ScheduledSeq(a, 0, 4, True), ScheduledSeq(b, 0, 4, True)], 8, [])
    out.lora_loads, out.lora_slots = slots.take_step(out.seqs)
    assert [(s, x.load_id) for s, x in out.lora_loads] == [(1, 1), (2, 2)]
    assert [s.lora_slot for s in out.seqs] == [1, 2]
    for r in (b, a, a2):  # b goes idle first, then slot 1
        slots.release(r)
    assert not slots.can_acquire(c.lora)  # idle, but the step in flight still reads them
    slots.step_done(out)
    slots.step_done(out)  # (idempotent)
    assert slots.acquire(c) == (2, True)  # the least recently used idle slot: b's
    assert slots.slot_of(2) == 0 and slots.slot_of(1) == 1 and slots.slot_of(3) == 2
    # A pending load whose rows all left the step stays pending: the next step carries it.
    loads, used = slots.take_step([])
    assert loads == [] and used == ()
    loads, used = slots.take_step([ScheduledSeq(c, 0, 4, True)])
    assert [(s, x.load_id) for s, x in loads] == [(2, 3)] and used == (2,)
    # Forgotten (unloaded) while pinned: emptied once unpinned and unheld.
    gone = []
    slots.on_unbind = gone.append
    slots.forget(3)
    slots.release(c)
    assert slots.binding(2) is not None
    slots.step_done(SchedulerOutput([], 0, [], lora_slots=used))
    assert slots.binding(2) is None and gone == [3]


def test_lora_rows_give_each_token_its_row_slot() -> None:
    shape = BatchShape(buckets=((16, 4),), page_size=4, max_pages_per_seq=4, vocab_size=64,
                       history_len=8)
    rows = [ScheduledSeq(seq(None, 3), 0, 3, True, lora_slot=0),
            ScheduledSeq(seq(binding(1), 5), 0, 5, True, lora_slot=2),
            ScheduledSeq(seq(binding(2), 2), 0, 2, True, lora_slot=1)]
    batch = build_batch(SchedulerOutput(rows, 10, []), shape)
    assert batch.lora.token_slots.tolist() == [0] * 3 + [2] * 5 + [1] * 2 + [0] * 6
    assert batch.lora.token_slots.dtype == np.int32
    assert empty_batch(shape, 16, 4, False).lora.token_slots.tolist() == [0] * 16


def test_stats_and_metrics_per_adapter() -> None:
    engine = lora_engine(max_loras=1)
    engine.add_request("a", PROMPT, greedy(6), lora_request=adapter(1))
    engine.add_request("a2", PROMPT, greedy(6, n=2), lora_request=adapter(1))
    engine.add_request("b", PROMPT, greedy(3), lora_request=adapter(2))
    engine.add_request("base", PROMPT, greedy(3))
    registry = CollectorRegistry()
    metrics = EngineMetrics("m", 64, registry=registry)
    outputs = engine.step()
    st = engine.stats().lora
    assert (st.max_lora, st.running, st.waiting) == (1, ("ad1",), ("ad2",))
    metrics.on_step(engine.stats(), outputs, True)

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value("jaxserve:" + name, {"model_name": "m", **labels})

    info = dict(running_lora_adapters="ad1", waiting_lora_adapters="ad2", max_lora="1")
    assert value("lora_requests_info", **info) > 1e9  # the update time (epoch seconds)
    while engine.has_unfinished():
        outputs = engine.step()
        metrics.on_step(engine.stats(), outputs, True)
    st = engine.stats().lora
    assert (st.running, st.waiting) == ((), ())
    assert st.requests == (("ad1", 2), ("ad2", 1))
    assert st.generation_tokens == (("ad1", 18), ("ad2", 3))
    assert value("lora_requests_info", **info) is None  # replaced by the current label set
    assert value("lora_requests_info", running_lora_adapters="", waiting_lora_adapters="",
                 max_lora="1") is not None
    assert value("lora_requests_total", lora_name="ad1") == 2
    assert value("lora_generation_tokens_total", lora_name="ad1") == 18
    assert value("lora_generation_tokens_total", lora_name="ad2") == 3
    assert oracle(PROMPT, 3, 13)  # (the outputs themselves: test_lora_engine.py)
    # Data-parallel replicas add up by adapter name.
    total = EngineStats.total([engine.stats(), engine.stats()]).lora
    assert total == LoraStats(1, (), (), (("ad1", 4), ("ad2", 2)), (("ad1", 36), ("ad2", 6)))


def test_no_lora_families_without_lora() -> None:
    engine = lora_engine(lora=False)
    engine.add_request("base", PROMPT, greedy(2))
    registry = CollectorRegistry()
    metrics = EngineMetrics("m", 64, registry=registry)
    while engine.has_unfinished():
        outputs = engine.step()
        metrics.on_step(engine.stats(), outputs, True)
    assert not [m for m in registry.collect() if "lora" in m.name]


def test_the_fault_injecting_wrapper_forwards_loads() -> None:
    from support.engine_fixtures import VOCAB

    from jaxserve.engine.fake_runner import ArithmeticRunner, FakeLora
    from jaxserve.engine.fault_injection import FaultInjectingRunner, InjectedFault

    inner = ArithmeticRunner(VOCAB)
    FaultInjectingRunner(inner, InjectedFault(97)).load_lora(1, FakeLora(3))
    assert inner.loras == {1: FakeLora(3)}
