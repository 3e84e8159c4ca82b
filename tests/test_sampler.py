"""The device sampler against numpy implementations of each knob's definition."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.device import sampler

V = 64


def tensors(S: int, **kw: object) -> sampler.SamplingTensors:
    base = dict(
        temperature=np.ones(S, np.float32), top_k=np.full(S, V, np.int32),
        top_p=np.ones(S, np.float32), min_p=np.zeros(S, np.float32),
        rng_key=np.stack([np.zeros(S, np.uint32), np.arange(S, dtype=np.uint32)], 1),
        repetition_penalty=np.ones(S, np.float32), presence_penalty=np.zeros(S, np.float32),
        frequency_penalty=np.zeros(S, np.float32), history=np.zeros((S, 0), np.int32),
        history_is_output=np.zeros((S, 0), bool), logprobs=np.zeros(S, np.float32))
    base.update(kw)
    return sampler.SamplingTensors.of(**{k: jnp.asarray(v) for k, v in base.items()})


# ------------------------------------------------------------------ numpy definitions (oracle)
def np_allowed(logits: np.ndarray, temp: float, top_k: int, top_p: float, min_p: float) -> set:
    x = logits / (temp if temp > 0 else 1.0)
    allowed = set(range(len(x)))
    if 0 < top_k < len(x):  # -1 (or any k <= 0): whole vocabulary
        kth = np.sort(x)[::-1][top_k - 1]
        allowed &= {i for i in range(len(x)) if x[i] >= kth}
    if top_p < 1.0:
        p = np.exp(x - x.max())
        p /= p.sum()
        order = np.argsort(-x, kind="stable")
        mass, keep = 0.0, set()
        for i in order:  # smallest prefix of the sorted distribution reaching top_p
            keep.add(int(i))
            mass += p[i]
            if mass >= top_p:
                break
        cut = min(x[i] for i in keep)
        allowed &= {i for i in range(len(x)) if x[i] >= cut}
    if min_p > 0:
        p = np.exp(x - x.max())
        p /= p.sum()
        allowed &= {i for i in range(len(x)) if p[i] >= min_p * p.max()}
    return allowed


def np_penalised(logits: np.ndarray, prompt: list[int], output: list[int], rep: float,
                 presence: float, freq: float) -> np.ndarray:
    out = logits.copy()
    for t in set(prompt) | set(output):
        out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
    for t in set(output):
        out[t] -= freq * output.count(t) + presence
    return out


@pytest.mark.parametrize("seed", range(4))
def test_filters_match_numpy_definition(seed: int) -> None:
    rng = np.random.default_rng(seed)
    S = 6
    logits = rng.normal(0, 2, (S, V)).astype(np.float32)
    temp = rng.choice([0.5, 1.0, 1.7], S).astype(np.float32)
    top_k = rng.choice([-1, 1, 5, 17, V, V + 100, 2**30], S).astype(np.int32)
    top_p = rng.choice([0.3, 0.8, 0.95, 1.0], S).astype(np.float32)
    min_p = rng.choice([0.0, 0.05, 0.3], S).astype(np.float32)
    st = tensors(S, temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p)
    filtered = np.asarray(sampler.filter_logits(jnp.asarray(logits), st))
    for r in range(S):
        got = set(np.flatnonzero(np.isfinite(filtered[r])).tolist())
        assert got == np_allowed(logits[r], temp[r], top_k[r], top_p[r], min_p[r]), r
        kept = np.isfinite(filtered[r])
        np.testing.assert_allclose(filtered[r][kept], (logits[r] / temp[r])[kept], rtol=1e-6)


def test_penalties_match_numpy_definition() -> None:
    rng = np.random.default_rng(0)
    S, P = 3, 12
    logits = rng.normal(0, 2, (S, V)).astype(np.float32)
    prompts = [[1, 2, 3, 3], [5], [7, 8]]
    outputs = [[3, 9, 9, 9], [5, 5, 6], []]
    hist = np.full((S, P), -1, np.int32)
    is_out = np.zeros((S, P), bool)
    for r, (p, o) in enumerate(zip(prompts, outputs)):
        hist[r, : len(p) + len(o)] = p + o
        is_out[r, len(p): len(p) + len(o)] = True
    rep = np.array([1.3, 0.8, 2.0], np.float32)
    pres = np.array([0.5, -0.2, 1.0], np.float32)
    freq = np.array([0.25, 1.5, 0.0], np.float32)
    st = tensors(S, history=hist, history_is_output=is_out, repetition_penalty=rep,
                 presence_penalty=pres, frequency_penalty=freq)
    got = np.asarray(sampler.apply_penalties(jnp.asarray(logits), st))
    for r in range(S):
        want = np_penalised(logits[r], prompts[r], outputs[r], rep[r], pres[r], freq[r])
        np.testing.assert_allclose(got[r], want, rtol=1e-6, atol=1e-6)


def test_greedy_rows_take_argmax_and_samples_stay_in_allowed_set() -> None:
    rng = np.random.default_rng(1)
    S = 8
    logits = rng.normal(0, 1, (S, V)).astype(np.float32)
    temp = np.array([0, 1, 1, 1, 0, 2, 1, 1], np.float32)
    top_k = np.array([V, 3, V, V, V, 2, 1, V], np.int32)
    top_p = np.array([1, 1, 0.5, 1, 1, 1, 1, 1], np.float32)
    st = tensors(S, temperature=temp, top_k=top_k, top_p=top_p)
    for trial in range(20):
        keys = np.stack([np.full(S, trial, np.uint32), np.arange(S, dtype=np.uint32)], 1)
        out = sampler.sample(jnp.asarray(logits), st.replace(rng_key=jnp.asarray(keys)), False)
        toks = np.asarray(out.tokens)
        for r in range(S):
            if temp[r] == 0:
                assert toks[r] == np.argmax(logits[r])
            else:
                assert toks[r] in np_allowed(logits[r], temp[r], top_k[r], top_p[r], 0.0)


def test_sampling_frequencies_follow_the_distribution() -> None:
    rng = np.random.default_rng(2)
    logits = rng.normal(0, 1, (1, V)).astype(np.float32)
    N = 4000
    keys = np.stack([np.arange(N, dtype=np.uint32), np.full(N, 9, np.uint32)], 1)
    st = tensors(N, temperature=np.full(N, 0.7, np.float32), rng_key=keys)
    toks = np.asarray(sampler.sample(jnp.asarray(np.repeat(logits, N, 0)), st, False).tokens)
    p = np.exp(logits[0] / 0.7 - (logits[0] / 0.7).max())
    p /= p.sum()
    freq = np.bincount(toks, minlength=V) / N
    assert np.abs(freq - p).max() < 0.03


def test_same_key_same_token_regardless_of_batch_neighbours() -> None:
    rng = np.random.default_rng(3)
    row = rng.normal(0, 1, (1, V)).astype(np.float32)
    key = np.array([[123, 456]], np.uint32)
    alone = sampler.sample(jnp.asarray(row), tensors(1, rng_key=key), False).tokens[0]
    others = rng.normal(0, 1, (4, V)).astype(np.float32)
    batch = np.concatenate([others[:2], row, others[2:]])
    keys = np.array([[1, 2], [3, 4], [123, 456], [5, 6], [7, 8]], np.uint32)
    mixed = sampler.sample(jnp.asarray(batch), tensors(5, rng_key=keys), False).tokens[2]
    assert int(alone) == int(mixed)


def test_logprobs_are_raw_log_softmax() -> None:
    rng = np.random.default_rng(4)
    logits = rng.normal(0, 1, (2, V)).astype(np.float32)
    out = sampler.sample(jnp.asarray(logits), tensors(2, temperature=np.zeros(2, np.float32)),
                         False)
    ref = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), -1))
    np.testing.assert_allclose(np.asarray(out.logprob), ref[np.arange(2), np.asarray(out.tokens)],
                               rtol=1e-6)
    for r in range(2):
        order = np.argsort(-ref[r])[: sampler.MAX_LOGPROBS]
        np.testing.assert_array_equal(np.asarray(out.top_ids[r]), order)
