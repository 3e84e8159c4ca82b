"""Polling a served engine from a test: its gRPC health status, waiting with a deadline for a
condition (never a bare sleep), and for a server's engine to drain."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

DEADLINE_S = 30.0
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

if TYPE_CHECKING:
    from jaxserve.server.background import BackgroundServer


def health(target: str) -> int:
    with grpc.insecure_channel(target) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5).status


def wait_for(predicate, what: str, deadline_s: float = DEADLINE_S) -> None:  # noqa: ANN001
    deadline = time.monotonic() + deadline_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def wait_pages_free(server: BackgroundServer) -> None:
    """Poll (with a deadline) until every KV page of the server's engine is free, nothing is
    in flight in its async engine and the engine has nothing unfinished."""
    eng = server.server.engine.engine
    alloc = eng.scheduler.allocator
    deadline = time.monotonic() + DEADLINE_S
    while alloc.num_free_pages != alloc.num_usable_pages or server.server.engine.num_in_flight \
            or eng.has_unfinished():
        assert time.monotonic() < deadline, \
            f"{alloc.num_usable_pages - alloc.num_free_pages} pages still held"
        time.sleep(0.005)
