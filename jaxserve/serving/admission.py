"""Admission: a caller's prompt -> token ids, and every check a request passes before the engine.

Both fronts (gRPC, OpenAI HTTP) admit requests through one `Admission` per served model, and
the offline API (`LLM`, `jaxserve batch`) through the same functions, synchronously, so the same
bad input gets the same error text everywhere. Data flow: a `PromptInput` (text, token ids or
chat messages) -> `admit_input` (chat roles, then `EngineLimits.admit`: empty prompt,
tokenization, vocabulary, max_model_len / max_tokens, KV fit) -> an `Admitted` request, which
the engine queues without checking again. `Admission` runs the tokenizer on a small thread pool
(never on the event loop, never between engine steps). Duplicate in-flight ids are refused by
what the request is submitted to (`AsyncEngine`, `AsyncReplicaPool`, `Engine`), through the
one `limits.check_not_in_flight`.

Every error raised here is an `InvalidRequest` (a ValueError) whose `field` names the field in
the offline API's words; the fronts rename it to their wire names (`InvalidRequest.message_as`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
from typing import Any, Sequence

from jaxserve.engine.limits import (Admitted, EngineLimits, InvalidRequest, check_prompt_text,
                                    check_request_id)
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.models.tokenizer import Tokenizer

CHAT_ROLES = ("system", "user", "assistant", "tool")

__all__ = ["Admission", "Admitted", "CHAT_ROLES", "InvalidRequest", "PromptInput", "admit_input",
           "check_chat", "render_chat", "tokenize"]


@dataclasses.dataclass(frozen=True)
class PromptInput:
    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    chat: tuple[dict[str, str], ...] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True


def check_chat(messages: Sequence[Any]) -> tuple[dict[str, str], ...]:
    """A non-empty list of {"role", "content"} messages with known roles."""
    if not messages:
        raise InvalidRequest("messages must not be empty", "messages")
    out = []
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in CHAT_ROLES:
            raise InvalidRequest(f"messages[{i}].role={role!r} must be one of "
                                 f"{', '.join(CHAT_ROLES)}", "messages")
        out.append(dict(m))
    return tuple(out)


def render_chat(messages: Sequence[Any], tokenizer: Tokenizer,
                add_generation_prompt: bool = True) -> list[int]:
    """The token ids of a conversation through the model's chat template."""
    msgs = check_chat(messages)
    try:
        return list(tokenizer.apply_chat_template([dict(m) for m in msgs],
                                                  add_generation_prompt, tokenize=True))
    except Exception as e:  # noqa: BLE001 - ChatTemplateError, message shapes: the caller's
        raise InvalidRequest(f"messages could not be rendered with the chat template: "
                             f"{type(e).__name__}: {e}", "messages") from None


def tokenize(inp: PromptInput, tokenizer: Tokenizer) -> list[int]:
    """Token ids of the input exactly as the offline API computes them (blocking)."""
    if inp.token_ids is not None:
        return list(inp.token_ids)
    if inp.text is not None:
        check_prompt_text(inp.text)
        return tokenizer.encode(inp.text, add_special_tokens=inp.add_special_tokens)
    assert inp.chat is not None
    return render_chat(inp.chat, tokenizer, inp.add_generation_prompt)


def admit_input(inp: PromptInput, params: SamplingParams, limits: EngineLimits,
                tokenizer: Tokenizer) -> Admitted:
    """Every request check of one prompt (blocking: it tokenizes)."""
    if inp.text is not None:
        return limits.admit(inp.text, params, lambda text: tokenizer.encode(
            text, add_special_tokens=inp.add_special_tokens))
    return limits.admit(tokenize(inp, tokenizer), params)


class Admission:
    """One served model's admission for the async fronts: the engine's limits, its tokenizer
    and the small thread pool that tokenizes (shared by both fronts)."""

    def __init__(self, limits: EngineLimits, tokenizer: Tokenizer, threads: int = 2):
        self.limits = limits
        self.tokenizer = tokenizer
        self._pool = concurrent.futures.ThreadPoolExecutor(
            threads, thread_name_prefix="jaxserve-tokenize")

    async def tokenize(self, inp: PromptInput) -> list[int]:
        if inp.token_ids is not None:
            return list(inp.token_ids)  # nothing to tokenize: skip the thread hop
        return await asyncio.get_running_loop().run_in_executor(
            self._pool, tokenize, inp, self.tokenizer)

    async def admit(self, request_id: str, inp: PromptInput,
                    params: SamplingParams) -> Admitted:
        """Every request check (InvalidRequest naming the field); the result goes to
        `submit` as the prompt."""
        check_request_id(request_id)
        if inp.text is None and inp.chat is None:  # token ids: cheap, stay on the loop
            return admit_input(inp, params, self.limits, self.tokenizer)
        return await asyncio.get_running_loop().run_in_executor(
            self._pool, admit_input, inp, params, self.limits, self.tokenizer)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
