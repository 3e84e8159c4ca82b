"""Compiled bucket sets: the default token / seqs buckets, bucket selection, user overrides.

No jax runs here (the compile-count check only reads `ModelRunner.buckets()` off a plan). The
padding bound uses the step cost model measured by scripts/bench/bench_buckets.py on the bundled
model (2-core CPU, CPU ms of an all-padding step, least squares over T = 2..512): a step of T
tokens in S sequences costs about A + B * T + R * S, the fixed part A being the weights read
once whatever T is. Padding share of a step = (cost(bucket) - cost(step)) / cost(bucket).
"""

from __future__ import annotations

import types

import pytest

from jaxserve.config import EngineConfig
from jaxserve.engine.batch import bucket_for, default_token_buckets
from jaxserve.engine.sizing import plan_engine
from jaxserve.models.config import ModelConfig

A, B, R = 196.0, 2.85, 1.67  # ms; ms per token; ms per sequence row (lm_head + sampler)


def cost(tokens: int, seqs: int) -> float:
    return A + B * tokens + R * seqs


def model_config() -> ModelConfig:
    return ModelConfig(model_type="llama", vocab_size=1000, hidden_size=64,
                       intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                       head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                       max_position_embeddings=4096, tie_word_embeddings=False,
                       attention_bias=False, qk_norm=False, bos_token_id=1, eos_token_ids=(2,))


def plan_buckets(**cfg: object) -> tuple[tuple[int, int], ...]:
    plan = plan_engine(EngineConfig(**cfg), model_config(), 4, 1 << 34)  # type: ignore[arg-type]
    return plan.batch_shape.buckets


