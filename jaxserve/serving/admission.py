"""Admission: a caller's prompt -> token ids, and every check a request passes before the engine.

Both fronts (gRPC, OpenAI HTTP) and the offline API admit requests through here, so the same
bad input gets the same error text everywhere. Data flow: a `PromptInput` (text, token ids or
chat messages) -> `tokenize` (blocking: the fronts run it on a worker thread) -> `check_prompt`
(vocabulary, max_model_len, max_tokens) -> the engine.

Every error raised here is an `InvalidRequest` (a ValueError) whose message names the field.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.models.tokenizer import Tokenizer

CHAT_ROLES = ("system", "user", "assistant", "tool")


class InvalidRequest(ValueError):
    """A request field is invalid; the message names it and its allowed range."""


@dataclasses.dataclass(frozen=True)
class PromptInput:
    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    chat: tuple[dict[str, str], ...] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True


def tokenize(inp: PromptInput, tokenizer: Tokenizer) -> list[int]:
    """Token ids of the input exactly as the offline API computes them (blocking: run it on
    a worker thread)."""
    if inp.token_ids is not None:
        return list(inp.token_ids)
    if inp.text is not None:
        return tokenizer.encode(inp.text, add_special_tokens=inp.add_special_tokens)
    assert inp.chat is not None
    try:
        return list(tokenizer.apply_chat_template([dict(m) for m in inp.chat],
                                                  inp.add_generation_prompt, tokenize=True))
    except ValueError as e:  # ChatTemplateError and message-shape errors
        raise InvalidRequest(f"chat: {e}") from None


def check_prompt(ids: Sequence[int], params: SamplingParams, vocab_size: int,
                 max_model_len: int) -> None:
    """The length and vocabulary limits of the model (the KV fit is the engine's check)."""
    if not ids:
        raise InvalidRequest("prompt tokenizes to no tokens")
    for i, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            raise InvalidRequest(f"token_ids.ids[{i}]={t} is outside the vocabulary "
                                 f"[0, {vocab_size})")
    n = len(ids)
    if n >= max_model_len:
        raise InvalidRequest(f"prompt has {n} tokens; max_model_len={max_model_len} allows at "
                             f"most {max_model_len - 1} prompt tokens")
    if params.max_tokens is not None and n + params.max_tokens > max_model_len:
        raise InvalidRequest(
            f"sampling.max_tokens={params.max_tokens} is over the limit: prompt ({n} tokens) + "
            f"max_tokens must be <= max_model_len={max_model_len}, so max_tokens must be in "
            f"[1, {max_model_len - n}]")
