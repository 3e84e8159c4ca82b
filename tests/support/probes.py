"""Polling a served engine from a test: its gRPC health status, and waiting with a deadline
for a condition (never a bare sleep)."""

from __future__ import annotations

import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

DEADLINE_S = 30.0
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def health(target: str) -> int:
    with grpc.insecure_channel(target) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5).status


def wait_for(predicate, what: str, deadline_s: float = DEADLINE_S) -> None:  # noqa: ANN001
    deadline = time.monotonic() + deadline_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)
