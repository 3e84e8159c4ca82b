"""OpenAI's completions JSON <-> engine types: the HTTP front's wire format, nothing more.

`parse_completion`: a /v1/completions body -> `CompletionRequest` (prompt as an
`admission.PromptInput`; the sampling fields derived from the SamplingParams registry, after
the type checks their declared types call for) or `ApiError(400)` naming the field (`param`).
`echo` with `logprobs` asks the engine for prompt_logprobs too (`_echo_prompt_logprobs`,
the one place that mapping lives). The response helpers build OpenAI's `text_completion`
choices, usage and server-sent events (logprobs and echo: `openai_choices`). Content
checks (ranges, vocabulary, lengths) belong to admission and the SamplingParams registry; an
`InvalidRequest` becomes a 400 through `invalid`.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from aiohttp import web

from jaxserve.engine.outputs import CompletionOutput
from jaxserve.engine.sequence import FinishReason
from jaxserve.engine.sampling_params import FIELDS as SAMPLING_FIELDS
from jaxserve.engine.sampling_params import SamplingField, SamplingParams
from jaxserve.server import openai_fields
from jaxserve.server.openai_fields import Body
from jaxserve.server.openai_structured import structured_outputs_of
from jaxserve.serving import admission

FINISH_REASONS = {FinishReason.EOS: "stop", FinishReason.STOP: "stop",
                  FinishReason.STOP_STRING: "stop", FinishReason.LENGTH: "length",
                  FinishReason.ABORT: "abort", FinishReason.ERROR: "error"}
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; null: up to max_model_len
# Body fields passed to SamplingParams as they are (after the type checks their declared
# types call for: booleans, lists); None means unset. max_tokens has this front's default.
_SAMPLING_FIELDS = tuple(f for f in SAMPLING_FIELDS if f.name != "max_tokens")
_LIST_FIELDS = tuple(f for f in SAMPLING_FIELDS if f.type is tuple)
_BOOL_FIELDS = tuple(f.name for f in SAMPLING_FIELDS if f.type is bool)
_MAP_FIELDS = tuple(f for f in SAMPLING_FIELDS if f.type is dict)  # JSON objects
_JSON_SEPARATORS = (",", ":")


class ApiError(Exception):
    """An error answered with OpenAI's error JSON and an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | int | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message = status, message
        self.body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
        self.headers = headers  # e.g. Retry-After on a 429

    def response(self) -> web.Response:
        return web.json_response(self.body, status=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


def unavailable(message: str) -> ApiError:
    return ApiError(503, message, None, "service_unavailable")


def _field_of(error: ValueError, default: str) -> str:
    """This API's name of the field an admission / SamplingParams error is about."""
    field = admission.InvalidRequest.of(error).field or default
    return "prompt" if field == "prompt_token_ids" else field  # ids are a prompt here


def invalid(error: ValueError, rename: dict[str, str] | None = None) -> ApiError:
    """An admission / engine refusal as a 400 in this API's field names (`rename`: an
    endpoint's own names of some fields)."""
    field = admission.InvalidRequest.of(error).field
    param = (rename or {}).get(field or "") or _field_of(error, "prompt")
    return bad_request(admission.InvalidRequest.of(error).message_as(param), param)


@dataclasses.dataclass(frozen=True)
class CompletionRequest:
    prompt: admission.PromptInput
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    continuous_usage_stats: bool = False  # usage in every chunk (with include_usage)
    priority: int = 0  # as the body gives it: admission checks it
    echo: bool = False  # the prompt's text (and with logprobs, its logprobs) first
    # vLLM's prompt_logprobs as the client asked (`params.prompt_logprobs` is what the
    # engine computes: echo with logprobs raises it to cover the legacy object).
    prompt_logprobs: int | None = None
    # The client's names of registry fields it gave under another name (response_format for
    # structured_outputs), for the `param` of a refusal at admission.
    rename: dict[str, str] = dataclasses.field(default_factory=dict)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _list_value(field: SamplingField, value: object) -> bool:
    """Whether `value` suits a tuple field: a list (of strings, for a string field, which also
    takes one string); SamplingParams checks the items."""
    if field.item is str:
        return isinstance(value, str) or (
            isinstance(value, list) and all(isinstance(v, str) for v in value))
    return isinstance(value, list)


def parse_prompt(prompt: object, add_special_tokens: bool = True) -> admission.PromptInput:
    """A string, a list of token ids, or a list holding exactly one of those;
    `add_special_tokens`: a text's (vLLM's field, default true)."""
    if prompt is None:
        raise bad_request("prompt is required: a string or a list of token ids", "prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):  # empty prompts are refused by admission
        return admission.PromptInput(text=prompt, add_special_tokens=add_special_tokens)
    if isinstance(prompt, list):
        if all(_is_int(t) for t in prompt):
            return admission.PromptInput(token_ids=tuple(prompt))
        if all(isinstance(p, (str, list)) for p in prompt):
            raise bad_request(f"prompt holds a batch of {len(prompt)} prompts; this server "
                              "takes one prompt per request", "prompt")
    raise bad_request("prompt must be a string or a list of token ids", "prompt")


def check_common(body: object, bools: tuple[str, ...] = (), sampling: bool = True) -> Body:
    """The wire-type checks every body gets: a JSON object, booleans (`bools`, and with
    `sampling` the registry's), `model` a string, `user` a string (OpenAI's end-user label,
    taken and unused; `priority` is admission's: `priority_of`). Returns the body as a
    `Body`, which records what the endpoint reads, for `refuse_unread`."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    body = Body(body)
    for name in (_BOOL_FIELDS if sampling else ()) + bools:
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise bad_request(f"{name}={body[name]!r} must be a boolean", name)
    for name in ("model", "user"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise bad_request(f"{name}={body[name]!r} must be a string", name)
    return body


def refuse_unread(body: Body) -> None:
    """400 naming the first field of `body` the endpoint did not read (`openai_fields`):
    called once the endpoint has parsed it, before any work."""
    refused = openai_fields.refusal(body)
    if refused is not None:
        raise bad_request(*refused)


def priority_of(body: dict[str, Any]) -> Any:
    """The body's `priority` as given (null / absent: 0); admission checks it
    (`limits.check_priority`: an integer within the operator's client range)."""
    return body["priority"] if body.get("priority") is not None else 0


def parse_stream_options(body: dict[str, Any]) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats) of `stream_options` (stream=true only)."""
    options = body.get("stream_options")
    if options is None:
        return False, False
    if not body.get("stream"):
        raise bad_request("stream_options is only allowed with stream=true", "stream_options")
    flags = ("include_usage", "continuous_usage_stats")
    if not isinstance(options, dict) or not all(
            isinstance(options.get(k, False), bool) for k in flags):
        raise bad_request("stream_options must be an object like {\"include_usage\": true}",
                          "stream_options")
    return bool(options.get("include_usage")), bool(options.get("continuous_usage_stats"))


def sampling_params(body: dict[str, Any], max_tokens: int | None,
                    rename: dict[str, str] | None = None, **fields: Any) -> SamplingParams:
    """The registry's fields as the body gives them (None: unset), `max_tokens`, then
    `fields` (a front's own mapping, e.g. chat's logprobs); `rename`: this API's name of a
    registry field, for the 400's `param`."""
    kwargs: dict[str, Any] = {f.name: body[f.name] for f in _SAMPLING_FIELDS
                              if body.get(f.name) is not None and f.name not in fields}
    kwargs["max_tokens"] = max_tokens
    kwargs.update(fields)
    for f in _LIST_FIELDS:
        if f.name in kwargs and not _list_value(f, kwargs[f.name]):
            text = f.rule.text if f.rule is not None else "a list"
            raise bad_request(f"{f.name} must be {text}", f.name)
    for f in _MAP_FIELDS:  # a list of pairs would pass SamplingParams: JSON gives objects
        if f.name in kwargs and not isinstance(kwargs[f.name], dict):
            text = f.rule.text if f.rule is not None else "a JSON object"
            raise bad_request(f"{f.name} must be {text}", f.name)
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        field = _field_of(e, "prompt")
        wire = (rename or {}).get(field, field)
        raise bad_request(admission.InvalidRequest.of(e).message_as(wire), wire) from None


def structured(body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """A body's structured-output request (`openai_structured`) as `sampling_params` fields
    ({} or {"structured_outputs": spec}) and the client's names of the spec's fields."""
    try:
        spec, names = structured_outputs_of(body)
    except ValueError as e:
        raise invalid(e) from None
    return ({} if spec is None else {"structured_outputs": spec}), names


def _echo_prompt_logprobs(body: dict[str, Any]) -> int | None:
    """The top-N the engine computes for each prompt token: vLLM's `prompt_logprobs`, and
    with `echo` and `logprobs` at least `logprobs` (the legacy object then covers the prompt
    tokens first). Wire types only; SamplingParams checks the ranges."""
    asked, top = body.get("prompt_logprobs"), body.get("logprobs")
    if not (body.get("echo") and _is_int(top)):
        return asked
    return max(asked, top) if _is_int(asked) else top if asked is None else asked


def parse_completion(body: object) -> CompletionRequest:
    """Validate a /v1/completions body; ApiError(400) naming the field otherwise."""
    body = check_common(body, ("stream", "echo", "add_special_tokens"))
    if body.get("suffix"):  # "" and null mean no suffix
        raise bad_request("suffix is not supported", "suffix")
    n = 1 if body.get("n") is None else body["n"]
    if body.get("best_of") is not None and body["best_of"] != n:
        raise bad_request("best_of is not supported (leave it unset or equal to n)", "best_of")
    stream = bool(body.get("stream"))
    include_usage, continuous = parse_stream_options(body)
    prompt = parse_prompt(body.get("prompt"), body.get("add_special_tokens") is not False)
    spec, names = structured(body)
    params = sampling_params(body, body.get("max_tokens", DEFAULT_MAX_TOKENS), names,
                             prompt_logprobs=_echo_prompt_logprobs(body), **spec)
    priority = priority_of(body)  # (read before the refusal of unread fields)
    refuse_unread(body)
    return CompletionRequest(prompt, params, stream, include_usage, continuous,
                             priority, bool(body.get("echo")),
                             body.get("prompt_logprobs"), names)


def choice(c: CompletionOutput, text: str, logprobs: dict[str, Any] | None) -> dict[str, Any]:
    reason = FINISH_REASONS[c.finish_reason] if c.finish_reason is not None else None
    return {"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": reason}


def usage(prompt_tokens: int, completion_tokens: int,
          cached_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage object (`cached_tokens`: prompt tokens the prefix cache served)."""
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens,
                           "completion_tokens": completion_tokens,
                           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def sse(obj: object) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=_JSON_SEPARATORS)
    return f"data: {data}\n\n".encode()
