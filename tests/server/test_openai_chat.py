"""/v1/chat/completions, /tokenize, /detokenize and /version end to end: a real server
(gRPC + HTTP on free ports, one engine) on 127.0.0.1, a real aiohttp client, a tiny random
model whose tokenizer ships a chat template. Oracles: the offline `LLM.chat` over an engine
with the same config (same rendering, same seeds), and the tokenizer itself."""

from __future__ import annotations

import asyncio
import json
import threading
import types
from typing import Any

import aiohttp
import pytest
from support.engine_fixtures import tiny_engine, tiny_logprob_atol, tiny_tokenizer
from support.http_clients import call, url_of
from support.openai_front import CHAT, CONFIG, DEADLINE_S, GREEDY
from support.probes import wait_pages_free

from jaxserve import SamplingParams, __version__
from jaxserve.engine.limits import EngineLimits
from jaxserve.server.background import BackgroundServer
from jaxserve.server.config import ServerConfig
from jaxserve.server.openai_http import OpenAIHttpFront
from jaxserve.serving.admission import Admission, InvalidRequest, PromptInput, render_chat
from jaxserve.serving.async_engine import EngineStopped, QueueFull
from jaxserve.serving.served import ServedModel


@pytest.fixture(scope="module")
def server() -> BackgroundServer:
    srv = BackgroundServer(ServerConfig(port=0, http_port=0),
                           lambda: ServedModel(tiny_engine(**CONFIG), "tiny", "hf")).start()
    yield srv
    srv.stop()


def chat(url: str, body: Any, headers: dict | None = None) -> tuple[int, Any]:
    return asyncio.run(call(url, "/v1/chat/completions", body, headers))


async def chat_events(url: str, body: dict) -> list[Any]:
    """Every SSE `data:` payload of a streamed chat, decoded (`[DONE]` kept as the string)."""
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/chat/completions",
                                json={**body, "stream": True}) as resp:
            assert resp.status == 200, await resp.text()
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            raw = (await resp.read()).decode()
    events = []
    for block in raw.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def by_choice(events: list[Any]) -> tuple[dict[int, list[dict]], list[dict]]:
    """The chunks of each choice index, and the usage-only chunks."""
    choices: dict[int, list[dict]] = {}
    usage = []
    for e in events:
        assert e["object"] == "chat.completion.chunk" and e["id"] == events[0]["id"]
        if not e["choices"]:
            usage.append(e)
        for c in e["choices"]:
            choices.setdefault(c["index"], []).append(c)
    return choices, usage


