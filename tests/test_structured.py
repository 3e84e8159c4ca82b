"""The host half of structured output (jaxserve/engine/structured.py), with llguidance.

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
import pathlib
import re

import numpy as np
import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from jaxserve.engine.errors import InvalidRequest  # noqa: E402
from jaxserve.engine.structured import (GrammarCompiler, SequenceGrammar,  # noqa: E402
                                        StructuredOutputs, bitmask_words)
from jaxserve.models.tokenizer import Tokenizer  # noqa: E402

CORPUS = ['{"name": "Ada", "age": 36, "tags": ["x", "y"]}', "true false null 0123456789",
          "hello world, the quick brown fox", '{"a": [1, 2.5, -3e4]}', "yes no maybe"] * 20

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
    from tokenizers import Tokenizer as Backend, decoders, models, pre_tokenizers, trainers

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(CORPUS, trainer)
    d = pathlib.Path(tmp_path_factory.mktemp("bpe"))
    backend.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return Tokenizer.from_hf_dir(d)


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
        assert not SequenceGrammar.allows_nothing(mask, 1)
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
    assert spec.json == '{"a": {"type": "string"}, "b": 1}' and hash(spec)
