"""The OpenAI-compatible HTTP front end to end: a real server (gRPC + HTTP on free ports, one
engine) on 127.0.0.1, a real aiohttp client, a tiny random model. Oracles: the offline Engine
with the same config and seeds (what `LLM.generate` drives), and the plain full-sequence
greedy rollout (no cache, no pages) for the token ids."""

from __future__ import annotations

import asyncio
import threading
import time
import types
import urllib.request

import aiohttp
import pytest
from support.engine_fixtures import rollout, tiny_engine, tiny_logprob_atol, tiny_model
from support.http_clients import post, stream_events
from support.openai_front import CONFIG, DEADLINE_S, GREEDY, offline
from support.probes import wait_pages_free
from prometheus_client.parser import text_string_to_metric_families

from jaxserve import SamplingParams
from jaxserve.engine.limits import EngineLimits
from jaxserve.server.background import BackgroundServer
from jaxserve.server.config import ServerConfig
from jaxserve.server.openai_http import OpenAIHttpFront
from jaxserve.serving.async_engine import EngineStopped, QueueFull
from jaxserve.serving.served import ServedModel


@pytest.fixture(scope="module")
def server() -> BackgroundServer:
    srv = BackgroundServer(ServerConfig(port=0, http_port=0, metrics_port=0),
                           lambda: ServedModel(tiny_engine(**CONFIG), "tiny", "hf")).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def oracle():  # noqa: ANN201 - an Engine
    return tiny_engine(**CONFIG)


def base_url(server: BackgroundServer) -> str:
    return f"http://127.0.0.1:{server.server.http_port}"


def scrape(server: BackgroundServer) -> dict:
    url = f"http://127.0.0.1:{server.server.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    values = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            values[(s.name, s.labels.get("finished_reason"))] = s.value
    return values


ABORTED = ("jaxserve:request_success_total", "abort")
GENERATED = ("jaxserve:generation_tokens_total", None)


# --------------------------------------------------------------------------- outputs
def test_stream_equals_offline_engine(server: BackgroundServer, oracle) -> None:  # noqa: ANN001
    prompt = "w5 w9 w33 w7"
    want = offline(oracle, prompt, SamplingParams(max_tokens=12, **GREEDY))
    events = asyncio.run(stream_events(base_url(server), {
        "model": "tiny", "prompt": prompt, "max_tokens": 12, **GREEDY,
        "stream_options": {"include_usage": True}}))
    *chunks, usage, done = events
    assert done == "[DONE]"
    # One event per engine output (one token each), or fewer when the handler fell behind
    # and got coalesced deltas; never more, and the last one carries the finish reason.
    assert 1 <= len(chunks) <= 12
    for i, c in enumerate(chunks):
        assert c["object"] == "text_completion" and c["model"] == "tiny"
        assert c["id"] == chunks[0]["id"] and c["id"].startswith("cmpl-")
        assert isinstance(c["created"], int)
        [choice] = c["choices"]
        assert choice["index"] == 0 and choice["logprobs"] is None
        assert choice["finish_reason"] == ("length" if i == len(chunks) - 1 else None)
    assert "".join(c["choices"][0]["text"] for c in chunks) == want.outputs[0].text
    assert usage["choices"] == [] and usage["id"] == chunks[0]["id"]
    n_prompt = len(oracle.tokenizer.encode(prompt))
    assert usage["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 12,
                              "total_tokens": n_prompt + 12}
    wait_pages_free(server)


def test_token_ids_non_streaming_equal_rollout(server: BackgroundServer,
                                               oracle) -> None:  # noqa: ANN001
    ids = list(range(3, 20))
    want_ids = rollout(tiny_model(), ids, 10)
    want = offline(oracle, ids, SamplingParams(max_tokens=10, logprobs=2, **GREEDY))
    assert want.outputs[0].token_ids == want_ids
    status, body = asyncio.run(post(base_url(server), {
        "model": "tiny", "prompt": ids, "max_tokens": 10, "logprobs": 2, **GREEDY}))
    assert status == 200, body
    assert body["object"] == "text_completion" and body["model"] == "tiny"
    [choice] = body["choices"]
    assert choice["text"] == want.outputs[0].text and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert [oracle.tokenizer.token_to_id(t) for t in lp["tokens"]] == want_ids
    assert lp["token_logprobs"] == pytest.approx(
        [entry[t] for entry, t in zip(want.outputs[0].logprobs, want_ids)],
        abs=tiny_logprob_atol())  # another layout of the test model, derived from its weights
    assert all(1 <= len(top) <= 3 for top in lp["top_logprobs"])
    assert body["usage"] == {"prompt_tokens": 17, "completion_tokens": 10, "total_tokens": 27}
    # A list of one prompt (text or ids) is the same request.
    for one in (["w5 w6"], [[5, 6]]):
        status, other = asyncio.run(post(base_url(server), {"prompt": one, "max_tokens": 4,
                                                            **GREEDY}))
        assert status == 200, other
        expected = offline(oracle, [5, 6], SamplingParams(max_tokens=4, **GREEDY))
        assert other["choices"][0]["text"] == expected.outputs[0].text
    wait_pages_free(server)


