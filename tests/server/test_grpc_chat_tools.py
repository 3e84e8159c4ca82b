"""Tools on the gRPC chat (ChatMessages.tools / tool_choice / parallel_tool_calls), as the
HTTP front takes them: a live server over the arithmetic fake runner (no model) whose
byte-level BPE tokenizer lets a grammar spell any JSON; the runner honours the step's token
mask, so a forced call's grammar shapes its output.

Oracles: jsonschema for a forced call's arguments; the text a regex forces under "auto";
admission's `render_chat` of the same messages and tools for the prompt (tool turns too);
INVALID_ARGUMENT naming the field, as the HTTP front's 400 names it."""

from __future__ import annotations

import json

import grpc
import jsonschema
import pytest
from support.fake_engines import bpe_engine

from jaxserve import SamplingParams
from jaxserve.client import Client
from jaxserve.server.background import BackgroundServer
from jaxserve.server.client import fill_chat, fold, pb2
from jaxserve.server.config import ServerConfig
from jaxserve.serving.admission import render_chat
from jaxserve.serving.served import ServedModel

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}
ASK = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def server() -> BackgroundServer:
    srv = BackgroundServer(ServerConfig(port=0, http_port=None),
                           lambda: ServedModel(bpe_engine(max_model_len=1024), "bpe",
                                               "hf")).start()
    yield srv
    srv.stop()


def test_forced_call_comes_back_parsed(server: BackgroundServer) -> None:
    with Client(server.target) as client:
        [got] = client.generate(None, SamplingParams(max_tokens=60, seed=3), messages=ASK,
                                tools=[WEATHER, CLOCK],
                                tool_choice={"type": "function",
                                             "function": {"name": "get_weather"}})
    assert got.content is None and len(got.tool_calls) == 1, got
    call = got.tool_calls[0]
    assert call["function"]["name"] == "get_weather" and call["id"].startswith("call_")
    jsonschema.validate(json.loads(call["function"]["arguments"]),
                        WEATHER["function"]["parameters"])
    assert json.loads(got.text) == json.loads(call["function"]["arguments"])  # raw chunks


def test_auto_reads_the_models_calls_and_the_prompt_renders_the_tools(
        server: BackgroundServer) -> None:
    text = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    regex = text.replace("{", r"\{").replace("}", r"\}")
    tok = server.server.engine.engine.tokenizer
    convo = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "noon"}]
    req = pb2.GenerateRequest(sampling=pb2.SamplingParams(
        max_tokens=80, temperature=0, structured_outputs=pb2.StructuredOutputs(regex=regex)))
    fill_chat(req.chat, convo)
    # One tool as JSON text, the other as a FunctionTool message: the same tools.
    req.chat.tools.extend([pb2.Tool(json=json.dumps(WEATHER)),
                           pb2.Tool(function=pb2.FunctionTool(name="get_time"))])
    with Client(server.target) as client:
        [got] = fold(client.stub.Generate(req))
    assert got.text == text and got.content is None
    assert [(t["function"]["name"], t["function"]["arguments"]) for t in got.tool_calls] == \
        [("get_time", "{}")]
    assert got.usage.prompt_tokens == len(render_chat(convo, tok, tools=[WEATHER, CLOCK]))
    # tool_choice none: the text is not read
    with Client(server.target) as client:
        [plain] = client.generate(None, SamplingParams(max_tokens=3), messages=ASK,
                                  tools=[WEATHER], tool_choice="none")
    assert plain.tool_calls == [] and plain.content is None


@pytest.mark.parametrize("tools,choice,field", [
    ([{"type": "function", "function": {"name": "a b"}}], None, "chat.tools[0].function.name"),
    ([WEATHER], "sometimes", "chat.tool_choice"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "chat.tool_choice"),
])
def test_bad_tools_are_invalid_argument_naming_the_field(server: BackgroundServer,
                                                         tools: list, choice: object,
                                                         field: str) -> None:
    with Client(server.target) as client, pytest.raises(grpc.RpcError) as e:
        client.generate(None, SamplingParams(max_tokens=1), messages=ASK, tools=tools,
                        tool_choice=choice)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith(field), e.value.details()


def test_malformed_tool_messages_are_invalid_argument(server: BackgroundServer) -> None:
    cases = {"chat.tools[0] is not JSON": pb2.Tool(json="{nope"),
             "chat.tools[0] is empty: set json or function": pb2.Tool(),
             "chat.tools[0].function.parameters is not JSON":
                 pb2.Tool(function=pb2.FunctionTool(name="f", parameters="["))}
    with Client(server.target) as client:
        for message, tool in cases.items():
            req = pb2.GenerateRequest(sampling=pb2.SamplingParams(max_tokens=1))
            req.chat.messages.append(pb2.ChatMessage(role="user", content="hi"))
            req.chat.tools.append(tool)
            with pytest.raises(grpc.RpcError) as e:
                list(client.stub.Generate(req))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert e.value.details().startswith(message), e.value.details()
        req = pb2.GenerateRequest(sampling=pb2.SamplingParams(max_tokens=1))
        req.chat.messages.append(pb2.ChatMessage(role="user", content="hi"))
        req.chat.tool_choice, req.chat.tool_choice_function = "auto", "f"
        with pytest.raises(grpc.RpcError) as e:
            list(client.stub.Generate(req))
        assert e.value.details() == ("chat.tool_choice and tool_choice_function are both "
                                     "set: set one")


def test_the_servers_max_tool_calls_bounds_grpc_chat() -> None:
    """--max-tool-calls reaches the gRPC chat as it reaches HTTP: of two calls the model
    writes under "auto", the response carries the first only."""
    call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    text = call + "\n" + call
    regex = text.replace("{", r"\{").replace("}", r"\}")
    req = pb2.GenerateRequest(sampling=pb2.SamplingParams(
        max_tokens=120, temperature=0, structured_outputs=pb2.StructuredOutputs(regex=regex)))
    fill_chat(req.chat, ASK, tools=[CLOCK])
    with BackgroundServer(ServerConfig(port=0, http_port=None, max_tool_calls=1),
                          lambda: ServedModel(bpe_engine(max_model_len=1024), "bpe", "hf")
                          ) as srv, Client(srv.target) as client:
        [got] = fold(client.stub.Generate(req))
    assert got.text == text
    assert [t["function"]["name"] for t in got.tool_calls] == ["get_time"]
