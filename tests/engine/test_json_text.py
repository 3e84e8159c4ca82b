"""JSON text inside requests (jaxserve/engine/json_text.py): parsed with bounded depth.

Oracle: json.loads itself on text within the bound; past it, or on text json refuses, an
InvalidRequest naming the field (never the RecursionError the C parser raises at ~1000
levels); the depth count is checked against nesting built here, strings with brackets in
them included."""

from __future__ import annotations

import json

import pytest

from jaxserve.engine.errors import MAX_MESSAGE_CHARS, InvalidRequest, bounded
from jaxserve.engine.json_text import (MAX_FIELD_DEPTH, json_depth, parse_field,
                                       parse_or_none)


@pytest.mark.parametrize("text,depth", [
    ("1", 0), ("[]", 1), ('{"a": [1, {"b": []}]}', 4), ('["[[[", "]"]', 1),
    ('"\\"[["', 0), ("[" * 5000 + "]" * 5000, 5000)])
def test_json_depth(text: str, depth: int) -> None:
    assert json_depth(text) == depth


def test_parse_field_takes_what_json_takes_within_the_bound() -> None:
    text = "[" * MAX_FIELD_DEPTH + "]" * MAX_FIELD_DEPTH
    assert parse_field("f", text) == json.loads(text)
    assert parse_field("f", '{"a": "[[["}') == {"a": "[[["}


@pytest.mark.parametrize("text,match", [
    ("[" * (MAX_FIELD_DEPTH + 1) + "]" * (MAX_FIELD_DEPTH + 1),
     rf"^tool.args nests {MAX_FIELD_DEPTH + 1} levels deep; at most {MAX_FIELD_DEPTH}"),
    ("[" * 30000 + "]" * 30000, r"^tool.args nests 30000 levels deep"),
    ("{not json", r"^tool.args is not JSON: "),
    ("NaN", r"^tool.args is not JSON: NaN is not JSON"),
    ("1" * 5000, r"^tool.args is not JSON: "),  # int() refuses > 4300 digits
])
def test_parse_field_refuses_naming_the_field(text: str, match: str) -> None:
    with pytest.raises(InvalidRequest, match=match) as e:
        parse_field("tool.args", text)
    assert e.value.field == "tool.args"
    assert len(str(e.value)) <= MAX_MESSAGE_CHARS


def test_parse_or_none() -> None:
    assert parse_or_none('{"a": 1}') == {"a": 1}
    assert parse_or_none("[" * 2000 + "]" * 2000) is None
    assert parse_or_none("{") is None


def test_bounded_messages() -> None:
    assert bounded("short") == "short"
    long = bounded("x" * 10_000)
    assert len(long) == MAX_MESSAGE_CHARS and long.endswith("more characters)")
    assert len(str(InvalidRequest("y" * 10_000, "f"))) == MAX_MESSAGE_CHARS
