"""Multi-LoRA through both fronts, over real HTTP and gRPC on 127.0.0.1, on fake-runner
engines (`support.lora_fakes`: adapter directories checked by the real PEFT loader, each
adapter shifting the arithmetic tokens by its own offset, so `lora_oracle` says which adapter
ran, or the base model): model resolution and 404s, /v1/models' shape, load -> request ->
unload -> 404, bad adapters refused naming the problem, a duplicate name, who may load, a
server without --enable-lora, and the gRPC equivalents."""

from __future__ import annotations

import asyncio
import json
import pathlib

import aiohttp
import grpc
import pytest
from support.fake_engines import fake_engine
from support.engine_fixtures import tiny_tokenizer
from support.http_clients import call
from support.lora_fakes import lora_fake_engine, lora_oracle, oracle_text, write_peft_dir

from jaxserve import SamplingParams
from jaxserve.server.background import BackgroundServer
from jaxserve.server.client import Client
from jaxserve.server.config import ServerConfig
from jaxserve.serving.served import ServedModel

KEY = "lora-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = [11, 12, 13, 14]
TOKENS = 6
SQL_OFFSET = 5


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {"sql": write_peft_dir(root / "sql", SQL_OFFSET, seed=1),
            "chat": write_peft_dir(root / "chat", 11, seed=2),
            "chat2": write_peft_dir(root / "chat2", 17, seed=3),
            "big": write_peft_dir(root / "big", 1, rank=16)}


def _server(engine_factory, **cfg: object) -> BackgroundServer:  # noqa: ANN001
    return BackgroundServer(ServerConfig(port=0, http_port=0, **cfg),  # type: ignore[arg-type]
                            lambda: ServedModel(engine_factory(), "fake"))  # not started


@pytest.fixture(scope="module")
def srv(dirs):  # noqa: ANN001, ANN201 - a keyed server with LoRA and one start-up adapter
    s = _server(lambda: lora_fake_engine((("sql", str(dirs["sql"])),), max_loras=2,
                                         max_lora_rank=8), api_keys=(KEY,)).start()
    yield s
    s.stop()


def url(s: BackgroundServer) -> str:
    return f"http://127.0.0.1:{s.server.http_port}"


def post(s: BackgroundServer, path: str, body: object, headers: dict | None = AUTH
         ) -> tuple[int, object]:
    """POST; the JSON reply, or the text of a 200 from the LoRA endpoints."""
    async def go() -> tuple[int, object]:
        async with aiohttp.ClientSession() as session:
            async with session.post(url(s) + path, json=body, headers=headers or {}) as r:
                if r.content_type == "application/json":
                    return r.status, await r.json()
                return r.status, await r.text()
    return asyncio.run(go())


def models(s: BackgroundServer) -> list[dict]:
    async def go() -> list[dict]:
        async with aiohttp.ClientSession() as session:
            async with session.get(url(s) + "/v1/models", headers=AUTH) as r:
                assert r.status == 200
                return (await r.json())["data"]
    return asyncio.run(go())


def complete(s: BackgroundServer, model: object = None, **extra: object) -> tuple[int, dict]:
    body = {"prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True,
            **extra}
    if model is not None:
        body["model"] = model
    return asyncio.run(call(url(s), "/v1/completions", body, AUTH))


def test_models_lists_adapters_with_parent_and_root(srv, dirs) -> None:  # noqa: ANN001
    data = models(srv)
    assert [(m["id"], m["parent"], m["root"]) for m in data] == [
        ("fake", None, "fake"), ("sql", "fake", str(dirs["sql"]))]
    assert all(m["object"] == "model" for m in data)


@pytest.mark.parametrize("model,offset", [(None, 0), ("fake", 0), ("sql", SQL_OFFSET)])
def test_model_names_pick_the_adapter(srv, model, offset) -> None:  # noqa: ANN001
    status, body = complete(srv, model)
    assert status == 200, body
    assert body["choices"][0]["text"] == oracle_text(PROMPT, TOKENS, offset)
    assert body["model"] == (model or "fake")  # the adapter's name echoed


