"""Tool calling requests: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`, checked
once, and what they make of a request's sampling and of its output.

Data flow: a chat request's three fields -> `check_tools` (shapes, names, the choice;
InvalidRequest naming the field: `tools[2].function.name`, `tool_choice`, ...) -> a
`ToolRequest`, or None when the request has no tools. Then:
  - its `tools` travel with the messages (`PromptInput.tools`): admission renders them with
    the chat template (`tool_prompt`) and checks each tool's parameters schema by compiling
    it (`check_schemas`: a schema the grammar library refuses is a 400 naming
    `tools[i].function.parameters`), whatever the choice;
  - a function with `"strict": true` has its parameters made strict (`strict_schema`:
    OpenAI's strict mode, every property required and no others), for the prompt's listing
    and every grammar built from it;
  - `guide`: a forced call is enforced with a grammar (vLLM's approach): a named function
    constrains the output to that function's parameters schema (the text IS the arguments),
    "required" to a JSON array of 1 or more (exactly 1 without parallel_tool_calls)
    {"name": <a tool's name>, "parameters": <that tool's schema>} objects (at most the
    server's --max-tool-calls: `ToolRequest.call_limit`). The grammar is the
    engine's JSON-schema one (in json.dumps' spacing: `COMPACT` with disable_any_whitespace,
    so no whitespace but the separators' single spaces), so the arguments always
    parse and validate; the model's own call format is not used (it would need a grammar
    per format, and a template that never shows the model that format gets nothing from it);
  - `parser`: the sample's text -> content and tool calls (`tool_parsers`): the forced
    shapes, or for "auto" the served model's format; "none" parses nothing.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Mapping, Sequence

from jaxserve.engine.errors import InvalidRequest
from jaxserve.engine.structured_outputs import NAME, StructuredOutputs
from jaxserve.serving import tool_parsers
from jaxserve.serving.strict_schema import strict_schema
from jaxserve.serving.tool_parsers import NamedParser, RequiredParser, ToolParser

MAX_TOOLS = 128  # as OpenAI
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
CHOICES = ("none", "auto", "required")
# A forced call's JSON is written as json.dumps writes it (", " and ": ", no other
# whitespace): the arguments read the same whatever the model, and a weak model cannot spend
# its tokens on whitespace that a flexible grammar would allow forever.
COMPACT = {"x-guidance": {"whitespace_flexible": False, "item_separator": ", ",
                          "key_separator": ": "}}
# ... and no whitespace pattern: the engine's default (a bounded run between tokens) would
# let it add a newline and indent anywhere.
_NO_WHITESPACE = {"disable_any_whitespace": True}
# A function without parameters takes none: its arguments are {}.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {},
                                 "additionalProperties": False}


@dataclasses.dataclass(frozen=True)
class ToolRequest:
    """A request's checked tools: OpenAI tool objects ({"type": "function", "function":
    {"name", "description"?, "parameters"?}}, the HF chat templates' `tools`), the choice
    ("none", "auto", "required" or "function": the one named by `function`), whether
    several calls may come in one response, and the server's bound on them (None: none)."""

    tools: tuple[dict[str, Any], ...]
    choice: str = "auto"
    function: str | None = None
    parallel: bool = True
    max_calls: int | None = None  # the server's --max-tool-calls

    @property
    def call_limit(self) -> int | None:
        """At most this many calls in one response (None: any number)."""
        return 1 if not self.parallel else self.max_calls

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t["function"]["name"] for t in self.tools)

    def parameters(self, index: int) -> dict[str, Any]:
        return parameters_schema(self.tools[index])


def parameters_schema(tool: Mapping[str, Any]) -> dict[str, Any]:
    """A checked tool's parameters schema as the grammar gets it (always an object's)."""
    given = tool["function"].get("parameters")
    return NO_PARAMETERS if given is None else {"type": "object", **given}