def test_n_samples_stop_string_and_concurrency(server: BackgroundServer,
                                               oracle) -> None:  # noqa: ANN001
    sampled = dict(prompt=[40] * 9, n=3, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)
    stopped = dict(prompt="w100 w101", temperature=0.7, top_k=20, repetition_penalty=1.2,
                   seed=1, max_tokens=16, stop=["w7"], ignore_eos=True)

    def params(body: dict) -> SamplingParams:
        return SamplingParams(**{k: v for k, v in body.items() if k != "prompt"})

    want_sampled = offline(oracle, sampled["prompt"], params(sampled))
    want_stopped = offline(oracle, stopped["prompt"], params(stopped))

    async def main() -> tuple:
        return await asyncio.gather(stream_events(base_url(server), sampled),
                                    post(base_url(server), stopped))

    events, (status, body) = asyncio.run(main())
    assert events[-1] == "[DONE]"
    texts = {i: "" for i in range(3)}
    reasons: dict[int, str] = {}
    for e in events[:-1]:
        [c] = e["choices"]
        assert c["index"] not in reasons, "a chunk after its sample finished"
        texts[c["index"]] += c["text"]
        if c["finish_reason"] is not None:
            reasons[c["index"]] = c["finish_reason"]
    assert reasons == {0: "length", 1: "length", 2: "length"}
    assert [texts[i] for i in range(3)] == [o.text for o in want_sampled.outputs]
    assert status == 200, body
    [choice] = body["choices"]
    assert choice["text"] == want_stopped.outputs[0].text
    assert choice["finish_reason"] == \
        {"stop_string": "stop", "length": "length"}[want_stopped.outputs[0].finish_reason.value]
    assert body["usage"]["completion_tokens"] == len(want_stopped.outputs[0].token_ids)
    wait_pages_free(server)


def test_models_and_health(server: BackgroundServer) -> None:
    async def main() -> tuple:
        async with aiohttp.ClientSession() as s:
            async with s.get(base_url(server) + "/v1/models") as r:
                models = (r.status, await r.json())
            async with s.get(base_url(server) + "/health") as r:
                health = r.status
            async with s.get(base_url(server) + "/v1/nothing") as r:
                missing = (r.status, await r.json())
        return models, health, missing

    (status, models), health, (missing, err) = asyncio.run(main())
    assert status == 200 and models["object"] == "list"
    assert [m["id"] for m in models["data"]] == ["tiny"]
    assert health == 200
    assert missing == 404 and "message" in err["error"]


# --------------------------------------------------------------------------- errors
BAD = [
    ({"prompt": ["w5", "w6"]}, "prompt"),
    ({"prompt": [[5], [6]]}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"max_tokens": 4}, "prompt"),
    ({"prompt": [5, 99999]}, "prompt"),
    ({"prompt": "w5", "temperature": -1}, "temperature"),
    ({"prompt": "w5", "temperature": "hot"}, "temperature"),
    ({"prompt": "w5", "top_p": 0}, "top_p"),
    ({"prompt": "w5", "top_k": -3}, "top_k"),
    ({"prompt": "w5", "min_p": 2}, "min_p"),
    ({"prompt": "w5", "seed": -1}, "seed"),
    ({"prompt": "w5", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "w5", "max_tokens": 5000}, "max_tokens"),
    ({"prompt": "w5", "n": 0}, "n"),
    ({"prompt": "w5", "logprobs": 50}, "logprobs"),
    ({"prompt": "w5", "stop": 5}, "stop"),
    ({"prompt": "w5", "stop": [""]}, "stop"),
    ({"prompt": "w5", "ignore_eos": "yes"}, "ignore_eos"),
    ({"prompt": "w5", "max_tokens": 3, "min_tokens": 5}, "min_tokens"),
    ({"prompt": "w5", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "w5", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "w5", "frequency_penalty": -3}, "frequency_penalty"),
    ({"prompt": "w5", "stream": "yes"}, "stream"),
    ({"prompt": "w5", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "w5", "stream": True, "stream_options": {"include_usage": 1}},
     "stream_options"),
    ({"prompt": "w5", "model": 3}, "model"),
    ({"prompt": "w5", "echo": "yes"}, "echo"),
    ({"prompt": "w5", "suffix": "w7"}, "suffix"),
    ({"prompt": "w5", "n": 2, "best_of": 3}, "best_of"),
    ({"prompt": "w5", "best_of": 2}, "best_of"),
    ({"prompt": "w5", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "w5", "echo": True, "logprobs": 21}, "logprobs"),
]


def test_bad_requests_name_the_field(server: BackgroundServer) -> None:
    async def main() -> list:
        return await asyncio.gather(*(post(base_url(server), body) for body, _ in BAD),
                                    post(base_url(server), "{not json"),
                                    post(base_url(server), "[1, 2]"))

    results = asyncio.run(main())
    for (body, field), (status, err) in zip(BAD, results):
        assert status == 400, (body, err)
        assert err["error"]["type"] == "invalid_request_error", body
        assert err["error"]["param"] == field, (body, err)
        assert field in err["error"]["message"], (body, err)
    for status, err in results[len(BAD):]:
        assert status == 400 and err["error"]["param"] is None
    wait_pages_free(server)


