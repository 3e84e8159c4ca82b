"""OpenAI's strict mode for a JSON schema: `"strict": true` on a function (its `parameters`)
or on `response_format.json_schema` (its `schema`).

Data flow: the client's schema -> `strict_schema(schema, field)` -> the schema the grammar is
built from (and, for a tool, the one its prompt lists). As OpenAI's strict mode reads it:
every object schema (one that says `"type": "object"` or lists `properties`) gets
`additionalProperties: false` and every one of its properties required, through the whole
tree: properties, items and prefixItems, anyOf / oneOf / allOf, not, if / then / else, and the
`$defs` / `definitions` that `$ref`s point at. The output is then bounded by the schema: no
invented keys (a small model at temperature 1.0 added a `flight_id` to a call), no key left out.
A property that may be absent is written as OpenAI asks, a union with null
(`"type": ["string", "null"]`).

What strict mode cannot express is refused, naming the field and the place in the schema, as
OpenAI refuses it: `additionalProperties` other than false (true, or a schema for the extra
keys), `patternProperties`, and an object property list that is not an object. A JSON
property's value under `const` / `enum` / `default` / `examples` is data and is left as it
is.
"""

from __future__ import annotations

from typing import Any

from jaxserve.engine.errors import InvalidRequest
from jaxserve.engine.json_text import parse_field
from jaxserve.engine.schema_closure import NAMED_SCHEMAS, ONE_SCHEMA, SCHEMA_LISTS

# The subschema keywords walked here; an object's properties and other keys are `_close`'s.
_ONE = tuple(k for k in ONE_SCHEMA if k not in ("additionalProperties",
                                                 "unevaluatedProperties"))
_MANY = SCHEMA_LISTS
_NAMED = tuple(k for k in NAMED_SCHEMAS if k not in ("properties", "patternProperties"))


def strict_schema(schema: Any, field: str) -> Any:
    """`schema` (an object, or its JSON text) as strict mode reads it (a new tree; the
    client's is not changed); InvalidRequest naming `field` where strict mode cannot
    express it."""
    if isinstance(schema, str):
        schema = parse_field(field, schema)
    return _strict(schema, field, "")


def _is_object(schema: dict[str, Any]) -> bool:
    kind = schema.get("type")
    return kind == "object" or (isinstance(kind, list) and "object" in kind) or \
        "properties" in schema


def _strict(schema: Any, field: str, where: str) -> Any:
    if not isinstance(schema, dict):
        return schema  # true / false, or not a schema (the grammar compiler says so)
    out = dict(schema)
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = _strict(out[key], field, f"{where}.{key}")
    for key in _MANY:
        if isinstance(out.get(key), list):
            out[key] = [_strict(s, field, f"{where}.{key}[{i}]")
                        for i, s in enumerate(out[key])]
    for key in _NAMED:
        if isinstance(out.get(key), dict):
            out[key] = {name: _strict(s, field, f"{where}.{key}.{name}")
                        for name, s in out[key].items()}
    if _is_object(out):
        _close(out, field, where)
    return out


def _shown(value: object, limit: int = 120) -> str:
    """A place in the schema (or a list of names), cut to `limit` characters: a message
    quoting a client's long property names stays bounded."""
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _close(out: dict[str, Any], field: str, where: str) -> None:
    """An object schema closed in place: its properties strict, all required, no others."""
    at = f"{field}{_shown(where)}"
    properties = out.get("properties", {})
    if not isinstance(properties, dict):
        raise InvalidRequest(f"{at}.properties must be an object of property schemas", field)
    given = out.get("required", [])
    unknown = [str(n) for n in given if n not in properties] if isinstance(given, list) \
        else None
    if unknown is None or unknown:
        raise InvalidRequest(f"{at}.required must list properties of the object only "
                             f"(strict mode requires them all); not {_shown(unknown)}", field)
    if "patternProperties" in out:
        raise InvalidRequest(f"{at}.patternProperties is not allowed in strict mode (an "
                             "object has its listed properties only)", field)
    extra = out.get("additionalProperties", False)
    if extra is not False:
        raise InvalidRequest(f"{at}.additionalProperties must be false in strict mode (an "
                             "object has its listed properties only)", field)
    out["properties"] = {name: _strict(s, field, f"{where}.properties.{name}")
                         for name, s in properties.items()}
    out["required"] = list(properties)
    out["additionalProperties"] = False
