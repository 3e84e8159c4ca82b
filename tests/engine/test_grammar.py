"""The host half of structured output (jaxserve/engine/grammar.py and structured_outputs.py).

Oracle: the outputs' own parsers. A byte-level BPE tokenizer trained here (every byte is a
token, plus merges, so any text is reachable several ways) stands in for a model's; a random
walk plays the sampler: at each step it picks uniformly among the tokens the filled mask
allows, or EOS where allowed, until the grammar finishes. Every walk's text must parse as JSON
and validate against its schema (jsonschema), fully match its regex, or be one of its choices.
A walk that the mask lets go wrong fails here: the test can fail. Also: bad specs raise
InvalidRequest naming the field; a token the mask forbids is refused.
"""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
from support.bpe_tokenizer import train_bpe_tokenizer

from jaxserve.engine.batch import bitmask_words
from jaxserve.engine.errors import InvalidRequest
from jaxserve.engine.grammar import GrammarCompiler
from jaxserve.engine.structured_outputs import StructuredOutputs
from jaxserve.models.tokenizer import Tokenizer

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                      "age": {"type": "integer", "minimum": 0,
                                              "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {
        "enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
        "inner": {"type": "object", "properties": {"x": {"type": "number", "minimum": -5,
                                                         "maximum": 5}},
                  "required": ["x"], "additionalProperties": False}},
     "required": ["tags", "inner"], "additionalProperties": False},
    {"type": "array", "items": {"type": "boolean"}, "maxItems": 4},
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return train_bpe_tokenizer(tmp_path_factory.mktemp("bpe"))


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, tokenizer.vocab_size)


def walk(compiler: GrammarCompiler, tokenizer: Tokenizer, spec: StructuredOutputs,
         rng: np.random.Generator, max_tokens: int = 200) -> str:
    seq = compiler.matcher(compiler.compile(spec))
    mask = np.zeros((3, bitmask_words(compiler.vocab_size)), np.int32)
    eos = tokenizer.eos_token_ids[0]
    out: list[int] = []
    for _ in range(max_tokens):
        seq.fill(mask, 1)
        assert mask[1].any()
        bits = np.unpackbits(mask[1].view(np.uint8), bitorder="little")[:compiler.vocab_size]
        allowed = np.flatnonzero(bits)
        token = int(rng.choice(allowed))
        assert seq.accept(token), seq.error
        if token == eos:
            break
        out.append(token)
        if seq.finished:  # the grammar's last token: nothing may follow
            break
    else:
        pytest.fail(f"no end after {max_tokens} tokens: {tokenizer.decode(out)!r}")
    return tokenizer.decode(out)


@pytest.mark.parametrize("schema", SCHEMAS, ids=["flat", "nested", "array"])
def test_json_schema_walks_validate(compiler, tokenizer, schema) -> None:
    rng = np.random.default_rng(0)
    for _ in range(15):
        text = walk(compiler, tokenizer, StructuredOutputs(json=schema), rng)
        jsonschema.validate(json.loads(text), schema)


def test_json_object_accepts_objects_only(compiler, tokenizer) -> None:
    # (A uniform random walk in "any object" rarely closes its strings: checked by tokens.)
    grammar = compiler.compile(StructuredOutputs(json_object=True))
    seq = compiler.matcher(grammar)
    assert all(seq.accept(t) for t in tokenizer.encode('{"a": [1, true], "b": {}}'))
    assert seq.accept(tokenizer.eos_token_ids[0]) and seq.finished
    assert not compiler.matcher(grammar).accept(tokenizer.encode("[1]")[0])


def test_regex_and_choice(compiler, tokenizer) -> None:
    rng = np.random.default_rng(1)
    for _ in range(10):
        text = walk(compiler, tokenizer, StructuredOutputs(regex=r"[a-c]{2,4}-\d{3}"), rng)
        assert re.fullmatch(r"[a-c]{2,4}-\d{3}", text), text
        choices = ("yes", "no", "maybe so")
        assert walk(compiler, tokenizer, StructuredOutputs(choice=list(choices)),
                    rng) in choices


