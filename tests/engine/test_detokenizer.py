"""Incremental detokenization and stop strings, with the bundled SmolLM2 byte-level tokenizer.

Oracle: the tokenizer's one-shot `decode` of the same ids, and plain `str.find` for stops.
"""

from __future__ import annotations

import pytest

from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.models.bundled import bundled_model_path
from jaxserve.models.tokenizer import Tokenizer

TEXTS = ["héllo wörld 😀👍🏽 世界 안녕하세요", "def f(x):\n\treturn x**2  # ok", "🇫🇷 flag, ZWJ 👨‍👩‍👧", "plain"]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf(bundled_model_path())


def stream(tok: Tokenizer, ids: list[int], params: SamplingParams) -> tuple[list[str], str, bool]:
    d = IncrementalDetokenizer(tok.backend, params)
    deltas = []
    stopped = False
    for i in ids:
        stopped = d.add_token(i)
        if stopped:
            break
        deltas.append(d.pop_delta())
    deltas.append(d.finish())
    return deltas, "".join(deltas), stopped


@pytest.mark.parametrize("text", TEXTS)
def test_stream_equals_one_shot_decode_and_never_splits_characters(tok, text) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    deltas, joined, _ = stream(tok, ids, SamplingParams())
    assert joined == tok.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)


@pytest.mark.parametrize("text,stop,include", [
    ("The answer is 42. STOP here and more", "STOP", False),
    ("The answer is 42. STOP here and more", "STOP", True),
    ("emoji 😀 then END😀 tail", "END😀", False),
    ("abcabcabd", "abd", False),
    ("no stop in this one", "zzz", False),
])
def test_stop_strings_cut_and_never_leak_into_deltas(tok, text, stop, include) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    params = SamplingParams(stop=[stop], include_stop_str_in_output=include)
    deltas, joined, stopped = stream(tok, ids, params)
    i = text.find(stop)
    if i == -1:
        assert not stopped and joined == text
        return
    assert stopped
    assert joined == (text[: i + len(stop)] if include else text[:i])
    # Before the stop completed, no delta may have shown any part of it.
    shown_before_stop = "".join(deltas[:-1])
    assert shown_before_stop == text[: len(shown_before_stop)]
    assert len(shown_before_stop) <= i


def test_special_tokens_and_dropped_eos(tok) -> None:
    eos = tok.token_to_id("<|im_end|>")
    ids = tok.encode("Hi there", add_special_tokens=False) + [eos]
    for skip in (True, False):
        d = IncrementalDetokenizer(tok.backend, SamplingParams(skip_special_tokens=skip))
        for i in ids:
            d.add_token(i)
        assert d.finish(drop_last_token=True) == "Hi there"
    d = IncrementalDetokenizer(tok.backend, SamplingParams(skip_special_tokens=False))
    for i in ids:
        d.add_token(i)
    assert d.finish() == "Hi there<|im_end|>"
