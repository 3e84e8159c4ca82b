"""vLLM's prompt forms for the offline API: a text, token ids, or a prompt dict.

`prompt_of` maps one `LLM.generate` prompt to what admission takes (a text or token ids):
  "text" / [ids]                        as they are;
  {"prompt": "text"}                    vLLM's TextPrompt;
  {"prompt_token_ids": [ids]}           vLLM's TokensPrompt.
A key this server does not implement (vLLM's `multi_modal_data`, `mm_processor_kwargs`,
`multi_modal_uuids`, `cache_salt`, ...) is refused with an InvalidRequest naming it, never
dropped; the prompt's own contents are admission's to check.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from jaxserve.engine.errors import InvalidRequest
from jaxserve.engine.sampling_params import show

FORMS = ("prompt", "prompt_token_ids")
# vLLM's keys that need what this server does not have, and why they are refused.
WHY = {"multi_modal_data": "the served models take text only",
       "mm_processor_kwargs": "the served models take text only",
       "multi_modal_uuids": "the served models take text only",
       "prompt_embeds": "prompts are text or token ids",
       "cache_salt": "the prefix cache is not salted per request"}

Prompt = str | Sequence[int] | Mapping[str, Any]


def is_one_prompt(value: object) -> bool:
    """Whether `value` is one prompt (not a list of them)."""
    return isinstance(value, (str, Mapping)) or (
        isinstance(value, Sequence) and bool(value) and isinstance(value[0], int))


def prompt_of(value: Prompt, where: str = "prompt") -> str | Sequence[int]:
    """The text or token ids of one prompt (`where`: how an error names it, e.g.
    "prompts[2]")."""
    if not isinstance(value, Mapping):
        return value
    for key in value:
        if key not in FORMS:
            why = WHY.get(key, "it is not a prompt field this server knows") \
                if isinstance(key, str) else "prompt fields are strings"
            raise InvalidRequest(f"{where}[{show(key)}] is not supported ({why}); a prompt "
                                 "dict holds prompt or prompt_token_ids", _name(key))
    given = [k for k in FORMS if value.get(k) is not None]
    if len(given) != 1:
        raise InvalidRequest(f"{where} must hold exactly one of prompt (a text) and "
                             f"prompt_token_ids (a list of token ids); got {given or 'none'}",
                             "prompt")
    key = given[0]
    inner = value[key]
    if key == "prompt" and not isinstance(inner, str):
        raise InvalidRequest(f"{where}[\"prompt\"]={show(inner)} must be a string", "prompt")
    if key == "prompt_token_ids" and (isinstance(inner, (str, bytes)) or
                                      not isinstance(inner, Sequence)):
        raise InvalidRequest(f"{where}[\"prompt_token_ids\"]={show(inner)} must be a list of "
                             "token ids", "prompt_token_ids")
    return inner


def _name(key: object) -> str:
    return key[:64] if isinstance(key, str) else show(key)
