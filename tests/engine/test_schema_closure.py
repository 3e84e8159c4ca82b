"""Which keys a JSON-schema grammar may invent (jaxserve/engine/schema_closure.py): none
where an object lists its properties and says nothing of others, and the schemas left open.

Oracles: jsonschema on instances written by hand (every instance the closed schema takes,
the client's schema takes too; the closed one refuses an invented key exactly where it is
closed), and the grammar itself over a byte-level BPE (an invented key cannot be written;
an explicit `additionalProperties: true` still can)."""

from __future__ import annotations

import jsonschema
import pytest
from support.bpe_tokenizer import train_bpe_tokenizer

from jaxserve.engine.grammar import GrammarCompiler
from jaxserve.engine.schema_closure import close_all_objects, close_listed_objects
from jaxserve.engine.structured_outputs import StructuredOutputs

LISTED = {"type": "object", "properties": {"city": {"type": "string"},
                                           "pop": {"type": "integer"}}, "required": ["city"]}
# (schema, an instance the client's schema takes, whether the closed one still takes it)
CASES = [
    (LISTED, {"city": "Oslo", "id": 7}, False),
    ({"type": "array", "items": LISTED}, [{"city": "Oslo"}, {"city": "a", "x": 1}], False),
    ({"anyOf": [LISTED, {"type": "null"}]}, {"city": "Oslo", "x": []}, False),
    ({"$defs": {"C": LISTED}, "type": "object", "properties": {"c": {"$ref": "#/$defs/C"}}},
     {"c": {"city": "Oslo", "x": 1}}, False),
    ({"type": "object"}, {"anything": 1}, True),  # no properties: any object
    ({**LISTED, "additionalProperties": True}, {"city": "Oslo", "id": 7}, True),
    ({**LISTED, "patternProperties": {"^x_": {}}}, {"city": "Oslo", "x_1": 7}, True),
    ({**LISTED, "required": ["city", "id"]}, {"city": "Oslo", "id": 7}, True),
    ({"allOf": [LISTED, {"properties": {"id": {"type": "integer"}}}]},
     {"city": "Oslo", "id": 7}, True),  # a branch's keys come from its sibling
    ({**LISTED, "$ref": "#/$defs/X", "$defs": {"X": {"properties": {"id": {}}}}},
     {"city": "Oslo", "id": 7}, True),
    ({"allOf": [{"$ref": "#/$defs/A"}, {"properties": {"b": {}}}],
      "$defs": {"A": {"properties": {"a": {}}}}}, {"a": 1, "b": 2}, True),
    ({"type": "object", "properties": {"x": LISTED, "y": {"$ref": "#/properties/x",
                                                           "required": ["pop"]}}},
     {"x": {"city": "a", "id": 1}}, True),  # an untracked composing ref: all left open
    ({"type": "object", "properties": {"kind": {"const": {"properties": {"a": {}}}}}},
     {"kind": {"properties": {"a": {}}}}, True),  # const is data: its value is kept
]


@pytest.mark.parametrize("schema,instance,still", CASES)
def test_closed_where_listed_and_never_wider(schema, instance, still) -> None:
    closed = close_listed_objects(schema)
    jsonschema.validate(instance, schema)
    if still:
        jsonschema.validate(instance, closed)
    else:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(instance, closed)


def test_close_all_objects_closes_what_says_nothing() -> None:
    """vLLM's disable_additional_properties: every object schema that says nothing of other
    keys is closed, composed or not; what says something, and data, is kept."""
    schema = {"allOf": [LISTED, {"type": "object"}],
              "properties": {"x": {"additionalProperties": True, "properties": {}},
                             "d": {"const": {"type": "object"}}}}
    closed = close_all_objects(schema)
    assert [b["additionalProperties"] for b in closed["allOf"]] == [False, False]
    assert closed["additionalProperties"] is False
    assert closed["properties"]["x"]["additionalProperties"] is True
    assert closed["properties"]["d"] == {"const": {"type": "object"}}
    jsonschema.validate({"city": "a"}, close_all_objects(LISTED))


def test_the_grammar_writes_no_invented_key(tmp_path) -> None:
    tok = train_bpe_tokenizer(tmp_path)
    compiler = GrammarCompiler(tok, tok.vocab_size)

    def accepts(schema: dict, text: str) -> bool:
        seq = compiler.matcher(compiler.compile(StructuredOutputs(json=schema)))
        return all(seq.accept(t) for t in tok.encode(text)) and seq.accept(
            tok.eos_token_ids[0])

    assert accepts(LISTED, '{"city": "Oslo", "pop": 3}')
    assert not accepts(LISTED, '{"city": "Oslo", "flight_id": 3}')
    assert accepts({**LISTED, "additionalProperties": True}, '{"city": "Oslo", "flight_id": 3}')
    assert accepts({"type": "object"}, '{"flight_id": 3}')

    def accepts_with(option: bool, schema: dict, text: str) -> bool:
        seq = compiler.matcher(compiler.compile(StructuredOutputs(
            json=schema, disable_additional_properties=option)))
        return all(seq.accept(t) for t in tok.encode(text)) and seq.accept(
            tok.eos_token_ids[0])

    # false: the schema read literally (JSON Schema's other keys); true: every object closed
    assert accepts_with(False, LISTED, '{"city": "Oslo", "flight_id": 3}')
    assert not accepts_with(True, {"type": "object"}, '{"flight_id": 3}')
    assert accepts_with(True, {"type": "object"}, '{}')
