"""Tool calling on /v1/chat/completions end to end: a live server on loopback (a tiny
random-weight model whose byte-level BPE tokenizer can spell any JSON, and a Qwen2-like chat
template with tool support), driven by the official `openai` SDK.

A random model writes garbage, so each behaviour is pinned by an oracle that does not come
from the code under test:
  - forced calls (required, named): every call parses and validates against its function's
    parameters with jsonschema; a stream, assembled the way the SDK documents it (by index,
    arguments concatenated), equals the non-streamed message of the same seeded request;
  - auto: the model's output is forced with a regex (a request may combine tools with its own
    structured output under auto), so the text is known; a free run's content equals the
    text of the same seeded request under tool_choice "none";
  - a follow-up conversation's prompt is the offline `render_chat` of the same messages;
  - bad tools: the 400's `param`, and the server still answers afterwards;
  - the README's tool-calling example runs as written and prints a call of its tool.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import pathlib
import re
import tempfile
import urllib.request

import jsonschema
import pytest
from support.bpe_tokenizer import train_bpe_tokenizer
from support.engine_fixtures import tiny_engine, tiny_model
from support.chat_templates import LLAMA31_LIKE, QWEN_LIKE

from jaxserve.server.background import BackgroundServer
from jaxserve.server.config import ServerConfig
from jaxserve.serving import tools as tool_checks
from jaxserve.serving.admission import render_chat
from jaxserve.serving.served import ServedModel

openai = pytest.importorskip("openai")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather now in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
        "additionalProperties": False}}}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "hello"}]
# The BPE is trained on a few sentences: a prompt listing two tools is ~600 tokens.
CONFIG = dict(max_num_seqs=4, max_num_batched_tokens=64, page_size=16, max_model_len=1024,
              token_buckets=(16, 64))


def served(template: str) -> ServedModel:
    tok = train_bpe_tokenizer(pathlib.Path(tempfile.mkdtemp(prefix="jaxserve-bpe-")),
                              chat_template=template)
    model = dataclasses.replace(
        tiny_model(vocab_size=tok.vocab_size, eos_token_ids=tok.eos_token_ids,
                   max_position_embeddings=1024), tokenizer=tok)
    return ServedModel(tiny_engine(model, **CONFIG), "tiny", "hf")


@pytest.fixture(scope="module")
def server() -> BackgroundServer:
    srv = BackgroundServer(ServerConfig(port=None, http_port=0),
                           lambda: served(QWEN_LIKE)).start()
    yield srv
    srv.stop()


def client(srv: BackgroundServer):  # noqa: ANN201 - openai.OpenAI
    return openai.OpenAI(base_url=f"http://127.0.0.1:{srv.server.http_port}/v1",
                         api_key="none", max_retries=0, timeout=120)


def create(srv: BackgroundServer, **kw: object):  # noqa: ANN201 - a ChatCompletion
    args = dict(model="tiny", messages=ASK, tools=TOOLS, max_completion_tokens=120,
                temperature=1.0, seed=5)
    return client(srv).chat.completions.create(**{**args, **kw})


def assembled(srv: BackgroundServer, **kw: object) -> tuple[dict, object]:
    """A streamed response put together as the SDK documents it: per choice, content
    concatenated, tool calls by index (id, type and name from the first delta, arguments
    concatenated); and the usage of the last chunk."""
    choices: dict[int, dict] = {}
    usage = None
    for chunk in create(srv, stream=True, stream_options={"include_usage": True}, **kw):
        usage = chunk.usage or usage
        for c in chunk.choices:
            got = choices.setdefault(c.index, {"content": "", "calls": {}, "finish": None})
            got["content"] += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                call = got["calls"].setdefault(d.index, {"id": None, "name": None,
                                                         "arguments": ""})
                if d.id is not None:
                    assert call["id"] is None, "a call's id comes once, first"
                    call.update(id=d.id, name=d.function.name, type=d.type)
                call["arguments"] += d.function.arguments or ""
            got["finish"] = c.finish_reason or got["finish"]
    return choices, usage


def calls_of(message) -> list[tuple[str, dict]]:  # noqa: ANN001 - a ChatCompletionMessage
    """(name, arguments) of each call, every one parsed and validated against its tool."""
    out = []
    for call in message.tool_calls or []:
        assert call.type == "function" and call.id.startswith("call_")
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        out.append((call.function.name, args))
    return out


def streamed_calls(choice: dict) -> list[tuple[str, dict]]:
    out = []
    for i, call in sorted(choice["calls"].items()):
        assert call["id"].startswith("call_") and call["type"] == "function"
        args = json.loads(call["arguments"])
        jsonschema.validate(args, SCHEMAS[call["name"]])
        out.append((call["name"], args))
    return out


def test_required_calls_validate_and_stream_alike(server: BackgroundServer) -> None:
    # Under parallel_tool_calls the "required" grammar is an unbounded array, and whether the
    # random-weight model closes it within 120 tokens is its draw's: about 3 in 10 seeds run
    # to length (the sampler's draw changed with #30, so the seeds were picked again among
    # those that close). What is checked is the calls' validity and streaming alike.
    for seed, parallel in ((1, True), (2, True), (7, False)):
        got = create(server, tool_choice="required", seed=seed, n=2,
                     parallel_tool_calls=parallel)
        for choice in got.choices:
            calls = calls_of(choice.message)
            assert choice.finish_reason == "tool_calls" and calls, choice
            assert choice.message.content is None
            assert parallel or len(calls) == 1
        streamed, usage = assembled(server, tool_choice="required", seed=seed, n=2,
                                    parallel_tool_calls=parallel)
        for choice in got.choices:
            s = streamed[choice.index]
            assert streamed_calls(s) == calls_of(choice.message)
            assert s["finish"] == "tool_calls" and s["content"] == ""
        assert usage.completion_tokens == got.usage.completion_tokens


def test_named_function_is_called(server: BackgroundServer) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    got = create(server, tool_choice=named)
    [choice] = got.choices
    assert [name for name, _ in calls_of(choice.message)] == ["get_time"]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    streamed, usage = assembled(server, tool_choice=named)
    assert streamed_calls(streamed[0]) == calls_of(choice.message)
    assert usage.prompt_tokens == got.usage.prompt_tokens
    # Cut by max_tokens: "length" stays, the arguments so far come back (not JSON yet).
    cut = create(server, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                 max_completion_tokens=3)
    assert cut.choices[0].finish_reason == "length"
    assert cut.choices[0].message.tool_calls[0].function.name == "get_weather"


FLIGHT = {"type": "function", "function": {"name": "book_flight", "strict": True, "parameters": {
    "type": "object", "properties": {"to": {"enum": ["Oslo", "Lima"]},
                                     "seats": {"type": "integer", "minimum": 1, "maximum": 4},
                                     "class": {"enum": ["eco", "biz"]}}}}}
# What OpenAI's strict mode makes of FLIGHT's parameters, written out by hand (the oracle).
FLIGHT_STRICT = {"type": "object", "properties": FLIGHT["function"]["parameters"]["properties"],
                 "required": ["to", "seats", "class"], "additionalProperties": False}


def test_strict_function_gets_every_property_and_no_other(server: BackgroundServer) -> None:
    """`"strict": true` on a function: its arguments have every property (none is required
    by the client's schema) and nothing else, in every forced call, streamed or not."""
    for seed in (5, 6):
        got = create(server, tools=[FLIGHT, CLOCK], tool_choice="required", seed=seed, n=2,
                     parallel_tool_calls=False)
        for choice in got.choices:
            [call] = choice.message.tool_calls
            args = json.loads(call.function.arguments)
            if call.function.name == "book_flight":
                jsonschema.validate(args, FLIGHT_STRICT)
    named = create(server, tools=[FLIGHT], seed=7, n=3, tool_choice={
        "type": "function", "function": {"name": "book_flight"}})
    for choice in named.choices:
        jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments),
                            FLIGHT_STRICT)


