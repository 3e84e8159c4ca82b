"""API-key authentication over `authorization: Bearer <key>`, for both fronts.

`ApiKeys.allows(header value)` is the check itself; the gRPC front calls it through
`ApiKeyInterceptor` (an asyncio server interceptor), the HTTP front from its middleware.
Data flow (gRPC): every call's metadata -> `ApiKeyInterceptor.intercept_service` -> the bearer
token is compared with each configured key by `hmac.compare_digest` over SHA-256 digests (constant
time, and equal-length inputs so the key length does not leak either) -> the real handler, or
one of the same streaming shape that ends the call with UNAUTHENTICATED.

The health service stays open: load balancers and Kubernetes gRPC probes send no metadata,
and health reveals nothing but SERVING / NOT_SERVING.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any, Awaitable, Callable, Sequence

import grpc

OPEN_PREFIXES = ("/grpc.health.v1.Health/",)


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode("utf-8", "surrogatepass")).digest()


class ApiKeys:
    """The configured keys; `allows` is the one bearer-token check both fronts call."""

    def __init__(self, api_keys: Sequence[str]):
        if not api_keys or any(not k for k in api_keys):
            raise ValueError("api_keys must be a non-empty list of non-empty keys")
        self._digests = tuple(_digest(k) for k in api_keys)

    def allows(self, authorization: str | None) -> bool:
        """Whether an `authorization` header / metadata value is `Bearer <a known key>`."""
        if not isinstance(authorization, str):
            return False
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer":
            return False
        digest = _digest(token.strip())
        ok = False
        for known in self._digests:  # no early exit: time does not depend on which key
            ok |= hmac.compare_digest(digest, known)
        return ok


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, api_keys: Sequence[str]):
        self.keys = ApiKeys(api_keys)

    def authorized(self, metadata: Sequence[tuple[str, Any]] | None) -> bool:
        value = next((v for k, v in metadata or () if k == "authorization"), None)
        return self.keys.allows(value)

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails],
                                         Awaitable[grpc.RpcMethodHandler]],
            handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method or ""
        if handler is None or method.startswith(OPEN_PREFIXES) or \
                self.authorized(handler_call_details.invocation_metadata):
            return handler
        return _deny(handler)


async def _refuse(_request: object, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                        "missing or invalid API key: send metadata 'authorization: Bearer <key>'")


def _deny(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler with `handler`'s streaming shape whose every call is refused; the request
    is left as raw bytes (an unauthenticated caller's message is never parsed)."""
    kw = dict(response_serializer=handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(_refuse, **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(_refuse, **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(_refuse, **kw)
    return grpc.stream_stream_rpc_method_handler(_refuse, **kw)