def test_forbidden_token_is_refused(compiler, tokenizer) -> None:
    seq = compiler.matcher(compiler.compile(StructuredOutputs(regex=r"\d+")))
    assert not seq.accept(tokenizer.encode("x")[0])
    assert seq.error


@pytest.mark.parametrize("spec,field", [
    (dict(json='{"type": "object", "properties": {"a": {"type": "nosuchtype"}}}'), "json"),
    (dict(regex="(unclosed"), "regex"),
    (dict(grammar="start: undefined_rule"), "grammar"),
    (dict(json="{not json"), "json"),
    (dict(choice=[]), "choice"),
])
def test_bad_specs_name_the_field(compiler, spec, field) -> None:
    with pytest.raises(InvalidRequest, match=rf"^structured_outputs\.{field}") as info:
        compiler.compile(StructuredOutputs(**spec))
    assert info.value.field == f"structured_outputs.{field}"


def test_exactly_one_field() -> None:
    with pytest.raises(InvalidRequest, match="exactly one of"):
        StructuredOutputs(regex="a", choice=["a"])
    with pytest.raises(InvalidRequest, match="got none"):
        StructuredOutputs()
    spec = StructuredOutputs(json={"b": 1, "a": {"type": "string"}})
    assert spec.json == '{"b": 1, "a": {"type": "string"}}' and hash(spec)  # order kept


def test_object_properties_come_in_the_schemas_order(compiler, tokenizer) -> None:
    """The schema's key order is the order the output gives the properties in: storing the
    schema with sorted keys would force "age" before "name" here."""
    schema = {"type": "object", "properties": {"name": {"enum": ["Ada"]},
                                               "age": {"enum": [36]}},
              "required": ["name", "age"], "additionalProperties": False}
    rng = np.random.default_rng(2)
    for _ in range(5):
        text = walk(compiler, tokenizer, StructuredOutputs(json=schema), rng)
        assert list(json.loads(text)) == ["name", "age"], text
    seq = compiler.matcher(compiler.compile(StructuredOutputs(json=json.dumps(schema))))
    assert all(seq.accept(t) for t in tokenizer.encode('{"name": "Ada", "age": 36}'))


WS_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"},
                                             "b": {"type": "array", "items": {"type": "integer"}}},
             "required": ["a", "b"], "additionalProperties": False}
PRETTY = json.dumps({"a": 1, "b": [2, 3]}, indent=2)


def accepts(compiler, tokenizer, spec: StructuredOutputs, text: str) -> bool:
    """Whether the spec's grammar takes `text` (its byte-level tokens) and may end there."""
    seq = compiler.matcher(compiler.compile(spec))
    return all(seq.accept(t) for t in tokenizer.encode(text)) and \
        seq.accept(tokenizer.eos_token_ids[0])


@pytest.mark.parametrize("kind", [dict(json=WS_SCHEMA), dict(json_object=True)])
def test_default_json_whitespace_is_bounded(compiler, tokenizer, kind) -> None:
    """The issue's runaway: llguidance's own default takes any whitespace run inside an
    object (a model spent 470 lines on it). The default takes json.dumps' spacing, a
    pretty-printed object and one newline with an indent of up to 16; not 17 blanks, nor
    two newlines. The oracle is the texts themselves (json.loads parses every one)."""
    spec = StructuredOutputs(**kind)
    good = ['{"a":1,"b":[2,3]}', '{"a": 1, "b": [2, 3]}', PRETTY,
            '{\n' + " " * 16 + '"a": 1,\n\t"b": []}']
    bad = ['{"a":' + " " * 17 + '1, "b": []}', '{\n' + " " * 17 + '"a": 1, "b": []}',
           '{"a": 1,\n\n"b": []}', '{"a": 1, ' + "\n " * 40 + '"b": []}']
    for text in good + bad:
        json.loads(text)
    assert [accepts(compiler, tokenizer, spec, t) for t in good] == [True] * len(good)
    assert [accepts(compiler, tokenizer, spec, t) for t in bad] == [False] * len(bad)