def test_chat_and_stream_under_an_adapter(srv) -> None:  # noqa: ANN001
    body = {"model": "sql", "messages": [{"role": "user", "content": "w11 w12"}],
            "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
    status, got = asyncio.run(call(url(srv), "/v1/chat/completions", body, AUTH))
    assert status == 200, got
    assert got["model"] == "sql"
    status, base = asyncio.run(call(url(srv), "/v1/chat/completions",
                                    {**body, "model": "fake"}, AUTH))
    assert got["choices"][0]["message"]["content"] != base["choices"][0]["message"]["content"]

    async def stream() -> list[dict]:
        async with aiohttp.ClientSession() as session:
            async with session.post(url(srv) + "/v1/completions", headers=AUTH, json={
                    "model": "sql", "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0,
                    "ignore_eos": True, "stream": True}) as r:
                raw = (await r.read()).decode()
        return [json.loads(e[len("data: "):]) for e in raw.split("\n\n")[:-2]]
    events = asyncio.run(stream())
    assert {e["model"] for e in events} == {"sql"}
    assert "".join(e["choices"][0]["text"] for e in events) == oracle_text(PROMPT, TOKENS,
                                                                           SQL_OFFSET)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_unknown_model_is_404_without_served_names(srv, path) -> None:  # noqa: ANN001
    body = {"model": "nope", "prompt": "w3"} if path != "/v1/chat/completions" else {
        "model": "nope", "messages": [{"role": "user", "content": "w3"}]}
    status, got = asyncio.run(call(url(srv), path, body, AUTH))
    assert status == 404, got
    assert got["error"]["param"] == "model" and got["error"]["type"] == "NotFoundError"


def test_load_request_unload_then_404(srv, dirs) -> None:  # noqa: ANN001
    status, text = post(srv, "/v1/load_lora_adapter",
                        {"lora_name": "chat", "lora_path": str(dirs["chat"])})
    assert (status, text) == (200, "Success: LoRA adapter 'chat' added successfully.")
    assert [m["id"] for m in models(srv)] == ["fake", "sql", "chat"]
    status, body = complete(srv, "chat")
    assert status == 200 and body["model"] == "chat"
    assert body["choices"][0]["text"] == oracle_text(PROMPT, TOKENS, 11)
    status, text = post(srv, "/v1/unload_lora_adapter", {"lora_name": "chat"})
    assert (status, text) == (200, "Success: LoRA adapter 'chat' removed successfully.")
    status, body = complete(srv, "chat")
    assert status == 404 and body["error"]["param"] == "model", body
    assert [m["id"] for m in models(srv)] == ["fake", "sql"]
    status, body = post(srv, "/v1/unload_lora_adapter", {"lora_name": "chat"})
    assert status == 404, body
    # The name is free again: another directory under it, with vLLM's lora_int_id.
    status, _ = post(srv, "/v1/load_lora_adapter", {"lora_name": "chat", "lora_int_id": 40,
                                                    "lora_path": str(dirs["chat2"])})
    assert status == 200
    assert complete(srv, "chat")[1]["choices"][0]["text"] == oracle_text(PROMPT, TOKENS, 17)
    status, body = post(srv, "/v1/unload_lora_adapter", {"lora_name": "chat",
                                                          "lora_int_id": 41})
    assert status == 400 and body["error"]["param"] == "lora_int_id", body
    assert post(srv, "/v1/unload_lora_adapter", {"lora_name": "chat", "lora_int_id": 40}
                )[0] == 200


@pytest.mark.parametrize("body,param,words", [
    ({"lora_name": "x", "lora_path": "/no/such/dir"}, "lora_path", "no such adapter directory"),
    ({"lora_name": "x", "lora_path": "BIG"}, "lora_path", "has rank 16, over the maximum"),
    ({"lora_name": "sql", "lora_path": "BIG"}, "lora_name", "already been loaded"),
    ({"lora_name": "fake", "lora_path": "BIG"}, "lora_name", "base model's name"),
    ({"lora_name": "a b", "lora_path": "BIG"}, "lora_name", "without spaces"),
    ({"lora_name": "x", "lora_path": "BIG", "load_inplace": True}, "load_inplace", "unknown"),
])
def test_bad_adapters_are_400_naming_the_problem(srv, dirs, body, param, words
                                                 ) -> None:  # noqa: ANN001
    body = {k: str(dirs["big"]) if v == "BIG" else v for k, v in body.items()}
    status, got = post(srv, "/v1/load_lora_adapter", body)
    assert status == 400, got
    assert got["error"]["param"] == param and words in got["error"]["message"], got
    assert [m["id"] for m in models(srv)] == ["fake", "sql"]  # nothing registered


@pytest.mark.parametrize("headers", [None, {"Authorization": "Bearer wrong"}])
def test_load_and_unload_need_the_key(srv, dirs, headers) -> None:  # noqa: ANN001
    assert post(srv, "/v1/load_lora_adapter", {"lora_name": "y", "lora_path": str(
        dirs["chat"])}, headers)[0] == 401
    assert post(srv, "/v1/unload_lora_adapter", {"lora_name": "sql"}, headers)[0] == 401
    assert [m["id"] for m in models(srv)] == ["fake", "sql"]


def test_grpc_lora_name_load_list_unload(srv, dirs) -> None:  # noqa: ANN001
    params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
    with Client(srv.target, api_key=KEY) as c:
        assert c.generate(PROMPT, params, lora_name="sql")[0].token_ids == lora_oracle(
            PROMPT, TOKENS, SQL_OFFSET)
        for base in ("", "fake"):
            assert c.generate(PROMPT, params, lora_name=base)[0].token_ids == lora_oracle(
                PROMPT, TOKENS)
        with pytest.raises(grpc.RpcError) as e:
            c.generate(PROMPT, params, lora_name="nope")
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and "nope" in e.value.details()
        added = c.load_lora_adapter("g", str(dirs["chat"]))
        assert (added.lora_name, added.lora_path) == ("g", str(dirs["chat"]))
        assert [a.lora_name for a in c.list_lora_adapters()] == ["sql", "g"]
        assert [a.lora_name for a in c.model_info().lora_adapters] == ["sql", "g"]
        assert c.generate(PROMPT, params, lora_name="g")[0].token_ids == lora_oracle(
            PROMPT, TOKENS, 11)
        for bad, words in [(str(dirs["big"]), "over the maximum"), ("/no/dir", "no such")]:
            with pytest.raises(grpc.RpcError) as e:
                c.load_lora_adapter("h", bad)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert words in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            c.load_lora_adapter("g", str(dirs["chat"]))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # a duplicate name
        assert c.unload_lora_adapter("g").lora_name == "g"
        for call_ in (lambda: c.generate(PROMPT, params, lora_name="g"),
                      lambda: c.unload_lora_adapter("g")):
            with pytest.raises(grpc.RpcError) as e:
                call_()
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
    with Client(srv.target) as c, pytest.raises(grpc.RpcError) as e:
        c.load_lora_adapter("k", str(dirs["chat"]))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_without_enable_lora(dirs) -> None:  # noqa: ANN001
    with _server(fake_engine, enable_admin=True) as s:
        for path, body in [("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": str(
                dirs["sql"])}), ("/v1/unload_lora_adapter", {"lora_name": "a"})]:
            status, got = post(s, path, body, None)
            assert status == 400 and "--enable-lora" in got["error"]["message"], got
        assert complete(s, "anything")[0] == 200  # no served names, no LoRA: any name
        with Client(s.target) as c:
            with pytest.raises(grpc.RpcError) as e:
                c.generate(PROMPT, {"max_tokens": 2}, lora_name="a")
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
            with pytest.raises(grpc.RpcError) as e:
                c.load_lora_adapter("a", str(dirs["sql"]))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert c.list_lora_adapters() == []


