"""Speculative decoding with a draft model (method draft_model), built end to end by
`build_engine` from a checkpoint directory.

Oracles: the plain full-sequence greedy rollout (`rollout`): greedy with speculation must
emit exactly it, whatever the draft proposes; a draft equal to the target proposes the
target's own argmaxes, so every proposal is accepted (draft tokens == accepted tokens); a
draft with other weights is mostly wrong, so rejections happen and must not change the
output. The drafter's host bookkeeping runs against a recording fake drafter whose rows are
checked against what the rule says (catch-up from the first unverified position, split over
rounds by the token budget, restarted after preemption). Every run checks that no KV page
leaked and nothing compiled after warmup.
"""

from __future__ import annotations

import dataclasses
import pathlib

import numpy as np
import pytest
from support.engine_fixtures import (FEW_TOKEN_BUCKETS, VOCAB, rollout, run_checked,
                                     tiny_engine, tiny_model)
from support.tiers import slow

from jaxserve import SamplingParams
from jaxserve.config import EngineConfig, SpeculativeConfig
from jaxserve.engine.engine import Engine
from jaxserve.engine.sequence import Sequence, SequenceStatus
from jaxserve.engine.sizing import plan_engine
from jaxserve.models import tiny
from jaxserve.models.hf_loader import save_hf_dir
from jaxserve.serving.build import build_engine
from jaxserve.serving.draft_proposer import DraftModelEngineProposer

K = 3
# Chunked prefill (64-token steps), pages of 4, prefix caching on; every running sequence may
# speculate (disable_by_batch_size 17).
SHARED = dict(max_num_seqs=16, max_num_batched_tokens=64, page_size=4, max_model_len=96,
              token_buckets=FEW_TOKEN_BUCKETS, enable_prefix_caching=True)


def save(d: pathlib.Path, model) -> pathlib.Path:  # noqa: ANN001 - a LoadedModel
    save_hf_dir(d, model.config, model.params)
    tiny.save_word_tokenizer(d, model.config.vocab_size)
    return d


def draft_spec(path: pathlib.Path, k: int = K) -> SpeculativeConfig:
    return SpeculativeConfig.from_dict({"method": "draft_model", "model": str(path),
                                        "num_speculative_tokens": k,
                                        "disable_by_batch_size": 17})


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("drafts")
    return {"same": save(root / "same", tiny_model()),
            "other": save(root / "other", tiny_model(seed=1)),
            "vocab": save(root / "vocab", tiny_model(vocab_size=VOCAB + 5))}


@pytest.fixture(scope="module")
def same(dirs: dict[str, pathlib.Path]) -> Engine:
    return tiny_engine(speculative_config=draft_spec(dirs["same"]), **SHARED)


@pytest.fixture(scope="module")
def other(dirs: dict[str, pathlib.Path]) -> Engine:
    return tiny_engine(speculative_config=draft_spec(dirs["other"]), **SHARED)


def prompts(n: int, length: int = 13) -> list[list[int]]:
    """`n` prompts; pairs share their first 8 tokens (prefix cache hits), lengths vary so
    some prefills are chunked over steps."""
    rng = np.random.default_rng(7)
    shared = rng.integers(3, VOCAB, 8).tolist()
    return [(shared if i % 2 else rng.integers(3, VOCAB, 8).tolist())
            + rng.integers(3, VOCAB, length + 3 * i).tolist() for i in range(n)]


def run(eng: Engine, ps: list[list[int]], max_tokens: int) -> dict[str, list[int]]:
    finals = run_checked(eng, ps, [SamplingParams(max_tokens=max_tokens, temperature=0.0)]
                         * len(ps))
    return {rid: list(out.outputs[0].token_ids) for rid, out in finals.items()}


def per_token(c) -> int:  # noqa: ANN001 - float32 KV bytes of one token, all layers
    return c.num_layers * 2 * c.num_kv_heads * c.head_dim * 4


def spec_counts(eng: Engine) -> tuple[int, int, tuple[int, ...]]:
    s = eng.stats()
    return s.spec_num_draft_tokens, s.spec_num_accepted_tokens, s.spec_acceptance_counts


