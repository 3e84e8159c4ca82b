"""SLO targets through the offline API (`LLM`), on the tiny model: the build seeds the
step-time model at warmup (`Engine.calibrate_step_time`), the steps' budgets follow the
targets, and the tokens are what they would be under any budget (the oracle: the
full-sequence greedy rollout). `slo_admission="reject"` is refused by name offline."""

from __future__ import annotations

import itertools

import pytest
from support.engine_fixtures import rollout, tiny_engine, tiny_model

from jaxserve import LLM, SamplingParams


def test_llm_with_targets_serves_the_rollout_and_fits_its_model() -> None:
    llm = LLM.__new__(LLM)  # LLM() loads a checkpoint; the facade's own code is what is used
    # Two buckets: fewer compiles; the budget still has a choice to make.
    llm.engine = tiny_engine(itl_slo=0.5, ttft_slo="5,0=2", token_buckets=(16, 64))
    llm.config, llm._ids = llm.engine.config, itertools.count()
    model = llm.engine.scheduler.budget.model
    assert model.fitted and model.num_observations == 0  # seeded by warmup's calibration
    prompts = [[3 + i + j for j in range(5 + 3 * i)] for i in range(5)]  # one rollout shape
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0,
                                                ignore_eos=True), use_tqdm=False)
    m = tiny_model()
    assert [o.outputs[0].token_ids for o in outs] == [rollout(m, p, 6) for p in prompts]
    stats = llm.engine.stats()
    assert model.num_observations == stats.num_steps > 0
    assert stats.slo.measured_step_s > 0 and stats.slo.last_budget > 0
    assert stats.slo.by_priority[0][0] == 0  # judged at level 0 (its TTFT target is 2 s)
    # Live changes between generate calls, as the admin endpoint makes them.
    got = llm.update_scheduler(max_num_seqs=2, itl_slo="0=0.25")
    assert got["max_num_seqs"] == 2 and got["itl_slo"] == {"0": 0.25}
    assert llm.scheduler_settings() == got
    steps = llm.engine.stats().num_steps
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0,
                                                ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [rollout(m, p, 6) for p in prompts]
    assert llm.engine.stats().num_steps - steps >= 3 * 6  # two at a time: more steps
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        llm.update_scheduler(max_num_batched_tokens=4096)
    with pytest.raises(ValueError, match="slo_admission='reject'"):
        llm.update_scheduler(slo_admission="reject")
    assert llm.scheduler_settings() == got
    llm.close()


def test_reject_is_refused_offline() -> None:
    with pytest.raises(ValueError, match="slo_admission='reject' refuses requests as they "
                                         "arrive at a server"):
        LLM(ttft_slo=1.0, slo_admission="reject")
