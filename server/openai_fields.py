"""Which top-level fields of an HTTP body an endpoint takes: those its mappers read.

A body is wrapped in a `Body` by `openai_schema.check_common`; every `get`, `[]` and `in`
of the endpoint's parsing (its own fields, the sampling registry's, the structured-output
and tool fields, `model`, ...) marks the field as read. Once parsed, `refuse_unread` answers
a 400 naming the first non-null field nothing read, so a field the server does not
implement (vLLM's `use_beam_search`, `guided_decoding_backend`, `prompt_embeds`, a typo) is
refused rather than accepted and ignored, and a field a mapper starts reading is accepted
with no list to update. The only exceptions are `NO_OP_VALUES`: vLLM's extras at the value
that asks for nothing this server would have to do (`use_beam_search: false`), which
clients built for vLLM send. Nested objects (`structured_outputs`, `stream_options`, ...)
are their mappers' to check.
"""

from __future__ import annotations

from typing import Any

from jaxserve.engine.sampling_params import show

# field -> the one value that asks for nothing (vLLM's default), accepted without effect.
NO_OP_VALUES: dict[str, Any] = {
    "use_beam_search": False,  # vLLM: beam search off (jaxserve implements none)
    "length_penalty": 1.0,  # vLLM: beam search's length penalty, 1 = none
    "return_tokens_as_token_ids": False,  # vLLM: tokens as "token_id:N" strings
    "add_special_tokens": False,  # chat: vLLM's default (the template writes them)
}
# Why a field vLLM takes is refused, where a reason helps the client.
WHY: dict[str, str] = {
    "use_beam_search": "beam search is not implemented",
    "guided_decoding_backend": "the grammar backend (llguidance) is not chosen per request",
    "prompt_embeds": "prompts are text or token ids",
    "logits_processors": "custom logits processors are not implemented",
    "request_id": "the server names requests (its id comes back in the response)",
}


class Body(dict):
    """A JSON object body that records the fields read from it (`read`)."""

    def __init__(self, body: dict[str, Any]) -> None:
        super().__init__(body)
        self.read: set[str] = set()

    def get(self, key: Any, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key: Any) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self.read.add(key)  # type: ignore[arg-type]
        return super().__contains__(key)


def _no_op(name: str, value: Any) -> bool:
    want = NO_OP_VALUES.get(name, ...)
    return want is not ... and type(value) is type(want) and value == want or (
        isinstance(want, float) and type(value) is int and value == want)


def unread(body: Body) -> str | None:
    """The first non-null field of `body` nothing read and no no-op value, or None."""
    for name, value in dict.items(body):
        if value is None or name in body.read or _no_op(name, value):
            continue
        return name
    return None


def refusal(body: Body) -> tuple[str, str] | None:
    """(message, field) refusing the body's first unread field, or None when all were read."""
    name = unread(body)
    if name is None:
        return None
    value = dict.__getitem__(body, name)
    why = WHY.get(name)
    text = f"{name[:64]} is not supported by this endpoint"
    if name in NO_OP_VALUES:
        text += f" (only {show(NO_OP_VALUES[name])}, its default, is accepted)"
    elif why is not None:
        text += f" ({why})"
    return f"{text}; got {show(value)}", name[:64]