def _check_tool(i: int, tool: object) -> dict[str, Any]:
    where = f"tools[{i}]"
    if not isinstance(tool, Mapping) or tool.get("type") != "function":
        raise InvalidRequest(f"{where} must be an object like {{\"type\": \"function\", "
                             "\"function\": {\"name\": ..., \"parameters\": {...}}}", where)
    fn = tool.get("function")
    if not isinstance(fn, Mapping):
        raise InvalidRequest(f"{where}.function must be an object with a name", f"{where}"
                             ".function")
    name = fn.get("name")
    if not isinstance(name, str) or TOOL_NAME.fullmatch(name) is None:
        raise InvalidRequest(f"{where}.function.name must be 1 to 64 letters, digits, "
                             "underscores or dashes", f"{where}.function.name")
    out: dict[str, Any] = {"name": name}
    if fn.get("description") is not None:
        if not isinstance(fn["description"], str):
            raise InvalidRequest(f"{where}.function.description must be a string",
                                 f"{where}.function.description")
        out["description"] = fn["description"]
    params = fn.get("parameters")
    if params is not None:
        if not isinstance(params, Mapping) or params.get("type", "object") != "object":
            raise InvalidRequest(f"{where}.function.parameters must be a JSON schema of an "
                                 "object (its arguments are a JSON object)",
                                 f"{where}.function.parameters")
        out["parameters"] = dict(params)
    if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
        raise InvalidRequest(f"{where}.function.strict must be a boolean",
                             f"{where}.function.strict")
    if fn.get("strict"):  # OpenAI's strict mode: the prompt and the grammar get it alike
        out["strict"] = True
        out["parameters"] = strict_schema({"type": "object", **out.get("parameters", {})},
                                          f"{where}.function.parameters")
    return {"type": "function", "function": out}


