"""OpenAI's chat completions JSON <-> engine types: the /v1/chat/completions wire format.

`parse_chat`: a body -> `ChatRequest`: `messages` (and vLLM's `chat_template`,
`chat_template_kwargs`, `add_generation_prompt`, `continue_final_message`) as an
`admission.PromptInput(chat=...)`, which admission checks and renders (content parts,
roles, template); the sampling fields through `openai_schema.sampling_params` (the
registry), with chat's own names: `max_completion_tokens` (or the older `max_tokens`; unset:
up to max_model_len), `logprobs` (a boolean) + `top_logprobs` (how many), vLLM's
`prompt_logprobs` and `echo`; `response_format` and vLLM's structured-output fields through
`openai_schema.structured`; `tools`, `tool_choice` and `parallel_tool_calls` through
`serving.chat.chat_input`, as the other fronts build a chat (`tools.check_tools`; a forced
call becomes the request's structured output: `tools.guide`; the tools travel with the
messages to admission's template). Fields this server does not implement (the deprecated
`functions` / `function_call`, and any field nothing reads: `openai_fields`) are refused by
name rather than ignored.
The response helpers build `chat.completion` choices, `chat.completion.chunk` deltas and
chat-format logprobs (`{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from jaxserve.engine.outputs import CompletionOutput, TokenLogprobs
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.engine.structured_outputs import NAME as STRUCTURED
from jaxserve.server import openai_schema as schema
from jaxserve.serving import admission, chat, tools

_BOOLS = ("stream", "logprobs", "add_generation_prompt", "continue_final_message", "echo")


@dataclasses.dataclass(frozen=True)
class ChatRequest:
    prompt: admission.PromptInput
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    continuous_usage_stats: bool = False
    priority: int = 0  # as the body gives it: admission checks it
    # Chat's names of registry fields the client used (max_completion_tokens), for the
    # `param` of a refusal at admission.
    rename: dict[str, str] = dataclasses.field(default_factory=dict)
    echo: bool = False  # vLLM's: prepend the last message's content (an assistant's)
    tools: tools.ToolRequest | None = None  # None: no tools given


def _refuse_unsupported(body: dict[str, Any]) -> None:
    for name in ("functions", "function_call"):  # OpenAI's deprecated form of tools
        if body.get(name):
            raise schema.bad_request(f"{name} is not supported: use tools and tool_choice",
                                     name)


def _output_spec(body: dict[str, Any], request: tools.ToolRequest | None
                 ) -> tuple[dict[str, Any], dict[str, str]]:
    """The request's structured output (`sampling_params` fields) and the client's names of
    its fields: a forced tool call's grammar, or the client's own structured output."""
    spec, names = schema.structured(body)
    given = names.get(STRUCTURED) or (STRUCTURED if body.get(STRUCTURED) is not None
                                      else None)  # the client's name of its own
    try:
        forced, forced_names = tools.guide(request, given)
    except ValueError as e:
        raise schema.invalid(e) from None
    return (spec, names) if forced is None else ({STRUCTURED: forced}, forced_names)


def _max_tokens(body: dict[str, Any]) -> tuple[Any, dict[str, str]]:
    """The token budget and the name the client gave it (for a 400's `param`)."""
    if body.get("max_completion_tokens") is not None:
        return body["max_completion_tokens"], {"max_tokens": "max_completion_tokens"}
    return body.get("max_tokens"), {}


def parse_chat(body: object, max_tool_calls: int | None = None) -> ChatRequest:
    """Validate a /v1/chat/completions body; ApiError(400) naming the field otherwise.
    `max_tool_calls`: the server's bound on calls per response (None: unbounded)."""
    body = schema.check_common(body, _BOOLS)
    _refuse_unsupported(body)
    include_usage, continuous = schema.parse_stream_options(body)
    if body.get("messages") is None:  # absent or null
        raise schema.bad_request("messages is required: a list of {role, content} objects",
                                 "messages")
    prompt, request = chat_input(body, max_tool_calls)
    top = body.get("top_logprobs")
    if top is not None and not body.get("logprobs"):
        raise schema.bad_request("top_logprobs needs logprobs=true", "top_logprobs")
    wanted = (0 if top is None else top) if body.get("logprobs") else None
    budget, rename = _max_tokens(body)
    spec, spec_names = _output_spec(body, request)
    # chat's names of registry fields
    names = {**rename, **spec_names, "logprobs": "top_logprobs"}
    params = schema.sampling_params(body, budget, names, logprobs=wanted, **spec)
    priority = schema.priority_of(body)  # (read before the refusal of unread fields)
    schema.refuse_unread(body)
    return ChatRequest(prompt, params, bool(body.get("stream")), include_usage, continuous,
                       priority, names, bool(body.get("echo")), request)


def chat_input(body: dict[str, Any], max_tool_calls: int | None = None
               ) -> tuple[admission.PromptInput, tools.ToolRequest | None]:
    """`messages`, vLLM's rendering fields and the tools as every front builds a chat
    (`serving.chat.chat_input`; admission checks the messages' shapes, chat_template_kwargs
    an object), 400 naming a bad tool field; a null boolean is its default, as OpenAI's
    unset. `max_tool_calls`: the server's --max-tool-calls."""
    try:
        return chat.chat_input(
            body["messages"], tools_=body.get("tools"), tool_choice=body.get("tool_choice"),
            parallel_tool_calls=body.get("parallel_tool_calls"),
            add_generation_prompt=body.get("add_generation_prompt") is not False,
            chat_template=body.get("chat_template"),
            chat_template_kwargs=body.get("chat_template_kwargs"),
            continue_final_message=bool(body.get("continue_final_message")),
            max_tool_calls=max_tool_calls)
    except ValueError as e:
        raise schema.invalid(e) from None


# ----------------------------------------------------------------------------- responses
def _token(tid: int, logprob: float, decode: Callable[[int], str]) -> dict[str, Any]:
    text = decode(tid)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def logprobs_json(entries: list[TokenLogprobs], top: int,
                  decode: Callable[[int], str]) -> dict[str, Any]:
    """Chat's logprobs: each sampled token with its `top` likeliest alternatives (an entry
    holds the sampled token first, then the top-N, the sampled one once if among them)."""
    content = []
    for entry in entries:
        tid, lp = next(iter(entry.items()))
        best = sorted(entry.items(), key=lambda kv: -kv[1])[:top]
        content.append({**_token(tid, lp, decode),
                        "top_logprobs": [_token(t, v, decode) for t, v in best]})
    return {"content": content}


def _reason(c: CompletionOutput) -> str | None:
    return schema.FINISH_REASONS[c.finish_reason] if c.finish_reason is not None else None


def choice(c: CompletionOutput, logprobs: dict[str, Any] | None,
           content: str | None = None) -> dict[str, Any]:
    """A chat.completion choice; `content`: the text when not the sample's own (echo)."""
    text = c.text if content is None else content
    return {"index": c.index, "message": {"role": "assistant", "content": text},
            "logprobs": logprobs, "finish_reason": _reason(c)}


def delta_choice(c: CompletionOutput, delta: dict[str, Any],
                 logprobs: dict[str, Any] | None,
                 reason: str | None = None) -> dict[str, Any]:
    """A chat.completion.chunk choice; `reason`: the finish reason when not the engine's
    (tool_calls)."""
    return {"index": c.index, "delta": delta, "logprobs": logprobs,
            "finish_reason": reason or _reason(c)}
