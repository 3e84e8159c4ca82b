"""A simulated device with a known step-time law, on a simulated clock: the SLO policy's test
bench.

`TimedRunner` is the arithmetic fake runner whose steps take `StepLaw` seconds of a
`SimClock` (the engine's clock too): a step starts when it is dispatched or when the step
before it ends, whichever is later, and `collect` moves the clock to its end, so the gaps the
engine measures, the TTFT and ITL its sequences record, and the law are one and the same
time. Host work takes no simulated time. `run_workload` drives an engine through requests
arriving at given simulated times (idle spells skipped) and returns every finished sequence.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from support.engine_fixtures import VOCAB, tiny_model_config, tiny_tokenizer

from jaxserve import SamplingParams
from jaxserve.config import EngineConfig
from jaxserve.engine.engine import Engine
from jaxserve.engine.fake_runner import ArithmeticRunner, FakePending
from jaxserve.engine.sizing import plan_engine
from jaxserve.engine.speculation import OnTokens


class SimClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclasses.dataclass(frozen=True)
class StepLaw:
    """Seconds of a step: base + per padded token + per padded sampler row + per key read."""

    base: float = 0.004
    per_token: float = 0.0004
    per_row: float = 0.0002
    per_key: float = 50e-9

    def seconds(self, tokens: int, rows: int, keys: int) -> float:
        return self.base + self.per_token * tokens + self.per_row * rows + self.per_key * keys


def step_keys(batch) -> int:  # noqa: ANN001 - a StepBatch
    """Key reads of a batch's live queries: position p reads p + 1 keys."""
    f = batch.forward
    live = int(f.cu_q_lens[int(f.num_seqs[0])])
    return int((f.positions[:live].astype(np.int64) + 1).sum())


class TimedRunner(ArithmeticRunner):
    def __init__(self, clock: SimClock, law: StepLaw):
        super().__init__(VOCAB)
        self.clock = clock
        self.law = law
        self._ends = -1.0
        self.step_tokens: list[int] = []  # live tokens of each dispatched step
        self.step_buckets: list[int] = []  # its padded token bucket

    def dispatch(self, batch, late_mask=None):  # noqa: ANN001, ANN201 - the Runner protocol
        pending = super().dispatch(batch, late_mask)
        f = batch.forward
        tokens = len(f.token_ids)
        self.step_tokens.append(int(f.cu_q_lens[int(f.num_seqs[0])]))
        self.step_buckets.append(tokens)
        start = max(self.clock(), self._ends)
        self._ends = start + self.law.seconds(tokens, batch.num_seqs_bucket, step_keys(batch))
        return FakePending(pending.result, self._ends)

    def collect(self, pending: FakePending):  # noqa: ANN201
        self.clock.now = max(self.clock.now, pending.ready_at)
        return pending.result


@dataclasses.dataclass(frozen=True)
class Arrival:
    at: float  # simulated seconds
    prompt: list[int]
    max_tokens: int
    priority: int = 0


def timed_engine(clock: SimClock, law: StepLaw, proposer: object = None, **cfg: object
                 ) -> tuple[Engine, TimedRunner]:
    """`proposer`: a speculative proposer over token lists (`speculation.OnTokens` wraps it;
    give `speculative_config` too)."""
    base = dict(max_num_seqs=16, max_num_batched_tokens=512, page_size=16, max_model_len=1024,
                attention_impl="reference")
    base.update(cfg)
    config = EngineConfig(**base)  # type: ignore[arg-type]
    plan = plan_engine(config, tiny_model_config(max_position_embeddings=2048), 4, 1 << 30)
    runner = TimedRunner(clock, law)
    return Engine(config, plan, runner, tiny_tokenizer(), (-1,), clock=clock,
                  proposer=None if proposer is None else OnTokens(proposer)), runner


def phased_arrivals(seed: int, phases: list[tuple[float, float, tuple[int, int], int]]
                    ) -> list[Arrival]:
    """Poisson arrivals: each phase (seconds, rate per second, (min, max) prompt tokens,
    max_tokens), one after the other."""
    rng = np.random.default_rng(seed)
    out, t0 = [], 0.0
    for duration, rate, (lo, hi), max_tokens in phases:
        t = t0 + rng.exponential(1 / rate)
        while t < t0 + duration:
            n = int(rng.integers(lo, hi + 1))
            out.append(Arrival(t, rng.integers(3, VOCAB, n).tolist(), max_tokens))
            t += rng.exponential(1 / rate)
        t0 += duration
    return out


def run_workload(engine: Engine, clock: SimClock, arrivals: list[Arrival],
                 max_steps: int = 200_000) -> list:
    """Every request to completion; returns the finished sequences (with their metrics),
    in arrival order. Asserts no KV page leaked."""
    pending = sorted(arrivals, key=lambda a: a.at)
    seqs = {}
    i = steps = 0
    while i < len(pending) or engine.has_unfinished():
        if not engine.has_unfinished() and i < len(pending):
            clock.now = max(clock.now, pending[i].at)  # idle: skip to the next arrival
        while i < len(pending) and pending[i].at <= clock.now:
            a = pending[i]
            rid = f"r{i}"
            try:
                engine.add_request(rid, a.prompt, SamplingParams(max_tokens=a.max_tokens,
                                                                 ignore_eos=True),
                                   priority=a.priority, arrival_time=a.at)
                seqs[rid] = engine._groups[rid].seqs[0]
            except Exception as e:  # noqa: BLE001 - a refusal is part of the outcome
                seqs[rid] = e
            i += 1
        engine.step()
        steps += 1
        assert steps < max_steps, "the engine made no progress"
    alloc = engine.scheduler.allocator
    assert alloc.num_free_pages == alloc.num_usable_pages, "KV pages leaked"
    return [seqs[f"r{j}"] for j in range(len(pending))]
