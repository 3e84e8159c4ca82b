"""`jaxserve serve`'s serving defaults and the HTTP front's server-level features, end to end:
served model names (a 404 for any other), GET /metrics on the HTTP port and its auth policy,
`--stream-interval` on SSE streams, the body limit (413) and a mid-stream disconnect on the
chat endpoint, 503 while draining, and the `serve` flags -> ServerConfig.

A real server (gRPC + HTTP on free loopback ports, one engine, an API key) over a tiny random
model. Oracles: the offline engine and `LLM.chat` with the same config (texts), the
Prometheus text parser (metrics), the engine's own allocator (pages), and hand-counted token
groups for the coalescer."""

from __future__ import annotations

import ast
import asyncio
import json
import pathlib
import types
from typing import Any, AsyncIterator

import aiohttp
import pytest
from support.engine_fixtures import tiny_engine, tiny_tokenizer
from support.http_clients import call as plain_call
from support.http_clients import url_of
from support.openai_front import CONFIG, GREEDY, offline
from support.probes import wait_pages_free
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families

from jaxserve import SamplingParams
from jaxserve.engine.limits import EngineLimits
from jaxserve.engine.outputs import RequestOutput
from jaxserve.server.background import BackgroundServer
from jaxserve.server.client import Client
from jaxserve.server.config import DEFAULT_HTTP_PORT, DEFAULT_PORT, ServerConfig
from jaxserve.server.openai_http import OpenAIHttpFront
from jaxserve.server.openai_stream import coalesce
from jaxserve.serving.served import ServedModel

KEY = "sekrit"
AUTH = {"Authorization": f"Bearer {KEY}"}
NAMES = ("tiny-a", "tiny-b")
INTERVAL = 4
MAX_BODY = 64 << 10
USER = [{"role": "user", "content": "w5 w9 w33"}]


@pytest.fixture(scope="module")
def server() -> BackgroundServer:
    cfg = ServerConfig(port=0, http_port=0, api_keys=(KEY,), served_model_names=NAMES,
                       stream_interval=INTERVAL, max_message_bytes=MAX_BODY)
    srv = BackgroundServer(cfg, lambda: ServedModel(tiny_engine(**CONFIG), "tiny", "hf")).start()
    yield srv
    srv.stop()


async def call(url: str, path: str, body: Any, headers: dict | None = None) -> tuple[int, Any]:
    """support.http_clients.call with this server's API key."""
    return await plain_call(url, path, body, {**AUTH, **(headers or {})})


async def get(url: str, path: str, headers: dict | None = None) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session:
        async with session.get(url + path, headers=headers or {}) as resp:
            return resp.status, await resp.text()


async def events(url: str, path: str, body: dict) -> list[Any]:
    """Every SSE `data:` payload, decoded; `[DONE]` last."""
    async with aiohttp.ClientSession() as session:
        async with session.post(url + path, json={**body, "stream": True}, headers=AUTH) as r:
            assert r.status == 200, await r.text()
            raw = (await r.read()).decode()
    out = [block[len("data: "):] for block in raw.split("\n\n")[:-1]]
    assert out[-1] == "[DONE]"
    return [json.loads(e) for e in out[:-1]]


def scrape(server: BackgroundServer) -> dict[tuple[str, str | None], float]:
    """GET /metrics on the HTTP port, parsed: (sample name, finished_reason) -> value, for
    the model_name label the served names say."""
    status, text = asyncio.run(get(url_of(server), "/metrics", AUTH))
    assert status == 200, text
    values = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("model_name") == NAMES[0]:
                values[(s.name, s.labels.get("finished_reason"))] = s.value
    return values


GENERATED = ("jaxserve:generation_tokens_total", None)
ABORTED = ("jaxserve:request_success_total", "abort")


# --------------------------------------------------------------------------- names
NOT_FOUND = {"error": {"message": "The model `tiny` does not exist.", "type": "NotFoundError",
                       "param": "model", "code": 404}}


