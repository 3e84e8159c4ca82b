"""Bounds on every request field (issue #13): the registry's ranges keep each value inside what
the engine stores it in (int32, uint64, finite float32), `EngineLimits` bounds what depends on
the model (vocabulary, max_model_len, the prompt byte bound), the tokenizer's worst case
(`Tokenizer.max_token_bytes`) is checked against the tokenizer itself, and the fronts' client
priority range is the operator's. Engines run the arithmetic fake runner."""

from __future__ import annotations

import asyncio
import functools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.engine_fixtures import tiny_tokenizer
from hypothesis import given, settings
from hypothesis import strategies as st
from support.fake_engines import fake_engine
from support.tiers import fuzz_examples

from jaxserve import SamplingParams
from jaxserve.engine import sampling_params as sp_mod
from jaxserve.engine.limits import FALLBACK_TOKEN_BYTES, InvalidRequest, check_priority
from jaxserve.models import bundled
from jaxserve.models.gguf_vocab import byte_alphabet
from jaxserve.models.tokenizer import Tokenizer, _covers_every_byte
from jaxserve.serving.admission import MAX_CHAT_MESSAGES, Admission, PromptInput, render_chat

IDS = [5, 6, 7]


def refused(field: str, phrase: str, **kwargs: object) -> None:
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert e.value.field == field and phrase in str(e.value), str(e.value)
    assert str(e.value).startswith(field)


# --------------------------------------------------------------------------- the registry
def test_integer_ranges() -> None:
    SamplingParams(seed=2**64 - 1, top_k=2**31 - 1, max_tokens=2**31 - 1,
                   stop_token_ids=[2**31 - 1] * sp_mod.MAX_STOP_TOKEN_IDS)
    refused("seed", "must be an integer in [0, 18446744073709551615]", seed=2**64)
    refused("seed", "must be an integer in [0, ", seed=-1)
    refused("max_tokens", "must be an integer in [0, 2147483647]", max_tokens=2**31)
    refused("min_tokens", "must be an integer in [0, 2147483647]", min_tokens=2**31)
    refused("top_k", "must be -1 or 0 (disabled) or an integer in [1, 2147483647]",
            top_k=2**31)
    refused("top_k", "must be -1 or 0", top_k=-2)
    refused("stop_token_ids", "[0]=2147483648 must be an integer in [0, 2147483647]",
            stop_token_ids=[2**31])
    refused("stop_token_ids", "has 65 ids; at most 64", stop_token_ids=[5] * 65)
    for k in (-1, 0):  # both "the whole vocabulary"; the sampler reads k <= 0 so
        assert SamplingParams(top_k=k).row[sp_mod.DEVICE_COLUMN["top_k"]] <= 0


def test_the_issues_huge_top_k_is_refused_and_quoted_short() -> None:
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(top_k=2**1100)
    text = str(e.value)
    assert text.startswith("top_k=") and "must be -1 or 0" in text and len(text) < 120
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(seed=10**5000)  # past Python's int -> str limit: still a message
    assert "an integer of about 5000 digits" in str(e.value)


def test_float_ranges_survive_float32() -> None:
    for t in (0, 0.0, 1e-5, 100):
        SamplingParams(temperature=t)
    for t in (1e-6, 100.5, 1e39, -0.5):
        refused("temperature", "must be 0 (greedy) or in [1e-05, 100]", temperature=t)
    refused("temperature", "must be a finite number", temperature=math.inf)
    for r in (0.01, 100):
        SamplingParams(repetition_penalty=r)
    for r in (0.0, 0.001, 1e39):
        refused("repetition_penalty", "must be in [0.01, 100]", repetition_penalty=r)
    refused("presence_penalty", "must be in [-2, 2]", presence_penalty=1e39)
    refused("top_p", "must be in (0, 1]", top_p=1e39)


@settings(max_examples=fuzz_examples(200), deadline=None)
@given(st.fixed_dictionaries({f.name: st.one_of(
    st.floats(allow_nan=True, allow_infinity=True), st.integers(-2**70, 2**70))
    for f in sp_mod.DEVICE}))
def test_every_accepted_row_is_finite_in_float32(values: dict) -> None:
    """Oracle for the issue's overflow: whatever the registry accepts encodes into the
    sampling matrix as finite float32 values (no OverflowError, no inf)."""
    ok = {}
    for name, v in values.items():
        try:
            SamplingParams(**{name: v})
        except InvalidRequest:
            continue
        ok[name] = v
    row = np.asarray(SamplingParams(**ok).row, np.float32)
    assert np.isfinite(row).all(), (ok, row)


