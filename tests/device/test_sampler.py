"""The device sampler against numpy implementations of each knob's definition."""

from __future__ import annotations

import dataclasses
import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.numerics import F32_UNIT_ROUNDOFF, gamma, rounding_rtol, transcendental_bound

from jaxserve.device import sampler
from jaxserve.engine.batch import BIAS_PAD_ID

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
        # One division in numpy, a division or a reciprocal and a product in XLA: 3 roundings.
        np.testing.assert_allclose(filtered[r][kept], (logits[r] / temp[r])[kept],
                                   rtol=rounding_rtol("float32", 3))


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
        # Each side: the repetition scaling (a division, or a reciprocal and a product), the
        # presence and frequency terms (a product, two subtractions): <= 4 roundings of terms
        # no larger than mag; two sides, 8u mag.
        mag = (np.abs(logits[r]) * max(rep[r], 1 / rep[r]) + abs(pres[r])
               + abs(freq[r]) * (len(prompts[r]) + len(outputs[r])))
        assert np.all(np.abs(got[r] - want) <= 8 * F32_UNIT_ROUNDOFF * mag), r


def np_penalised_exact(logits: np.ndarray, history: np.ndarray, is_output: np.ndarray,
                       rep: np.ndarray, presence: np.ndarray, freq: np.ndarray) -> np.ndarray:
    """The penalties in float32, one rounding per operation in the sampler's order (the
    repetition division as the product with the row's reciprocal), from the history rows
    (-1 padded) counted with a Counter."""
    out = logits.copy()
    for r in range(len(logits)):
        ids = [int(t) for t in history[r] if t >= 0]
        counts = Counter(int(t) for t, o in zip(history[r], is_output[r]) if t >= 0 and o)
        inv = np.float32(1) / rep[r]
        for t in set(ids):
            x = logits[r, t]
            x = x * inv if x > 0 else x * rep[r]
            x = x - freq[r] * np.float32(counts[t])
            out[r, t] = x - presence[r] * np.float32(counts[t] > 0)
    return out


def test_penalties_equal_a_numpy_count_of_the_history_bit_for_bit() -> None:
    """Random histories with many repeats, -1 padding, prompt-only, output-only and empty
    rows, rows with and without penalties (a row without keeps its logits exactly), counts
    up to 8 so that frequency x count rounds: the shipped (jitted) penalties and the eager
    ones equal the numpy oracle bit for bit."""
    rng = np.random.default_rng(30)
    S, P, Vp = 16, 96, 1000
    logits = rng.normal(0, 3, (S, Vp)).astype(np.float32)
    logits[:, :8] = 0.0  # +0.0: neither divided nor multiplied into a different value
    hist = np.full((S, P), -1, np.int32)
    is_out = np.zeros((S, P), bool)
    for r in range(S):
        n_prompt, n_out = [(40, 30), (0, 50), (60, 0), (0, 0)][r % 4]
        n_prompt, n_out = rng.integers(0, n_prompt + 1), rng.integers(0, n_out + 1)
        pool = 12 if r % 3 else Vp  # a small pool: many repeats of each id
        hist[r, : n_prompt + n_out] = rng.integers(0, pool, n_prompt + n_out)
        is_out[r, n_prompt: n_prompt + n_out] = True
    rep = rng.uniform(0.5, 2.0, S).astype(np.float32)
    pres = rng.uniform(-2, 2, S).astype(np.float32)
    freq = rng.uniform(-2, 2, S).astype(np.float32)
    off = np.arange(S) % 5 == 4  # knobs at their padding values: no penalty
    rep[off], pres[off], freq[off] = 1.0, 0.0, 0.0
    rep[1], pres[2], freq[3] = 1.0, 0.0, 0.0  # one knob off, the others on
    assert np.any(is_out.sum(1) == 0) and np.any((hist >= 0).sum(1) == 0)
    st = tensors(S, history=hist, history_is_output=is_out, repetition_penalty=rep,
                 presence_penalty=pres, frequency_penalty=freq)
    want = np_penalised_exact(logits, hist, is_out, rep, pres, freq)
    assert np.any(want != logits) and np.array_equal(want[off], logits[off])
    for fn in (jax.jit(sampler.apply_penalties), sampler.apply_penalties):
        got = np.asarray(fn(jnp.asarray(logits), st))
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


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
        rows = dataclasses.replace(st.sampling, rng_key=jnp.asarray(keys))
        out = sampler.sample(jnp.asarray(logits), st.replace(sampling=rows), False)
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
                               atol=log_softmax_atol(logits), rtol=0)
    for r in range(2):
        order = np.argsort(-ref[r])[: sampler.MAX_LOGPROBS]
        np.testing.assert_array_equal(np.asarray(out.top_ids[r]), order)


