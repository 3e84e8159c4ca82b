"""OpenAI's strict mode for JSON schemas (jaxserve/serving/strict_schema.py): what a strict
schema accepts, checked by jsonschema (the oracle) on instances written by hand, and what
strict mode refuses, naming the client's field."""

from __future__ import annotations

import copy

import jsonschema
import pytest

from jaxserve.engine.errors import InvalidRequest
from jaxserve.serving import tools
from jaxserve.serving.strict_schema import strict_schema

FLIGHT = {"type": "object", "properties": {
    "to": {"$ref": "#/$defs/City"},
    "seats": {"type": "integer", "minimum": 1},
    "legs": {"type": "array", "items": {"type": "object", "properties": {
        "via": {"$ref": "#/$defs/City"}, "note": {"type": ["string", "null"]}}}},
    "pay": {"anyOf": [{"type": "object", "properties": {"card": {"type": "string"}}},
                      {"type": "null"}]}},
    "required": ["to"],
    "$defs": {"City": {"type": "object", "properties": {"name": {"enum": ["Oslo", "Lima"]},
                                                         "code": {"type": "string"}}}},
    "examples": [{"to": {"properties": "data, not a schema"}}]}
CITY = {"name": "Oslo", "code": "OSL"}
FULL = {"to": CITY, "seats": 2, "legs": [{"via": CITY, "note": None}], "pay": {"card": "x"}}


def test_every_object_is_closed_and_fully_required() -> None:
    given = copy.deepcopy(FLIGHT)
    strict = strict_schema(FLIGHT, "f")
    assert FLIGHT == given  # the client's schema is not changed
    jsonschema.validate(FULL, FLIGHT)
    jsonschema.validate(FULL, strict)
    jsonschema.validate({**FULL, "pay": None}, strict)
    # each of these is valid for the client's schema, and not in strict mode
    loose = [{"to": CITY}, {**FULL, "flight_id": 7}, {**FULL, "to": {"name": "Oslo"}},
             {**FULL, "to": {**CITY, "gate": 3}}, {**FULL, "legs": [{"via": CITY}]},
             {**FULL, "legs": [{"via": CITY, "note": "a", "x": 1}]},
             {**FULL, "pay": {}}, {**FULL, "pay": {"card": "x", "cvv": 1}}]
    for instance in loose:
        jsonschema.validate(instance, FLIGHT)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(instance, strict)
    assert strict["examples"] == FLIGHT["examples"]  # data is left as it is


@pytest.mark.parametrize("schema,where", [
    ({"type": "object", "additionalProperties": True}, "f.additionalProperties"),
    ({"properties": {"a": {"type": "object", "additionalProperties": {"type": "string"}}}},
     "f.properties.a.additionalProperties"),
    ({"type": "object", "patternProperties": {"^x": {}}}, "f.patternProperties"),
    ({"properties": {"a": {}}, "required": ["a", "b"]}, "f.required"),
    ({"$defs": {"D": {"properties": []}}}, "f.$defs.D.properties"),
])
def test_what_strict_mode_cannot_express_is_refused(schema: dict, where: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        strict_schema(schema, "f")
    assert e.value.field == "f" and str(e.value).startswith(where), str(e.value)


def test_a_strict_tool_has_strict_parameters() -> None:
    tool = {"type": "function", "function": {"name": "book", "strict": True,
                                             "parameters": FLIGHT}}
    req = tools.check_tools([tool], {"type": "function", "function": {"name": "book"}})
    assert req.tools[0]["function"]["parameters"] == strict_schema(FLIGHT, "f")
    spec, _ = tools.guide(req)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"to": CITY}, spec["json"])
    bare = tools.check_tools([{"type": "function", "function": {"name": "f", "strict": True}}])
    assert bare.parameters(0)["additionalProperties"] is False
    with pytest.raises(InvalidRequest) as e:
        tools.check_tools([{"type": "function", "function": {
            "name": "f", "strict": True, "parameters": {"type": "object",
                                                       "additionalProperties": True}}}])
    assert e.value.field == "tools[0].function.parameters"
