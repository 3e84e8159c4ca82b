"""SLO targets through the offline API (`LLM`) on the tiny model, set live on the shared
`small_llm` engine as `LLM.update_scheduler` (the admin endpoint's path) sets them and put
back after: the step-time model seeded by the warmup calibration (`Engine.
calibrate_step_time`, forced here: the shared engine was built without targets), the steps'
budgets follow the targets, and the tokens are what they would be under any budget (the
oracle: the full-sequence greedy rollout). `slo_admission="reject"` is refused by name
offline, at construction and live."""

from __future__ import annotations

import pytest
from support.engine_fixtures import rollout, tiny_model

from jaxserve import LLM, SamplingParams

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [[3 + i + j for j in range(5 + 3 * i)] for i in range(5)]  # one rollout shape


def test_llm_with_targets_serves_the_rollout_and_fits_its_model(small_llm: LLM) -> None:
    llm = small_llm
    before = llm.scheduler_settings()
    model = llm.engine.scheduler.budget.model
    try:
        got = llm.update_scheduler(itl_slo=0.5, ttft_slo="5,0=2")
        assert got["itl_slo"] == 0.5 and got["ttft_slo"] == {"default": 5.0, "0": 2.0}
        llm.engine.calibrate_step_time(force=True)
        assert model.fitted
        seen = model.num_observations
        steps = llm.engine.stats().num_steps
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        m = tiny_model()
        want = [rollout(m, p, 6) for p in PROMPTS]
        assert [o.outputs[0].token_ids for o in outs] == want
        stats = llm.engine.stats()
        assert model.num_observations - seen == stats.num_steps - steps > 0
        assert stats.slo.measured_step_s > 0 and stats.slo.last_budget > 0
        assert 0 in [row[0] for row in stats.slo.by_priority]  # judged at level 0
        # Fewer seats, live: more steps, the same tokens.
        llm.update_scheduler(max_num_seqs=2, itl_slo="0=0.25")
        steps = llm.engine.stats().num_steps
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
        assert llm.engine.stats().num_steps - steps >= 3 * 6
        with pytest.raises(ValueError, match="max_num_batched_tokens"):
            llm.update_scheduler(max_num_batched_tokens=4096)
        with pytest.raises(ValueError, match="slo_admission='reject'"):
            llm.update_scheduler(slo_admission="reject")
    finally:
        llm.update_scheduler(**before)
    assert llm.scheduler_settings() == before


def test_reject_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="slo_admission='reject' refuses requests as they "
                                         "arrive at a server"):
        LLM(ttft_slo=1.0, slo_admission="reject")