def test_served_model_names_and_404_for_others(server: BackgroundServer) -> None:
    url = url_of(server)

    async def main() -> list:
        out = [await get(url, "/v1/models", AUTH),
               await call(url, "/v1/completions", {"model": "tiny-b", "prompt": [5, 6],
                                                   "max_tokens": 2}),
               await call(url, "/v1/chat/completions", {"messages": USER, "max_tokens": 2})]
        for path, body in (("/v1/completions", {"prompt": [5]}),
                           ("/v1/chat/completions", {"messages": USER}),
                           ("/v1/chat/completions", {"messages": USER, "stream": True}),
                           ("/tokenize", {"prompt": "w5"}),
                           ("/detokenize", {"tokens": [5]})):
            out.append(await call(url, path, {"model": "tiny", **body}))
        return out

    (s_models, models), (s_named, named), (s_unnamed, unnamed), *refused = asyncio.run(main())
    assert s_models == 200
    data = json.loads(models)["data"]
    assert [m["id"] for m in data] == list(NAMES)  # every served name, the first first
    assert all(m["max_model_len"] == CONFIG["max_model_len"] for m in data)
    assert s_named == 200 and named["model"] == NAMES[0]  # responses name the first
    assert s_unnamed == 200 and unnamed["model"] == NAMES[0]  # no model: the served one
    for status, body in refused:
        assert (status, body) == (404, NOT_FOUND)
    with Client(server.target, api_key=KEY) as client:  # gRPC reports the same name
        assert client.model_info().model == NAMES[0]
    assert scrape(server)  # the metrics' model_name label is the first name too
    wait_pages_free(server)


# --------------------------------------------------------------------------- /metrics
def test_metrics_on_the_http_port_count_a_request(server: BackgroundServer) -> None:
    url = url_of(server)
    before = scrape(server)
    status, body = asyncio.run(call(url, "/v1/completions", {"prompt": [7, 8], "max_tokens": 5,
                                                             **GREEDY}))
    assert status == 200 and body["usage"]["completion_tokens"] == 5
    after = scrape(server)
    assert after[GENERATED] - before.get(GENERATED, 0) == 5
    # The API key guards /metrics as it guards the API (no --metrics-no-auth here).
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        status, text = asyncio.run(get(url, "/metrics", headers))
        assert status == 401
        assert json.loads(text)["error"]["type"] == "authentication_error"
    wait_pages_free(server)


def test_front_metrics_policy_loading_and_draining() -> None:
    """--metrics-no-auth opens /metrics only; 503 before the model is attached; a draining
    front refuses chat with 503. A stand-in engine: nothing reaches it."""
    limits = EngineLimits(max_model_len=64, vocab_size=100, page_size=8, num_kv_pages=16,
                          max_num_seqs=4, max_num_batched_tokens=64, eos_token_ids=(2,))
    registry = CollectorRegistry()
    Counter("probe", "a counter to find in the text", registry=registry).inc(3)

    async def main() -> list:
        front = OpenAIHttpFront(("k",), open_metrics=True)
        url = f"http://127.0.0.1:{await front.start('127.0.0.1', 0)}"
        out = [await get(url, "/metrics")]
        engine = types.SimpleNamespace(limits=limits, tokenizer=tiny_tokenizer())
        front.attach(types.SimpleNamespace(error=None), ServedModel(engine, "fake"),
                     registry=registry)
        out += [await get(url, "/metrics"), await get(url, "/v1/models")]
        front.calls.draining = True
        out.append(await call(url, "/v1/chat/completions", {"messages": USER},
                              {"Authorization": "Bearer k"}))
        await front.stop()
        return out

    (loading, _), (ok, text), (models, _), (draining, err) = asyncio.run(main())
    assert loading == 503
    assert ok == 200
    [probe] = [f for f in text_string_to_metric_families(text) if f.name == "probe"]
    assert probe.samples[0].value == 3
    assert models == 401  # only /metrics (and /health) are open
    assert draining == 503 and "shutting down" in err["error"]["message"]


# --------------------------------------------------------------------------- stream interval
async def _replay(outputs: list[RequestOutput]) -> AsyncIterator[RequestOutput]:
    for out in outputs:
        yield out


