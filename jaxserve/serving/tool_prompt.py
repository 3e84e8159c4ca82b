"""Tools in the prompt: a chat's tools and tool turns made ready for its chat template.

Data flow (admission's `render_chat`, after `check_chat`): the messages, the request's checked
tools (`tools.check_tools`), the template's source and the served model's tool-call format ->
`prepare` -> the messages and variables the template renders:
  - every assistant `tool_calls[j].function.arguments` given as JSON text (OpenAI's wire
    shape) becomes an object, since templates write it with `tojson` (HF's convention, as
    vLLM does); a call's shape is checked (InvalidRequest naming `messages`);
  - a template that reads the `tools` variable (Qwen2/2.5/3, Hermes, Llama 3.1, Mistral, ...)
    gets the tools as `tools` (a list of OpenAI tool objects) and the tool turns as they
    are: assistant messages with `tool_calls`, `tool` messages with `tool_call_id`;
  - any other template (the bundled SmolLM2's) gets the fallback: a block in the system
    prompt that lists the tools and asks for calls in the served format (hermes:
    `<tool_call>{"name", "arguments"}</tool_call>`; llama3_json: a bare
    {"name", "parameters"} object), each assistant's calls written into its content in that
    format, and tool results as user turns in `<tool_response>` tags (consecutive results in
    one turn), which any template renders.
`resolve_format`: the served format (`--tool-call-parser`; auto: `detect_format` reads the
model's template: `<tool_call>` -> hermes, `<|python_tag|>` or `ipython` -> llama3_json,
anything else hermes, which the fallback prompt teaches).
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

from jaxserve.engine.errors import InvalidRequest
from jaxserve.engine.json_text import parse_field
from jaxserve.models.chat_template import template_variables
from jaxserve.serving.tool_parsers import FORMATS, HERMES, LLAMA3_JSON, PYTHON_TAG

AUTO = "auto"
PARSER_CHOICES = (AUTO, *FORMATS)  # --tool-call-parser

_LISTING = ("# Tools\n\nYou can call the functions described below, one JSON object a line, "
            "between <tools> and </tools>:\n<tools>\n{tools}\n</tools>\n\n")
_ASK = {
    HERMES: "To call a function, answer with a JSON object of its name and arguments between "
            "<tool_call> and </tool_call>:\n<tool_call>\n{\"name\": \"<function name>\", "
            "\"arguments\": {\"<argument>\": <value>}}\n</tool_call>\nWrite one such block "
            "per call. ",
    LLAMA3_JSON: "To call a function, answer with nothing but a JSON object of the form "
                 "{\"name\": \"<function name>\", \"parameters\": {\"<argument>\": "
                 "<value>}}; separate several calls with \"; \". ",
}
_RESULTS = "Results come back between <tool_response> and </tool_response>."


def detect_format(template: str | None) -> str:
    """The tool-call format a chat template teaches its model (hermes when it shows none)."""
    source = template or ""
    if "<tool_call>" in source:
        return HERMES
    if PYTHON_TAG in source or "ipython" in source:
        return LLAMA3_JSON
    return HERMES


def resolve_format(flag: str, template: str | None) -> str:
    """`--tool-call-parser`'s value for a model whose template is `template`."""
    if flag not in PARSER_CHOICES:
        raise ValueError(f"tool_call_parser={flag!r} must be one of {', '.join(PARSER_CHOICES)}")
    return detect_format(template) if flag == AUTO else flag


def renders_tools(template: str | None) -> bool:
    """Whether the template reads a `tools` variable (and so renders tools and tool turns)."""
    return template is not None and "tools" in template_variables(template)


def _arguments(where: str, args: object) -> dict[str, Any]:
    if args is None or isinstance(args, str) and not args.strip():
        return {}
    if isinstance(args, str):
        try:
            args = parse_field(f"{where}.function.arguments", args)
        except InvalidRequest as e:  # reported under the request field that holds it
            raise InvalidRequest(str(e), "messages") from None
    if not isinstance(args, dict):
        raise InvalidRequest(f"{where}.function.arguments must be a JSON object",
                             "messages")
    return args


def _tool_calls(i: int, message: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The message's tool calls, checked, their arguments as objects."""
    where = f"messages[{i}].tool_calls"
    calls = message["tool_calls"]
    if message["role"] != "assistant":
        raise InvalidRequest(f"{where}: only assistant messages carry tool calls",
                             "messages")
    if not isinstance(calls, (list, tuple)):
        raise InvalidRequest(f"{where} must be a list", "messages")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise InvalidRequest(f"{where}[{j}] must be an object like {{\"id\": "
                                 "..., \"type\": \"function\", \"function\": {\"name\": ..., "
                                 "\"arguments\": \"{...}\"}}", "messages")
        args = _arguments(f"{where}[{j}]", fn.get("arguments"))
        out.append({**call, "type": "function", "function": {**fn, "arguments": args}})
    return out


def prepare(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None,
            template: str | None, fmt: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, extra template variables) for rendering `messages` with `tools` through
    `template` (the source, to tell whether it renders tools) for a model answering in
    `fmt`."""
    msgs = []
    for i, m in enumerate(messages):
        m = dict(m)
        if m.get("tool_calls") is not None:
            m["tool_calls"] = _tool_calls(i, m)
        if not m.get("tool_calls"):  # an empty list is no calls (templates test presence)
            m.pop("tool_calls", None)
        msgs.append(m)
    if renders_tools(template):
        return msgs, ({"tools": [dict(t) for t in tools]} if tools else {})
    return _fallback(msgs, tools, fmt), {}


def calls_text(calls: Sequence[Mapping[str, Any]], fmt: str) -> str:
    """Tool calls written the way `fmt` reads them (the fallback's assistant turns)."""
    if fmt == LLAMA3_JSON:
        return "; ".join(json.dumps({"name": c["function"]["name"],
                                     "parameters": c["function"]["arguments"]},
                                    ensure_ascii=False) for c in calls)
    return "\n".join("<tool_call>\n" + json.dumps(
        {"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
        ensure_ascii=False) + "\n</tool_call>" for c in calls)


def tools_block(tools: Sequence[Mapping[str, Any]], fmt: str) -> str:
    """The fallback's system-prompt block: the tools, and how to call them in `fmt`."""
    listing = "\n".join(json.dumps(dict(t), ensure_ascii=False) for t in tools)
    return _LISTING.format(tools=listing) + _ASK[fmt] + _RESULTS


def _fallback(msgs: list[dict[str, Any]], tools: Sequence[Mapping[str, Any]] | None,
              fmt: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    after_result = False  # the previous message was a tool result
    for m in msgs:
        if m["role"] == "tool":
            result = f"<tool_response>\n{m['content']}\n</tool_response>"
            if after_result:
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result})
            after_result = True
            continue
        after_result = False
        calls = m.pop("tool_calls", None)
        if calls:
            m["content"] = "\n".join(t for t in (m["content"], calls_text(calls, fmt)) if t)
        out.append(m)
    if tools:
        block = tools_block(tools, fmt)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{block}"}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out