# --------------------------------------------------------------------------- disconnects
LONG = dict(max_tokens=500, **GREEDY)


def test_disconnect_mid_stream_aborts(server: BackgroundServer) -> None:
    before = scrape(server)

    async def main() -> None:
        session = aiohttp.ClientSession()
        resp = await session.post(base_url(server) + "/v1/completions",
                                  json={"prompt": [9, 10, 11], "stream": True, **LONG})
        assert resp.status == 200
        assert (await resp.content.readline()).startswith(b"data: {")
        assert server.server.engine.engine.scheduler.allocator.usage > 0
        resp.close()  # drop the connection mid-stream
        await session.close()

    asyncio.run(main())
    wait_pages_free(server)
    after = scrape(server)
    assert after.get(ABORTED, 0) - before.get(ABORTED, 0) == 1
    assert after[GENERATED] - before[GENERATED] < LONG["max_tokens"]


def test_disconnect_while_waiting_for_a_non_streaming_body_aborts(
        server: BackgroundServer) -> None:
    before = scrape(server)
    alloc = server.server.engine.engine.scheduler.allocator

    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            call = asyncio.ensure_future(session.post(
                base_url(server) + "/v1/completions", json={"prompt": [12, 13], **LONG}))
            deadline = time.monotonic() + DEADLINE_S
            while alloc.usage == 0:  # running in the engine
                assert time.monotonic() < deadline and not call.done()
                await asyncio.sleep(0.002)
            call.cancel()  # the client gives up: its connection closes
            with pytest.raises(asyncio.CancelledError):
                await call

    asyncio.run(main())
    wait_pages_free(server)
    after = scrape(server)
    assert after.get(ABORTED, 0) - before.get(ABORTED, 0) == 1
    assert after[GENERATED] - before[GENERATED] < LONG["max_tokens"]


# --------------------------------------------------------------------------- admission
def test_api_key_and_health_while_warming() -> None:
    release = threading.Event()

    def factory() -> ServedModel:
        release.wait(DEADLINE_S)
        raise RuntimeError("never loads")

    srv = BackgroundServer(ServerConfig(port=0, http_port=0, api_keys=("sekrit",)),
                           factory).start(wait_ready=False)
    url = f"http://127.0.0.1:{srv.server.http_port}"

    async def main() -> list:
        async with aiohttp.ClientSession() as s:
            out = []
            for path, headers in (("/health", {}), ("/v1/models", {}),
                                  ("/v1/models", {"Authorization": "Bearer wrong"}),
                                  ("/v1/models", {"Authorization": "Bearer sekrit"})):
                async with s.get(url + path, headers=headers) as r:
                    out.append((r.status, await r.json()))
            out.append(await post(url, {"prompt": "w5"}))
            out.append(await post(url, {"prompt": "w5"}, {"Authorization": "Bearer sekrit"}))
            return out

    try:
        (health, _), (no_key, err), (wrong, _), (ok_key, loading), (post_no_key, _), \
            (post_key, _) = asyncio.run(main())
    finally:
        release.set()
        srv.stop()
    assert health == 503  # warming up
    assert no_key == wrong == post_no_key == 401
    assert err["error"]["type"] == "authentication_error"
    assert ok_key == post_key == 503 and "loading" in loading["error"]["message"]


def test_queue_full_and_engine_stopped_statuses() -> None:
    """429 / 503 from the engine's admission, through a stand-in engine."""
    limits = EngineLimits(max_model_len=64, vocab_size=100, page_size=8, num_kv_pages=16,
                          max_num_seqs=4, max_num_batched_tokens=64, eos_token_ids=(2,))

    class Refusing:
        error = None

        def __init__(self, exc: Exception):
            self.exc = exc

        def submit(self, *args: object, **kwargs: object) -> None:
            raise self.exc

    async def main() -> list:
        out = []
        for exc in (QueueFull("7 sequences are waiting"), EngineStopped("stopping")):
            front = OpenAIHttpFront()
            port = await front.start("127.0.0.1", 0)
            # A stand-in engine: admission reads only the tokenizer's chat template here.
            engine = types.SimpleNamespace(
                limits=limits, tokenizer=types.SimpleNamespace(chat_template=None))
            front.attach(Refusing(exc), ServedModel(engine, "fake"))
            out.append(await post(f"http://127.0.0.1:{port}", {"prompt": [5, 6]}))
            front.calls.draining = True
            out.append(await post(f"http://127.0.0.1:{port}", {"prompt": [5, 6]}))
            await front.stop()
        return out

    (full, err), (draining, _), (stopped, _), _ = asyncio.run(main())
    assert full == 429 and "waiting" in err["error"]["message"]
    assert draining == stopped == 503