@pytest.mark.parametrize("interval,sizes", [(1, [1] * 11), (INTERVAL, [1, 4, 4, 2])])
def test_coalesce_groups_tokens_per_sample(interval: int, sizes: list[int]) -> None:
    """The engine's one-token outputs of two samples, regrouped: the first token at once,
    then `interval` at a time, the end flushed; nothing lost or reordered."""
    engine = tiny_engine(**CONFIG)
    engine.add_request("c", [5, 6, 7], SamplingParams(n=2, seed=3, max_tokens=11,
                                                      ignore_eos=True))
    steps: list[RequestOutput] = []
    while engine.has_unfinished():
        steps += engine.step()
    final = steps[-1]

    async def main() -> list[RequestOutput]:
        return [out async for out in coalesce(_replay(steps), interval)]

    got = asyncio.run(main())
    for index in range(2):
        pieces = []
        for c in (c for out in got for c in out.outputs if c.index == index):
            if c.delta_token_ids or c.finish_reason:
                pieces.append(c)
            if c.finish_reason:
                break  # a finished sample reappears in its group's later outputs
        assert [len(c.delta_token_ids) for c in pieces] == sizes
        assert [t for c in pieces for t in c.delta_token_ids] == final.outputs[index].token_ids
        assert "".join(c.delta_text for c in pieces) == final.outputs[index].text
        assert pieces[-1].finish_reason is not None
        assert all(c.finish_reason is None for c in pieces[:-1])


