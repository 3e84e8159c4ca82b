"""StructuredOutputs: what a request's output must match (vLLM's `structured_outputs` shape).

Plain Python (no jax, no grammar library): the spec only, validated for shape where it enters
(`SamplingParams(structured_outputs=...)`, given as this dataclass or as a mapping of its
fields: a JSON object from HTTP or a batch line, a proto message's set fields). Exactly one
kind is set. The spec becomes a grammar at admission (`jaxserve.engine.grammar`), where a
schema or regex the grammar library refuses is reported with the field named
(`structured_outputs.json`, ...).

Two options (vLLM's names) say how a JSON kind (json, json_object) is spelled, never what it
means: `disable_any_whitespace` (no whitespace at all between JSON tokens) and
`whitespace_pattern` (a regex for the whitespace allowed between two JSON tokens). Unset, the
grammar allows a bounded run (`grammar.BOUNDED_WHITESPACE`): a small model at temperature 1.0
cannot spend its budget on whitespace inside an object. A third, `disable_additional_properties`
(json only), says which objects may carry keys their schema does not list: unset, those that
list properties and say nothing of others may not (`schema_closure`); true, no object that
says nothing of other keys may (vLLM's meaning); false, the schema read literally (JSON
Schema's: other keys allowed unless it says not). Given for another kind they are refused
by name.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping

from jaxserve.engine.errors import InvalidRequest
from jaxserve.engine.json_text import MAX_FIELD_DEPTH, check_depth, parse_field
from jaxserve.engine.sampling_rules import check_text

FIELDS = ("json", "regex", "choice", "grammar", "json_object")  # the kinds: exactly one
WHITESPACE_OPTIONS = ("disable_any_whitespace", "whitespace_pattern")  # how JSON is spelled
OPTIONS = (*WHITESPACE_OPTIONS, "disable_additional_properties")
JSON_KINDS = ("json", "json_object")
MAX_PATTERN_BYTES = 1024  # a whitespace_pattern's
# A grammar's source is compiled on the admission path; past this it is refused unread.
MAX_SPEC_BYTES = 64 * 1024
MAX_CHOICES = 1024
NAME = "structured_outputs"


@dataclasses.dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one kind set. `json` is a JSON schema (a dict, a bool or its JSON text; stored as
    JSON text, key order kept, so the spec stays frozen and hashable); `grammar` is Lark syntax, as
    llguidance reads it; `json_object` asks for any JSON object. The options apply to the JSON
    kinds only: `disable_any_whitespace` writes the JSON with no whitespace (',' and ':'
    alone); `whitespace_pattern` (a regex, as llguidance's JSON option) is the whitespace
    allowed between two JSON tokens, e.g. `[ \\t\\n\\r]*` for any run (llguidance's flexible
    form); neither: at most one space, or a newline and an indent of up to 16 spaces or tabs.
    `disable_additional_properties` (json only): None, the default closing of objects that
    list their properties; True, every object closed; False, the schema as written."""

    json: Any = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None
    disable_additional_properties: bool | None = None

    def __post_init__(self) -> None:
        for name in ("json_object", "disable_any_whitespace"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequest(f"{NAME}.{name} must be true or false",
                                     field=f"{NAME}.{name}")
        given = [f for f in FIELDS if getattr(self, f) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequest(f"{NAME}: give exactly one of {', '.join(FIELDS)}; "
                                 f"got {', '.join(given) or 'none'}", field=NAME)
        if self.json is not None:
            object.__setattr__(self, "json", _schema_text(self.json))
        if self.choice is not None:
            choice = tuple(self.choice) if isinstance(self.choice, (list, tuple)) else None
            if not choice or not all(isinstance(c, str) and c for c in choice):
                raise InvalidRequest(f"{NAME}.choice must be a non-empty list of non-empty "
                                     "strings", field=f"{NAME}.choice")
            if len(choice) > MAX_CHOICES:
                raise InvalidRequest(f"{NAME}.choice has {len(choice)} strings; at most "
                                     f"{MAX_CHOICES}", field=f"{NAME}.choice")
            _check_size("choice", sum(check_text(f"{NAME}.choice", c, f"[{i}]")
                                      for i, c in enumerate(choice)))
            object.__setattr__(self, "choice", choice)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None:
                if not isinstance(value, str) or not value:
                    raise InvalidRequest(f"{NAME}.{name} must be a non-empty string",
                                         field=f"{NAME}.{name}")
                _check_size(name, check_text(f"{NAME}.{name}", value))
        self._check_options()

    def _check_options(self) -> None:
        keys = self.disable_additional_properties
        field = f"{NAME}.disable_additional_properties"
        if keys is not None and not isinstance(keys, bool):
            raise InvalidRequest(f"{field} must be true or false", field=field)
        if keys is not None and self.field != "json":
            raise InvalidRequest(f"{field} applies to json only, not to {self.field}",
                                 field=field)
        options = [o for o in WHITESPACE_OPTIONS if getattr(self, o) not in (None, False)]
        if options and self.field not in JSON_KINDS:
            raise InvalidRequest(f"{NAME}.{options[0]} applies to json and json_object only, "
                                 f"not to {self.field}", field=f"{NAME}.{options[0]}")
        if len(options) > 1:
            raise InvalidRequest(f"{NAME}: give at most one of disable_any_whitespace and "
                                 "whitespace_pattern (each says what whitespace the JSON may "
                                 "have)", field=f"{NAME}.whitespace_pattern")
        pattern = self.whitespace_pattern
        if pattern is not None:
            field = f"{NAME}.whitespace_pattern"
            if not isinstance(pattern, str):
                raise InvalidRequest(f"{field} must be a string (a regex)", field=field)
            size = check_text(field, pattern)
            if size > MAX_PATTERN_BYTES:
                raise InvalidRequest(f"{field} is {size} bytes long; at most "
                                     f"{MAX_PATTERN_BYTES}", field=field)

    @property
    def field(self) -> str:
        """The one kind set."""
        return next(f for f in FIELDS if getattr(self, f) not in (None, False))

    @classmethod
    def from_mapping(cls, value: Mapping[str, Any]) -> "StructuredOutputs":
        """From a mapping of field -> value; a key that is not a field is refused by name.
        Unset fields may be given as null (false for json_object and disable_any_whitespace)."""
        unknown = sorted(str(k) for k in value if k not in FIELDS + OPTIONS)
        if unknown:
            raise InvalidRequest(f"{NAME} has unknown field(s) {', '.join(unknown)}; the fields "
                                 f"are {', '.join(FIELDS + OPTIONS)}", field=NAME)
        return cls(**{k: v for k, v in value.items()
                      if not (v is None or (k in _FLAGS and v is False))})

    def as_mapping(self) -> dict[str, Any]:
        """The kind set and the options set, the schema parsed back to JSON (the wire form)."""
        name = self.field
        value = getattr(self, name)
        out = {name: json.loads(value) if name == "json" else
               list(value) if name == "choice" else value}
        out.update({o: getattr(self, o) for o in OPTIONS
                    if getattr(self, o) not in (None, False)})
        if self.disable_additional_properties is False:  # unlike unset: the literal schema
            out["disable_additional_properties"] = False
        return out


_FLAGS = ("json_object", "disable_any_whitespace")


def _schema_text(schema: Any) -> str:
    """A JSON schema given as an object, a bool or JSON text, as JSON text (keys in order)."""
    field = f"{NAME}.json"
    if isinstance(schema, str):
        _check_size("json", check_text(field, schema))
        schema = parse_field(field, schema)
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequest(f"{field} must be a JSON schema (an object or a boolean), got "
                             f"{type(schema).__name__}", field=field)
    try:
        # Key order is kept: it is the order the grammar emits an object's properties in.
        text = json.dumps(schema, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise InvalidRequest(f"{field} is not JSON: {e}", field=field) from e
    except RecursionError:  # an object nested past the interpreter's recursion limit
        raise InvalidRequest(f"{field} nests too deep; at most {MAX_FIELD_DEPTH} levels are "
                             "allowed", field=field) from None
    _check_size("json", check_text(field, text))
    check_depth(field, text)  # an object given as such: its depth is the text's
    return text


def _check_size(name: str, num_bytes: int) -> None:
    if num_bytes > MAX_SPEC_BYTES:
        raise InvalidRequest(f"{NAME}.{name} is {num_bytes} bytes long; at most "
                             f"{MAX_SPEC_BYTES}", field=f"{NAME}.{name}")
