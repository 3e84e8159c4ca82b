"""logit_bias end to end on a tiny random model: the offline API (`LLM`) against a greedy
full-sequence rollout whose logits get the same bias (the oracle), with biased and unbiased
requests sharing steps and alternating, and no compile after warmup (a step's bias arrays have
width 0 when no row is biased, else one static width; warmup compiles the sampler for both)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from support.engine_fixtures import tiny_model

from jaxserve import LLM, SamplingParams
from jaxserve.models import decoder

MODEL = tiny_model()
PROMPTS = [[5, 9, 11, 40], [7, 3, 100, 12, 60, 8], [150, 42]]


@functools.lru_cache(maxsize=None)
def biased_rollout(prompt: tuple[int, ...], n: int,
                   bias: tuple[tuple[int, float], ...] = ()) -> list[int]:
    """Oracle: greedy decoding with the plain full-sequence forward, `bias` added to each
    step's logits (numpy) before the argmax."""
    seq = list(prompt)
    add = np.zeros(MODEL.config.vocab_size, np.float32)
    for t, b in bias:
        add[t] += b
    T = 1 << (len(prompt) + n - 1).bit_length()
    for _ in range(n):
        tokens = np.zeros((1, T), np.int32)
        tokens[0, : len(seq)] = seq
        logits = decoder.forward_jit(MODEL.params, tokens, np.array([len(seq)], np.int32),
                                     cfg=MODEL.config)
        seq.append(int(np.argmax(np.asarray(logits[0, len(seq) - 1]) + add)))
    return seq[len(prompt):]


@pytest.fixture
def llm(small_llm: LLM) -> LLM:
    """conftest's session engine (SMALL_CONFIG) over MODEL."""
    return small_llm


def greedy(max_tokens: int = 6, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def test_bias_steers_greedy_generation_and_leaves_neighbours_alone(llm: LLM) -> None:
    plain = [biased_rollout(tuple(p), 6) for p in PROMPTS]
    forced = 123
    assert forced not in plain[0]
    down = {plain[1][0]: -100.0, 17: 2.5}  # the greedy first token made impossible
    params = [greedy(logit_bias={forced: 100.0}), greedy(logit_bias=down), greedy()]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)  # one batch: they share steps
    got = [o.outputs[0].token_ids for o in outs]
    assert got[0] == [forced] * 6
    assert got[1] == biased_rollout(tuple(PROMPTS[1]), 6, tuple(sorted(down.items())))
    assert got[1][0] != plain[1][0]
    assert got[2] == plain[2]  # an unbiased row (and the padding rows) unaffected
    # Logprobs are of the model's own distribution, as without a bias (OpenAI / vLLM).
    lp = llm.generate([PROMPTS[0]], greedy(1, logit_bias={forced: 100.0}, logprobs=0),
                      use_tqdm=False)[0].outputs[0].logprobs[0][forced]
    assert lp < np.log(0.5)


def test_alternating_biased_and_plain_requests_compile_nothing(llm: LLM) -> None:
    # The compile guard counts the whole process's compiles, the oracle's too: compare the
    # count around the engine's work only, and run the oracle after.
    before = llm.engine.stats().compiles_after_warmup
    runs = []
    for i in range(4):
        bias = {int(t): float(b) for t, b in zip(range(3 + i, 200, 7), np.linspace(-100, 100, 25))}
        params = greedy(4, logit_bias=bias) if i % 2 == 0 else greedy(4)
        out = llm.generate([PROMPTS[i % 3]], params, use_tqdm=False)[0].outputs[0].token_ids
        runs.append((i, out, tuple(sorted(bias.items())) if i % 2 == 0 else ()))
    # Temperature and penalties variants with a bias: still the warmed-up executables.
    llm.generate(PROMPTS, [SamplingParams(max_tokens=3, seed=1, logit_bias={9: 5.0}),
                           greedy(3, repetition_penalty=1.5, logit_bias={9: -5.0}),
                           greedy(3)], use_tqdm=False)
    assert llm.engine.stats().compiles_after_warmup == before
    for i, out, bias in runs:
        assert out == biased_rollout(tuple(PROMPTS[i % 3]), 4, bias), i


def test_warmup_adds_sampler_variants_not_forward_shapes(llm: LLM) -> None:
    """The bias and penalties variants are sampler shapes only: warmup runs each forward
    bucket's (tokens, seqs) and nothing else, and every seqs bucket with all four samplers;
    the prompt logprobs pass once per tokens bucket, apart from those."""
    runner = llm.engine.runner
    runs = runner.buckets()
    assert {(t, s) for t, s, _, _, _ in runs} == set(runner.shape.buckets)
    for seqs in {s for _, s in runner.shape.buckets}:
        variants = sorted((p, b) for _, s, p, b, lp in runs if s == seqs and (p or b))
        assert variants == [(False, True), (True, False), (True, True)]  # once each
        assert not any(lp for _, s, p, b, lp in runs if s == seqs and (p or b))
    scored = sorted(t for t, _, p, b, lp in runs if lp)
    assert scored == sorted({t for t, _ in runner.shape.buckets})
    assert not any(p or b for _, _, p, b, lp in runs if lp)