def check_groups(sizes: list[int], total: int) -> None:
    """A stream with --stream-interval INTERVAL: its first chunk goes at once, every later
    one but the last (the finish flush) holds at least INTERVAL tokens. Exact sizes depend on
    how far the reader fell behind (then the engine side merges outputs)."""
    assert sum(sizes) == total and all(n >= 1 for n in sizes)
    assert all(n >= INTERVAL for n in sizes[1:-1]), sizes
    assert len(sizes) <= 1 + -(-(total - 1) // INTERVAL), sizes


def test_stream_interval_on_completions_and_chat(server: BackgroundServer,
                                                 llm) -> None:  # noqa: ANN001
    url = url_of(server)
    prompt = [5, 9, 33, 7]
    want = offline(llm.engine, prompt, SamplingParams(max_tokens=11, **GREEDY)).outputs[0]
    chunks = asyncio.run(events(url, "/v1/completions", {
        "prompt": prompt, "max_tokens": 11, "logprobs": 0, **GREEDY}))
    assert "".join(c["choices"][0]["text"] for c in chunks) == want.text
    check_groups([len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks], 11)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"

    want_chat = llm.chat(USER, SamplingParams(max_tokens=11, **GREEDY), use_tqdm=False)[0]
    chat = asyncio.run(events(url, "/v1/chat/completions", {
        "messages": USER, "max_tokens": 11, "logprobs": True, **GREEDY}))
    [role, *content] = [c["choices"][0] for c in chat]
    assert role["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["delta"].get("content", "") for c in content) == \
        want_chat.outputs[0].text
    check_groups([len(c["logprobs"]["content"]) for c in content], 11)
    assert content[-1]["finish_reason"] == "length"
    wait_pages_free(server)


# --------------------------------------------------------------------------- chat wire
def test_chat_body_over_the_limit_is_413(server: BackgroundServer) -> None:
    big = {"messages": [{"role": "user", "content": "w5 " * (MAX_BODY // 3 + 10)}]}
    status, err = asyncio.run(call(url_of(server), "/v1/chat/completions", big))
    assert status == 413
    assert err["error"]["type"] == "invalid_request_error"
    assert err["error"]["code"] == "request_too_large"
    assert str(MAX_BODY) in err["error"]["message"]


def test_chat_disconnect_mid_stream_frees_pages(server: BackgroundServer) -> None:
    before = scrape(server)
    alloc = server.server.engine.engine.scheduler.allocator

    async def main() -> None:
        session = aiohttp.ClientSession()
        resp = await session.post(url_of(server) + "/v1/chat/completions", headers=AUTH, json={
            "messages": USER, "stream": True, "max_tokens": 500, **GREEDY})
        assert resp.status == 200
        assert (await resp.content.readline()).startswith(b"data: {")  # the role chunk
        assert alloc.usage > 0
        resp.close()  # drop the connection mid-stream
        await session.close()

    asyncio.run(main())
    wait_pages_free(server)
    after = scrape(server)
    assert after.get(ABORTED, 0) - before.get(ABORTED, 0) == 1
    assert after[GENERATED] - before[GENERATED] < 500


def test_developer_role_null_assistant_content_and_tokenize_nulls(
        server: BackgroundServer, llm) -> None:  # noqa: ANN001
    """`developer` renders as `system`, an assistant's null content as "", a null boolean
    on /tokenize as its default (true) and /detokenize names `tokens` in its refusals; the
    oracle is admission's own `render_chat` over the spelled-out messages."""
    from jaxserve.serving.admission import check_chat, render_chat

    tok = llm.tokenizer
    sent = [{"role": "developer", "content": "w3 w4"}, *USER,
            {"role": "assistant", "content": None}, {"role": "user", "content": "w6"}]
    spelled = [{"role": "system", "content": "w3 w4"}, *USER,
               {"role": "assistant", "content": ""}, {"role": "user", "content": "w6"}]
    url = url_of(server)

    async def main() -> list:
        return [await call(url, "/tokenize", {"messages": sent}),
                await call(url, "/tokenize", {"messages": USER, "add_generation_prompt": None}),
                await call(url, "/tokenize", {"prompt": "w5", "add_special_tokens": None}),
                await call(url, "/detokenize", {"tokens": [5] * (CONFIG["max_model_len"] + 1)}),
                await call(url, "/v1/chat/completions", {"messages": sent, "max_tokens": 3,
                                                         **GREEDY}),
                await call(url, "/v1/chat/completions", {
                    "messages": [{"role": "user", "content": None}]})]

    (s1, t1), (s2, t2), (s3, t3), (s4, d4), (s5, c5), (s6, e6) = asyncio.run(main())
    assert (s1, s2, s3, s5) == (200,) * 4
    assert t1["tokens"] == render_chat(spelled, tok)
    # (the tiny template renders role names as unknown tokens: the mapping itself)
    assert [m["role"] for m in check_chat(sent)] == [m["role"] for m in spelled]
    assert t2["tokens"] == render_chat(USER, tok, add_generation_prompt=True)
    assert t3["tokens"] == tok.encode("w5", add_special_tokens=True)
    assert s4 == 400 and d4["error"]["param"] == "tokens"
    want = llm.chat(spelled, SamplingParams(max_tokens=3, **GREEDY), use_tqdm=False)[0]
    assert c5["choices"][0]["message"]["content"] == want.outputs[0].text
    assert s6 == 400 and "messages[0].content must be" in e6["error"]["message"]
    wait_pages_free(server)


# --------------------------------------------------------------------------- flags
def test_serve_defaults_and_front_flags(monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    from jaxserve.cli.main import build_parser, main
    from jaxserve.cli.serve import API_KEY_ENV, server_config_from_args

    monkeypatch.delenv(API_KEY_ENV, raising=False)

    def config(*argv: str) -> ServerConfig:
        return server_config_from_args(build_parser().parse_args(["serve", *argv]))

    default = config()
    assert (default.host, default.port, default.http_port) == \
        ("127.0.0.1", DEFAULT_PORT, DEFAULT_HTTP_PORT) == ("127.0.0.1", 50051, 8000)
    assert default.served_model_names == ()
    assert config("--no-http").http_port is None and config("--no-http").port == 50051
    assert config("--no-grpc").port is None and config("--no-grpc").http_port == 8000
    assert (config("--port", "0", "--http-port", "0").port,
            config("--http-port", "0").http_port) == (0, 0)
    assert config("--served-model-name", "a", "b/c").served_model_names == ("a", "b/c")
    with pytest.raises(ValueError, match="both fronts are off"):
        config("--no-grpc", "--no-http")
    assert main(["serve", "--no-grpc", "--no-http"]) == 2
    assert "both fronts are off" in capsys.readouterr().err
    with pytest.raises(ValueError, match="served_model_names"):
        ServerConfig(served_model_names=("",))


def test_servers_started_in_code_choose_both_ports() -> None:
    """Every server this repository starts in-process (tests, scripts, benchmarks) names its
    gRPC and HTTP ports (0: a free one; None: off): with the defaults on 50051 and 8000, two
    servers in one test, or two test runs on one machine, would collide."""
    root = pathlib.Path(__file__).resolve().parents[2]
    starters = {"BackgroundServer", "GrpcServer", "serve"}
    missing = []
    for path in [*root.glob("tests/**/*.py"), *root.glob("scripts/**/*.py"),
                 *root.glob("jaxserve/**/*.py"), *root.glob("server/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and getattr(node.func, "id", getattr(
                    node.func, "attr", None)) in starters and node.args):
                continue
            cfg = node.args[0]
            if not (isinstance(cfg, ast.Call) and getattr(cfg.func, "id", "") == "ServerConfig"):
                continue
            names = {k.arg for k in cfg.keywords}
            if None not in names and not {"port", "http_port"} <= names:  # None: **kwargs
                missing.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not missing, f"servers started on a default port: {missing}"