def steps(max_num_seqs: int, max_num_batched_tokens: int, every: bool = True):  # noqa: ANN201
    """Every (tokens, seqs) a step can have: 1 <= seqs <= min(tokens, max_num_seqs); with
    `every` False, past 64 tokens only 1, 2, half and all of the seqs a step may hold."""
    for t in range(1, max_num_batched_tokens + 1):
        most = min(t, max_num_seqs)
        seqs = range(1, most + 1) if every or t <= 64 else sorted({1, 2, most // 2, most})
        for s in seqs:
            yield t, s


def test_default_token_buckets() -> None:
    assert default_token_buckets(512) == (
        1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384,
        448, 512)
    assert default_token_buckets(1) == (1,)
    assert default_token_buckets(3) == (1, 2, 3)
    assert default_token_buckets(100)[-3:] == (80, 96, 100)  # the budget itself ends the set
    assert default_token_buckets(512, steps_per_octave=8)[-9:] == (
        256, 288, 320, 352, 384, 416, 448, 480, 512)
    for limit in (1, 7, 64, 100, 512, 777, 8192):
        b = default_token_buckets(limit)
        assert list(b) == sorted(set(b)) and b[0] == 1 and b[-1] == limit
    # Above 64, 4 buckets per octave: 4 more each time the budget doubles.
    assert len(default_token_buckets(1024)) == len(default_token_buckets(512)) + 4
    with pytest.raises(ValueError, match="limit=0"):
        default_token_buckets(0)


def test_default_plan_buckets_and_seqs() -> None:
    buckets = plan_buckets()  # max_num_seqs 32, max_num_batched_tokens 2048
    assert [t for t, _ in buckets] == list(default_token_buckets(2048))
    # One seqs bucket per token bucket: as many rows as tokens, up to max_num_seqs.
    assert all(s == min(t, 32) for t, s in buckets)


@pytest.mark.parametrize("max_num_seqs,max_num_batched_tokens",
                         [(32, 512), (8, 64), (256, 2048), (64, 8192), (5, 100)])
def test_every_step_fits_its_bucket(max_num_seqs: int, max_num_batched_tokens: int) -> None:
    buckets = plan_buckets(max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=max_num_batched_tokens)
    token_buckets = sorted({t for t, _ in buckets})
    smallest = {t: min(x for x in token_buckets if x >= t)
                for t in range(1, max_num_batched_tokens + 1)}
    for t, s in steps(max_num_seqs, max_num_batched_tokens,
                      every=max_num_batched_tokens <= 512):
        bt, bs = bucket_for(t, s, buckets)
        assert bt >= t and bs >= s
        # The smallest token bucket that holds the step: its seqs bucket never forces a
        # bigger one.
        assert bt == smallest[t]
        # Token padding: under the fine step of 8 up to 64 tokens, under 1/5 of the bucket
        # above (a quarter octave: 257 tokens run as 320).
        if t > 64:
            assert (bt - t) / bt < 1 / 5, (t, s, bt)
        elif t > 8:
            assert bt - t < 8, (t, s, bt)


def test_padding_share_of_the_step_under_the_default_config() -> None:
    """Under the measured cost model: decode steps (one token per sequence) spend under 12%
    of the step on padding at every size, steps with as many sequences as their bucket holds
    under 16%, any step under 22% (the worst: a few sequences in a bucket of up to 32 rows).
    Powers of two spent up to 46% (a 257-token step ran as 512)."""
    buckets = plan_buckets()
    worst_decode = worst_full = worst_any = 0.0
    for t, s in steps(32, 512):  # steps with decodes (a decode_token_budget up to 512)
        bt, bs = bucket_for(t, s, buckets)
        share = (cost(bt, bs) - cost(t, s)) / cost(bt, bs)
        worst_any = max(worst_any, share)
        if t == s:
            worst_decode = max(worst_decode, share)
        if s == min(t, 32):
            worst_full = max(worst_full, share)
    assert worst_decode < 0.12 and worst_full < 0.16 and worst_any < 0.22
    pow2 = plan_buckets(token_buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048))
    assert bucket_for(257, 32, pow2) == (512, 32)
    assert bucket_for(257, 32, buckets) == (320, 32)


def test_overrides_are_honoured() -> None:
    assert plan_buckets(max_num_seqs=4, max_num_batched_tokens=32,
                        token_buckets=(8, 32)) == ((8, 4), (32, 4))
    # seq_buckets: every (tokens, seqs) pair with seqs <= tokens.
    assert plan_buckets(max_num_seqs=4, max_num_batched_tokens=32, token_buckets=(2, 8, 32),
                        seq_buckets=(1, 4)) == ((2, 1), (8, 1), (8, 4), (32, 1), (32, 4))
    # seq_buckets with the default token buckets.
    got = plan_buckets(max_num_seqs=8, max_num_batched_tokens=64, seq_buckets=(2, 8))
    assert got == tuple(sorted((t, s) for t in default_token_buckets(64) for s in (2, 8)
                               if s <= t))
    # A user's set picks the smallest bucket that holds the step, seqs included.
    assert bucket_for(3, 3, plan_buckets(max_num_seqs=4, max_num_batched_tokens=32,
                                         token_buckets=(2, 8, 32), seq_buckets=(1, 4))) == (8, 4)


def test_decode_token_budget_is_clamped_to_the_seats_and_the_budget() -> None:
    def plan(**cfg: object) -> int | None:
        return plan_engine(EngineConfig(**cfg), model_config(), 4,  # type: ignore[arg-type]
                           1 << 34).scheduler.decode_token_budget

    assert plan() == 256  # the default: steps with decodes hold 256 of the 2048 tokens
    assert plan(max_num_batched_tokens=128) == 128
    assert plan(max_num_seqs=64, max_num_batched_tokens=4096, decode_token_budget=16) == 64
    assert plan(decode_token_budget=None) is None


def test_bucket_errors() -> None:
    with pytest.raises(ValueError, match=r"token_buckets end at 256 < max_num_batched_tokens=512"):
        plan_buckets(max_num_batched_tokens=512, token_buckets=(64, 256))
    with pytest.raises(ValueError, match=r"seq_buckets end at 16 < max_num_seqs=32"):
        plan_buckets(max_num_batched_tokens=512, seq_buckets=(8, 16))
    with pytest.raises(ValueError, match="strictly increasing"):
        EngineConfig(token_buckets=(64, 32, 512))
    with pytest.raises(ValueError, match="strictly increasing"):
        EngineConfig(seq_buckets=(0, 32))
    with pytest.raises(ValueError, match=r"a step of 600 tokens in 3 sequences exceeds every "
                                         r"compiled bucket \(largest \(512, 32\)\)"):
        bucket_for(600, 3, plan_buckets(max_num_batched_tokens=512))
    with pytest.raises(ValueError, match="exceeds every compiled bucket"):
        bucket_for(8, 5, ((8, 4), (32, 4)))


def test_warmup_compile_count_of_the_default_config() -> None:
    """What `ModelRunner.buckets()` (the warmup list) runs for the default config: every
    forward bucket once, the three other sampler variants per seqs bucket, the prompt
    logprobs pass per token bucket; each (tokens, seqs) pair of it is a compiled bucket."""
    from jaxserve.device.model_runner import ModelRunner

    buckets = plan_buckets()
    runs = ModelRunner.buckets(types.SimpleNamespace(  # type: ignore[arg-type]
        shape=types.SimpleNamespace(buckets=buckets)))
    seqs = {s for _, s in buckets}
    assert len(buckets) == 31 and seqs == {1, 2, 4, 8, 16, 24, 32}
    assert len(runs) == len(buckets) + 3 * len(seqs) + len(buckets) == 83
    assert {(t, s) for t, s, *_ in runs} == set(buckets)
    assert sorted((t, s) for t, s, p, b, lp in runs if not (p or b or lp)) == list(buckets)