# --------------------------------------------------------------------------- outputs
def test_greedy_chat_equals_llm_chat_streamed_and_not(server: BackgroundServer, llm) -> None:  # noqa: ANN001
    want = llm.chat(CHAT, SamplingParams(max_tokens=9, **GREEDY), use_tqdm=False)[0]
    n_prompt = len(render_chat(CHAT, llm.tokenizer))
    status, body = chat(url_of(server), {"model": "tiny", "messages": CHAT,
                                         "max_completion_tokens": 9, **GREEDY})
    assert status == 200, body
    assert body["object"] == "chat.completion" and body["model"] == "tiny"
    assert body["id"].startswith("chatcmpl-")
    [choice] = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": want.outputs[0].text}
    assert choice["finish_reason"] == "length" and choice["logprobs"] is None
    usage = body["usage"]
    assert {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")} == \
        {"prompt_tokens": n_prompt, "completion_tokens": 9, "total_tokens": n_prompt + 9}
    assert isinstance(usage["prompt_tokens_details"]["cached_tokens"], int)

    events = asyncio.run(chat_events(url_of(server), {
        "messages": CHAT, "max_tokens": 9, **GREEDY,
        "stream_options": {"include_usage": True}}))
    assert events[-1] == "[DONE]"
    choices, [last] = by_choice(events[:-1])
    assert last is events[-2]
    [chunks] = choices.values()
    assert chunks[0]["delta"] == {"role": "assistant", "content": ""}
    assert all("role" not in c["delta"] for c in chunks[1:])
    assert [c["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert "".join(c["delta"].get("content", "") for c in chunks) == want.outputs[0].text
    assert last["usage"]["prompt_tokens"] == n_prompt
    assert last["usage"]["completion_tokens"] == 9
    wait_pages_free(server)


def test_chat_logit_bias_equals_llm_chat(server: BackgroundServer, llm) -> None:  # noqa: ANN001
    """A JSON-object logit_bias (string keys) reaches the sampler: the text equals LLM.chat's
    with the same bias, and a +100 bias differs from the unbiased greedy text."""
    bias = SamplingParams(max_tokens=6, logit_bias={123: 100.0}, **GREEDY)
    want = llm.chat(CHAT, bias, use_tqdm=False)[0].outputs[0]
    plain = llm.chat(CHAT, SamplingParams(max_tokens=6, **GREEDY), use_tqdm=False)[0]
    assert want.token_ids == [123] * 6 and plain.outputs[0].token_ids != want.token_ids
    status, body = chat(url_of(server), {"messages": CHAT, "max_completion_tokens": 6,
                                         "logit_bias": {"123": 100}, **GREEDY})
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] == want.text
    assert body["usage"]["completion_tokens"] == 6
    wait_pages_free(server)


def test_second_turn_hits_the_prefix_cache(server: BackgroundServer) -> None:
    long_chat = [{"role": "system", "content": " ".join(f"w{i}" for i in range(3, 60))},
                 {"role": "user", "content": "w5"}]
    first = chat(url_of(server), {"messages": long_chat, "max_tokens": 2, **GREEDY})[1]
    turn = long_chat + [{"role": "assistant", "content": first["choices"][0]["message"][
        "content"]}, {"role": "user", "content": "w6"}]
    status, second = chat(url_of(server), {"messages": turn, "max_tokens": 2, **GREEDY})
    assert status == 200, second
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < second["usage"]["prompt_tokens"]
    wait_pages_free(server)


def test_content_parts_n_samples_and_continuous_usage(server: BackgroundServer,
                                                      llm) -> None:  # noqa: ANN001
    parts = [{"role": "user", "content": [{"type": "text", "text": "w5 w6"},
                                          {"type": "text", "text": "w7"}]}]
    joined = [{"role": "user", "content": "w5 w6\nw7"}]
    sampled = dict(n=3, temperature=1.0, seed=11, max_tokens=5, ignore_eos=True)
    want = llm.chat(joined, SamplingParams(**sampled), use_tqdm=False)[0]
    status, body = chat(url_of(server), {"messages": parts, **sampled})
    assert status == 200, body
    assert [c["message"]["content"] for c in body["choices"]] == [o.text for o in want.outputs]
    assert body["usage"]["completion_tokens"] == 15
    events = asyncio.run(chat_events(url_of(server), {
        "messages": parts, **sampled,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}}))
    choices, usage = by_choice(events[:-1])
    assert sorted(choices) == [0, 1, 2]
    for i, chunks in choices.items():
        assert "".join(c["delta"].get("content", "") for c in chunks) == want.outputs[i].text
        assert chunks[-1]["finish_reason"] == "length"
    assert all("usage" in e for e in events[:-1])
    assert usage[-1]["usage"]["completion_tokens"] == 15
    wait_pages_free(server)


def test_logprobs_in_chat_format(server: BackgroundServer, llm) -> None:  # noqa: ANN001
    want = llm.chat(CHAT, SamplingParams(max_tokens=6, logprobs=2, **GREEDY),
                    use_tqdm=False)[0].outputs[0]
    status, body = chat(url_of(server), {"messages": CHAT, "max_tokens": 6, "logprobs": True,
                                         "top_logprobs": 2, **GREEDY})
    assert status == 200, body
    content = body["choices"][0]["logprobs"]["content"]
    tok = llm.tokenizer
    assert [tok.token_to_id(e["token"]) for e in content] == want.token_ids
    for e, entry, tid in zip(content, want.logprobs, want.token_ids):
        # Another batch layout of the test model: tiny_logprob_atol, derived from its weights.
        assert e["logprob"] == pytest.approx(entry[tid], abs=tiny_logprob_atol())
        assert e["bytes"] == list(e["token"].encode())
        assert len(e["top_logprobs"]) == 2
        top = [t["logprob"] for t in e["top_logprobs"]]
        assert top == sorted(top, reverse=True)
        assert top[0] == pytest.approx(e["logprob"], abs=tiny_logprob_atol())  # the likeliest
    # logprobs=true alone: the sampled token, no alternatives
    status, body = chat(url_of(server), {"messages": CHAT, "max_tokens": 2, "logprobs": True,
                                         **GREEDY})
    assert [e["top_logprobs"] for e in body["choices"][0]["logprobs"]["content"]] == [[], []]
    wait_pages_free(server)


# --------------------------------------------------------------------------- errors
USER = [{"role": "user", "content": "w5"}]
BAD = [
    ({}, "messages", "messages is required"),
    ({"messages": None}, "messages", "messages is required"),
    ({"messages": "hi"}, "messages", "messages must be a list"),
    ({"messages": []}, "messages", "messages must not be empty"),
    ({"messages": [{"role": "bot", "content": "w5"}]}, "messages", "messages[0].role="),
    ({"messages": [{"role": "user", "content": 5}]}, "messages", "messages[0].content must"),
    ({"messages": [USER[0], {"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages",
     "messages[1].content[0].type='image_url' is not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages",
     "messages[0].content[0].text must be a string"),
    ({"messages": USER, "top_logprobs": 2}, "top_logprobs", "needs logprobs=true"),
    ({"messages": USER, "logprobs": True, "top_logprobs": 50}, "top_logprobs",
     "top_logprobs=50 must be"),
    ({"messages": USER, "logprobs": 3}, "logprobs", "must be a boolean"),
    ({"messages": USER, "max_completion_tokens": -1}, "max_completion_tokens",
     "max_completion_tokens=-1"),
    # Refused at admission (no room in max_model_len=512), in the name the client used.
    ({"messages": USER, "max_completion_tokens": 5000}, "max_completion_tokens",
     "max_completion_tokens"),
    ({"messages": ["hi"]}, "messages", "messages[0] must be an object"),
    ({"messages": USER, "max_tokens": 5000}, "max_tokens", "max_tokens"),
    ({"messages": USER, "temperature": -1}, "temperature", "temperature"),
    ({"messages": USER, "stop": [""]}, "stop", "stop"),
    ({"messages": USER, "logit_bias": {"5": 101}}, "logit_bias", "must be in [-100, 100]"),
    ({"messages": USER, "logit_bias": [[5, 1.0]]}, "logit_bias", "logit_bias must be"),
    ({"messages": USER, "tools": [{"type": "function"}]}, "tools[0].function",
     "tools[0].function must be an object"),
    ({"messages": USER, "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"messages": USER, "functions": [{"name": "f"}]}, "functions", "not supported"),
    ({"messages": USER, "response_format": {"type": "json_object"}}, "response_format",
     "response_format"),
    ({"messages": USER, "stream_options": {"include_usage": True}}, "stream_options",
     "stream=true"),
    ({"messages": USER, "continue_final_message": True}, "continue_final_message",
     "add_generation_prompt=false"),
    ({"messages": USER, "chat_template": "{{ messages }}"}, "chat_template", "not trust"),
    ({"messages": USER, "chat_template_kwargs": {"messages": 1}}, "chat_template_kwargs",
     "cannot set messages"),
    ({"messages": USER, "user": 5}, "user", "user"),
    ({"messages": USER, "priority": -1}, "priority", "priority"),
]


def test_bad_chat_requests_name_the_field(server: BackgroundServer) -> None:
    async def main() -> list:
        return await asyncio.gather(*(call(url_of(server), "/v1/chat/completions", body)
                                      for body, _, _ in BAD))

    for (body, field, phrase), (status, err) in zip(BAD, asyncio.run(main())):
        assert status == 400, (body, err)
        assert err["error"]["type"] == "invalid_request_error", body
        assert err["error"]["param"] == field, (body, err)
        assert phrase in err["error"]["message"], (body, err)
    wait_pages_free(server)


TAGGED = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"


def test_continue_final_message(server: BackgroundServer, llm) -> None:  # noqa: ANN001
    msgs = [*USER, {"role": "assistant", "content": "w8 w9"}]
    status, body = asyncio.run(call(url_of(server), "/tokenize", {
        "messages": msgs, "add_generation_prompt": False, "continue_final_message": True}))
    assert status == 200, body
    assert body["tokens"] == render_chat(msgs, llm.tokenizer, False,
                                         continue_final_message=True)
    # A template with text after each message: the render stops right after "w8 w9".
    full = render_chat(msgs, llm.tokenizer, False, chat_template=TAGGED)
    cut = render_chat(msgs, llm.tokenizer, False, chat_template=TAGGED,
                      continue_final_message=True)
    assert cut[-2:] == [8, 9] and full[:len(cut)] == cut and len(full) > len(cut)


def test_request_chat_template_and_kwargs() -> None:
    """A request's template (when the Admission trusts them) and its extra variables."""
    tok = tiny_tokenizer()
    limits = EngineLimits(max_model_len=64, vocab_size=100, page_size=8, num_kv_pages=16,
                          max_num_seqs=4, max_num_batched_tokens=64, eos_token_ids=(2,))
    template = "{{ greeting }} {% for m in messages %}{{ m.content }} {% endfor %}"
    inp = PromptInput(chat=tuple(USER), chat_template=template,
                      chat_template_kwargs={"greeting": "w42"})

    async def main() -> list[int]:
        trusting = Admission(limits, tok, trust_request_chat_template=True)
        try:
            return await trusting.tokenize(inp)
        finally:
            trusting.close()

    assert asyncio.run(main()) == [42, 5]
    with pytest.raises(InvalidRequest, match="chat_template could not be rendered"):
        render_chat(USER, tok, chat_template="{{ nope(")
    with pytest.raises(InvalidRequest, match="continue_final_message"):
        render_chat([{"role": "user", "content": " "}], tok, False, chat_template=TAGGED,
                    continue_final_message=True)


# --------------------------------------------------------------------------- utilities
def test_tokenize_detokenize_version_models(server: BackgroundServer, llm) -> None:  # noqa: ANN001
    tok = llm.tokenizer

    async def main() -> list:
        url = url_of(server)
        out = [await call(url, "/tokenize", {"prompt": "w5 w6 w7"}),
               await call(url, "/tokenize", {"prompt": "w5", "return_token_strs": True}),
               await call(url, "/tokenize", {"messages": CHAT}),
               await call(url, "/detokenize", {"tokens": [5, 6, 7]}),
               await call(url, "/detokenize", {"tokens": [5, 10**6]}),
               await call(url, "/tokenize", {"prompt": "w5", "messages": CHAT})]
        async with aiohttp.ClientSession() as s:
            for path in ("/version", "/v1/models"):
                async with s.get(url + path) as r:
                    out.append((r.status, await r.json()))
        return out

    (s1, t1), (s2, t2), (s3, t3), (s4, d1), (s5, d2), (s6, e6), (s7, ver), (s8, models) = \
        asyncio.run(main())
    assert (s1, s2, s3, s4, s7, s8) == (200,) * 6
    assert t1 == {"count": 3, "max_model_len": CONFIG["max_model_len"],
                  "tokens": tok.encode("w5 w6 w7"), "token_strs": None}
    assert t2["token_strs"] == ["w5"]
    assert t3["tokens"] == render_chat(CHAT, tok) and t3["count"] == len(t3["tokens"])
    assert d1 == {"prompt": tok.decode([5, 6, 7], skip_special_tokens=False)}
    assert s5 == 400 and d2["error"]["param"] == "tokens" and "tokens[1]" in \
        d2["error"]["message"]
    assert s6 == 400 and e6["error"]["param"] == "prompt"
    assert ver == {"version": __version__}
    assert models["data"][0]["max_model_len"] == CONFIG["max_model_len"]


# --------------------------------------------------------------------------- admission
def test_chat_api_key_and_warming() -> None:
    release = threading.Event()

    def factory() -> ServedModel:
        release.wait(DEADLINE_S)
        raise RuntimeError("never loads")

    srv = BackgroundServer(ServerConfig(port=0, http_port=0, api_keys=("sekrit",)),
                           factory).start(wait_ready=False)
    url = f"http://127.0.0.1:{srv.server.http_port}"

    async def main() -> list:
        return [await call(url, path, {"messages": USER}, headers)
                for path in ("/v1/chat/completions", "/tokenize")
                for headers in ({}, {"Authorization": "Bearer sekrit"})]

    try:
        (no_key, err), (loading, why), (tok_no_key, _), (tok_loading, _) = asyncio.run(main())
    finally:
        release.set()
        srv.stop()
    assert no_key == tok_no_key == 401 and err["error"]["type"] == "authentication_error"
    assert loading == tok_loading == 503 and "loading" in why["error"]["message"]


def test_chat_queue_full_and_engine_stopped() -> None:
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
            engine = types.SimpleNamespace(limits=limits, tokenizer=tiny_tokenizer())
            front.attach(Refusing(exc), ServedModel(engine, "fake"))
            out.append(await call(f"http://127.0.0.1:{port}", "/v1/chat/completions",
                                  {"messages": USER}))
            await front.stop()
        return out

    (full, err), (stopped, _) = asyncio.run(main())
    assert full == 429 and "waiting" in err["error"]["message"]
    assert stopped == 503


TEMPLATE_ATTACKS = {
    "nested-3000": "{% if 1 %}" * 3000 + "x" + "{% endif %}" * 3000,
    "5000-filters": "{{ 'a'" + "|lower" * 5000 + " }}",
    "tojson-indent": "{{ messages|tojson(indent=10**8) }}",
    "doubling": "{% set ns = namespace(s='ab') %}{% for i in range(60) %}"
                "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
}


@pytest.mark.parametrize("path", ["/tokenize", "/v1/chat/completions"])
def test_request_templates_past_their_bounds_are_400(path: str) -> None:
    """With --trust-request-chat-template: a template that nests past jinja's parser, or
    builds a prompt far longer than max_model_len can hold, is a 400 naming chat_template
    (these were 500s, and `tojson(indent=10**8)` grew the server to 24 GB); the server then
    serves the next request."""
    from support.fake_engines import fake_engine

    srv = BackgroundServer(ServerConfig(port=0, http_port=0, trust_request_chat_template=True),
                           lambda: ServedModel(fake_engine(), "fake")).start()
    try:
        async def main() -> list[tuple[int, Any]]:
            url = url_of(srv)
            budget = {} if path == "/tokenize" else {"max_tokens": 2}  # /tokenize has none
            out = [await call(url, path, {"model": "fake", "messages": CHAT, **budget,
                                          "chat_template": t})
                   for t in TEMPLATE_ATTACKS.values()]
            out.append(await call(url, path, {"model": "fake", "messages": CHAT, **budget}))
            return out

        *refused, ok = asyncio.run(main())
        for name, (status, body) in zip(TEMPLATE_ATTACKS, refused):
            error = body.get("error", body)
            assert status == 400 and error["param"] == "chat_template", (name, body)
            assert len(error["message"]) <= 500, name
        assert ok[0] == 200, ok
    finally:
        srv.stop()
