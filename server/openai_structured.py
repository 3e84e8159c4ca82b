"""OpenAI's and vLLM's structured-output fields -> `SamplingParams.structured_outputs`.

Wire mapping only (the spec's shape is checked by `StructuredOutputs`, the grammar at
admission). A request gives at most one source:
  - `response_format`: {"type": "text"} (free text, the default), {"type": "json_object"}
    (any JSON object), {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
    (a JSON schema; without `schema`: any JSON object; `strict: true`: OpenAI's strict mode,
    `serving.strict_schema`);
  - vLLM's `structured_outputs` object ({"json": ...} / {"regex": ...} / {"choice": [...]} /
    {"grammar": ...} / {"json_object": true}), which the registry passes on as it is;
  - vLLM's older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`.
How the JSON is spelled (`disable_any_whitespace`, `whitespace_pattern`: options of
StructuredOutputs, unset = the engine's bounded whitespace) comes inside the
`structured_outputs` object; that object may hold the options alone next to response_format or
a guided_* field, and they join that source's spec (vLLM's older `guided_whitespace_pattern`
likewise).
`structured_outputs_of` returns the spec as a mapping and the client's names of its fields,
so that a refusal (here, in SamplingParams or at admission) names what the client sent:
`response_format.json_schema.schema` rather than `structured_outputs.json`. Refusals here are
InvalidRequest naming the client's field (the caller answers 400).
"""

from __future__ import annotations

from typing import Any

from jaxserve.engine.errors import InvalidRequest
from jaxserve.engine.structured_outputs import FIELDS, NAME
from jaxserve.serving.strict_schema import strict_schema

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
_FORMATS = ("text", "json_object", "json_schema")
_PATTERN = "guided_whitespace_pattern"  # vLLM's older name of whitespace_pattern


def structured_outputs_of(body: dict[str, Any]) -> tuple[dict[str, Any] | None, dict[str, str]]:
    """(the spec as SamplingParams takes it, or None; spec field -> the client's name)."""
    spec, names = _source(body)
    options, option_names = _options(body)
    if not options:
        return spec, names
    if spec is None:  # the object's own kind, or options alone (refused: no kind)
        obj = body.get(NAME)
        if obj is not None and not isinstance(obj, dict):
            return None, {}  # the registry refuses it, naming it
        return {**(obj or {}), **options}, option_names
    return {**spec, **options}, {**names, **option_names}


def _options(body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """The spelling options given beside another source: a `structured_outputs` object of
    options alone, or guided_whitespace_pattern."""
    obj = body.get(NAME)
    options: dict[str, Any] = {}
    names: dict[str, str] = {}
    if isinstance(obj, dict) and obj and not any(obj.get(k) not in (None, False)
                                                 for k in FIELDS):
        options = dict(obj)  # unknown keys: refused by the spec
    if body.get(_PATTERN) is not None:
        if "whitespace_pattern" in options:
            raise InvalidRequest(f"give at most one of {NAME}.whitespace_pattern and "
                                 f"{_PATTERN}", _PATTERN)
        options["whitespace_pattern"] = body[_PATTERN]
        names[f"{NAME}.whitespace_pattern"] = _PATTERN
    return options, names


def _source(body: dict[str, Any]) -> tuple[dict[str, Any] | None, dict[str, str]]:
    """The one source of the spec's kind."""
    if body.get("structural_tag") is not None:
        raise InvalidRequest("structural_tag is not supported (use response_format or "
                             "structured_outputs)", "structural_tag")
    fmt = body.get("response_format")
    obj = body.get(NAME)
    options_only = isinstance(obj, dict) and not any(obj.get(k) not in (None, False)
                                                     for k in FIELDS)
    given = [n for n in ("response_format", NAME, *_GUIDED) if body.get(n) is not None
             and not (n == "response_format" and isinstance(fmt, dict)
                      and fmt.get("type") == "text")
             and not (n == NAME and options_only)]
    if len(given) > 1:
        raise InvalidRequest(f"give at most one of {', '.join(given)} (each asks for a "
                             "structured output)", given[1])
    if not given or given[0] == NAME:
        return None, {}  # none, or vLLM's object: the registry passes it to SamplingParams
    name = given[0]
    if name in _GUIDED:
        field = _GUIDED[name]
        return {field: body[name]}, {NAME: name, f"{NAME}.{field}": name}
    return _response_format(fmt)


def _response_format(fmt: Any) -> tuple[dict[str, Any], dict[str, str]]:
    if not isinstance(fmt, dict) or fmt.get("type") not in _FORMATS:
        raise InvalidRequest(f"response_format must be an object whose type is one of "
                             f"{', '.join(_FORMATS)}", "response_format")
    if fmt["type"] == "json_object":
        return {"json_object": True}, {NAME: "response_format",
                                       f"{NAME}.json_object": "response_format"}
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidRequest("response_format.json_schema must be an object with the schema "
                             "under \"schema\"", "response_format.json_schema")
    schema = spec.get("schema", spec.get("json_schema"))  # some clients nest it so
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequest("response_format.json_schema.strict must be a boolean",
                             "response_format.json_schema.strict")
    if schema is None:  # OpenAI allows a name alone: any JSON object
        return {"json_object": True}, {NAME: "response_format"}
    if strict:  # OpenAI's strict mode: every property required and no others
        schema = strict_schema(schema, "response_format.json_schema.schema")
    return {"json": schema}, {NAME: "response_format",
                              f"{NAME}.json": "response_format.json_schema.schema"}
