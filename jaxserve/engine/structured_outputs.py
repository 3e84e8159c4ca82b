"""StructuredOutputs: what a request's output must match (vLLM's `structured_outputs` shape).

Plain Python (no jax, no grammar library): the spec only, validated for shape where it enters
(`SamplingParams(structured_outputs=...)`, given as this dataclass or as a mapping of its
fields: a JSON object from HTTP or a batch line, a proto message's set fields). Exactly one
field is set. The spec becomes a grammar at admission (`jaxserve.engine.grammar`), where a
schema or regex the grammar library refuses is reported with the field named
(`structured_outputs.json`, ...).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping

from jaxserve.engine.errors import InvalidRequest
from jaxserve.engine.json_text import MAX_FIELD_DEPTH, check_depth, parse_field
from jaxserve.engine.sampling_rules import check_text

FIELDS = ("json", "regex", "choice", "grammar", "json_object")
# A grammar's source is compiled on the admission path; past this it is refused unread.
MAX_SPEC_BYTES = 64 * 1024
MAX_CHOICES = 1024
NAME = "structured_outputs"


@dataclasses.dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one field set. `json` is a JSON schema (a dict, a bool or its JSON text; stored as
    JSON text, key order kept, so the spec stays frozen and hashable); `grammar` is Lark syntax, as
    llguidance reads it; `json_object` asks for any JSON object."""

    json: Any = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.json_object, bool):
            raise InvalidRequest(f"{NAME}.json_object must be true or false",
                                 field=f"{NAME}.json_object")
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

    @property
    def field(self) -> str:
        """The one field set."""
        return next(f for f in FIELDS if getattr(self, f) not in (None, False))

    @classmethod
    def from_mapping(cls, value: Mapping[str, Any]) -> "StructuredOutputs":
        """From a mapping of field -> value; a key that is not a field is refused by name.
        Unset fields may be given as null (false for json_object)."""
        unknown = sorted(str(k) for k in value if k not in FIELDS)
        if unknown:
            raise InvalidRequest(f"{NAME} has unknown field(s) {', '.join(unknown)}; the fields "
                                 f"are {', '.join(FIELDS)}", field=NAME)
        return cls(**{k: v for k, v in value.items()
                      if not (v is None or (k == "json_object" and v is False))})

    def as_mapping(self) -> dict[str, Any]:
        """The one field set, the schema parsed back to JSON (the wire form)."""
        name = self.field
        value = getattr(self, name)
        return {name: json.loads(value) if name == "json" else
                list(value) if name == "choice" else value}


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