def test_equal_draft_accepts_every_proposal_and_equals_rollout(same: Engine) -> None:
    before = spec_counts(same)
    ps = prompts(6)
    got = run(same, ps, 17)
    drafted, accepted, counts = (np.subtract(a, b) for a, b in zip(spec_counts(same), before))
    assert drafted > 0 and accepted == drafted, (drafted, accepted)
    assert counts[K] > 0 and counts[0] == 0
    proposer = same._core.speculator.proposer  # type: ignore[union-attr]
    proposer.propose([])  # finished sequences' state goes at the next round
    assert proposer.num_tracked == 0
    model = tiny_model()
    for i, p in enumerate(ps):
        assert got[f"r{i}"] == rollout(model, p, 17), i


def test_drafter_kv_follows_partial_acceptances(same: Engine) -> None:
    """Sampled requests (temperature 1) reject the equal draft's greedy proposals at random
    places, so the drafter's KV is reused as far as each round's chain was accepted and
    recomputed from there: each round's proposals must be the greedy rollout of the
    sequence's tokens at that moment (an error in that bookkeeping changes them)."""
    proposer = same._core.speculator.proposer  # type: ignore[union-attr]
    seen: list[tuple[list[int], list[int]]] = []
    inner = proposer.propose

    def recording(seqs):  # noqa: ANN001, ANN202
        out = inner(seqs)
        seen.extend((list(s.all_token_ids), p) for s, p in zip(seqs, out) if p)
        return out

    proposer.propose = recording
    before = spec_counts(same)
    try:
        compiles = same.runner.compiles_after_warmup
        for i, p in enumerate(prompts(4, 6)):
            same.add_request(f"s{i}", p, SamplingParams(max_tokens=14, temperature=1.0,
                                                        seed=i))
        while same.has_unfinished():
            same.step()
        assert same.runner.compiles_after_warmup == compiles
        drafted, accepted, _ = (np.subtract(a, b) for a, b in zip(spec_counts(same), before))
    finally:
        del proposer.propose
    model = tiny_model()
    assert len(seen) >= 8 and drafted > accepted, (len(seen), drafted, accepted)
    for tokens, props in seen:
        assert props == rollout(model, tokens, K), len(tokens)


def test_other_draft_rejections_keep_the_rollout(other: Engine) -> None:
    before = spec_counts(other)
    ps = prompts(5, 9)
    got = run(other, ps, 15)
    drafted, accepted, _ = (np.subtract(a, b) for a, b in zip(spec_counts(other), before))
    assert drafted > accepted >= 0
    model = tiny_model()
    for i, p in enumerate(ps):
        assert got[f"r{i}"] == rollout(model, p, 15), i


def test_abort_mid_speculation_leaks_no_page(other: Engine) -> None:
    before = spec_counts(other)[0]
    for i, p in enumerate(prompts(4)):
        other.add_request(f"a{i}", p, SamplingParams(max_tokens=40, temperature=0.0))
    while spec_counts(other)[0] == before:
        other.step()
    for i in range(4):
        other.abort(f"a{i}")
    while other.has_unfinished():
        other.step()
    alloc = other.scheduler.allocator
    assert alloc.num_free_pages == alloc.num_usable_pages


@slow(reason="two more engine builds (a small KV budget that preempts)")
def test_preemption_restarts_the_drafts_kv(dirs: dict[str, pathlib.Path]) -> None:
    page = 4 * 2 * per_token(tiny_model().config)  # target + draft (same shape) bytes
    eng = tiny_engine(speculative_config=draft_spec(dirs["same"]),
                      **(SHARED | dict(kv_cache_memory=30 * page)))
    ps = prompts(8, 12)
    got = run(eng, ps, 30)
    assert eng.stats().num_preemptions > 0
    drafted, accepted, _ = spec_counts(eng)  # the equal draft, restarted after preemption
    assert drafted > 0 and accepted == drafted, (drafted, accepted)
    model = tiny_model()
    for i, p in enumerate(ps):
        assert got[f"r{i}"] == rollout(model, p, 30), i


@pytest.mark.parametrize("k", [1, 5])
@slow(reason="another engine build per k (k=1: the chain is empty, the catch-up still "
      "writes; k=5: a longer chain); k=3 runs by default")
def test_other_k_equal_draft(dirs: dict[str, pathlib.Path], k: int) -> None:
    eng = tiny_engine(speculative_config=draft_spec(dirs["same"], k=k), **SHARED)
    ps = prompts(4, 10)
    got = run(eng, ps, 12)
    drafted, accepted, _ = spec_counts(eng)
    assert drafted > 0 and accepted == drafted, (drafted, accepted)
    model = tiny_model()
    for i, p in enumerate(ps):
        assert got[f"r{i}"] == rollout(model, p, 12), i