def test_extreme_accepted_values_sample_finite_on_device() -> None:
    """The sampler itself at every range end: tokens in the vocabulary, finite logprobs."""
    from jaxserve.device.sampler import SamplingTensors, sample

    S, V = 6, 64
    logits = jax.random.normal(jax.random.key(0), (S, V), jnp.float32) * 30.0
    cols = dict(temperature=[1e-5, 100.0, 1e-5, 100.0, 0.0, 1.0],
                repetition_penalty=[0.01, 100.0, 100.0, 0.01, 1.0, 100.0],
                presence_penalty=[2.0, -2.0, -2.0, 2.0, 0.0, 2.0],
                frequency_penalty=[-2.0, 2.0, 2.0, -2.0, 0.0, -2.0],
                top_k=[V, 1, 0, -1, 5, 2**31 - 1], top_p=[1e-6, 1.0, 0.5, 1.0, 1.0, 0.1],
                min_p=[1.0, 0.0, 0.5, 1e-6, 0.0, 0.9], logprobs=[20.0] * S)
    history = jnp.tile(jnp.arange(16, dtype=jnp.int32), (S, 1))
    st_ = SamplingTensors.of(jnp.zeros((S, 2), jnp.uint32), history,
                             history >= 8, **{k: jnp.asarray(v) for k, v in cols.items()})
    out = sample(logits, st_, apply_penalty=True)
    tokens = np.asarray(out.tokens)
    assert ((tokens >= 0) & (tokens < V)).all()
    assert np.isfinite(np.asarray(out.logprob)).all()
    assert np.isfinite(np.asarray(out.top_logprobs)).all()


def test_text_must_be_valid_unicode() -> None:
    refused("stop", "stop[1] is not valid Unicode: character 2 is a lone UTF-16 surrogate",
            stop=["ok", "ab\ud800"])
    engine = fake_engine()
    for prompt in ("w5 \ud800", "\udfff"):
        with pytest.raises(InvalidRequest) as e:
            engine.admit(prompt, SamplingParams())
        assert e.value.field == "prompt" and "lone UTF-16 surrogate" in str(e.value)
    with pytest.raises(InvalidRequest) as e:
        engine.add_request("id\ud800", IDS)
    assert e.value.field == "request_id"


# --------------------------------------------------------------------------- engine limits
def test_vocabulary_bounds_of_sampling_fields() -> None:
    engine = fake_engine()  # vocabulary 211
    engine.admit(IDS, SamplingParams(top_k=211, stop_token_ids=[210]))
    for kw, field, phrase in (
            (dict(top_k=212), "top_k", "top_k=212 must be -1 or 0 (disabled) or in [1, 211]"),
            (dict(stop_token_ids=[5, 211]), "stop_token_ids",
             "stop_token_ids[1]=211 is outside the vocabulary [0, 211)")):
        with pytest.raises(InvalidRequest) as e:
            engine.admit(IDS, SamplingParams(**kw))
        assert e.value.field == field and str(e.value).startswith(phrase), str(e.value)


def test_priority_ranges() -> None:
    check_priority(-2**63)
    check_priority(2**63 - 1)
    with pytest.raises(InvalidRequest, match=r"priority=9223372036854775808 must be in "):
        check_priority(2**63)
    engine = fake_engine()
    engine.add_request("trusted", IDS, SamplingParams(max_tokens=1), priority=-2**31)
    adm = Admission(engine.limits, engine.tokenizer, 1)  # the default client range
    try:
        with pytest.raises(InvalidRequest, match=r"^priority=-1 must be in \[0, 2147483647\]"):
            asyncio.run(adm.admit("r", PromptInput(token_ids=tuple(IDS)), SamplingParams(), -1))
        asyncio.run(adm.admit("r", PromptInput(token_ids=tuple(IDS)), SamplingParams(), 7))
    finally:
        adm.close()
    wide = Admission(engine.limits, engine.tokenizer, 1, (-10, 10))
    try:
        asyncio.run(wide.admit("r", PromptInput(token_ids=tuple(IDS)), SamplingParams(), -10))
        with pytest.raises(InvalidRequest, match=r"must be in \[-10, 10\]"):
            asyncio.run(wide.admit("r", PromptInput(token_ids=tuple(IDS)), SamplingParams(), 11))
    finally:
        wide.close()


