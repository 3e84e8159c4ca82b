"""The SLO-driven token budget on the arithmetic fake runner with a known step-time law
(`support.slo_sim`: simulated device and clock, so every figure is exact and the test is
deterministic).

Workload: short chats, then long prompts arriving while chats go on. The oracle is the law
itself and the targets: with `itl_slo` / `ttft_slo` every inter-token gap and every first
token meets them, while a static whole budget (2048-style: one big prefill step) breaks the
ITL target and a static small decode budget starves the long prompts' TTFT. The fit is
checked against the law's coefficients, the steps against the compiled buckets, and the
budget choice against a hand computation on a seeded model.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from support.arithmetic_workload import arithmetic
from support.engine_fixtures import VOCAB
from support.slo_sim import (Arrival, SimClock, StepLaw, phased_arrivals, run_workload,
                             timed_engine)

from jaxserve.config import SchedulerConfig, SloTargets, SpeculativeConfig
from jaxserve.engine.errors import SloUnattainable
from jaxserve.engine.fake_runner import arithmetic_next_token
from jaxserve.engine.sequence import Sequence
from jaxserve.engine.slo_policy import SloPolicy
from jaxserve.engine.step_time_model import StepFeatures, StepTimeModel
from jaxserve import SamplingParams

LAW = StepLaw(base=0.010, per_token=0.001, per_row=0.0005, per_key=20e-9)
ITL, TTFT = 0.1, 2.0
SPLIT = 30.0  # simulated seconds of chats before the long prompts start


def _arrivals() -> list[Arrival]:
    chats = phased_arrivals(1, [(SPLIT, 2.0, (32, 96), 64), (SPLIT, 0.5, (500, 900), 24)])
    later_chats = phased_arrivals(2, [(SPLIT, 1.0, (32, 96), 64)])
    return chats + [Arrival(SPLIT + a.at / 2, a.prompt, a.max_tokens) for a in later_chats]


def _run(**cfg: object):
    clock = SimClock()
    engine, runner = timed_engine(clock, LAW, **cfg)
    return engine, runner, run_workload(engine, clock, _arrivals())


def _good(seq) -> bool:  # noqa: ANN001 - a finished Sequence
    gaps = seq.metrics.inter_token_latencies
    return seq.metrics.ttft <= TTFT and (not gaps or np.percentile(gaps, 99) <= ITL)


@pytest.fixture(scope="module")
def runs() -> dict:
    return {"adaptive": _run(itl_slo=ITL, ttft_slo=TTFT),
            "large": _run(decode_token_budget=None),
            "small": _run(decode_token_budget=16)}


def test_adaptive_budget_meets_both_targets_where_static_budgets_fail(runs: dict) -> None:
    _, _, adaptive = runs["adaptive"]
    gaps = np.concatenate([s.metrics.inter_token_latencies for s in adaptive])
    assert gaps.max() <= ITL, f"a stream waited {gaps.max() * 1e3:.1f} ms for a token"
    assert max(s.metrics.ttft for s in adaptive) <= TTFT
    _, _, large = runs["large"]
    assert max(max(s.metrics.inter_token_latencies) for s in large) > 4 * ITL  # a big prefill
    _, _, small = runs["small"]
    late = [s.metrics.ttft for s in small if s.metrics.arrival_time >= SPLIT]
    assert np.percentile(late, 90) > TTFT  # prefill starved by the small decode budget
    # Goodput: at least the better static setting's in each phase, more over the whole run.
    for phase in (lambda s: s.metrics.arrival_time < SPLIT,
                  lambda s: s.metrics.arrival_time >= SPLIT):
        good = {name: sum(_good(s) for s in run[2] if phase(s)) for name, run in runs.items()}
        assert good["adaptive"] >= max(good["large"], good["small"]), good
    total = {name: sum(map(_good, run[2])) for name, run in runs.items()}
    assert total["adaptive"] > max(total["large"], total["small"]), total


def test_step_time_fit_converges_to_the_law(runs: dict) -> None:
    engine, _, _ = runs["adaptive"]
    model = engine.scheduler.budget.model
    want = (LAW.base, LAW.per_token, LAW.per_row)
    np.testing.assert_allclose(model.coefficients[:3], want, rtol=0.01)
    # The run ends on chats with short contexts: the recent (weighted) steps read few keys,
    # so that term is pinned less tightly (what is left of the ridge's pull toward 0); the
    # prediction of a long prompt's chunk, where it matters, is still within 1%.
    assert model.coefficients[3] == pytest.approx(LAW.per_key, rel=0.25)
    chunk = StepFeatures(256, 16, 256 * 600 + 256 * 257 // 2)
    assert model.predict(chunk) == pytest.approx(LAW.seconds(256, 16, chunk.attention_keys),
                                                 rel=0.01)
    assert model.relative_error < 1e-3
    slo = engine.stats().slo
    assert slo.predicted_step_s == pytest.approx(slo.measured_step_s, rel=1e-3)


def test_no_step_exceeds_a_compiled_bucket(runs: dict) -> None:
    engine, runner, _ = runs["adaptive"]
    compiled = {t for t, _ in engine.plan.batch_shape.buckets}
    assert set(runner.step_buckets) <= compiled
    assert max(runner.step_tokens) <= engine.plan.scheduler.max_num_batched_tokens
    # The budget moved with the load (the policy is not a constant in disguise).
    assert len({b for b in runner.step_buckets if b > 16}) > 3


def test_attainment_is_counted_per_priority(runs: dict) -> None:
    engine, _, seqs = runs["adaptive"]
    ((level, ttft_met, ttft_missed, itl_met, itl_missed, unattainable),) = \
        engine.stats().slo.by_priority
    assert (level, ttft_met, ttft_missed, unattainable) == (0, len(seqs), 0, 0)
    assert itl_met + itl_missed == sum(1 for s in seqs if s.metrics.inter_token_latencies)
    assert itl_missed == 0


def test_reject_refuses_what_the_forecast_says_will_miss_ttft() -> None:
    """A tight TTFT target under the long prompts: with reject, requests whose forecast
    passes it are refused with the predicted wait (the others mostly meet it); with queue,
    the same requests run and are counted as unattainable."""
    tight = 0.6
    engine, _, seqs = _run(itl_slo=ITL, ttft_slo=tight, slo_admission="reject")
    refused = [s for s in seqs if isinstance(s, SloUnattainable)]
    ran = [s for s in seqs if not isinstance(s, Exception)]
    assert refused and ran
    assert all(e.predicted_s > tight and e.target_s == tight for e in refused)
    met = sum(s.metrics.ttft <= tight for s in ran) / len(ran)
    engine_q, _, queued = _run(itl_slo=ITL, ttft_slo=tight)
    assert all(not isinstance(s, Exception) for s in queued)
    met_q = sum(s.metrics.ttft <= tight for s in queued) / len(queued)
    assert met > met_q
    (row,) = engine_q.stats().slo.by_priority
    assert row[5] >= len(refused) // 2 > 0  # counted, not refused


# ------------------------------------------------------------------- the decision by hand
def _seeded_policy(buckets: list[tuple[int, int]]) -> SloPolicy:
    model = StepTimeModel()
    rng = np.random.default_rng(0)
    model.seed([(f, LAW.seconds(f.tokens, f.rows, f.attention_keys)) for f in
                (StepFeatures(int(t), int(s), int(k)) for t, s, k in
                 zip(rng.integers(1, 512, 40), rng.integers(1, 16, 40),
                     rng.integers(0, 10**6, 40)))])
    return SloPolicy(buckets, lambda: 0.0, model)


def _decoding(priority: int, context: int, proposals: int = 0) -> Sequence:
    seq = Sequence("r", list(range(3, 3 + context)), SamplingParams(max_tokens=100), (2,),
                   0.0, priority=priority)
    seq.append_token(5)  # two tokens out: an established stream
    seq.append_token(6)
    seq.num_computed_tokens = seq.num_scheduled_tokens = seq.num_tokens - 1
    seq.spec_token_ids = [7] * proposals
    return seq


@pytest.mark.parametrize("proposals", [0, 3])
def test_budget_is_the_largest_bucket_within_the_strictest_itl(proposals: int) -> None:
    buckets = [(t, min(t, 16)) for t in (8, 16, 32, 48, 64, 96, 128, 192, 256, 512)]
    policy = _seeded_policy(buckets)
    cfg = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512, max_model_len=4096,
                          itl_slo=SloTargets.parse("0=0.06,1=0.2"))
    decodes = [_decoding(1, 300, proposals) for _ in range(4)]
    prompt = Sequence("p", list(range(3, 1003)), SamplingParams(max_tokens=4), (2,), 0.0)
    waiting = [(0, 0, prompt)]

    def by_hand(itl: float, decs: list[Sequence]) -> int:
        """The largest bucket whose step (the decodes, each 1 + its proposals at its context,
        plus the waiting prompt's first chunk filling the rest) the law keeps within `itl`."""
        dec_tokens = sum(1 + len(d.spec_token_ids) for d in decs)
        dec_keys = sum(p + 1 for d in decs for p in range(
            d.num_scheduled_tokens, d.num_scheduled_tokens + 1 + len(d.spec_token_ids)))
        best = dec_tokens
        for t, _ in buckets:
            if t <= dec_tokens:
                continue
            chunk = t - dec_tokens
            rows = min(dec_tokens + 1, 16)  # each token a sampler row, the chunk one more
            s_bucket = next(b for a, b in buckets if a >= t and b >= rows)
            if LAW.seconds(t, s_bucket, dec_keys + chunk * (chunk + 1) // 2) <= itl:
                best = t
        return best

    todo = [(d, 1) for d in decodes]
    assert policy.plan(cfg, todo, waiting) == by_hand(0.2, decodes)  # priority 1 only
    strict = _decoding(0, 300, proposals)
    got = policy.plan(cfg, todo + [(strict, 1)], waiting)
    assert got == by_hand(0.06, decodes + [strict]) < by_hand(0.2, decodes)


def test_without_targets_the_budget_is_the_static_one() -> None:
    policy = _seeded_policy([(t, min(t, 16)) for t in (16, 64, 256)])
    cfg = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256,
                          decode_token_budget=64)
    dec = _decoding(0, 100)
    assert policy.plan(cfg, [(dec, 1)], []) == 64 == cfg.step_budget(True)
    assert policy.plan(cfg, [], []) == 256


def test_predicted_ttft_is_inf_when_decodes_leave_no_prefill_room() -> None:
    policy = _seeded_policy([(t, min(t, 16)) for t in (16, 64, 256)])
    cfg = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256,
                          itl_slo=SloTargets.parse(0.001))  # below even one decode's step
    decodes = [(_decoding(0, 100), 1) for _ in range(3)]
    assert policy.plan(cfg, decodes, []) == 3
    assert policy.stats().itl_overloads == 1
    assert math.isinf(policy.predict_ttft(10, 0, [], []))