FORCED = (r'Sure\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": '
          r'"(Paris|Oslo)", "unit": "c"\}\}\n</tool_call>')


def test_auto_reads_the_models_calls(server: BackgroundServer) -> None:
    forced = {"structured_outputs": {"regex": FORCED}}
    got = create(server, extra_body=forced)
    [choice] = got.choices
    assert choice.message.content == "Sure."
    [(name, args)] = calls_of(choice.message)
    assert name == "get_weather" and args["city"] in ("Paris", "Oslo") and args["unit"] == "c"
    assert choice.finish_reason == "tool_calls"
    streamed, _ = assembled(server, extra_body=forced)
    assert streamed[0]["content"] == "Sure." and streamed[0]["finish"] == "tool_calls"
    assert streamed_calls(streamed[0]) == [(name, args)]
    # A malformed call is content, tags and all; tool_choice none parses nothing.
    broken = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": </tool_call>'
    got = create(server, extra_body={"structured_outputs": {"regex": broken}})
    assert got.choices[0].message.content == broken.replace("\\", "")
    assert not got.choices[0].message.tool_calls and got.choices[0].finish_reason == "stop"
    got = create(server, tool_choice="none", extra_body=forced)
    assert got.choices[0].message.content.startswith("Sure.\n<tool_call>")
    assert not got.choices[0].message.tool_calls


def test_auto_free_text_is_content(server: BackgroundServer) -> None:
    """A random model's own text under auto: the content is the text the same seeded request
    gets under tool_choice none (same prompt: tools are rendered for none too)."""
    for seed in range(3):
        plain = create(server, tool_choice="none", seed=seed, max_completion_tokens=24)
        auto = create(server, seed=seed, max_completion_tokens=24)
        text = plain.choices[0].message.content
        assert "<tool_call>" not in text
        assert auto.choices[0].message.content == text
        assert not auto.choices[0].message.tool_calls
        assert auto.choices[0].finish_reason == plain.choices[0].finish_reason