def log_softmax_atol(logits: np.ndarray) -> float:
    """Two float32 evaluations of x - max - log(sum exp(x - max)) over V entries (the
    sampler's and jax.nn.log_softmax): the sum's order (gamma_V relative, absolute through
    the log), the exps and the log (transcendental_bound(2) per side), and the subtractions'
    rounding (2u of |x| + |lse| <= 2 (2 max|x| + log V)), for each of the two sides."""
    big = 2 * float(np.abs(logits).max()) + float(np.log(logits.shape[-1]))
    return 2 * (gamma(logits.shape[-1]) + transcendental_bound(2, sides=1)
                + 2 * F32_UNIT_ROUNDOFF * big)


def np_biased(logits: np.ndarray, bias: dict[int, float]) -> np.ndarray:
    out = logits.copy()
    for t, b in bias.items():
        out[t] += b
    return out


def bias_arrays(biases: list[dict[int, float]], width: int,
                pad_id: int = BIAS_PAD_ID) -> tuple[np.ndarray, np.ndarray]:
    """The step's padded sparse form: (pad_id, 0.0) where a row has fewer entries."""
    ids = np.full((len(biases), width), pad_id, np.int32)
    vals = np.zeros((len(biases), width), np.float32)
    for r, bias in enumerate(biases):
        ids[r, : len(bias)] = list(bias)
        vals[r, : len(bias)] = list(bias.values())
    return ids, vals


@pytest.mark.parametrize("pad_id", [BIAS_PAD_ID, V])
def test_logit_bias_matches_numpy_definition_and_padding_is_dropped(pad_id: int) -> None:
    rng = np.random.default_rng(5)
    S, B = 5, 8
    logits = rng.normal(0, 2, (S, V)).astype(np.float32)
    biases = [{int(t): float(rng.uniform(-100, 100)) for t in rng.choice(V, k, replace=False)}
              for k in (8, 3, 0, 1, 0)]
    biases[3] = {0: 7.5}  # token 0 and the last token: no padding entry lands on either
    biases[1][V - 1] = -3.0
    ids, vals = bias_arrays(biases, B, pad_id)
    # Padding values that a clamped or wrapped index would add somewhere: dropping them is
    # what keeps the rows exact.
    vals[ids == pad_id] = 1000.0
    got = np.asarray(sampler.apply_logit_bias(jnp.asarray(logits),
                                              tensors(S, bias_ids=ids, bias_values=vals)))
    for r in range(S):
        # One bias per token: numpy adds the float64 bias and rounds once; XLA rounds the
        # bias to float32, then the sum: 3u of |logit| + |bias| at most.
        bias = np.zeros(V)
        bias[list(biases[r])] = list(biases[r].values())
        tol = 3 * F32_UNIT_ROUNDOFF * (np.abs(logits[r]) + np.abs(bias))
        assert np.all(np.abs(got[r] - np_biased(logits[r], biases[r])) <= tol), r
    np.testing.assert_array_equal(got[[2, 4]], logits[[2, 4]])  # all-padding rows: bit-exact


def test_logit_bias_of_width_zero_is_no_op_at_trace_time() -> None:
    logits = jnp.asarray(np.random.default_rng(7).normal(size=(3, V)).astype(np.float32))
    st = tensors(3)  # no bias arrays: width 0
    assert st.bias.ids.shape == (3, 0)
    assert sampler.apply_logit_bias(logits, st) is logits  # nothing traced, not even a copy


