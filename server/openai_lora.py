"""LoRA adapters on the OpenAI HTTP front: which adapter a body's `model` names, the adapters
in /v1/models, and vLLM's runtime endpoints to load and unload them.

  model resolution  a body's `model`: absent / null or a base model name (the served names,
                    else the model's own) -> the base model; a loaded adapter's name -> that
                    adapter (responses then name it as their `model`); any other name -> 404
                    NotFoundError (param "model"). A server without --served-model-name and
                    without --enable-lora answers to any name, as before.
  /v1/models        the base model's entries ("parent": null), then one per adapter with
                    "root" its path and "parent" the base model's id (vLLM's shape).
  POST /v1/load_lora_adapter    {"lora_name", "lora_path", "lora_int_id"?} -> 200 text
                    "Success: LoRA adapter 'NAME' added successfully."; 400 naming the
                    problem (a bad adapter: missing files, rank over --max-lora-rank, ...; a
                    name already loaded; a server without --enable-lora).
  POST /v1/unload_lora_adapter  {"lora_name", "lora_int_id"?} -> 200 text "Success: LoRA
                    adapter 'NAME' removed successfully."; 404 for a name not loaded.
                    Requests already running under it finish; new ones naming it get 404.

Who may load and unload (vLLM asks for VLLM_ALLOW_RUNTIME_LORA_UPDATING): the admin gate
(`admin.py`): with API keys, any caller with a key; without, nobody (403) unless the server
runs with --enable-admin. The work is `serving.lora_adapters.LoraAdmin`'s (every replica).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from aiohttp import web

from jaxserve.engine.errors import InvalidRequest
from jaxserve.engine.lora_request import LoRARequest
from jaxserve.server import admin
from jaxserve.server import openai_schema as schema
from jaxserve.server.http_body import read_json
from jaxserve.serving.async_engine import EngineStopped
from jaxserve.serving.lora_adapters import LoraAdmin
from jaxserve.serving.lora_requests import LoraNotFound

if TYPE_CHECKING:
    from jaxserve.server.openai_http import OpenAIHttpFront

log = logging.getLogger(__name__)
LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"
_LOAD_KEYS = ("lora_name", "lora_path", "lora_int_id")
_UNLOAD_KEYS = ("lora_name", "lora_int_id")


def not_found(error: LoraNotFound) -> schema.ApiError:
    """OpenAI's (and vLLM's) 404 for a model name nothing serves."""
    return schema.ApiError(404, str(error), "model", "NotFoundError", 404)


def resolve(loras: LoraAdmin, body: dict[str, Any], strict: bool) -> LoRARequest | None:
    """The adapter the body's `model` names (None: the base model); 404 for an unknown
    name (`strict`: served names are set; without them, only when LoRA is on)."""
    try:
        return loras.resolve(body.get("model"), strict)
    except LoraNotFound as e:
        raise not_found(e) from None


def model_cards(loras: LoraAdmin, base: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """/v1/models' data: the base model's cards, then each adapter's."""
    parent = base[0]["id"]
    return [{**card, "parent": None} for card in base] + [
        {**base[0], "id": r.lora_name, "root": r.lora_path, "parent": parent}
        for r in loras.list()]


def _gate(front: "OpenAIHttpFront") -> LoraAdmin:
    if not front.requires_key and not front.enable_admin:
        raise schema.ApiError(403, admin.REFUSED.replace("the admin endpoint is",
                                                         "loading LoRA adapters is"),
                              None, "permission_error", "admin_disabled")
    front.ready()  # 503 while loading, draining or failed
    assert front.loras is not None
    return front.loras


async def _body(front: "OpenAIHttpFront", request: web.Request,
                keys: tuple[str, ...]) -> dict[str, Any]:
    body = await read_json(request, front.max_body_bytes, front.body_timeout)
    if not isinstance(body, dict):
        raise schema.bad_request("the request body must be a JSON object")
    extra = sorted(set(body) - set(keys))
    if extra:
        raise schema.bad_request(f"unknown field {extra[0]!r:.60}: this endpoint takes "
                                 f"{', '.join(keys)}", extra[0])
    return body


def _refused(e: Exception) -> schema.ApiError:
    if isinstance(e, LoraNotFound):
        return schema.ApiError(404, str(e), "lora_name", "NotFoundError", 404)
    if isinstance(e, EngineStopped):
        return schema.unavailable(str(e))
    error = InvalidRequest.of(e)  # type: ignore[arg-type]
    return schema.bad_request(str(error), error.field)


async def load_adapter(front: "OpenAIHttpFront", request: web.Request) -> web.Response:
    loras = _gate(front)
    body = await _body(front, request, _LOAD_KEYS)
    try:
        added = await loras.load(body.get("lora_name"), body.get("lora_path"),
                                 body.get("lora_int_id"))
    except (ValueError, LookupError, EngineStopped) as e:
        raise _refused(e) from None
    log.info("LoRA adapter %r (lora_int_id %d) loaded from %s by HTTP client %s",
             added.lora_name, added.lora_int_id, added.lora_path, request.remote)
    return web.Response(text=f"Success: LoRA adapter '{added.lora_name}' added successfully.")


async def unload_adapter(front: "OpenAIHttpFront", request: web.Request) -> web.Response:
    loras = _gate(front)
    body = await _body(front, request, _UNLOAD_KEYS)
    try:
        gone = await loras.unload(body.get("lora_name"), body.get("lora_int_id"))
    except (ValueError, LookupError, EngineStopped) as e:
        raise _refused(e) from None
    log.info("LoRA adapter %r unloaded by HTTP client %s", gone.lora_name, request.remote)
    return web.Response(text=f"Success: LoRA adapter '{gone.lora_name}' removed successfully.")