def test_closed_server_refuses_loading_but_lists(dirs) -> None:  # noqa: ANN001
    with _server(lambda: lora_fake_engine((("sql", str(dirs["sql"])),))) as s:
        status, got = post(s, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": str(
            dirs["chat"])}, None)
        assert status == 403, got
        with Client(s.target) as c:
            with pytest.raises(grpc.RpcError) as e:
                c.unload_lora_adapter("sql")
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert [a.lora_name for a in c.list_lora_adapters()] == ["sql"]


def test_served_model_name_and_startup_refusals(dirs) -> None:  # noqa: ANN001
    with _server(lambda: lora_fake_engine((("sql", str(dirs["sql"])),)),
                 served_model_names=("base-x", "alias")) as s:
        assert [(m["id"], m["parent"]) for m in models(s)] == [
            ("base-x", None), ("alias", None), ("sql", "base-x")]
        assert complete(s, "alias")[1]["model"] == "base-x"
        assert complete(s, "sql")[1]["model"] == "sql"
        assert complete(s, "fake")[0] == 404
    # An adapter named as the base model, or a bad one, fails the start-up naming it.
    with pytest.raises(ValueError, match="'sql' is the base model's name"):
        _server(lambda: lora_fake_engine((("sql", str(dirs["sql"])),)),
                served_model_names=("sql",)).start()
    with pytest.raises(ValueError, match="'bad'.*over the maximum"):
        _server(lambda: lora_fake_engine((("bad", str(dirs["big"])),))).start()


def test_cli_client_lora_name(srv, capsys) -> None:  # noqa: ANN001
    from jaxserve import cli

    token_args = ["--max-tokens", str(TOKENS), "--ignore-eos", "--api-key", KEY]
    prompt = tiny_tokenizer().decode(PROMPT)
    assert cli.main(["client", prompt, "--target", srv.target, "--lora-name", "sql",
                     *token_args]) == 0
    assert capsys.readouterr().out.strip() == oracle_text(PROMPT, TOKENS, SQL_OFFSET).strip()
    assert cli.main(["client", prompt, "--target", srv.target, "--lora-name", "nope",
                     *token_args]) == 1
    assert "NOT_FOUND" in capsys.readouterr().err
