"""Admission: a caller's prompt -> token ids, and every check a request passes before the engine.

Both fronts (gRPC, OpenAI HTTP) admit requests through one `Admission` per served model, and
the offline API (`LLM`, `jaxserve batch`) through the same functions, synchronously, so the same
bad input gets the same error text everywhere. Data flow: a `PromptInput` (text, token ids or
chat messages) -> `admit_input` (chat roles, count and size, then `EngineLimits.admit`:
sampling fields against the vocabulary, empty prompt, valid Unicode, the prompt byte bound,
tokenization, vocabulary, max_model_len / max_tokens, KV fit) -> an `Admitted` request, which
the engine queues without checking again. Duplicate in-flight ids are refused by what the
request is submitted to (`AsyncEngine`, `AsyncReplicaPool`, `Engine`), through the one
`limits.check_not_in_flight`.

`Admission` (the fronts) also checks the client's priority against the operator's range and
tokenizes off the event loop in two lanes: inputs over `LARGE_INPUT_CHARS` on their own small
pool, the rest on another, so a burst of large prompts (each bounded by the prompt byte bound,
which is checked on the loop before any hop) delays only other large prompts, never the small
requests behind them.

Every error raised here is an `InvalidRequest` (a ValueError) whose `field` names the field in
the offline API's words; the fronts rename it to their wire names (`InvalidRequest.message_as`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
from typing import Any, Sequence

from jaxserve.engine.limits import (DEFAULT_CLIENT_PRIORITY_RANGE, Admitted, EngineLimits,
                                    InvalidRequest, check_priority, check_prompt_text,
                                    check_request_id, check_size)
from jaxserve.engine.sampling_params import SamplingParams, check_text, show
from jaxserve.models.tokenizer import Tokenizer

CHAT_ROLES = ("system", "user", "assistant", "tool")
MAX_CHAT_MESSAGES = 1024
# Inputs longer than this (characters; a chat: all contents) are tokenized in the large lane.
# About 4k tokens of English: a few milliseconds of tokenizer time.
LARGE_INPUT_CHARS = 16 << 10

__all__ = ["Admission", "Admitted", "CHAT_ROLES", "InvalidRequest", "LARGE_INPUT_CHARS",
           "MAX_CHAT_MESSAGES", "PromptInput", "admit_input", "check_chat", "input_chars",
           "render_chat", "tokenize"]


@dataclasses.dataclass(frozen=True)
class PromptInput:
    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    chat: tuple[dict[str, str], ...] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True


def check_chat(messages: Sequence[Any], max_bytes: int | None = None
               ) -> tuple[dict[str, str], ...]:
    """A non-empty list of at most MAX_CHAT_MESSAGES {"role", "content"} messages with known
    roles and valid Unicode text contents of at most `max_bytes` UTF-8 bytes in all (the
    prompt byte bound: a template only adds text around them)."""
    if not messages:
        raise InvalidRequest("messages must not be empty", "messages")
    if len(messages) > MAX_CHAT_MESSAGES:
        raise InvalidRequest(f"messages has {len(messages)} messages; at most "
                             f"{MAX_CHAT_MESSAGES}", "messages")
    what = " (the sum of the contents)"
    check_size("messages", _chat_chars(messages), max_bytes, what)  # before reading them
    out = []
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in CHAT_ROLES:
            raise InvalidRequest(f"messages[{i}].role={show(role)} must be one of "
                                 f"{', '.join(CHAT_ROLES)}", "messages")
        if not isinstance(m.get("content"), str):
            raise InvalidRequest(f"messages[{i}].content must be a string", "messages")
        out.append(dict(m))
    size = sum(check_text("messages", m["content"], f"[{i}].content") for i, m in enumerate(out))
    check_size("messages", size, max_bytes, what)
    return tuple(out)


def render_chat(messages: Sequence[Any], tokenizer: Tokenizer,
                add_generation_prompt: bool = True,
                limits: EngineLimits | None = None) -> list[int]:
    """The token ids of a conversation through the model's chat template (`limits`: its
    contents bounded by the prompt byte bound first)."""
    msgs = check_chat(messages, limits.max_prompt_bytes if limits is not None else None)
    try:
        return list(tokenizer.apply_chat_template([dict(m) for m in msgs],
                                                  add_generation_prompt, tokenize=True))
    except Exception as e:  # noqa: BLE001 - ChatTemplateError, message shapes: the caller's
        raise InvalidRequest(f"messages could not be rendered with the chat template: "
                             f"{type(e).__name__}: {e}", "messages") from None


def tokenize(inp: PromptInput, tokenizer: Tokenizer,
             limits: EngineLimits | None = None) -> list[int]:
    """Token ids of the input exactly as the offline API computes them (blocking); `limits`:
    texts bounded by the prompt byte bound before they are tokenized."""
    max_bytes = limits.max_prompt_bytes if limits is not None else None
    if inp.token_ids is not None:
        return list(inp.token_ids)
    if inp.text is not None:
        check_prompt_text(inp.text, max_bytes)
        return tokenizer.encode(inp.text, add_special_tokens=inp.add_special_tokens)
    assert inp.chat is not None
    return render_chat(inp.chat, tokenizer, inp.add_generation_prompt, limits)


def admit_input(inp: PromptInput, params: SamplingParams, limits: EngineLimits,
                tokenizer: Tokenizer) -> Admitted:
    """Every request check of one prompt (blocking: it tokenizes)."""
    if inp.text is not None:
        return limits.admit(inp.text, params, lambda text: tokenizer.encode(
            text, add_special_tokens=inp.add_special_tokens))
    if inp.chat is not None:
        limits.check_params(params)  # before the template runs
    return limits.admit(tokenize(inp, tokenizer, limits), params)


def input_chars(inp: PromptInput) -> int:
    """The input's text length in characters (cheap: no encoding): a lower bound of its
    UTF-8 size, used to refuse oversized inputs on the event loop and to pick a lane."""
    if inp.text is not None:
        return len(inp.text)
    return _chat_chars(inp.chat) if inp.chat is not None else 0


def _chat_chars(messages: Sequence[Any]) -> int:
    return sum(len(m["content"]) for m in messages
               if isinstance(m, dict) and isinstance(m.get("content"), str))


class Admission:
    """One served model's admission for the async fronts: the engine's limits, its tokenizer,
    the priority range clients may use, and the two tokenizer lanes (thread pools) shared by
    both fronts: `threads` workers for small inputs, half as many (at least one) for large."""

    def __init__(self, limits: EngineLimits, tokenizer: Tokenizer, threads: int = 2,
                 client_priority_range: tuple[int, int] = DEFAULT_CLIENT_PRIORITY_RANGE):
        self.limits = limits
        self.tokenizer = tokenizer
        self.client_priority_range = client_priority_range
        self._pool = concurrent.futures.ThreadPoolExecutor(
            threads, thread_name_prefix="jaxserve-tokenize")
        self._large_pool = concurrent.futures.ThreadPoolExecutor(
            max(1, threads // 2), thread_name_prefix="jaxserve-tokenize-large")

    def _lane(self, inp: PromptInput) -> concurrent.futures.ThreadPoolExecutor:
        """The lane of a text / chat input, after its checks that need no tokenizer (on the
        loop, linear in the input, itself bounded: an input that cannot fit never takes a
        worker)."""
        if inp.chat is not None:
            check_chat(inp.chat, self.limits.max_prompt_bytes)
        else:
            check_prompt_text(inp.text, self.limits.max_prompt_bytes)
        return self._large_pool if input_chars(inp) > LARGE_INPUT_CHARS else self._pool

    async def tokenize(self, inp: PromptInput) -> list[int]:
        if inp.token_ids is not None:
            return list(inp.token_ids)  # nothing to tokenize: skip the thread hop
        return await asyncio.get_running_loop().run_in_executor(
            self._lane(inp), tokenize, inp, self.tokenizer, self.limits)

    async def admit(self, request_id: str, inp: PromptInput, params: SamplingParams,
                    priority: int = 0) -> Admitted:
        """Every request check (InvalidRequest naming the field), the client's priority
        included; the result goes to `submit` as the prompt."""
        check_request_id(request_id)
        check_priority(priority, self.client_priority_range)
        if inp.text is None and inp.chat is None:  # token ids: cheap, stay on the loop
            return admit_input(inp, params, self.limits, self.tokenizer)
        self.limits.check_params(params)
        return await asyncio.get_running_loop().run_in_executor(
            self._lane(inp), admit_input, inp, params, self.limits, self.tokenizer)

    def close(self) -> None:
        for pool in (self._pool, self._large_pool):
            pool.shutdown(wait=False, cancel_futures=True)
