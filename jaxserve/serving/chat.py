"""A chat request with tools, as every front builds it, and its output read for tool calls.

Data flow (the offline `LLM.chat`, the gRPC chat and, for the output, the HTTP chat front):
the messages, the rendering options and OpenAI's `tools` / `tool_choice` /
`parallel_tool_calls` -> `chat_input` (`tools.check_tools`: a `ToolRequest`, or None; the
`admission.PromptInput` that carries the checked tools to the template) -> `guided` (a forced
call is the request's structured output: `tools.guide`) -> admission, the engine ->
each sample's text -> `read_calls` (the request's `tools.parser`: the forced shapes, or the
served model's format under "auto") -> `Message`: the content around the calls and the calls
in OpenAI's shape ({"id", "type": "function", "function": {"name", "arguments"}}).
The HTTP front keeps its own field mapping (wire names in its 400s) and calls the same
`tools` functions; this module is the plain-Python path the other callers share.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.engine.structured_outputs import NAME as STRUCTURED
from jaxserve.serving import tools
from jaxserve.serving.admission import PromptInput
from jaxserve.serving.tool_parsers import ToolParser, assemble


@dataclasses.dataclass(frozen=True)
class Message:
    """A sample's text read for tool calls: the text around them (None when calls were made
    and nothing else was written) and the calls, in OpenAI's shape."""

    content: str | None
    tool_calls: tuple[dict[str, Any], ...] = ()


def chat_input(messages: Sequence[Mapping[str, Any]], *, tools_: object = None,
               tool_choice: object = None, parallel_tool_calls: object = None,
               add_generation_prompt: bool = True, chat_template: str | None = None,
               chat_template_kwargs: Mapping[str, Any] | None = None,
               continue_final_message: bool = False, max_tool_calls: int | None = None
               ) -> tuple[PromptInput, tools.ToolRequest | None]:
    """The conversation as admission takes it and its checked tools (InvalidRequest naming
    the field: `tools[1].function.name`, `tool_choice`, ...); `max_tool_calls`: the
    server's bound on calls per response (--max-tool-calls; None: unbounded)."""
    request = tools.check_tools(tools_, tool_choice, parallel_tool_calls, max_tool_calls)
    inp = PromptInput(chat=tuple(messages) if isinstance(messages, (list, tuple)) else messages,
                      add_generation_prompt=add_generation_prompt, chat_template=chat_template,
                      chat_template_kwargs=chat_template_kwargs,
                      continue_final_message=continue_final_message,
                      tools=request.tools if request is not None else None)
    return inp, request


def guided(params: SamplingParams, request: tools.ToolRequest | None) -> SamplingParams:
    """`params` with a forced call's grammar as its structured output (unchanged when the
    choice is none or auto); a forced call and the caller's own structured_outputs cannot
    both hold (InvalidRequest naming structured_outputs)."""
    forced, _ = tools.guide(request, STRUCTURED if params.structured_outputs is not None
                            else None)
    return params if forced is None else dataclasses.replace(params, **{STRUCTURED: forced})


def read_calls(parser: ToolParser, text: str) -> Message:
    """A whole sample's text through a fresh `parser` (`tools.parser`)."""
    content, calls = assemble(parser.feed(text) + parser.finish())
    return Message(content, tuple({"id": c["id"], "type": "function",
                                   "function": {"name": c["name"], "arguments": c["arguments"]}}
                                  for c in calls))


def message_of(request: tools.ToolRequest | None, fmt: str, text: str) -> Message | None:
    """`text` read for the request's tool calls in format `fmt`; None when the request's
    output is not parsed (no tools, or tool_choice none)."""
    parser = tools.parser(request, fmt)
    return None if parser is None else read_calls(parser, text)