def test_admission_stops_where_one_more_stream_would_break_itl() -> None:
    """16 chats at once, an ITL target that 16 decoding streams cannot meet (the law: 10 ms
    + 1 ms a token + 0.5 ms a row): the policy runs as many as meet it, the rest wait their
    turn, and no gap passes the target."""
    clock = SimClock()
    engine, runner = timed_engine(clock, LAW, itl_slo=0.03)
    engine.calibrate_step_time()  # as serving's warmup does: the first admissions need it
    rng = np.random.default_rng(3)
    arrivals = [Arrival(0.0, rng.integers(3, 200, 40).tolist(), 32) for _ in range(16)]
    seqs = run_workload(engine, clock, arrivals)
    gaps = np.concatenate([s.metrics.inter_token_latencies for s in seqs])
    assert gaps.max() <= 0.03
    most = max(n for n in runner.step_tokens)  # decode steps: one token a stream
    assert 1 < min(t for t in runner.step_tokens if t > 1) and most < 16 * 40
    late = [s for s in seqs if s.metrics.first_scheduled_time > 0.0]
    assert late, "every stream was admitted at once: the ITL gate did nothing"


def test_a_ttft_target_alone_raises_the_static_budget_when_the_queue_needs_it(runs: dict
                                                                               ) -> None:
    """No ITL target: the static budget (a small decode budget here) is kept while the queue
    meets its deadlines and raised to the prefill rate the earliest deadline needs."""
    _, runner, seqs = _run(decode_token_budget=16, ttft_slo=TTFT)
    late = [s.metrics.ttft for s in seqs if s.metrics.arrival_time >= SPLIT]
    assert max(late) <= TTFT
    _, small_runner, small = runs["small"]
    assert np.percentile([s.metrics.ttft for s in small if s.metrics.arrival_time >= SPLIT],
                         90) > TTFT
    # Raised only where needed: most steps still carry at most the static budget's 16 tokens.
    assert np.median(runner.step_tokens) <= 16
    assert max(runner.step_tokens) > 16 + 16


