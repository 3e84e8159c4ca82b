"""vLLM's utility endpoints on the OpenAI HTTP front: GET /version, POST /tokenize and
POST /detokenize, in vLLM's shapes.

  /tokenize    {"prompt": TEXT, "add_special_tokens": true} or {"messages": [...],
               "add_generation_prompt": true, "continue_final_message", "chat_template",
               "chat_template_kwargs", "tools"} -> {"count", "max_model_len", "tokens",
               "token_strs"} (token_strs with "return_token_strs": true, else null). Text and
               chat go through admission's tokenization (the same rendering and size checks
               as a generation request, off the event loop).
  /detokenize  {"tokens": [ids]} -> {"prompt": TEXT} (ids checked as a prompt's).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiohttp import web

from jaxserve import __version__
from jaxserve.server import openai_chat_schema as chat_schema
from jaxserve.server import openai_schema as schema
from jaxserve.server.http_body import read_json
from jaxserve.serving import admission

if TYPE_CHECKING:
    from jaxserve.server.openai_http import OpenAIHttpFront

_BOOLS = ("add_special_tokens", "add_generation_prompt", "continue_final_message",
          "return_token_strs")


async def version(front: "OpenAIHttpFront", request: web.Request) -> web.Response:
    return web.json_response({"version": __version__})


def _tokenize_input(body: dict[str, Any]) -> admission.PromptInput:
    """A prompt, or chat messages rendered as /v1/chat/completions renders them; a null
    boolean is its default (true), as on the chat endpoint."""
    if (body.get("prompt") is None) == (body.get("messages") is None):
        raise schema.bad_request("send exactly one of prompt (a string) and messages",
                                 "prompt")
    if body.get("prompt") is not None:
        if not isinstance(body["prompt"], str):
            raise schema.bad_request("prompt must be a string", "prompt")
        return admission.PromptInput(
            text=body["prompt"], add_special_tokens=body.get("add_special_tokens") is not False)
    return chat_schema.chat_input(body)[0]


async def tokenize(front: "OpenAIHttpFront", request: web.Request) -> web.Response:
    _, _, admit = front.ready()
    body = schema.check_common(
        await read_json(request, front.max_body_bytes, front.body_timeout), _BOOLS,
        sampling=False)
    front.check_model(body)
    inp, token_strs = _tokenize_input(body), body.get("return_token_strs")
    schema.refuse_unread(body)
    try:
        ids = await admit.tokenize(inp)
    except ValueError as e:
        raise schema.invalid(e) from None
    strs = [admit.tokenizer.id_to_token(t) for t in ids] if token_strs else None
    return web.json_response({"count": len(ids), "max_model_len": admit.limits.max_model_len,
                              "tokens": ids, "token_strs": strs})


async def detokenize(front: "OpenAIHttpFront", request: web.Request) -> web.Response:
    _, _, admit = front.ready()
    body = schema.check_common(
        await read_json(request, front.max_body_bytes, front.body_timeout), sampling=False)
    front.check_model(body)
    tokens = body.get("tokens")
    schema.refuse_unread(body)
    if not isinstance(tokens, list):
        raise schema.bad_request("tokens must be a list of token ids", "tokens")
    try:
        text = await admit.detokenize(tokens)
    except ValueError as e:
        # limits name the ids "prompt_token_ids" or "prompt" (the count): here, "tokens"
        raise schema.invalid(e, {"prompt_token_ids": "tokens", "prompt": "tokens"}) from None
    return web.json_response({"prompt": text})
