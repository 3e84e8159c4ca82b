"""Structured output through every front: the `openai` SDK (response_format json_schema on
chat, vLLM's structured_outputs extra on completions, streamed and not), gRPC (the proto's
StructuredOutputs) and the batch tool (per line); bad specs -> 400 / INVALID_ARGUMENT naming
the field, and the server carries on.

The engine runs the arithmetic fake runner (no model: it takes the next token the grammar
allows after its arithmetic one, `fake_runner.allowed_tokens`) over a byte-level BPE tokenizer
trained here; the oracles are the outputs' own parsers (json + jsonschema, re.fullmatch)."""

from __future__ import annotations

import json
import pathlib
import re

import grpc
import jsonschema
import pytest
from support.fake_engines import bpe_engine

from jaxserve.cli.batch_job import BatchOptions, run_batch
from jaxserve.server.background import BackgroundServer
from jaxserve.server.client import Client
from jaxserve.server.config import ServerConfig
from jaxserve.serving.served import ServedModel

openai = pytest.importorskip("openai")
SCHEMA = {"type": "object", "properties": {
    "city": {"enum": ["Oslo", "Lima", "Pune"]},
    "temp": {"type": "integer", "minimum": -40, "maximum": 50},
    "tags": {"type": "array", "items": {"enum": ["wet", "dry"]}, "maxItems": 2}},
    "required": ["city", "temp", "tags"], "additionalProperties": False}
REGEX = r"[a-z]{3}-[0-9]{2}"
CHAT = [{"role": "user", "content": "weather?"}]


@pytest.fixture(scope="module")
def server() -> BackgroundServer:
    srv = BackgroundServer(ServerConfig(port=0, http_port=0),
                           lambda: ServedModel(bpe_engine(), "tiny", "hf")).start()
    yield srv
    srv.stop()


def sdk(server: BackgroundServer):  # noqa: ANN201 - openai.OpenAI
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.server.http_port}/v1",
                         api_key="none", max_retries=0, timeout=60)


def test_sdk_chat_response_format_json_schema(server: BackgroundServer) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}
    got = sdk(server).chat.completions.create(model="tiny", messages=CHAT, max_tokens=120,
                                              response_format=fmt, seed=1)
    assert got.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(got.choices[0].message.content), SCHEMA)
    text = "".join(c.choices[0].delta.content or "" for c in sdk(server).chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=120, response_format=fmt, seed=1, stream=True))
    assert text == got.choices[0].message.content  # the same seeded output, streamed
    obj = sdk(server).chat.completions.create(model="tiny", messages=CHAT, max_tokens=120,
                                              response_format={"type": "json_object"})
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


def test_sdk_completions_structured_outputs_extra(server: BackgroundServer) -> None:
    got = sdk(server).completions.create(model="tiny", prompt="id:", max_tokens=20, n=3,
                                         temperature=1.0, seed=4,
                                         extra_body={"structured_outputs": {"regex": REGEX}})
    assert all(re.fullmatch(REGEX, c.text) for c in got.choices), [c.text for c in got.choices]
    picked = sdk(server).completions.create(
        model="tiny", prompt="pick:", max_tokens=10,
        extra_body={"structured_outputs": {"choice": ["left", "right"]}})
    assert picked.choices[0].text in ("left", "right")


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nope"}}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"structured_outputs": {"regex": "(("}}, "structured_outputs.regex"),
    ({"structured_outputs": {"choice": ["a"], "regex": "b"}}, "structured_outputs"),
    ({"guided_json": {"type": 5}}, "guided_json"),
    # JSON text nested past the C parser's recursion (RecursionError, once a 500)
    ({"structured_outputs": {"json": "[" * 30000 + "]" * 30000}}, "structured_outputs.json"),
    # grammars that validate but fail at their first step (once a 500 after admission)
    ({"structured_outputs": {"regex": "[^\\x00-\\x{10FFFF}]"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": "a{1000000}"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "start: " + " | ".join(
        f'"w{i}"' for i in range(6000))}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"json": {"$defs": {"a": {"$ref": "#/$defs/b"},
                                                "b": {"$ref": "#/$defs/a"}},
                                      "$ref": "#/$defs/a"}}}, "structured_outputs.json"),
    # an error that quotes a 60,000-character pattern: bounded (once a 240 KB body)
    ({"structured_outputs": {"regex": "(" * 60000}}, "structured_outputs.regex"),
    ({"structured_outputs": {"json_object": True, "whitespace_pattern": "x*"}},
     "structured_outputs.whitespace_pattern"),
    ({"response_format": {"type": "json_object"},
      "structured_outputs": {"disable_any_whitespace": "yes"}},
     "structured_outputs.disable_any_whitespace"),
    ({"guided_json": {"type": "object"}, "guided_whitespace_pattern": "[ \n"},
     "guided_whitespace_pattern"),
    ({"structured_outputs": {"regex": "a", "disable_any_whitespace": True}},
     "structured_outputs.disable_any_whitespace"),
    ({"response_format": {"type": "json_object"},
      "structured_outputs": {"disable_additional_properties": True}},
     "structured_outputs.disable_additional_properties"),
], ids=["bad-schema", "bad-format", "bad-regex", "two-fields", "guided", "nested-text",
        "matches-nothing", "huge-repeat", "6000-alternatives", "looping-refs", "huge-quote",
        "pattern-not-whitespace", "flag-not-bool", "guided-pattern", "option-on-regex",
        "keys-option-on-json-object"])