def test_logit_bias_comes_before_penalties_and_filters_and_logprobs_stay_raw() -> None:
    rng = np.random.default_rng(6)
    S = 4
    logits = rng.normal(0, 1, (S, V)).astype(np.float32)
    logits[3] = np.clip(logits[3], -1.5, 1.5)
    logits[3, 7], logits[3, 5] = 1.6, -1.0
    low = [int(np.argmin(row)) for row in logits]
    top = [int(np.argmax(row)) for row in logits]
    # 0: greedy, +100 on the least likely token; 1: greedy, -100 on the argmax;
    # 2: sampling with top_k=1, +100 on the least likely token (top-k sees the biased logits);
    # 3: greedy, +5 on token 5 (logit -1) which the repetition penalty 3 then divides:
    # (-1 + 5) / 3 = 1.33 < 1.6 (token 7); penalising first would give -3 + 5 = 2 > 1.6.
    biases = [{low[0]: 100.0}, {top[1]: -100.0}, {low[2]: 100.0}, {5: 5.0}]
    ids, vals = bias_arrays(biases, 3)
    hist = np.full((S, 2), -1, np.int32)
    hist[3] = [5, -1]
    rep = np.array([1, 1, 1, 3.0], np.float32)
    st = tensors(S, temperature=np.array([0, 0, 1, 0], np.float32),
                 top_k=np.array([V, V, 1, V], np.int32), repetition_penalty=rep, history=hist,
                 history_is_output=np.zeros((S, 2), bool), bias_ids=ids, bias_values=vals)
    out = sampler.sample(jnp.asarray(logits), st, True)
    toks = np.asarray(out.tokens)
    assert toks[0] == low[0] and toks[2] == low[2]
    assert toks[1] == int(np.argmax(np_biased(logits[1], biases[1]))) != top[1]
    want3 = np_penalised(np_biased(logits[3], biases[3]), [5], [], 3.0, 0.0, 0.0)
    assert toks[3] == int(np.argmax(want3)) == 7
    ref = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), -1))  # unbiased distribution
    np.testing.assert_allclose(np.asarray(out.logprob), ref[np.arange(S), toks],
                               atol=log_softmax_atol(logits), rtol=0)


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("penalties", [False, True])
def test_sampler_with_logit_bias_lowers_for_tpu_and_cuda(platform: str, penalties: bool) -> None:
    """The serving sampler executable (model_runner's, with its grammar bitmask) at both bias
    widths a step can have, lowered without a device: catches ops a backend cannot take, and shows that a step with no
    biased row (width 0) has no bias scatter in it at all."""
    from jaxserve.device.model_runner import sample_jit  # the shipped jit
    from jaxserve.engine.batch import bias_width
    from jaxserve.engine.batch_mask import TokenMaskRows
    from jaxserve.engine.batch_parts import LogitBiasRows, PenaltyRows, SamplingRows
    from jaxserve.engine.sampling_params import DEVICE_FIELDS

    S, Vb, P = 8, 32000, 64 if penalties else 0

    def spec(shape: tuple, dtype: object) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))

    def scatters(B: int) -> int:
        st = sampler.SamplingTensors(
            SamplingRows(spec((S, len(DEVICE_FIELDS)), "float32"), spec((S, 2), "uint32")),
            PenaltyRows(spec((S, P), "int32"), spec((S, P), "bool")),
            LogitBiasRows(spec((S, B), "int32"), spec((S, B), "float32")),
            TokenMaskRows(spec((S, Vb // 32), "int32"), spec((S,), "bool")))
        text = sample_jit.trace(spec((S, Vb), "float32"), st, apply_penalty=penalties,
                                 feed_len=S).lower(lowering_platforms=(platform,)).as_text()
        return len(re.findall(r'"?stablehlo\.scatter"?\(', text))

    plain, biased = scatters(bias_width(False)), scatters(bias_width(True))
    assert bias_width(False) == 0 < bias_width(True)
    # exactly the bias scatter-add, once in each of the grammar mask's two branches
    assert biased == plain + 2
    assert (plain > 0) == penalties  # width 0: only the penalties' own scatters, if any


@pytest.mark.parametrize("S,V", [(3, 211), (48, 96), (5, 64), (64, 200)])
def test_greedy_tokens_are_the_masked_argmax(S: int, V: int) -> None:
    """The two-level argmax (32-token words; on a CPU 16 rows at a time when masked, S=48 and
    64) against numpy's argmax of the masked logits: ties resolved to the first index, rows
    without a grammar unmasked, a vocabulary 32 does not divide padded."""
    rng = np.random.default_rng(S * V)
    logits = rng.integers(-3, 3, size=(S, V)).astype(np.float32)  # many ties
    words = -(-V // 32)
    bits = rng.random((S, words * 32)) < 0.3
    bits[:, 0] = True  # a row allows at least one token
    weights = np.uint64(1) << np.arange(32, dtype=np.uint64)  # bit j of word w: token 32w+j
    bitmask = (bits.reshape(S, words, 32) * weights).sum(-1).astype(np.uint32).view(np.int32)
    constrained = rng.random(S) < 0.6
    st = tensors(S).with_mask(jnp.asarray(bitmask), jnp.asarray(constrained))
    want = np.where(bits[:, :V] | ~constrained[:, None], logits, -np.inf).argmax(-1)
    got = jax.jit(sampler.greedy_tokens, static_argnums=2)(jnp.asarray(logits), st, True)
    np.testing.assert_array_equal(np.asarray(got), want)
    plain = jax.jit(sampler.greedy_tokens, static_argnums=2)(jnp.asarray(logits), st, False)
    np.testing.assert_array_equal(np.asarray(plain), logits.argmax(-1))
    # The packed layout is llguidance's: bit t % 32 of word t // 32 (checked on one token).
    one = np.zeros((1, words), np.int32)
    one[0, 37 // 32] = np.int32(1 << (37 % 32))
    assert np.asarray(sampler.allowed_bits(jnp.asarray(one), jnp.ones(1, bool))
                      ).reshape(-1)[:V].nonzero()[0].tolist() == [37]


# ------------------------------------------------- sort-free cut-offs beyond the candidate set
VL = 1000  # > nucleus.CANDIDATES, and not a multiple of 32


@pytest.mark.parametrize("path", ["cpu_kernel", "jnp"])
@pytest.mark.parametrize("seed,std", [(0, 0.5), (1, 3.0), (2, 8.0)])
def test_cutoffs_beyond_the_candidates_match_numpy_definition(seed: int, std: float, path: str,
                                                             monkeypatch) -> None:
    """`nucleus.cutoffs` against the numpy oracle, by the CPU kernel and by the jnp path
    (both of its branches): top_k up to and past the 64 candidates, nuclei that fit in them
    (peaked rows) and that do not (flat rows: the bisection), ties (logits rounded to a
    coarse grid) and grammar -inf entries."""
    from jaxserve.device import nucleus
    from jaxserve.kernels_pallas import nucleus_cpu

    if path == "jnp":
        monkeypatch.setattr(nucleus_cpu, "available", lambda: False)
    elif not nucleus_cpu.available():
        pytest.skip("the CPU kernel library could not be built")

    rng = np.random.default_rng(seed)
    S = 12
    logits = (np.round(rng.normal(0, std, (S, VL)) * 4) / 4).astype(np.float32)  # many ties
    logits[3, rng.choice(VL, 600, replace=False)] = -np.inf  # a constrained row
    temp = rng.choice([0.5, 1.0, 1.7], S).astype(np.float32)
    top_k = np.array([-1, 5, 64, 65, 300, VL - 1, VL, -1, -1, 50, 200, 1], np.int32)
    top_p = np.array([0.95, 1, 1, 0.5, 0.9, 1, 0.999, 0.3, 0.99, 0.95, 1, 0.8], np.float32)
    min_p = np.array([0, 0, 0.05, 0, 0, 0.1, 0, 0, 0, 0, 0.01, 0], np.float32)
    st = tensors(S, temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p)
    assert nucleus.CANDIDATES < VL
    # a fresh function per path: jit's cache would hand the second path the first's trace
    filtered = np.asarray(jax.jit(lambda x, st: sampler.filter_logits(x, st))(
        jnp.asarray(logits), st))
    for r in range(S):
        got = set(np.flatnonzero(np.isfinite(filtered[r])).tolist())
        assert got == np_allowed(logits[r], temp[r], top_k[r], top_p[r], min_p[r]), r


def test_bisection_is_the_exact_kth_value_and_top_p_cut() -> None:
    """The fallback alone, for every row: the k-th largest value exactly, and the cut of the
    shortest descending prefix reaching top_p, negative, positive and -inf values mixed."""
    from jaxserve.device import nucleus

    rng = np.random.default_rng(11)
    S = 8
    x = rng.normal(0, 2, (S, VL)).astype(np.float32)
    x[0, :500] = -np.inf
    k = rng.integers(1, VL + 1, S).astype(np.int32)
    k[0] = 500  # exactly the finite entries
    top_p = rng.choice([0.1, 0.5, 0.9, 0.99, 1.0], S).astype(np.float32)
    kth, pth = jax.jit(nucleus.bisect_cutoffs)(jnp.asarray(x), jnp.asarray(k),
                                               jnp.asarray(top_p))
    # TPU's variant (halving down to one key, no bracket top-k), run here on the CPU
    keys, want = nucleus.order_keys(jnp.asarray(x)), jnp.ones(S, bool)
    kth1 = nucleus._bisect(keys, jnp.asarray(x), jnp.ones((S, VL)), jnp.asarray(k, jnp.float32),
                           want, None, bracket=1)
    np.testing.assert_array_equal(np.asarray(kth1), np.asarray(kth))
    for r in range(S):
        assert float(kth[r]) == np.sort(x[r])[::-1][k[r] - 1], r
        keep = np_allowed(x[r], 1.0, -1, float(top_p[r]), 0.0) if top_p[r] < 1 else None
        want = min(x[r][list(keep)]) if keep is not None else x[r].min()
        assert float(pth[r]) == want, r
    # the key map is an order isomorphism and its own inverse
    vals = jnp.asarray([-np.inf, -3.5, -0.0, 0.0, 1e-30, 2.0, np.inf], jnp.float32)
    keys = np.asarray(nucleus.order_keys(vals))
    assert np.all(np.diff(keys.astype(np.int64)) >= 0)
    np.testing.assert_array_equal(np.asarray(nucleus.key_value(jnp.asarray(keys))),
                                  np.asarray(vals))


@pytest.mark.parametrize("top_p,std", [(1.0, 1.0), (0.9, 1.0), (0.8, 4.0)])
def test_inverse_cdf_frequencies_follow_the_filtered_distribution(top_p: float,
                                                                  std: float) -> None:
    """Frequencies of N draws with distinct keys against the softmax of numpy's allowed set
    (a vocabulary 32 does not divide, zero-mass entries between allowed ones never drawn)."""
    rng = np.random.default_rng(12)
    Vs = 200
    logits = rng.normal(0, std, (1, Vs)).astype(np.float32)
    logits[0, ::7] = -np.inf  # excluded by a grammar
    N = 6000
    keys = np.stack([np.arange(N, dtype=np.uint32), np.full(N, 5, np.uint32)], 1)
    st = tensors(N, temperature=np.full(N, 0.9, np.float32), top_p=np.full(N, top_p, np.float32),
                 top_k=np.full(N, -1, np.float32), rng_key=keys)
    toks = np.asarray(jax.jit(sampler.sample, static_argnums=2)(
        jnp.asarray(np.repeat(logits, N, 0)), st, False).tokens)
    allowed = sorted(np_allowed(logits[0], 0.9, -1, top_p, 0.0))
    assert set(toks.tolist()) <= set(allowed)
    x = logits[0, allowed] / 0.9
    p = np.zeros(Vs)
    p[allowed] = np.exp(x - x.max()) / np.exp(x - x.max()).sum()
    freq = np.bincount(toks, minlength=Vs) / N
    assert np.abs(freq - p).max() < 4 * np.sqrt(p.max() / N) + 1e-3


def test_seeded_row_is_independent_of_a_neighbour_that_takes_the_fallback() -> None:
    """A row whose nucleus fits the candidates draws the same token alone and beside a row
    whose flat distribution sends the step down the bisection path."""
    rng = np.random.default_rng(13)
    peaked = rng.normal(0, 6, (1, VL)).astype(np.float32)
    flat = rng.normal(0, 0.1, (1, VL)).astype(np.float32)
    knobs = dict(temperature=np.ones(1, np.float32), top_p=np.full(1, 0.95, np.float32),
                 top_k=np.full(1, -1, np.float32))
    run = jax.jit(sampler.sample, static_argnums=2)
    for seed in range(8):
        key = np.array([[seed, 77]], np.uint32)
        alone = run(jnp.asarray(peaked), tensors(1, rng_key=key, **knobs), False).tokens[0]
        both = {k: np.concatenate([v, v]) for k, v in knobs.items()}
        keys = np.concatenate([np.array([[99, 1]], np.uint32), key])
        mixed = run(jnp.asarray(np.concatenate([flat, peaked])),
                    tensors(2, rng_key=keys, **both), False).tokens[1]
        assert int(alone) == int(mixed), seed


def test_approximate_candidates_are_checked_before_they_are_trusted() -> None:
    """TPU's approx_max_k may miss a top entry: `checked_candidates` settles a row only when
    the values it got are exactly the row's C largest (a miss, or a tie with the C-th value
    outside the set, sends the row to the exact bisection)."""
    from jaxserve.device import nucleus

    rng = np.random.default_rng(14)
    x = rng.normal(0, 1, (3, VL)).astype(np.float32)
    C = nucleus.CANDIDATES
    order = np.argsort(-x, axis=1)
    picked = np.stack([x[0, order[0, :C]],  # exact
                       x[1, np.r_[order[1, :C - 1], order[1, C]]],  # missed the C-th
                       x[2, order[2, :C]]])[:, ::-1]  # exact, given ascending
    x[2, order[2, C]] = x[2, order[2, C - 1]]  # ... but tied outside the set
    vals, settled = nucleus.checked_candidates(jnp.asarray(x), jnp.asarray(picked.copy()))
    assert np.asarray(settled).tolist() == [True, False, False]
    np.testing.assert_array_equal(np.asarray(vals[0]), np.sort(x[0])[::-1][:C])


def test_cpu_executable_keeps_its_top_k_and_sorts_no_vocabulary() -> None:
    """XLA:CPU's compiled sampler (the shipped `sample_jit`, penalties on) holds TopK calls
    and no sort over the vocabulary: with the candidates' slices folded into TopK's reference
    decomposition, XLA once compiled a full sort of f32[S, V] instead (~100x slower)."""
    from jaxserve.device.model_runner import sample_jit

    S, Vc = 8, 4096
    logits = jnp.zeros((S, Vc), jnp.float32)
    st = tensors(S, top_k=np.full(S, 50, np.int32), top_p=np.full(S, 0.9, np.float32),
                 history=np.zeros((S, 4), np.int32), history_is_output=np.ones((S, 4), bool))
    text = sample_jit.lower(logits, st, apply_penalty=True, feed_len=S).compile().as_text()
    assert 'custom_call_target="TopK"' in text  # the logprobs' top 20
    assert not re.findall(rf"= \(?f32\[{S},{Vc}\][^=]*\bsort\(", text)
    from jaxserve.kernels_pallas import cpu_build, nucleus_cpu

    if nucleus_cpu.available():  # the cut-offs are the C++ kernel's, not the jnp path's
        assert f'custom_call_target="{cpu_build.NUCLEUS_TARGET}"' in text


# ------------------------------------------------------------ the CPU sampler's row blocks
@pytest.mark.parametrize("S,block", [(24, 8), (48, 16), (20, 4)])
def test_row_blocks_give_what_all_rows_at_once_give(S: int, block: int) -> None:
    """`sample_blocks` (the CPU path past SAMPLE_BLOCK rows) against `sample_rows` on one
    batch mixing every feature row by row: greedy and sampled rows, top_k / top_p / min_p,
    penalties over a history, logprobs, a logit bias and a grammar mask on some rows. Each
    row's result is its own: the tokens agree exactly, the logprobs up to the order XLA sums
    a row's log-sum-exp in for each shape (a sum of Vb terms: (Vb - 1) eps relative, so
    Vb eps absolute on its log)."""
    rng = np.random.default_rng(S)
    Vb, P, B = 96, 12, 3
    logits = rng.normal(0, 2, (S, Vb)).astype(np.float32)
    bits = rng.random((S, Vb)) < 0.5
    bits[:, 0] = True
    weights = np.uint64(1) << np.arange(32, dtype=np.uint64)
    bitmask = (bits.reshape(S, Vb // 32, 32) * weights).sum(-1).astype(np.uint32).view(np.int32)
    st = tensors(
        S, temperature=rng.choice([0.0, 0.7, 1.0], S).astype(np.float32),
        top_k=rng.choice([-1, 5, 40], S).astype(np.int32),
        top_p=rng.choice([1.0, 0.9, 0.5], S).astype(np.float32),
        min_p=rng.choice([0.0, 0.05], S).astype(np.float32),
        rng_key=rng.integers(0, 2**32, (S, 2), dtype=np.uint32),
        repetition_penalty=rng.choice([1.0, 1.3], S).astype(np.float32),
        presence_penalty=rng.choice([0.0, 0.5], S).astype(np.float32),
        frequency_penalty=rng.choice([0.0, 0.2], S).astype(np.float32),
        history=np.where(rng.random((S, P)) < 0.8, rng.integers(0, Vb, (S, P)), -1
                         ).astype(np.int32),
        history_is_output=rng.random((S, P)) < 0.5,
        logprobs=rng.choice([-1.0, 0.0, 3.0], S).astype(np.float32),
        bias_ids=np.where(rng.random((S, B)) < 0.5, rng.integers(0, Vb, (S, B)), Vb
                          ).astype(np.int32),
        bias_values=rng.normal(0, 3, (S, B)).astype(np.float32),
        bitmask=bitmask, constrained=rng.random(S) < 0.4)
    x = jnp.asarray(logits)
    whole = jax.jit(lambda x, st: sampler.sample_rows(x, st, True))(x, st)
    blocks = jax.jit(lambda x, st: sampler.sample_blocks(x, st, True, block))(x, st)
    for name in ("tokens", "top_ids"):
        np.testing.assert_array_equal(np.asarray(getattr(blocks, name)),
                                      np.asarray(getattr(whole, name)), err_msg=name)
    for name in ("logprob", "top_logprobs"):
        np.testing.assert_allclose(np.asarray(getattr(blocks, name)),
                                   np.asarray(getattr(whole, name)), rtol=0,
                                   atol=Vb * np.finfo(np.float32).eps, err_msg=name)
    assert np.any(np.asarray(whole.tokens) != np.asarray(logits.argmax(-1)))  # rows sampled


def test_cpu_sampler_scratch_stays_under_the_mmap_threshold() -> None:
    """The compiled CPU sampler at 64 rows of the bundled model's vocabulary, penalties and a
    logit bias on, holds its scratch in a temp buffer well under glibc's 32 MiB mmap
    threshold (all rows at once it was 36 MiB: every call faulted its pages in again)."""
    from jaxserve.device.model_runner import sample_jit

    S, Vs, P = 64, 49152, 256
    st = tensors(S, history=np.zeros((S, P), np.int32), history_is_output=np.ones((S, P), bool),
                 bias_ids=np.zeros((S, 4), np.int32), bias_values=np.zeros((S, 4), np.float32))
    compiled = sample_jit.lower(jnp.zeros((S, Vs), jnp.float32), st, apply_penalty=True,
                                feed_len=S).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < 16 * 2**20, f"{temp / 2**20:.1f} MiB"
