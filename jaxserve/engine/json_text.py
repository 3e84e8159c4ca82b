"""JSON given as text inside a request (a schema in `structured_outputs.json`, a tool call's
`function.arguments`), and JSON a model wrote (tool calls), parsed with bounded depth.

Python's C json parser recurses once per nesting level and raises RecursionError (not a
ValueError) on text like `'[' * 30000`; json.dumps does the same on a deep object. Data flow
of `parse_field(field, text)`: `json_depth(text)` (no recursion, C speed) -> deeper than
MAX_FIELD_DEPTH -> InvalidRequest naming the field -> `json.loads` (NaN / Infinity refused:
they are not JSON) -> a ValueError or RecursionError of the parser -> InvalidRequest naming
the field, its message bounded (`errors.bounded`). `parse_or_none` is the same for text whose
failure is not the caller's error (a model's output: not a call, then).
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from jaxserve.engine.errors import InvalidRequest

# A request field's own JSON (a schema, a call's arguments) nests a few levels; 64 leaves
# room for real schemas while keeping every recursive consumer (json, the grammar compiler)
# far from Python's recursion limit.
MAX_FIELD_DEPTH = 64
# A JSON string, escapes included (the unrolled form: no backtracking), and anything that is
# not a bracket. The closing quote is optional: an unterminated string then runs to the end in
# one match, where a required quote would make the search fail and restart at every later
# quote (quadratic: a 4 MiB body of `"\"\"...` would hold the event loop for hours).
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_STEPS = np.zeros(256, np.int8)  # a bracket's byte -> its step
_STEPS[[ord("["), ord("{")]], _STEPS[[ord("]"), ord("}")]] = 1, -1


def json_depth(text: str) -> int:
    """The deepest nesting of arrays / objects in `text`, without recursion and at C speed
    (the HTTP front runs this on bodies of up to client_max_size): strings dropped, each
    bracket a +1 / -1 step, the running sum's maximum. Malformed text gets some number;
    json.loads then refuses it."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    if not brackets:
        return 0
    steps = _STEPS[np.frombuffer(brackets.encode("ascii"), dtype=np.uint8)]
    return int(np.cumsum(steps, dtype=np.int64).max(initial=0))


def no_constant(name: str) -> Any:
    """NaN / Infinity / -Infinity: Python's json accepts them, JSON does not."""
    raise ValueError(f"{name} is not JSON")


def check_depth(field: str, text: str, max_depth: int = MAX_FIELD_DEPTH) -> None:
    """InvalidRequest naming `field` when `text` nests deeper than `max_depth`."""
    depth = json_depth(text)
    if depth > max_depth:
        raise InvalidRequest(f"{field} nests {depth} levels deep; at most {max_depth} are "
                             "allowed", field=field)


def parse_field(field: str, text: str, max_depth: int = MAX_FIELD_DEPTH) -> Any:
    """`text` (a request field's JSON) as a value, or InvalidRequest naming `field`."""
    check_depth(field, text, max_depth)
    try:
        return json.loads(text, parse_constant=no_constant)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, a 4300-digit number, ...
        raise InvalidRequest(f"{field} is not JSON: {e}", field=field) from None


def parse_or_none(text: str, max_depth: int = MAX_FIELD_DEPTH) -> Any | None:
    """`text` as a JSON value, or None where it is not JSON (or nests deeper than
    `max_depth`): for text a model wrote, whose failure to parse is an outcome, not an
    error. A JSON null also comes back as None."""
    if json_depth(text) > max_depth:
        return None
    try:
        return json.loads(text, parse_constant=no_constant)
    except (ValueError, RecursionError):
        return None
