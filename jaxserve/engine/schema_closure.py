"""Which keys a JSON-schema grammar may invent: none, where an object schema lists its
properties and says nothing else about other keys.

Data flow: a `structured_outputs.json` schema (a response_format schema, a forced tool call's
parameters), parsed -> `close_listed_objects` -> the schema the grammar is built from
(`grammar.GrammarCompiler.compile`). JSON Schema lets an object without `additionalProperties`
carry any other key, and llguidance's grammar follows it: at temperature 1.0 a small model
then invents keys (an extra `flight_id` in a booking, a `properties` object nested in its own
arguments) and runs to the length limit inside them. vLLM's default grammar backend
(xgrammar) generates no undeclared property; so does this engine:
  - an object schema with `properties` and none of `additionalProperties`,
    `patternProperties`, `unevaluatedProperties` gets `additionalProperties: false`;
  - left open, so the output can still be anything the schema means: a schema that
    composes objects (`allOf`, a `$ref` beside its own keywords, `if` / `then` / `else`,
    `dependentSchemas`), the branches of an `allOf` and the `$defs` a composing `$ref`
    points at (their keys may come from a sibling), one whose `required` names a key it does
    not list, and an object without `properties` (`{"type": "object"}`: any object). A
    composing `$ref` to anything but a root `$defs` / `definitions` entry leaves the whole
    schema as it is.
Every output still validates against the client's schema: this narrows what is generated,
never what is accepted. A client who wants invented keys says `"additionalProperties": true`.
Values under `const` / `enum` / `default` / `examples` are data and are left as they are.
"""

from __future__ import annotations

from typing import Any

# Keywords whose value is one schema, and those whose value is a list of schemas.
ONE_SCHEMA = ("items", "additionalItems", "contains", "not", "if", "then", "else",
              "propertyNames", "unevaluatedItems", "additionalProperties",
              "unevaluatedProperties")
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
# Keywords whose value maps names to schemas.
NAMED_SCHEMAS = ("properties", "patternProperties", "$defs", "definitions",
                 "dependentSchemas")
# Keywords whose values are JSON data, not schemas.
_DATA = frozenset({"const", "enum", "default", "examples"})
# Keys an object schema says "other keys" with.
_OTHER_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
# Keywords that compose an object from elsewhere: its keys are not all listed here.
_COMPOSED = ("allOf", "$ref", "if", "then", "else", "dependentSchemas")
# Keywords beside a $ref that do not compose it with anything.
_ANNOTATIONS = frozenset({"$ref", "description", "title", "$comment", "default", "examples",
                          "deprecated", "readOnly", "writeOnly"})


def close_all_objects(schema: Any) -> Any:
    """`schema` with every object schema that says nothing of other keys closed, composed
    or not (a request's `disable_additional_properties: true`, as vLLM's option)."""
    if isinstance(schema, list):
        return [close_all_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in _DATA else
               {n: close_all_objects(s) for n, s in v.items()} if k in NAMED_SCHEMAS and
               isinstance(v, dict) else close_all_objects(v)) for k, v in schema.items()}
    kind = out.get("type")
    if (kind == "object" or isinstance(kind, list) and "object" in kind or
            "properties" in out) and not any(k in out for k in _OTHER_KEYS):
        out["additionalProperties"] = False
    return out


def close_listed_objects(schema: Any) -> Any:
    """`schema` with its listed-property objects closed (a new tree)."""
    composing = _composing_refs(schema, in_all_of=False)
    names = set()
    for ref in composing:
        parts = ref.split("/")
        if len(parts) != 3 or parts[0] != "#" or parts[1] not in ("$defs", "definitions"):
            return schema  # a composed target we do not track: nothing is closed
        names.add((parts[1], parts[2]))
    return _close(schema, composed=False, open_defs=frozenset(names))


def _composing_refs(schema: Any, in_all_of: bool) -> set[str]:
    """The `$ref`s whose target is composed with other keywords: beside them, or as an
    allOf branch."""
    if isinstance(schema, list):
        return set().union(*(_composing_refs(s, in_all_of) for s in schema))
    if not isinstance(schema, dict):
        return set()
    out = set()
    ref = schema.get("$ref")
    if isinstance(ref, str) and (in_all_of or any(k not in _ANNOTATIONS for k in schema)):
        out.add(ref)
    for key, value in schema.items():
        if key in ONE_SCHEMA:
            out |= _composing_refs(value, False)
        elif key in SCHEMA_LISTS:
            out |= _composing_refs(value, key == "allOf")
        elif key in NAMED_SCHEMAS and isinstance(value, dict):
            out |= _composing_refs(list(value.values()), False)
    return out


def _close(schema: Any, composed: bool, open_defs: frozenset[tuple[str, str]]) -> Any:
    """`composed`: the schema is a branch of an allOf or a composing $ref's target (its keys
    may come from a sibling)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in ONE_SCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = _close(out[key], False, open_defs)
    for key in SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_close(s, key == "allOf", open_defs) for s in out[key]]
    for key in NAMED_SCHEMAS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _close(s, (key, name) in open_defs, open_defs)
                        for name, s in out[key].items()}
    properties = out.get("properties")
    required = out.get("required", [])
    if (isinstance(properties, dict) and not composed
            and not any(k in out for k in _OTHER_KEYS + _COMPOSED)
            and isinstance(required, list) and all(r in properties for r in required)):
        out["additionalProperties"] = False
    return out