def test_refuses_a_bad_path_and_another_vocabulary(dirs: dict[str, pathlib.Path],
                                                    tmp_path: pathlib.Path) -> None:
    for path, match in [(tmp_path / "nothing", r"model=.*nothing.*does not load"),
                        (dirs["vocab"], r"model=.*vocab.*target .*: .*vocab_size=216 differs.*211")]:
        config = EngineConfig(speculative_config=draft_spec(path), max_model_len=64,
                              attention_impl="reference")
        with pytest.raises(ValueError, match=match):
            build_engine(config, tiny_model(), warmup=False, progress=False)
    split = dataclasses.replace(draft_spec(dirs["same"]), draft_tensor_parallel_size=2)
    with pytest.raises(ValueError, match="draft_tensor_parallel_size=2: the draft is not split"):
        EngineConfig(speculative_config=split, tensor_parallel_size=2)


def test_pages_cost_the_drafts_bytes_too() -> None:
    cfg = EngineConfig(max_model_len=64, page_size=4, kv_cache_memory=1 << 20)
    target, draft = tiny_model().config, tiny_model(num_layers=1).config
    alone = plan_engine(cfg, target, 4, 0)
    both = plan_engine(cfg, target, 4, 0, draft=draft)
    assert alone.kv_bytes_per_page == 4 * per_token(target)
    assert both.kv_bytes_per_page == 4 * (per_token(target) + per_token(draft))
    assert both.scheduler.num_pages - 1 == (1 << 20) // both.kv_bytes_per_page


# ------------------------------------------------------------- host bookkeeping (no device)
@dataclasses.dataclass
class FakeDrafter:
    """Records each round's DraftSeqs; proposes `answer(seq_index)`."""

    k: int
    buckets: tuple = ((8, 2),)
    rounds: list = dataclasses.field(default_factory=list)
    answer: object = None

    def pack(self, seqs):  # noqa: ANN001, ANN201
        return list(seqs)

    def propose(self, rnd):  # noqa: ANN001, ANN201
        self.rounds.append(rnd)
        return np.array([self.answer(i) for i in range(len(rnd))], np.int32)


def seq(tokens: list[int], seq_id: int) -> Sequence:
    s = Sequence("r", list(tokens), SamplingParams(max_tokens=50), (2,), 0.0)
    s.seq_id, s.status, s.pages = seq_id, SequenceStatus.RUNNING, list(range(1, 9))
    return s


def test_catch_up_split_by_budget_then_chain_reused_up_to_the_first_miss() -> None:
    fake = FakeDrafter(k=3, answer=lambda i: [50, 51, 52])
    prop = DraftModelEngineProposer(fake)  # type: ignore[arg-type]
    a, b = seq(list(range(10, 16)), 0), seq([20, 21], 1)
    # Round 1: a's 6 tokens take 6 of 8 rows, b gets 2: both caught up.
    assert prop.propose([a, b]) == [[50, 51, 52], [50, 51, 52]]
    assert [(r.start, list(r.token_ids)) for r in fake.rounds[-1]] == [(0, a.all_token_ids),
                                                                       (0, [20, 21])]
    # a accepted 50, 51 then got 7; b accepted nothing (got 9).
    for t in (50, 51, 7):
        a.append_token(t)
    b.append_token(9)
    prop.propose([a, b])
    # a: the chain wrote 50 at 6 and 51 at 7 (both accepted): catch-up starts at 8 (the 7);
    # b: 9 != 50, so from position 2.
    assert [(r.start, list(r.token_ids)) for r in fake.rounds[-1]] == [(8, [7]), (2, [9])]
    # Preempted (epoch moved): a starts over; 9 tokens > the budget of 8 -> split, and b
    # (not caught up on the budget left) gets no proposals either.
    a.epoch += 1
    b.append_token(50)
    assert prop.propose([a, b]) == [[], []]
    assert [(r.start, len(r.token_ids)) for r in fake.rounds[-1]] == [(0, 8)]
    assert prop.propose([a, b]) == [[50, 51, 52], [50, 51, 52]]
    assert [(r.start, len(r.token_ids)) for r in fake.rounds[-1]] == [(8, 1), (3, 1)]
    a.status = SequenceStatus.FINISHED
    prop.propose([b])
    assert prop.num_tracked == 1
