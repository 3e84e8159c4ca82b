"""The admin endpoint of both fronts: the live scheduler settings (read and change).

  HTTP  GET  /admin/scheduler  -> the settings as JSON, named as the flags
        POST /admin/scheduler  {field: value, ...} -> the new settings
  gRPC  jaxserve.v1.Admin/GetSchedulerConfig, /UpdateSchedulerConfig (`SchedulerSettings`:
        decode_token_budget 0 and an SLO "" mean none, as JSON's null does)

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

    def attach(self, admin: SchedulerAdmin) -> None:
        self._admin = admin

    async def _ready(self, context: grpc.aio.ServicerContext) -> SchedulerAdmin:
        if not self._allowed:
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