def test_server_config_priority_range() -> None:
    from jaxserve.server.config import ServerConfig

    assert ServerConfig().client_priority_range == (0, 2**31 - 1)
    for bad in ((5, 4), (-2**31 - 1, 0), (0, 2**31)):
        with pytest.raises(ValueError, match="client_priority_range"):
            ServerConfig(client_priority_range=bad)


def test_serve_flags_set_the_priority_range() -> None:
    import argparse

    from jaxserve.cli.serve import add_serve_parser

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--client-priority-min", "-5",
                              "--client-priority-max", "9"])
    assert (args.client_priority_min, args.client_priority_max) == (-5, 9)
    args = parser.parse_args(["serve"])
    assert (args.client_priority_min, args.client_priority_max) == (0, 2**31 - 1)


def test_chat_bounds() -> None:
    engine = fake_engine()
    tok, lim = engine.tokenizer, engine.limits
    user = {"role": "user", "content": "w5"}
    for msgs, phrase in (
            ([user] * (MAX_CHAT_MESSAGES + 1), f"messages has {MAX_CHAT_MESSAGES + 1} messages; "
                                               f"at most {MAX_CHAT_MESSAGES}"),
            ([user, {"role": "user", "content": None}], "messages[1].content must be a string"),
            ([user, {"role": "user", "content": "a\ud800"}],
             "messages[1].content is not valid Unicode"),
            ([{"role": "user", "content": "w5 " * (lim.max_prompt_bytes // 6 + 1)}] * 2,
             "messages (the sum of the contents) is at least ")):
        with pytest.raises(InvalidRequest) as e:
            render_chat(msgs, tok, True, lim)
        assert e.value.field == "messages" and str(e.value).startswith(phrase), str(e.value)


# --------------------------------------------------------------------------- tokenizer bound
@functools.cache
def gguf_tokenizer() -> Tokenizer:
    """The bundled SmolLM2 byte-level BPE tokenizer (skips when the package is absent)."""
    try:
        path = bundled.bundled_model_path()
    except Exception as e:  # noqa: BLE001 - the bundled model is an optional package
        pytest.skip(f"bundled tokenizer unavailable: {e}")
    return Tokenizer.from_gguf(path)


def test_max_token_bytes_is_the_longest_decoded_token() -> None:
    tok = gguf_tokenizer()
    oracle = max(len(tok.decode([i], skip_special_tokens=False).encode())
                 for i in range(tok.vocab_size))
    assert tok.max_token_bytes == max(oracle, 4)


@settings(max_examples=fuzz_examples(150), deadline=None)
@given(st.text(min_size=1, max_size=200))
def test_no_text_covers_more_than_max_token_bytes_per_token(text: str) -> None:
    """The bound admission relies on: bytes <= max_token_bytes * tokens, for any text, not
    counting the bytes the vocabulary cannot spell (which this BPE drops: SmolLM2 lacks 21
    of the 256 byte tokens, e.g. 0x16; docs/serving/limits.md states that those still count)."""
    tok = gguf_tokenizer()
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError:
        return  # refused before tokenization
    vocab = tok.backend.get_vocab(with_added_tokens=True)
    unspellable = bytes(b for b, c in byte_alphabet().items() if c not in vocab)
    size = len(data.translate(None, unspellable))
    assert size <= tok.max_token_bytes * len(tok.encode(text, add_special_tokens=False))


def test_tokenizers_that_drop_input_have_no_bound() -> None:
    assert tiny_tokenizer().max_token_bytes is None  # word-level: whitespace dropped, unk
    spec = json.loads(tiny_tokenizer().backend.to_str())
    bpe = {"type": "BPE", "byte_fallback": True, "fuse_unk": False}
    assert _covers_every_byte({**spec, "pre_tokenizer": None, "model": bpe})
    assert _covers_every_byte({"normalizer": {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "▁"},
        {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
        "pre_tokenizer": None, "model": bpe})
    for normalizer, pre, model in (
            ({"type": "NFKC"}, None, bpe),  # shrinks fullwidth letters
            (None, {"type": "Whitespace"}, bpe),
            (None, {"type": "Split", "behavior": "Removed"}, bpe),
            (None, None, {"type": "BPE", "unk_token": "<unk>", "fuse_unk": True}),
            (None, None, {"type": "WordPiece"})):
        assert not _covers_every_byte({"normalizer": normalizer, "pre_tokenizer": pre,
                                       "model": model})
    engine = fake_engine()
    assert engine.limits.max_prompt_bytes == 128 * FALLBACK_TOKEN_BYTES