def test_the_true_schema_is_any_json_value(compiler, tokenizer) -> None:
    """`json: true` (any value): llguidance applies its options to object schemas only."""
    for text in ('{"a": [1, null]}', '"x"', "3"):
        json.loads(text)
        assert accepts(compiler, tokenizer, StructuredOutputs(json=True), text)


def test_disable_any_whitespace_is_compact(compiler, tokenizer) -> None:
    spec = StructuredOutputs(json=WS_SCHEMA, disable_any_whitespace=True)
    assert accepts(compiler, tokenizer, spec, '{"a":1,"b":[2,3]}')
    for text in ['{"a": 1,"b":[]}', '{"a":1, "b":[]}', PRETTY, ' {"a":1,"b":[]}']:
        assert not accepts(compiler, tokenizer, spec, text), text
    rng = np.random.default_rng(3)
    for _ in range(5):
        text = walk(compiler, tokenizer, spec, rng)
        assert json.dumps(json.loads(text), separators=(",", ":")) == text


def test_whitespace_pattern_is_the_whitespace_allowed(compiler, tokenizer) -> None:
    flexible = StructuredOutputs(json=WS_SCHEMA, whitespace_pattern=r"[ \t\n\r]*")
    assert accepts(compiler, tokenizer, flexible, '{"a":' + " \n" * 60 + '1,"b":[]}')
    one_space = StructuredOutputs(json_object=True, whitespace_pattern=" ?")
    assert accepts(compiler, tokenizer, one_space, '{"a": 1, "b": [2, 3]}')
    assert not accepts(compiler, tokenizer, one_space, PRETTY)


@pytest.mark.parametrize("spec,field,match", [
    (dict(json_object=True, whitespace_pattern="a*"), "whitespace_pattern",
     "other than spaces"),
    (dict(json_object=True, whitespace_pattern="( "), "whitespace_pattern", "regex"),
    (dict(regex="a+", disable_any_whitespace=True), "disable_any_whitespace", "json and"),
    (dict(choice=["a"], whitespace_pattern=" "), "whitespace_pattern", "json and"),
    (dict(json_object=True, disable_any_whitespace=True, whitespace_pattern=" "),
     "whitespace_pattern", "at most one"),
    (dict(json_object=True, disable_any_whitespace="yes"), "disable_any_whitespace",
     "true or false"),
    (dict(json_object=True, disable_additional_properties=True),
     "disable_additional_properties", "json only"),
    (dict(json={}, disable_additional_properties="no"), "disable_additional_properties",
     "true or false"),
])
def test_bad_whitespace_options_name_the_field(compiler, spec, field, match) -> None:
    with pytest.raises(InvalidRequest, match=match) as info:
        compiler.compile(StructuredOutputs(**spec))
    assert info.value.field == f"structured_outputs.{field}"


def test_whitespace_options_round_trip_as_a_mapping() -> None:
    spec = StructuredOutputs.from_mapping({"json": WS_SCHEMA, "disable_any_whitespace": True,
                                           "whitespace_pattern": None})
    assert spec.disable_any_whitespace and StructuredOutputs.from_mapping(
        spec.as_mapping()) == spec
    assert "disable_any_whitespace" not in StructuredOutputs(json_object=True).as_mapping()
    literal = StructuredOutputs.from_mapping({"json": {}, "disable_additional_properties": False})
    assert literal.disable_additional_properties is False  # false is not unset here
    assert StructuredOutputs.from_mapping(literal.as_mapping()) == literal


@pytest.fixture(scope="module")
def bundled_compiler() -> tuple[Tokenizer, GrammarCompiler]:
    """The bundled SmolLM2's GGUF tokenizer (49k tokens) and a compiler over it."""
    from jaxserve.models.bundled import BundledModelMissing, bundled_model_path

    try:
        path = bundled_model_path()
    except BundledModelMissing as e:
        pytest.skip(str(e))
    tok = Tokenizer.from_gguf(path)
    return tok, GrammarCompiler(tok, tok.vocab_size)


