"""gRPC request decoding and the last-resort error mapping, for every service on the server.

grpc calls a method's `request_deserializer` before the servicer sees the call; when the
bytes do not decode (`DecodeError`, invalid UTF-8 in a string field, truncated input) it
answers UNKNOWN "Unexpected DecodeError". `WireGuardInterceptor` (a server interceptor, so
Generation, health and reflection all get it) swaps each unary-request method's deserializer
for one that returns an `Undecodable` instead of raising, and wraps the method so that an
`Undecodable` request is answered INVALID_ARGUMENT before the servicer runs.

Data flow of a unary-request call: bytes -> `_safe(deserializer)` -> message | Undecodable
-> wrapper: Undecodable -> INVALID_ARGUMENT "the request does not decode as <Message>: ...";
otherwise the servicer method; an exception escaping it (not an abort, not a cancel) is a bug:
logged with its traceback and answered INTERNAL. Methods that stream their requests
(reflection's ServerReflectionInfo) keep grpc's own handling: they decode message by message
inside the servicer's iterator, where no answer can be given first.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from typing import Any, AsyncIterator, Awaitable, Callable

import grpc

log = logging.getLogger(__name__)
_Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]]


class Undecodable:
    """A request whose bytes did not decode as the method's message type."""

    __slots__ = ("reason",)

    def __init__(self, reason: str):
        self.reason = reason


def _safe(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as e:  # noqa: BLE001 - DecodeError and kin: the client's bytes
            return Undecodable(f"the request does not decode as this method's message: {e}")
    return deserialize


async def _refuse_undecodable(request: Any, context: grpc.aio.ServicerContext) -> None:
    if isinstance(request, Undecodable):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)


async def _internal(method: str, context: grpc.aio.ServicerContext) -> None:
    log.exception("unhandled error in %s (a bug)", method)
    await context.abort(grpc.StatusCode.INTERNAL,
                        "internal error (a bug; the server logged it)")


def _wrap_unary(method: str, behavior: Callable[..., Awaitable[Any]]
                ) -> Callable[..., Awaitable[Any]]:
    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await _refuse_undecodable(request, context)
        try:
            return await behavior(request, context)
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception:  # noqa: BLE001 - see _internal
            await _internal(method, context)
    return call


def _wrap_stream(method: str, behavior: Callable[..., AsyncIterator[Any]]
                 ) -> Callable[..., AsyncIterator[Any]]:
    async def call(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await _refuse_undecodable(request, context)
        responses = behavior(request, context)
        try:
            async for response in responses:
                yield response
        except (grpc.aio.AbortError, asyncio.CancelledError, GeneratorExit):
            raise
        except Exception:  # noqa: BLE001 - see _internal
            await _internal(method, context)
        finally:
            # Closed now, not when collected: its own `finally` aborts the request in the
            # engine (a cancel or disconnect closes this wrapper at its `yield`).
            await responses.aclose()
    return call


def guard(method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """`handler` with decode errors as INVALID_ARGUMENT and bugs as INTERNAL (unary-request
    methods whose behavior is a coroutine or an async generator); others unchanged."""
    if handler.request_streaming or handler.request_deserializer is None:
        return handler
    kw = dict(request_deserializer=_safe(handler.request_deserializer),
              response_serializer=handler.response_serializer)
    if handler.unary_unary is not None and inspect.iscoroutinefunction(handler.unary_unary):
        return grpc.unary_unary_rpc_method_handler(_wrap_unary(method, handler.unary_unary),
                                                   **kw)
    behavior = handler.unary_stream
    if behavior is not None and inspect.isasyncgenfunction(behavior):
        return grpc.unary_stream_rpc_method_handler(_wrap_stream(method, behavior), **kw)
    if behavior is not None and inspect.iscoroutinefunction(behavior):  # writes via context
        return grpc.unary_stream_rpc_method_handler(_wrap_unary(method, behavior), **kw)
    return handler


class WireGuardInterceptor(grpc.aio.ServerInterceptor):
    """Applies `guard` to every method's handler; goes after the API-key interceptor, so an
    unauthenticated caller's bytes are never decoded."""

    async def intercept_service(self, continuation: _Continuation,
                                handler_call_details: grpc.HandlerCallDetails
                                ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        return guard(handler_call_details.method or "", handler)
