"""Failed steps and request identity on the wire (fake engine, real servers on 127.0.0.1).

A request a failed step finished with ERROR ends its gRPC call with INTERNAL naming the
failure and gets HTTP 500 (or an error event in a stream) while the server stays SERVING; a
fatal engine failure makes `serve()` drain and raise, so the process exits non-zero. Client
ids never collide with the engine's sequence ids (issue 13: "x#1" then "x" with n=2).
"""

from __future__ import annotations

import asyncio
import socket
import threading

import grpc
import pytest
from support.engine_fixtures import VOCAB
from support.fake_engines import FailingRunner, GatedRunner, fake_engine
from support.fake_engines import GREEDY, MARK, arithmetic
from support.http_clients import post, stream_events
from support.probes import SERVING, health, wait_for, wait_pages_free

from jaxserve import SamplingParams
from jaxserve.engine.errors import EngineDead
from jaxserve.engine.fake_runner import ArithmeticRunner
from jaxserve.engine.fault_injection import InjectedFault
from jaxserve.server.app import serve
from jaxserve.server.background import BackgroundServer
from jaxserve.server.client import Client
from jaxserve.server.config import ServerConfig
from jaxserve.serving.served import ServedModel

DEADLINE_S = 30.0


@pytest.fixture
def faulty_server():  # noqa: ANN201
    """Every step holding MARK fails for the rows holding it (not fatal)."""
    fault = InjectedFault(MARK, name_rows=True, times=None)
    srv = BackgroundServer(ServerConfig(port=0, http_port=0), lambda: ServedModel(
        fake_engine(ArithmeticRunner(VOCAB, fault)), "fake")).start()
    yield srv
    srv.stop()


def test_grpc_failed_request_ends_internal_and_server_serves_on(faulty_server) -> None:  # noqa: ANN001
    srv = faulty_server
    with Client(srv.target, timeout=DEADLINE_S) as client:
        with pytest.raises(grpc.RpcError) as err:
            list(client.stream([3, MARK], SamplingParams(max_tokens=3), request_id="bad"))
        assert err.value.code() is grpc.StatusCode.INTERNAL
        assert "'bad' failed" in err.value.details() and "injected fault" in err.value.details()
        msgs = list(client.stream([8, 9], SamplingParams(max_tokens=4, **GREEDY)))
    assert [t for m in msgs if m.HasField("chunk") for t in m.chunk.token_ids] == \
        arithmetic([8, 9], 4)
    assert health(srv.target) == SERVING
    wait_pages_free(srv)


def test_http_failed_request_is_a_500_or_an_error_event(faulty_server) -> None:  # noqa: ANN001
    srv = faulty_server
    url = f"http://127.0.0.1:{srv.server.http_port}"
    status, body = asyncio.run(post(url, {"prompt": [3, MARK], "max_tokens": 3}))
    assert status == 500 and body["error"]["type"] == "server_error"
    assert "injected fault" in body["error"]["message"]
    events = asyncio.run(stream_events(url, {"prompt": [3, MARK], "max_tokens": 3}))
    assert "injected fault" in events[-2]["error"]["message"] and events[-1] == "[DONE]"
    status, body = asyncio.run(post(url, {"prompt": [8, 9], "max_tokens": 4,
                                          "temperature": 0.0, "ignore_eos": True}))
    assert status == 200 and body["choices"][0]["finish_reason"] == "length"
    wait_pages_free(srv)


def test_grpc_client_id_cannot_collide_with_sample_ids() -> None:
    runner = GatedRunner()
    srv = BackgroundServer(ServerConfig(port=0, http_port=None), lambda: ServedModel(
        fake_engine(runner), "fake")).start()
    try:
        with Client(srv.target, timeout=DEADLINE_S) as client:
            runner.allow(2)  # overlapped steps: step 1's output comes once step 2 is dispatched
            held = client.stream([8, 9], SamplingParams(max_tokens=6, **GREEDY),
                                 request_id="x#1")
            first = next(held)  # "x#1" is running
            with pytest.raises(grpc.RpcError) as dup:
                list(client.stream([5], SamplingParams(max_tokens=1), request_id="x#1"))
            assert dup.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            call = client.stream([5, 6], SamplingParams(max_tokens=4, n=2, **GREEDY),
                                 request_id="x")  # the call starts now
            wait_for(lambda: srv.server.engine.num_in_flight == 2, '"x" to be submitted')
            runner.allow(1000)  # "x" joins the engine while "x#1" still runs
            two = list(call)
            one = [first, *held]
        samples: dict[int, list[int]] = {0: [], 1: []}
        for m in two:
            if m.HasField("chunk"):
                samples[m.chunk.index] += list(m.chunk.token_ids)
        assert samples == {0: arithmetic([5, 6], 4), 1: arithmetic([5, 6], 4)}
        assert [t for m in one if m.HasField("chunk") for t in m.chunk.token_ids] == \
            arithmetic([8, 9], 6)
        assert health(srv.target) == SERVING and srv.server.engine.error is None
    finally:
        runner.allow(1000)
        srv.stop()


def test_serve_exits_with_engine_dead_after_a_fatal_failure() -> None:
    with socket.socket() as s:  # a free port for serve(), which does not report its own
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    raised: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(serve(ServerConfig(port=port, http_port=None, shutdown_grace=1.0),
                              lambda: ServedModel(fake_engine(FailingRunner(VOCAB)), "fake")))
        except BaseException as e:  # noqa: BLE001 - inspected below
            raised.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    target = f"127.0.0.1:{port}"

    def serving() -> bool:
        try:
            return health(target) == SERVING
        except grpc.RpcError:  # not listening yet
            return False

    wait_for(serving, "SERVING")
    with Client(target, timeout=DEADLINE_S) as client:
        with pytest.raises(grpc.RpcError) as err:
            list(client.stream([5], SamplingParams(max_tokens=2)))
    assert err.value.code() is grpc.StatusCode.UNAVAILABLE
    thread.join(DEADLINE_S)
    assert not thread.is_alive(), "serve() did not exit after the engine failed"
    assert len(raised) == 1 and isinstance(raised[0], EngineDead)
    assert "device lost" in str(raised[0])