def test_follow_up_with_tool_results(server: BackgroundServer) -> None:
    first = create(server, tool_choice="required", parallel_tool_calls=False)
    call = first.choices[0].message.tool_calls[0]
    messages = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "18 C"}]
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == call.function.arguments
    got = create(server, messages=messages, max_completion_tokens=5)
    assert got.choices[0].finish_reason in ("length", "stop", "tool_calls")
    tok = server.server.engine.engine.tokenizer
    want = render_chat(messages, tok, tools=tool_checks.check_tools(TOOLS).tools)
    assert got.usage.prompt_tokens == len(want)
    assert "<tool_response>\n18 C\n</tool_response>" in tok.decode(want)
    # vLLM's /tokenize renders the same prompt when given the tools.
    request = urllib.request.Request(
        f"http://127.0.0.1:{server.server.http_port}/tokenize",
        json.dumps({"messages": messages, "tools": TOOLS}).encode(),
        {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as resp:
        assert json.loads(resp.read())["tokens"] == want


BAD = [
    (dict(tools=[{"type": "function", "function": {"description": "no name"}}]),
     "tools[0].function.name"),
    (dict(tools=[WEATHER, {"type": "function", "function": {"name": "bad name!"}}]),
     "tools[1].function.name"),
    (dict(tools=[WEATHER, WEATHER]), "tools[1].function.name"),
    (dict(tools=[CLOCK, {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}]),
     "tools[1].function.parameters"),
    (dict(tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(tools=openai.NOT_GIVEN, tool_choice="required"), "tool_choice"),
    (dict(tool_choice="required", response_format={"type": "json_object"}),
     "response_format"),
    (dict(extra_body={"functions": [{"name": "f"}]}), "functions"),
    (dict(parallel_tool_calls="yes"), "parallel_tool_calls"),
    (dict(tools=[CLOCK, {"type": "function", "function": {
        "name": "f", "strict": True, "parameters": {"type": "object", "properties": {
            "a": {"type": "object", "additionalProperties": True}}}}}]),
     "tools[1].function.parameters"),
]


@pytest.mark.parametrize("kwargs,param", BAD)
def test_bad_tools_are_400s_naming_the_field(server: BackgroundServer, kwargs: dict,
                                             param: str) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        create(server, **kwargs)
    assert bad.value.body["param"] == param, bad.value.body
    assert bad.value.body["message"].startswith(param)  # as the client named it
    assert create(server, max_completion_tokens=2).choices[0].finish_reason == "length"


def test_llama3_json_server() -> None:
    """A served model whose template shows Llama 3.1's JSON calls: auto detects llama3_json,
    and a bare {"name", "parameters"} object is a call (one tool: that template lists tools
    verbosely). The server is started with --max-tool-calls 1: of two calls in the text,
    the first is read."""
    with BackgroundServer(ServerConfig(port=None, http_port=0, max_tool_calls=1),
                          lambda: served(LLAMA31_LIKE)) as srv:
        forced = {"structured_outputs": {
            "regex": r'\{"name": "get_time", "parameters": \{"zone": "(utc|cet)"\}\}'}}
        got = create(srv, tools=[CLOCK], extra_body=forced)
        [(name, args)] = calls_of(got.choices[0].message)
        assert name == "get_time" and got.choices[0].finish_reason == "tool_calls"
        assert got.choices[0].message.content is None
        streamed, _ = assembled(srv, tools=[CLOCK], extra_body=forced)
        assert streamed_calls(streamed[0]) == [(name, args)]
        # The same text from a hermes server would be content: the format is the server's.
        hermes = r'<tool_call>\{"name": "get_time", "arguments": \{"zone": "utc"\}\}</tool_call>'
        got = create(srv, tools=[CLOCK], extra_body={"structured_outputs": {"regex": hermes}})
        assert not got.choices[0].message.tool_calls
        assert got.choices[0].message.content == hermes.replace("\\", "")
        two = {"structured_outputs": {"regex": r'\{"name": "get_time", "parameters": \{"zone": '
                                               r'"utc"\}\}; \{"name": "get_time", "parameters"'
                                               r': \{"zone": "cet"\}\}'}}
        got = create(srv, tools=[CLOCK], extra_body=two)
        assert calls_of(got.choices[0].message) == [("get_time", {"zone": "utc"})]
        streamed, _ = assembled(srv, tools=[CLOCK], extra_body=two)
        assert streamed_calls(streamed[0]) == [("get_time", {"zone": "utc"})]


def test_readme_tool_calling_example_runs(server: BackgroundServer) -> None:
    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("### Tool calling\n", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert "from openai import OpenAI" not in code  # it continues the SDK example
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        live = compile(code, "README.md:tool-calling", "exec")
        exec(live, {"client": client(server)})  # noqa: S102 - the README's own code
    first = printed.getvalue().splitlines()[0]
    assert first.startswith("get_weather {'city': ")
