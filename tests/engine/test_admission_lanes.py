"""Tokenization cost is bounded and shared fairly (issue #13): a prompt too large to fit is
refused from its size alone, before the tokenizer sees it (offline and through `Admission`),
and large prompts are tokenized in their own lane, so a small request is admitted while
large ones are still being tokenized. A wrapper tokenizer counts (and can hold) encode calls;
the order of events is asserted, never a duration."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from support.engine_fixtures import VOCAB, tiny_model_config, tiny_tokenizer

from jaxserve import SamplingParams
from jaxserve.config import EngineConfig
from jaxserve.engine.engine import Engine
from jaxserve.engine.fake_runner import ArithmeticRunner
from jaxserve.engine.limits import InvalidRequest
from jaxserve.engine.sizing import plan_engine
from jaxserve.serving.admission import LARGE_INPUT_CHARS, Admission, PromptInput, input_chars

DEADLINE_S = 30.0  # a guard against a hang, never a measurement


class CountingTokenizer:
    """The tiny tokenizer, with `max_token_bytes` set by the test, counting encode calls;
    with `hold` set, encoding a large text waits until the test releases it."""

    def __init__(self, max_token_bytes: int | None, hold: bool = False) -> None:
        self._inner = tiny_tokenizer()
        self.max_token_bytes = max_token_bytes
        self.calls: list[int] = []  # length of each encoded text
        self.release = threading.Event()
        self.entered = threading.Semaphore(0)  # one permit per large encode that started
        self._hold = hold
        self._lock = threading.Lock()
        self.active = self.max_active = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        with self._lock:
            self.calls.append(len(text))
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        try:
            if self._hold and len(text) > LARGE_INPUT_CHARS:
                self.entered.release()
                assert self.release.wait(DEADLINE_S), "the test never released the encode"
            return self._inner.encode(text, add_special_tokens)
        finally:
            with self._lock:
                self.active -= 1

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def engine_with(tokenizer: CountingTokenizer, max_model_len: int = 128) -> Engine:
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, page_size=8,
                          max_model_len=max_model_len, attention_impl="reference")
    plan = plan_engine(config, tiny_model_config(max_position_embeddings=1024), 4, 1 << 30)
    return Engine(config, plan, ArithmeticRunner(VOCAB), tokenizer, (2,))  # type: ignore


def test_oversized_prompt_is_refused_without_tokenizing() -> None:
    tok = CountingTokenizer(max_token_bytes=5)
    engine = engine_with(tok, max_model_len=1024)
    assert engine.limits.max_prompt_bytes == 5 * 1024
    huge = "w5 " * 350_000  # ~1 MB for a 1k-token model
    params = SamplingParams(max_tokens=4)
    with pytest.raises(InvalidRequest) as e:
        engine.admit(huge, params)
    assert e.value.field == "prompt" and str(e.value).startswith(
        "prompt is at least 1050000 bytes long; at most 5120 bytes can fit")
    adm = Admission(engine.limits, tok, 2)
    try:
        with pytest.raises(InvalidRequest) as e2:
            asyncio.run(adm.admit("r", PromptInput(text=huge), params))
        assert str(e2.value) == str(e.value)
        chat = ({"role": "user", "content": huge[:3000]},) * 2
        with pytest.raises(InvalidRequest, match=r"^messages \(the sum of the contents\) is at "
                                                 r"least 6000 bytes"):
            asyncio.run(adm.admit("c", PromptInput(chat=chat), params))
        with pytest.raises(InvalidRequest, match=r"^prompt is at least"):
            asyncio.run(adm.tokenize(PromptInput(text=huge)))
        assert tok.calls == []  # none of them reached the tokenizer
        # A text under the bound is tokenized (and here fits: 1000 tokens of 5 bytes).
        assert len(engine.admit("w100 " * 1000, params).token_ids) == 1000
        assert tok.calls == [5000]
    finally:
        adm.close()


def test_small_request_is_not_held_behind_large_ones() -> None:
    tok = CountingTokenizer(max_token_bytes=None, hold=True)  # bound: 128 * 256 bytes
    engine = engine_with(tok)
    large = "w5 " * (LARGE_INPUT_CHARS // 3 + 100)  # large, under the byte bound: tokenized
    assert LARGE_INPUT_CHARS < len(large) <= engine.limits.max_prompt_bytes
    params = SamplingParams(max_tokens=4)
    adm = Admission(engine.limits, tok, 2)  # 2 small-lane workers, 1 large-lane worker

    async def main() -> None:
        loop = asyncio.get_running_loop()
        bigs = [asyncio.ensure_future(adm.admit(f"L{i}", PromptInput(text=large), params))
                for i in range(4)]
        assert await loop.run_in_executor(None, tok.entered.acquire, True, DEADLINE_S)
        small = asyncio.ensure_future(adm.admit("s", PromptInput(text="w5 w6"), params))
        done, _ = await asyncio.wait([small, *bigs], timeout=DEADLINE_S,
                                     return_when=asyncio.FIRST_COMPLETED)
        assert done == {small}, "the small request waited for the large ones"
        assert small.result().token_ids == (5, 6)
        assert not any(b.done() for b in bigs)
        tok.release.set()
        results = await asyncio.gather(*bigs, return_exceptions=True)
        for r in results:  # tokenized, then refused: too many tokens for max_model_len
            assert isinstance(r, InvalidRequest) and "max_model_len=128" in str(r), r

    try:
        asyncio.run(main())
    finally:
        tok.release.set()
        adm.close()
    assert tok.max_active <= 2  # one large encode at a time, beside the small one
    assert tok.calls.count(len(large)) == 4


def test_chat_extras_count_toward_the_bound_and_the_lane() -> None:
    """Every string a template may render counts: extra message keys (`name`, ...), the
    tools and chat_template_kwargs values, not only the contents (keys are names: not
    counted)."""
    tool = {"type": "function", "function": {"name": "f", "description": "d" * 20}}
    inp = PromptInput(chat=({"role": "user", "content": "w5", "name": "n" * 100},),
                      chat_template_kwargs={"a": "y" * 50, "b": ["z" * 7, 3]}, tools=(tool,))
    assert input_chars(inp) == len("user") + len("w5") + 100 + 50 + 7 + len("function") + 21
    tok = CountingTokenizer(max_token_bytes=5)
    engine = engine_with(tok, max_model_len=1024)  # bound: 5120 bytes
    params = SamplingParams(max_tokens=4)
    user = {"role": "user", "content": "w5"}
    adm = Admission(engine.limits, tok, 2)
    try:
        wordy = {"type": "function", "function": {"name": "f", "description": "d" * 6000}}
        for big in (PromptInput(chat=({**user, "name": "n" * 6000},)),
                    PromptInput(chat=(user,), chat_template_kwargs={"k": "v" * 6000}),
                    PromptInput(chat=(user,), tools=(wordy,))):
            with pytest.raises(InvalidRequest, match=r"^messages \(every string of the messages, "
                                                     r"tools and chat_template_kwargs\) is at"):
                asyncio.run(adm.admit("c", big, params))
        assert tok.calls == []  # refused on the loop, before any tokenizer work
    finally:
        adm.close()
    # The lane is chosen from every string, not the contents alone (bound: 128 * 256 bytes).
    adm = Admission(engine_with(CountingTokenizer(max_token_bytes=None)).limits, tok, 2)
    try:
        wide = PromptInput(chat=(user,), chat_template_kwargs={"k": "v" * (LARGE_INPUT_CHARS + 1)})
        assert adm._lane(wide) is adm._large_pool
        assert adm._lane(PromptInput(chat=(user,))) is adm._pool
    finally:
        adm.close()