def _choice(value: object, names: tuple[str, ...]) -> tuple[str, str | None]:
    """(choice, named function) of `tool_choice`; unset: "auto" with tools, else "none"."""
    if value is None:
        return ("auto" if names else "none"), None
    if isinstance(value, str):
        if value not in CHOICES:
            raise InvalidRequest(f"tool_choice={value!r} must be one of {', '.join(CHOICES)} "
                                 "or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                                 "tool_choice")
        if value == "required" and not names:
            raise InvalidRequest("tool_choice=\"required\" needs tools", "tool_choice")
        return value, None
    fn = value.get("function") if isinstance(value, Mapping) else None
    if not isinstance(value, Mapping) or value.get("type") != "function" or \
            not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
        raise InvalidRequest("tool_choice must be none, auto, required or {\"type\": "
                             "\"function\", \"function\": {\"name\": ...}}", "tool_choice")
    if fn["name"] not in names:
        known = ", ".join(names) or "no tools were given"
        raise InvalidRequest(f"tool_choice names the function {fn['name']!r}, which is not "
                             f"among the tools ({known})", "tool_choice")
    return "function", fn["name"]


def check_tools(tools: object, tool_choice: object = None,
                parallel_tool_calls: object = None,
                max_calls: int | None = None) -> ToolRequest | None:
    """The request's tools checked (InvalidRequest naming the field), or None when it gives
    none (null or an empty list, whose only choices are none and auto). `max_calls`: the
    server's bound on calls per response (None: unbounded)."""
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise InvalidRequest("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if tools is not None and not isinstance(tools, (list, tuple)):
        raise InvalidRequest("tools must be a list of {\"type\": \"function\", \"function\": "
                             "{...}} objects", "tools")
    if tools is not None and len(tools) > MAX_TOOLS:
        raise InvalidRequest(f"tools has {len(tools)} tools; at most {MAX_TOOLS}", "tools")
    checked = tuple(_check_tool(i, t) for i, t in enumerate(tools or ()))
    names = tuple(t["function"]["name"] for t in checked)
    for i, name in enumerate(names):
        if name in names[:i]:
            raise InvalidRequest(f"tools[{i}].function.name={name!r} is given twice: names "
                                 "must be unique", f"tools[{i}].function.name")
    choice, function = _choice(tool_choice, names)
    if not checked:
        return None
    return ToolRequest(checked, choice, function, parallel_tool_calls is not False, max_calls)


def check_schemas(tools: Sequence[Mapping[str, Any]],
                  compile_schema: Callable[[StructuredOutputs], object]) -> None:
    """Each checked tool's parameters compiled as a JSON-schema grammar (`compile_schema`:
    the engine's compiler), so a schema the grammar library refuses is refused naming it
    whatever the request's choice (only a forced call compiles it again, to use it)."""
    for i, tool in enumerate(tools):
        if "parameters" not in tool["function"]:
            continue
        field = f"tools[{i}].function.parameters"
        try:
            compile_schema(StructuredOutputs(json=parameters_schema(tool), **_NO_WHITESPACE))
        except InvalidRequest as e:  # "structured_outputs.json ...": renamed
            raise InvalidRequest(e.message_as(field), field) from None


def guide(request: ToolRequest | None, structured: str | None = None
          ) -> tuple[dict[str, Any] | None, dict[str, str]]:
    """The grammar of a forced call as a StructuredOutputs mapping (None: free text) and the
    client's names of its fields, for a refusal's `param`. `structured`: the client's name
    of a structured output the request also asks for, which a forced call cannot honour
    (InvalidRequest naming it); under auto the two combine (the output is parsed as usual)."""
    if request is None or request.choice in ("none", "auto"):
        return None, {}
    if structured is not None:
        choice = "required" if request.choice == "required" else "naming a function"
        raise InvalidRequest(f"{structured} cannot be combined with tool_choice {choice}: a "
                             "forced tool call shapes the output itself", structured)
    if request.choice == "function":
        i = request.names.index(request.function)  # type: ignore[arg-type]
        return {"json": {**COMPACT, **request.parameters(i)}, **_NO_WHITESPACE}, {
            NAME: "tool_choice", f"{NAME}.json": f"tools[{i}].function.parameters"}
    one = len(request.names) == 1
    items = [{"type": "object", "properties": {"name": {"const": name}, "parameters": rebased(
                 request.parameters(i), "/items" + ("" if one else f"/anyOf/{i}") +
                 "/properties/parameters")},
              "required": ["name", "parameters"], "additionalProperties": False}
             for i, name in enumerate(request.names)]
    schema: dict[str, Any] = {**COMPACT, "type": "array", "minItems": 1,
                              "items": items[0] if one else {"anyOf": items}}
    if request.call_limit is not None:
        schema["maxItems"] = request.call_limit
    return {"json": schema, **_NO_WHITESPACE}, {NAME: "tool_choice", f"{NAME}.json": "tools"}


# Keywords whose values are JSON data, not schemas: a "$ref" key inside them is data.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
# Keywords whose values map names to schemas (a property may be called "const").
_NAMED_SCHEMAS = frozenset({"properties", "patternProperties", "$defs", "definitions",
                            "dependentSchemas"})


def rebased(schema: Any, base: str) -> Any:
    """`schema` as a subschema placed at JSON pointer `base` of a larger one: its local
    references (`#/$defs/X`, `#/definitions/X`, `#`: pointers from its own root) are
    prefixed with `base`, so they resolve against the schema they were written for and not
    against the new root (which has no such `$defs`). Anchors (`#name`) and other documents'
    references are left as they are."""
    if isinstance(schema, list):
        return [rebased(v, base) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or
                                                         value.startswith("#/")):
            out[key] = "#" + base + value[1:]
        elif key in _DATA_KEYWORDS:
            out[key] = value
        elif key in _NAMED_SCHEMAS and isinstance(value, dict):  # name -> schema
            out[key] = {name: rebased(v, base) for name, v in value.items()}
        else:
            out[key] = rebased(value, base)
    return out


def parses(request: ToolRequest | None) -> bool:
    """Whether the request's output is read for tool calls (tools given, choice not none)."""
    return request is not None and request.choice != "none"


def parser(request: ToolRequest | None, fmt: str,
           new_id: Callable[[], str] = tool_parsers.new_call_id) -> ToolParser | None:
    """A new parser for one sample's output (None: the text is all content)."""
    if request is None or not parses(request):
        return None
    if request.choice == "function":
        return NamedParser(request.function or "", new_id)
    if request.choice == "required":
        return RequiredParser(request.parallel, new_id, request.max_calls)
    return tool_parsers.parser_for(fmt, request.parallel, new_id, request.max_calls)
