"""The admin endpoint of both fronts: the live scheduler settings (read and change).

  HTTP  GET  /admin/scheduler  -> the settings as JSON, named as the flags
        POST /admin/scheduler  {field: value, ...} -> the new settings
  gRPC  jaxserve.v1.Admin/GetSchedulerConfig, /UpdateSchedulerConfig (`SchedulerSettings`:
        decode_token_budget 0 and an SLO "" mean none, as JSON's null does)
And the LoRA adapters (`serving.lora_adapters.LoraAdmin`; HTTP: vLLM's endpoints in
`openai_lora.py`): gRPC Admin/LoadLoraAdapter, /UnloadLoraAdapter behind the same gate
(ListLoraAdapters is open to every caller the server lets in, as /v1/models is).

Who may call it: with API keys configured, any caller with a key (without one: 401 /
UNAUTHENTICATED, answered by the fronts' own key checks before anything here runs); with
none, nobody (403 / PERMISSION_DENIED) unless the server runs with `--enable-admin`
(`ServerConfig.enable_admin`: a trusted network).

Data flow of a change: the wire form -> {field: value} (`admin_wire.changes_from_proto` maps
the proto's conventions; JSON is taken as it is: nothing is validated here) -> `serving.
admin_settings.SchedulerAdmin.update` (the engine checks every field against what start-up
compiled: its InvalidRequest names the field and the limit -> 400 / INVALID_ARGUMENT with
that message) -> one INFO log line naming the caller and each field's old -> new value ->
the settings the next step runs with.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Mapping

import grpc
from aiohttp import web

from jaxserve.engine.errors import InvalidRequest
from jaxserve.server import openai_schema as schema
from jaxserve.server import stubs
from jaxserve.server.admin_wire import changes_from_proto, settings_to_proto
from jaxserve.server.http_body import read_json
from jaxserve.serving.async_engine import EngineStopped
from jaxserve.serving.admin_settings import SchedulerAdmin
from jaxserve.serving.lora_adapters import LoraAdmin
from jaxserve.serving.lora_requests import LoraNotFound

if TYPE_CHECKING:
    from jaxserve.server.openai_http import OpenAIHttpFront

log = logging.getLogger(__name__)
_stubs = stubs.load()
pb2 = _stubs.pb2
SERVICE_NAME = pb2.DESCRIPTOR.services_by_name["Admin"].full_name
PATH = "/admin/scheduler"
REFUSED = ("the admin endpoint is off: this server has no API key; start it with --api-key "
           "(callers then send it) or, on a trusted network, with --enable-admin")


def log_change(who: str, before: Mapping[str, Any], after: Mapping[str, Any]) -> None:
    moved = [f"{k} {before[k]!r} -> {after[k]!r}" for k in after if before.get(k) != after[k]]
    log.info("scheduler settings changed by %s: %s", who, ", ".join(moved) or "no change")


# --------------------------------------------------------------------------- gRPC
class AdminServicer(_stubs.grpc.AdminServicer):
    def __init__(self, requires_key: bool, enable_admin: bool):
        """`requires_key`: the server has API keys (its key interceptor refused callers
        without one before this runs); without, callers are refused unless `enable_admin`."""
        self._allowed = requires_key or enable_admin
        self._admin: SchedulerAdmin | None = None
        self._loras: LoraAdmin | None = None

    def attach(self, admin: SchedulerAdmin, loras: LoraAdmin | None = None) -> None:
        self._admin, self._loras = admin, loras

    async def _ready(self, context: grpc.aio.ServicerContext, gated: bool = True
                     ) -> SchedulerAdmin:
        if gated and not self._allowed:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, REFUSED)
        if self._admin is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                "the model is loading; retry when health reports SERVING")
        assert self._admin is not None
        return self._admin

    async def GetSchedulerConfig(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return settings_to_proto((await self._ready(context)).settings())

    async def UpdateSchedulerConfig(self, request: Any,
                                    context: grpc.aio.ServicerContext) -> Any:
        admin = await self._ready(context)
        try:
            before, after = await admin.update(changes_from_proto(request))
        except EngineStopped as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                str(InvalidRequest.of(e)))
        log_change(f"gRPC peer {context.peer()}", before, after)
        return settings_to_proto(after)

    # ----------------------------------------------------------------------- LoRA
    async def _lora_admin(self, context: grpc.aio.ServicerContext, gated: bool = True
                          ) -> LoraAdmin:
        await self._ready(context, gated)
        if self._loras is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is loading")
        assert self._loras is not None
        return self._loras

    async def _lora_call(self, context: grpc.aio.ServicerContext, call: Any) -> Any:
        try:
            return await call
        except LoraNotFound as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        except EngineStopped as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(InvalidRequest.of(e)))

    async def LoadLoraAdapter(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        loras = await self._lora_admin(context)
        lora_id = request.lora_int_id if request.HasField("lora_int_id") else None
        added = await self._lora_call(context, loras.load(request.lora_name, request.lora_path,
                                                          lora_id))
        log.info("LoRA adapter %r (lora_int_id %d) loaded from %s by gRPC peer %s",
                 added.lora_name, added.lora_int_id, added.lora_path, context.peer())
        return lora_to_proto(added)

    async def UnloadLoraAdapter(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        loras = await self._lora_admin(context)
        lora_id = request.lora_int_id if request.HasField("lora_int_id") else None
        gone = await self._lora_call(context, loras.unload(request.lora_name, lora_id))
        log.info("LoRA adapter %r unloaded by gRPC peer %s", gone.lora_name, context.peer())
        return lora_to_proto(gone)

    async def ListLoraAdapters(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        loras = await self._lora_admin(context, gated=False)
        return pb2.LoraAdapters(adapters=[lora_to_proto(r) for r in loras.list()])


def lora_to_proto(r: Any) -> Any:
    """A `LoRARequest` as the wire's LoraAdapter."""
    return pb2.LoraAdapter(lora_name=r.lora_name, lora_int_id=r.lora_int_id,
                           lora_path=r.lora_path)


# --------------------------------------------------------------------------- HTTP
def _admin(front: "OpenAIHttpFront") -> SchedulerAdmin:
    if not front.requires_key and not front.enable_admin:
        raise schema.ApiError(403, REFUSED, None, "permission_error", "admin_disabled")
    front.ready()  # 503 while loading, draining or failed
    assert front.admin is not None
    return front.admin


async def get_scheduler(front: "OpenAIHttpFront", request: web.Request) -> web.Response:
    return web.json_response(_admin(front).settings())


async def post_scheduler(front: "OpenAIHttpFront", request: web.Request) -> web.Response:
    admin = _admin(front)
    body = await read_json(request, front.max_body_bytes, front.body_timeout)
    try:
        before, after = await admin.update(body)
    except EngineStopped as e:
        raise schema.unavailable(str(e)) from None
    except ValueError as e:
        error = InvalidRequest.of(e)
        raise schema.bad_request(str(error), error.field) from None
    log_change(f"HTTP client {request.remote}", before, after)
    return web.json_response(after)