def test_bad_specs_are_400_naming_the_field(server: BackgroundServer, body: dict,
                                            param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        sdk(server).chat.completions.create(model="tiny", messages=CHAT, max_tokens=5,
                                            extra_body=body)
    assert e.value.body["param"] == param, e.value.body
    assert len(e.value.body["message"]) <= 500
    ok = sdk(server).chat.completions.create(model="tiny", messages=CHAT, max_tokens=3)
    assert ok.choices[0].finish_reason is not None  # the server carries on


def compact(text: str) -> bool:
    """Whether `text` is JSON written with no whitespace outside its strings."""
    return json.dumps(json.loads(text), separators=(",", ":"), ensure_ascii=False) == text


def test_http_disable_any_whitespace(server: BackgroundServer) -> None:
    """vLLM's option inside the structured_outputs object: with its own kind (completions),
    or alone beside response_format (chat), where it joins that spec."""
    got = sdk(server).completions.create(
        model="tiny", prompt="weather?", max_tokens=120, n=2, seed=5, temperature=1.0,
        extra_body={"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}})
    for c in got.choices:
        jsonschema.validate(json.loads(c.text), SCHEMA)
        assert compact(c.text), c.text
    chat = sdk(server).chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=120, seed=6,
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}},
        extra_body={"structured_outputs": {"disable_any_whitespace": True}})
    text = chat.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)
    assert compact(text), text


OPTIONAL = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]},
                                            "temp": {"type": "integer", "minimum": 0,
                                                     "maximum": 9},
                                            "wet": {"type": "boolean"}}}


def test_response_format_strict(server: BackgroundServer) -> None:
    """json_schema.strict=true: OpenAI's strict mode (every property, no other); a schema
    it cannot express is a 400 naming the schema."""
    closed = {**OPTIONAL, "required": ["city", "temp", "wet"], "additionalProperties": False}
    for seed in (1, 2, 3):
        got = sdk(server).chat.completions.create(
            model="tiny", messages=CHAT, max_tokens=120, seed=seed, temperature=1.0,
            response_format={"type": "json_schema", "json_schema": {
                "name": "w", "schema": OPTIONAL, "strict": True}})
        jsonschema.validate(json.loads(got.choices[0].message.content), closed)
    with pytest.raises(openai.BadRequestError) as e:
        sdk(server).chat.completions.create(
            model="tiny", messages=CHAT, max_tokens=5, response_format={
                "type": "json_schema", "json_schema": {"name": "w", "strict": True, "schema": {
                    **OPTIONAL, "additionalProperties": {"type": "string"}}}})
    assert e.value.body["param"] == "response_format.json_schema.schema", e.value.body


def test_grpc_structured_outputs(server: BackgroundServer) -> None:
    with Client(server.target) as client:
        out = client.generate("weather?", {"max_tokens": 120, "seed": 2,
                                           "structured_outputs": {"json": SCHEMA}})[0]
        jsonschema.validate(json.loads(out.text), SCHEMA)
        out = client.generate("id:", {"max_tokens": 20, "structured_outputs": {"regex": REGEX}})
        assert re.fullmatch(REGEX, out[0].text)
        with pytest.raises(grpc.RpcError) as e:
            client.generate("x", {"max_tokens": 5, "structured_outputs": {"json": {"type": 1}}})
        assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details().startswith("sampling.structured_outputs.json")
        out = client.generate("x", {"max_tokens": 3})  # the server carries on
        assert out[0].finish_reason is not None


