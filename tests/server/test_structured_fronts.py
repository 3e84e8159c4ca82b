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
from jaxserve.serving.build import ServedModel

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
])
def test_bad_specs_are_400_naming_the_field(server: BackgroundServer, body: dict,
                                            param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        sdk(server).chat.completions.create(model="tiny", messages=CHAT, max_tokens=5,
                                            extra_body=body)
    assert e.value.body["param"] == param, e.value.body
    ok = sdk(server).chat.completions.create(model="tiny", messages=CHAT, max_tokens=3)
    assert ok.choices[0].finish_reason is not None  # the server carries on


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