def test_the_bundled_gguf_tokenizer_takes_a_grammar(bundled_compiler) -> None:
    """llguidance's vocabulary from a GGUF-loaded tokenizer (the bundled SmolLM2's): a JSON
    text in the schema's shape is accepted token by token and ends the grammar; a token that
    breaks it is refused."""
    tok, gguf = bundled_compiler
    schema = {"type": "object", "properties": {"city": {"type": "string"},
                                               "n": {"type": "integer"}},
              "required": ["city", "n"], "additionalProperties": False}
    grammar = gguf.compile(StructuredOutputs(json=schema))
    seq = gguf.matcher(grammar)
    assert all(seq.accept(t) for t in tok.encode('{"city": "Paris", "n": 2}',
                                                 add_special_tokens=False))
    assert seq.accept(tok.eos_token_ids[0]) and seq.finished
    bad = gguf.matcher(grammar)
    assert not bad.accept(tok.encode("[", add_special_tokens=False)[0])


LOOPING_REFS = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                "$ref": "#/$defs/a"}


@pytest.mark.parametrize("spec,field", [
    (StructuredOutputs(regex="[^\\x00-\\x{10FFFF}]"), "structured_outputs.regex"),
    (StructuredOutputs(regex="a{1000000}"), "structured_outputs.regex"),
    (StructuredOutputs(grammar="start: " + " | ".join(f'"w{i}"' for i in range(6000))),
     "structured_outputs.grammar"),
    (StructuredOutputs(json=json.dumps(LOOPING_REFS)), "structured_outputs.json"),
    (StructuredOutputs(json=json.dumps({"type": "string", "pattern": "^a{1000000}$"})),
     "structured_outputs.json"),
], ids=["matches-nothing", "huge-repeat", "6000-alternatives", "looping-refs",
        "huge-pattern"])
def test_specs_that_fail_at_the_first_step_are_refused_at_compile(compiler, spec,
                                                                  field) -> None:
    """Each of these validates as a grammar but fails when its first mask is computed (the
    lexer's limits, a language with no string, refs with no base case): compile must find it,
    so that admission answers 400 instead of the first step failing the request."""
    with pytest.raises(InvalidRequest) as e:
        compiler.compile(spec)
    assert e.value.field == field and str(e.value).startswith(field)
    assert len(str(e.value)) <= 500


def test_an_error_quoting_a_huge_pattern_is_bounded(compiler) -> None:
    """A 60,000-character regex that llguidance refuses, quoting it: the message is cut to a
    bounded excerpt (the gRPC status would otherwise overflow its metadata limit)."""
    with pytest.raises(InvalidRequest) as e:
        compiler.compile(StructuredOutputs(regex="(" * 60000))
    text = str(e.value)
    assert text.startswith("structured_outputs.regex") and len(text) <= 500
    assert "more characters)" in text


def test_the_bundled_tokenizer_refuses_the_late_failing_specs(bundled_compiler) -> None:
    """The specs above with the bundled SmolLM2's 49k vocabulary, where they were found
    (multi-character tokens such as `aaaa` reach the lexer's limits in one step)."""
    tok, gguf = bundled_compiler
    for spec in (StructuredOutputs(regex="a{1000000}"),
                 StructuredOutputs(grammar="start: " + " | ".join(f'"w{i}"'
                                                                   for i in range(6000))),
                 StructuredOutputs(json=json.dumps(LOOPING_REFS))):
        with pytest.raises(InvalidRequest, match="is not a usable grammar"):
            gguf.compile(spec)
    # A usable schema still compiles.
    gguf.compile(StructuredOutputs(json={"type": "object", "properties": {
        "a": {"type": "string"}}, "required": ["a"]}))
