"""Tool calls in /v1/chat/completions responses: parser events -> OpenAI's wire shapes.

Data flow: a sample's text -> its parser (`serving.tools.parser`: the forced call's shape, or
the served model's format for tool_choice "auto"; None for "none" or no tools, and the text
is then the content as without tools) -> events (`serving.tool_parsers`) ->
  non-streamed (`message`): {"role": "assistant", "content": the text around the calls or
    null, "tool_calls": [{"id": "call_...", "type": "function", "function": {"name",
    "arguments": JSON text}}]};
  streamed (`ToolStream`, one parser per sample): each output's new text -> the delta's
    `content` and `tool_calls` entries, the way the OpenAI SDK assembles them by `index`: a
    call's first entry carries `id`, `type` and `function.name` (with the arguments read so
    far, maybe ""), later ones `function.arguments` pieces to append.
`finish_reason` is "tool_calls" once a sample made a call and ended normally (the engine's
"stop"); "length" and the others stay, so a client sees that the arguments may be cut.
"""

from __future__ import annotations

from typing import Any

from jaxserve.engine.outputs import CompletionOutput
from jaxserve.server import openai_schema as schema
from jaxserve.serving import chat, tools
from jaxserve.serving.tool_parsers import CallDelta, Event, ToolParser


def finish_reason(c: CompletionOutput, calls: int) -> str | None:
    reason = schema.FINISH_REASONS[c.finish_reason] if c.finish_reason is not None else None
    return "tool_calls" if reason == "stop" and calls else reason


def message(parser: ToolParser, text: str, echo: str = "") -> dict[str, Any]:
    """A whole sample's message (`serving.chat.read_calls`); `echo`: text before the
    sample's (chat's echo)."""
    read = chat.read_calls(parser, text)
    content = read.content
    msg: dict[str, Any] = {"role": "assistant",
                           "content": echo + (content or "") if echo else content}
    if read.tool_calls:
        msg["tool_calls"] = list(read.tool_calls)
    return msg


def delta(events: list[Event]) -> dict[str, Any]:
    """A chunk's delta of `events`: their content joined, their call pieces as `tool_calls`
    entries (pieces of one call in a row merged into one entry)."""
    entries: list[dict[str, Any]] = []
    for e in events:
        if not isinstance(e, CallDelta):
            continue
        if e.id is None and entries and entries[-1]["index"] == e.index:
            entries[-1]["function"]["arguments"] += e.arguments
        elif e.id is None:
            entries.append({"index": e.index, "function": {"arguments": e.arguments}})
        else:
            entries.append({"index": e.index, "id": e.id, "type": "function",
                            "function": {"name": e.name, "arguments": e.arguments}})
    out: dict[str, Any] = {}
    content = "".join(e for e in events if isinstance(e, str))
    if content:
        out["content"] = content
    if entries:
        out["tool_calls"] = entries
    return out


class ToolStream:
    """The tool-call state of a streamed response: one parser per sample."""

    def __init__(self, request: tools.ToolRequest, fmt: str):
        self._request, self._fmt = request, fmt
        self._parsers: dict[int, ToolParser] = {}

    def step(self, c: CompletionOutput) -> tuple[dict[str, Any], str | None]:
        """(delta, finish_reason) of a sample's new output `c`."""
        parser = self._parsers.get(c.index)
        if parser is None:
            made = tools.parser(self._request, self._fmt)
            assert made is not None, "a ToolStream is for a request whose output is parsed"
            parser = self._parsers[c.index] = made
        events = parser.feed(c.delta_text)
        if c.finish_reason is not None:
            events += parser.finish()
        return delta(events), finish_reason(c, parser.calls)