class _RightProposer:
    """Proposes the arithmetic continuation (always accepted): k + 1 tokens a verification."""

    def __init__(self, k: int):
        self.k = k

    def propose(self, sequences):  # noqa: ANN001, ANN201 - the Proposer protocol
        out = []
        for tokens in sequences:
            seq = list(tokens)
            for _ in range(self.k):
                seq.append(arithmetic_next_token(seq[-1], len(seq) - 1, VOCAB))
            out.append(seq[len(tokens):])
        return out


def test_speculating_rows_are_budgeted_and_modelled() -> None:
    """Verification rows (1 + k tokens, as many sampler rows) count in the step's budget and
    the model's features: with every proposal accepted, 8 streams arriving together, and an
    ITL target that 8 verifications of 1 + 3 tokens would miss, fewer run at once (the
    admission gate counts a row as 1 + its proposals), every gap meets the target, no
    proposal is cut by a budget that forgot them, the model predicts the verification steps
    exactly, and the tokens are the arithmetic rollout's."""
    k = 3
    spec = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": k,
                                        "disable_by_batch_size": 9})  # all 8 may speculate
    clock = SimClock()
    engine, runner = timed_engine(clock, LAW, _RightProposer(k), speculative_config=spec,
                                  itl_slo=0.05)
    engine.calibrate_step_time()
    rng = np.random.default_rng(5)  # 8 at once: 8 x (1 + 3) tokens would take 58 ms a step
    arrivals = [Arrival(0.0, rng.integers(3, VOCAB, int(n)).tolist(), 40)
                for n in rng.integers(40, 100, 8)]
    seqs = run_workload(engine, clock, arrivals)
    for a, s in zip(arrivals, seqs):
        assert s.output_token_ids == arithmetic(a.prompt, 40)
    stats = engine.stats()
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens > 0
    # The budget made room for every proposal: drafts of fewer than k are only each
    # sequence's last (cut by max_tokens), not cut by a budget that forgot them.
    assert len(stats.spec_acceptance_counts) == k + 1
    assert sum(stats.spec_acceptance_counts[:k]) <= len(seqs)
    gaps = np.concatenate([s.metrics.inter_token_latencies for s in seqs])
    assert gaps.max() <= 0.05
    assert engine.scheduler.budget.model.relative_error < 0.01  # 22 steps from the seed
