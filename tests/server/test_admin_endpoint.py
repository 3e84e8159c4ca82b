"""The admin endpoint (`server/admin.py`) over real HTTP and gRPC on 127.0.0.1, on fake-runner
engines: who may call it (key configured: 401 / UNAUTHENTICATED without it; no key: 403 /
PERMISSION_DENIED unless --enable-admin), refusals naming the field and the limit (400 /
INVALID_ARGUMENT, nothing changed), a change seen by both fronts and by GetModelInfo, logged
at INFO, and requests after it still the runner's arithmetic."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import grpc
import pytest
from support.fake_engines import GREEDY, arithmetic, fake_engine

from jaxserve.server.background import BackgroundServer
from jaxserve.server.client import Client, pb2
from jaxserve.server.config import ServerConfig
from jaxserve.serving.served import ServedModel

KEY = "admin-secret"
START = {"max_num_seqs": 4, "max_num_batched_tokens": 64, "decode_token_budget": 64,
         "ttft_slo": None, "itl_slo": None, "slo_admission": "queue",
         "scheduling_policy": "priority"}


def _server(**cfg: object) -> BackgroundServer:
    return BackgroundServer(ServerConfig(port=0, http_port=0, **cfg),  # type: ignore[arg-type]
                            lambda: ServedModel(fake_engine(), "fake")).start()


@pytest.fixture(scope="module")
def servers():  # noqa: ANN201 - {"keyed" | "closed" | "open": BackgroundServer}
    made = {"keyed": _server(api_keys=(KEY,)), "closed": _server(),
            "open": _server(enable_admin=True)}
    yield made
    for srv in made.values():
        srv.stop()


def http(srv: BackgroundServer, method: str, body: object = None,
         key: str | None = None) -> tuple[int, dict]:
    async def go() -> tuple[int, dict]:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        url = f"http://127.0.0.1:{srv.server.http_port}/admin/scheduler"
        async with aiohttp.ClientSession() as session:
            async with session.request(method, url, json=body, headers=headers) as resp:
                return resp.status, await resp.json()
    return asyncio.run(go())


def metrics_text(srv: BackgroundServer, key: str) -> str:
    async def go() -> str:
        url = f"http://127.0.0.1:{srv.server.http_port}/metrics"
        async with aiohttp.ClientSession() as session:
            async with session.get(url, headers={"Authorization": f"Bearer {key}"}) as resp:
                assert resp.status == 200
                return await resp.text()
    return asyncio.run(go())


def grpc_code(srv: BackgroundServer, key: str | None, update: bool = False) -> grpc.StatusCode:
    with Client(srv.target, api_key=key) as client:
        try:
            if update:
                client.update_scheduler(max_num_seqs=4)
            else:
                client.scheduler_settings()
        except grpc.RpcError as e:
            return e.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("name,key,status,code", [
    ("keyed", None, 401, grpc.StatusCode.UNAUTHENTICATED),
    ("keyed", "wrong", 401, grpc.StatusCode.UNAUTHENTICATED),
    ("keyed", KEY, 200, grpc.StatusCode.OK),
    ("closed", None, 403, grpc.StatusCode.PERMISSION_DENIED),
    ("closed", "anything", 403, grpc.StatusCode.PERMISSION_DENIED),
    ("open", None, 200, grpc.StatusCode.OK),
])
def test_auth_matrix(servers, name, key, status, code) -> None:  # noqa: ANN001
    srv = servers[name]
    got, body = http(srv, "GET", key=key)
    assert got == status, body
    if status == 200:
        assert body == START
    assert http(srv, "POST", {"max_num_seqs": 1}, key=key)[0] == (200 if status == 200
                                                                   else status)
    if status == 200:
        assert http(srv, "POST", {"max_num_seqs": 4}, key=key)[1] == START
    else:
        assert srv.server.engine.engine.scheduler_settings() == START  # untouched
    if status == 403:
        assert "--enable-admin" in body["error"]["message"]
    assert grpc_code(srv, key) is code
    assert grpc_code(srv, key, update=True) is code


@pytest.mark.parametrize("changes,field,message", [
    ({"max_num_seqs": 9}, "max_num_seqs", "max_num_seqs=9 is past what start-up compiled: at most 4"),
    ({"max_num_batched_tokens": 128}, "max_num_batched_tokens",
     "max_num_batched_tokens=128 is past what start-up compiled: at most 64 (the largest compiled token "
     "bucket"),
    ({"itl_slo": "fast"}, "itl_slo", "itl_slo='fast' is not a number of seconds"),
    ({"slo_admission": "reject"}, "slo_admission", "slo_admission='reject' needs a ttft_slo"),
])
def test_refusals_name_the_field_and_limit(servers, changes, field,  # noqa: ANN001
                                           message) -> None:
    srv = servers["open"]
    status, body = http(srv, "POST", changes)
    assert status == 400 and body["error"]["param"] == field, body
    assert message in body["error"]["message"]
    with Client(srv.target) as client, pytest.raises(grpc.RpcError) as err:
        client.update_scheduler(**changes)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()
    assert http(srv, "GET")[1] == START


def test_bad_bodies(servers) -> None:  # noqa: ANN001
    srv = servers["open"]
    status, body = http(srv, "POST", [1, 2])
    assert status == 400 and "must be an object" in body["error"]["message"]
    status, body = http(srv, "POST", {"page_size": 4})
    assert status == 400 and body["error"]["param"] == "page_size"


def test_change_is_seen_everywhere_and_logged(servers, caplog) -> None:  # noqa: ANN001
    srv = servers["keyed"]
    with caplog.at_level(logging.INFO, logger="jaxserve.server.admin"):
        status, new = http(srv, "POST", {"max_num_seqs": 2, "ttft_slo": {"default": 2, "0": 0.5},
                                         "decode_token_budget": None}, key=KEY)
    assert status == 200
    want = {**START, "max_num_seqs": 2, "ttft_slo": {"default": 2.0, "0": 0.5},
            "decode_token_budget": None}
    assert new == want and http(srv, "GET", key=KEY)[1] == want
    lines = [r.getMessage() for r in caplog.records
             if "scheduler settings changed" in r.getMessage()]
    assert len(lines) == 1 and "HTTP client 127.0.0.1" in lines[0]
    assert "max_num_seqs 4 -> 2" in lines[0] and "decode_token_budget 64 -> None" in lines[0]
    gauges = metrics_text(srv, KEY)  # read at the scrape: the live values
    for setting, value in (("max_num_seqs", 2), ("max_num_batched_tokens", 64),
                           ("decode_token_budget", 0)):
        assert f'jaxserve:scheduler_setting{{model_name="fake",setting="{setting}"}} ' \
               f'{value:.1f}' in gauges
    try:
        with Client(srv.target, api_key=KEY) as client:
            live = client.scheduler_settings()
            assert live == {**want, "ttft_slo": "2.0,0=0.5"}
            info = client.model_info()
            assert (info.max_num_seqs, info.max_num_batched_tokens) == (2, 64)
            # gRPC's none: decode_token_budget 0 / an SLO "" ; then back over gRPC
            assert client.update_scheduler(**START) == START
            prompts = [[5 + i, 6, 7] for i in range(3)]
            for p in prompts:  # still the runner's arithmetic after the changes
                out = client.generate(p, dict(max_tokens=5, **GREEDY))
                assert out[0].token_ids == arithmetic(p, 5)
    finally:
        http(srv, "POST", START, key=KEY)
    assert http(srv, "GET", key=KEY)[1] == START