@pytest.mark.parametrize("spec", [
    {"json": SCHEMA, "disable_any_whitespace": True},
    {"json_object": True, "whitespace_pattern": ""},  # "" is a pattern (no whitespace)
    {"json": SCHEMA, "disable_additional_properties": False},  # false is not unset
    {"json": SCHEMA, "disable_additional_properties": True},
], ids=["compact", "empty-pattern", "keys-literal", "keys-closed"])
def test_structured_output_options_round_trip_the_proto(spec: dict) -> None:
    from jaxserve import SamplingParams
    from jaxserve.server.client import sampling_to_proto
    from jaxserve.server.proto_map import sampling_from_proto

    params = SamplingParams(structured_outputs=spec)
    assert sampling_from_proto(sampling_to_proto(params)) == params


def test_grpc_whitespace_options(server: BackgroundServer) -> None:
    with Client(server.target) as client:
        out = client.generate("weather?", {"max_tokens": 120, "seed": 3, "structured_outputs": {
            "json": SCHEMA, "disable_any_whitespace": True}})[0]
        jsonschema.validate(json.loads(out.text), SCHEMA)
        assert compact(out.text), out.text
        with pytest.raises(grpc.RpcError) as e:
            client.generate("x", {"max_tokens": 5, "structured_outputs": {
                "json_object": True, "whitespace_pattern": "[a ]*"}})
        assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details().startswith("sampling.structured_outputs.whitespace_pattern")
        out = client.generate("weather?", {"max_tokens": 120, "seed": 3, "structured_outputs": {
            "json": SCHEMA, "disable_additional_properties": False}})[0]
        jsonschema.validate(json.loads(out.text), SCHEMA)  # false travels (proto presence)


def test_batch_lines_with_structured_outputs(tmp_path: pathlib.Path) -> None:
    lines = [{"id": "a", "prompt": "weather?", "max_tokens": 120,
              "structured_outputs": {"json": SCHEMA}},
             {"id": "b", "prompt": "id:", "max_tokens": 20, "structured_outputs": {"regex": REGEX}},
             {"id": "c", "prompt": "x", "structured_outputs": {"regex": "(("}},
             {"id": "d", "prompt": "pick:", "structured_outputs": {"choice": ["up", "down"]}}]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "out.jsonl"
    run_batch(bpe_engine(), src, out, BatchOptions(progress=False))
    recs = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    jsonschema.validate(json.loads(recs["a"]["text"]), SCHEMA)
    assert re.fullmatch(REGEX, recs["b"]["text"])
    assert "structured_outputs.regex" in recs["c"]["error"]
    assert recs["d"]["text"] in ("up", "down")


TOOL = {"type": "function", "function": {"name": "pick", "parameters": {
    "type": "object", "properties": {"code": {"type": "string", "pattern": "^a{1000000}$"}},
    "required": ["code"]}}}


def test_a_forced_tool_whose_grammar_cannot_run_is_400() -> None:
    """tool_choice "required" over a tool whose parameters' grammar fails at its first step:
    refused at admission, naming the tool's parameters, instead of a 500 after it. (Its own
    server: the tool listing the prompt carries needs more than the module server's
    max_model_len.)"""
    srv = BackgroundServer(ServerConfig(port=0, http_port=0),
                           lambda: ServedModel(bpe_engine(1024), "tiny", "hf")).start()
    try:
        with pytest.raises(openai.BadRequestError) as e:
            sdk(srv).chat.completions.create(model="tiny", messages=CHAT, max_tokens=5,
                                             tools=[TOOL], tool_choice="required")
        assert "not a usable grammar" in e.value.body["message"], e.value.body
        # named exactly: each tool's schema is compiled as the forced grammars spell it
        assert e.value.body["param"] == "tools[0].function.parameters", e.value.body
    finally:
        srv.stop()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_nested_tool_call_arguments_are_400(server: BackgroundServer, path: str) -> None:
    """An assistant turn's tool call whose arguments (JSON text) nest 1,200 deep: 400 naming
    messages (the arguments were parsed by json.loads, whose RecursionError was a 500)."""
    import asyncio

    from support.http_clients import call, url_of

    nested = "[" * 1200 + "]" * 1200  # fits the prompt-bytes bound, past the recursion limit
    messages = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "pick", "arguments": nested}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    budget = {} if path == "/tokenize" else {"max_tokens": 3}  # /tokenize has none
    status, reply = asyncio.run(call(url_of(server), path, {
        "model": "tiny", "messages": messages, **budget}))
    assert status == 400, reply
    error = reply["error"] if "error" in reply else reply
    assert error["param"] == "messages" and "nests 1200 levels" in error["message"], reply
