"""Protobuf <-> engine types: the gRPC wire format mapped, nothing validated beyond its shape.

Data flow of a Generate call:
  GenerateRequest -> `parse_request` (sampling fields -> SamplingParams, whose ValueErrors
  name the field and range; the input oneof -> `admission.PromptInput`, a chat's tools and
  tool turns through `serving.chat.chat_input` and a forced call's grammar into the sampling:
  a `ParsedRequest`) -> admission (`jaxserve.serving.admission`: tokenize, prompt checks) ->
  the engine -> RequestOutputs -> `ResponseBuilder` -> GenerateResponse messages (with
  prompt_logprobs, one PromptLogprobs first, as soon as an output carries them; Chunk deltas
  per sample, then one Finished per sample with its usage and timing, and for a chat with
  tools the sample's text read for calls).

Every error raised here is an `InvalidRequest` (a ValueError): the servicer answers it with
INVALID_ARGUMENT, its field renamed to this service's names by `error_message`. A field the
proto does not define (`check_known`: a newer client's) is refused too, never dropped.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any, Sequence

from google.protobuf import unknown_fields

from jaxserve.engine.outputs import CompletionOutput, RequestOutput
from jaxserve.engine.sequence import FinishReason, RequestMetrics
from jaxserve.engine.sampling_params import BY_NAME as SAMPLING_BY_NAME
from jaxserve.engine.sampling_params import FIELDS as SAMPLING_FIELDS
from jaxserve.engine.sampling_params import SPECS, SamplingField, SamplingParams
from jaxserve.engine.json_text import parse_field
from jaxserve.server import stubs
from jaxserve.serving.admission import InvalidRequest, PromptInput
from jaxserve.serving.chat import chat_input, guided, message_of
from jaxserve.serving.tools import ToolRequest, parses

pb2 = stubs.load().pb2

# The gRPC front's defaults where they differ from SamplingParams': unset max_tokens generates
# up to max_model_len (HTTP's default is OpenAI's 16).
_UNSET_DEFAULTS: dict[str, object] = {"max_tokens": None}
_REASONS = {FinishReason.STOP: pb2.STOP, FinishReason.LENGTH: pb2.LENGTH,
            FinishReason.EOS: pb2.EOS, FinishReason.STOP_STRING: pb2.STOP_STRING,
            FinishReason.ABORT: pb2.ABORT}


# --------------------------------------------------------------------------- requests
def _proto_fields() -> tuple[tuple[SamplingField, bool, bool, object], ...]:
    """(field, has presence, repeated, zero value) of every registry field, from the proto
    descriptor (its field names are SamplingParams')."""
    by_name = pb2.SamplingParams.DESCRIPTOR.fields_by_name
    missing = [f.name for f in SAMPLING_FIELDS if f.name not in by_name]
    if missing:
        raise RuntimeError(f"SamplingParams fields {missing} have no field in the proto's "
                           "SamplingParams message (server/proto/jaxserve.proto)")
    return tuple((f, by_name[f.name].has_presence, _is_repeated(by_name[f.name]),
                  by_name[f.name].default_value) for f in SAMPLING_FIELDS)


def _is_repeated(d: Any) -> bool:
    repeated = getattr(d, "is_repeated", None)
    return repeated if repeated is not None else d.label == d.LABEL_REPEATED


_PROTO_FIELDS = _proto_fields()


def _spec_fields(msg: Any) -> dict[str, Any]:
    """A spec message's set fields (a repeated-field wrapper as its list)."""
    out: dict[str, Any] = {}
    for d, value in msg.ListFields():
        inner = getattr(value, "DESCRIPTOR", None)
        if inner is not None and len(inner.fields) == 1 and _is_repeated(inner.fields[0]):
            value = list(getattr(value, inner.fields[0].name))
        out[d.name] = value
    return out


def sampling_from_proto(sp: Any) -> SamplingParams:
    """SamplingParams from the proto message, one registry field at a time. Unset means the
    default (`_UNSET_DEFAULTS`, else SamplingParams'): a field with presence not set, a plain
    scalar at its zero value (n = 0 means 1), an empty repeated field."""
    kwargs: dict[str, object] = dict(_UNSET_DEFAULTS)
    for f, presence, repeated, zero in _PROTO_FIELDS:
        if repeated:  # a map is a repeated field of entries: its (key, value) pairs
            value: Any = tuple(getattr(sp, f.name).items() if f.type is dict
                               else getattr(sp, f.name))
            if not value:
                continue
        elif presence and not sp.HasField(f.name):
            continue
        else:
            value = getattr(sp, f.name)
            if not presence and value == zero:
                continue
        if f in SPECS:  # a nested message: its set fields, as SamplingParams takes them
            value = _spec_fields(value)
        kwargs[f.name] = value
    return SamplingParams(**kwargs)  # type: ignore[arg-type]


def _message(m: Any) -> dict[str, Any]:
    """A ChatMessage as OpenAI's message object (only the fields it sets beyond role and
    content)."""
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.name, "arguments": c.arguments}}
                             for c in m.tool_calls]
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    if m.name:
        out["name"] = m.name
    return out


def _tool(i: int, tool: Any) -> Any:
    """A Tool message as OpenAI's tool object (its JSON text parsed, bounded in depth);
    `tools.check_tools` checks the shape."""
    kind = tool.WhichOneof("kind")
    if kind == "json":
        return parse_field(f"tools[{i}]", tool.json)
    if kind is None:
        raise InvalidRequest(f"tools[{i}] is empty: set json or function", f"tools[{i}]")
    f = tool.function
    fn: dict[str, Any] = {"name": f.name}
    if f.HasField("description"):
        fn["description"] = f.description
    if f.parameters:
        fn["parameters"] = parse_field(f"tools[{i}].function.parameters", f.parameters)
    if f.HasField("strict"):
        fn["strict"] = f.strict
    return {"type": "function", "function": fn}


def _chat(chat: Any, max_tool_calls: int | None = None
          ) -> tuple[PromptInput, ToolRequest | None]:
    """A ChatMessages message through the chat fronts' path (`serving.chat.chat_input`;
    `max_tool_calls`: the server's --max-tool-calls)."""
    if chat.tool_choice and chat.tool_choice_function:
        raise InvalidRequest("tool_choice and tool_choice_function are both set: set one",
                             "tool_choice")
    choice: Any = chat.tool_choice or None
    if chat.tool_choice_function:
        choice = {"type": "function", "function": {"name": chat.tool_choice_function}}
    return chat_input(
        [_message(m) for m in chat.messages],
        tools_=[_tool(i, t) for i, t in enumerate(chat.tools)] or None, tool_choice=choice,
        parallel_tool_calls=chat.parallel_tool_calls if chat.HasField("parallel_tool_calls")
        else None,
        add_generation_prompt=chat.add_generation_prompt
        if chat.HasField("add_generation_prompt") else True, max_tool_calls=max_tool_calls)


def input_from_proto(msg: Any, text_field: str) -> PromptInput:
    """The `input` oneof of a GenerateRequest (`prompt`) or TokenizeRequest (`text`), after
    `check_known`; its contents are checked by admission."""
    check_known(msg)
    return _input(msg, text_field)[0]


def _input(msg: Any, text_field: str, max_tool_calls: int | None = None
           ) -> tuple[PromptInput, ToolRequest | None]:
    kind = msg.WhichOneof("input")
    if kind is None:
        options = f"{text_field}, token_ids or chat" if text_field == "prompt" else \
            f"{text_field} or chat"
        raise InvalidRequest(f"input is missing: set one of {options}")
    if kind == text_field:
        return PromptInput(text=getattr(msg, text_field)), None
    if kind == "token_ids":
        return PromptInput(token_ids=tuple(msg.token_ids.ids)), None
    return _chat(msg.chat, max_tool_calls)


@dataclasses.dataclass(frozen=True)
class ParsedRequest:
    """A GenerateRequest mapped: the input, the sampling (with a forced tool call's grammar
    as its structured output) and a chat's checked tools (None: none)."""

    prompt: PromptInput
    params: SamplingParams
    tools: ToolRequest | None = None


def check_known(msg: Any, path: str = "") -> None:
    """Refuse fields this server's proto does not define (a client built from a newer
    jaxserve.proto): protobuf keeps them aside as unknown fields, which would otherwise be
    ignored. Walks the set sub-messages (`path`: where `msg` is, for the message)."""
    unknown = unknown_fields.UnknownFieldSet(msg)
    if len(unknown):
        where = path or msg.DESCRIPTOR.name
        raise InvalidRequest(
            f"{where} has field number {unknown[0].field_number}, which this server's "
            f"{msg.DESCRIPTOR.full_name} does not define (a client built from a newer "
            "jaxserve.proto?): refused rather than ignored", path or None)
    for d, value in msg.ListFields():
        if d.message_type is None or d.message_type.GetOptions().map_entry:
            continue
        name = f"{path}.{d.name}" if path else d.name
        if _is_repeated(d):
            for i, item in enumerate(value):
                check_known(item, f"{name}[{i}]")
        else:
            check_known(value, name)


def parse_request(req: Any, max_tool_calls: int | None = None) -> ParsedRequest:
    """A GenerateRequest mapped (`max_tool_calls`: the server's --max-tool-calls)."""
    check_known(req)
    prompt, request = _input(req, "prompt", max_tool_calls)
    return ParsedRequest(prompt, guided(sampling_from_proto(req.sampling), request), request)


# Admission names fields as the offline API does; this service's names for them.
_WIRE_NAMES = {"prompt_token_ids": "token_ids.ids", "messages": "chat.messages"}
_CHAT_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")  # fields of ChatMessages


def error_message(error: ValueError, text_field: str = "prompt") -> str:
    """An admission / engine refusal in this service's field names (`text_field`: the name
    of the text input, `prompt` or Tokenize's `text`)."""
    error = InvalidRequest.of(error)
    field = error.field
    if field is None:
        return str(error)
    head = field.split(".")[0].split("[")[0]
    wire = {"prompt": text_field, **_WIRE_NAMES}.get(field) or (  # a spec's field: its own
        f"sampling.{field}" if head in SAMPLING_BY_NAME else
        f"chat.{field}" if head in _CHAT_FIELDS else field)
    return error.message_as(wire)


# --------------------------------------------------------------------------- responses
def timing_to_proto(m: RequestMetrics | None) -> Any:
    """Where one sample's time went; a phase that never happened (e.g. no token before an
    abort) is 0, and an unscheduled request spent all its time queued."""
    if m is None:
        return pb2.Timing()
    end = m.finished_time if m.finished_time is not None else m.arrival_time
    sched = m.first_scheduled_time
    first, last = m.first_token_time, m.last_token_time
    return pb2.Timing(
        queue_s=(sched if sched is not None else end) - m.arrival_time,
        ttft_s=first - m.arrival_time if first is not None else 0.0,
        prefill_s=first - sched if first is not None and sched is not None else 0.0,
        decode_s=last - first if first is not None and last is not None else 0.0,
        e2e_s=end - m.arrival_time,
        mean_itl_s=statistics.fmean(m.inter_token_latencies) if m.inter_token_latencies
        else 0.0,
        num_preemptions=m.num_preemptions, spec_num_draft_tokens=m.spec_num_draft_tokens,
        spec_num_accepted_tokens=m.spec_num_accepted_tokens)


def _top(entry: dict[int, float], n: int) -> list[Any]:
    """The `n` likeliest of an engine logprobs entry (the scored token first, then the
    top-N, the scored one once if among them), likeliest first."""
    best = sorted(entry.items(), key=lambda kv: -kv[1])[:n]
    return [pb2.TopLogprob(token_id=t, logprob=v) for t, v in best]


def _logprobs_to_proto(entries: Sequence[dict[int, float]], n: int) -> list[Any]:
    out = []
    for entry in entries:
        tid, lp = next(iter(entry.items()))  # the sampled token first, then the top-N
        out.append(pb2.TokenLogprob(token_id=tid, logprob=lp, top=_top(entry, n)))
    return out


def prompt_logprobs_to_proto(prompt_ids: Sequence[int],
                             entries: Sequence[dict[int, float] | None], n: int) -> Any:
    """A RequestOutput's prompt_logprobs as one PromptLogprobs response: per prompt token
    its id, its logprob (unset for the first: no context) and the `n` likeliest tokens."""
    tokens = []
    for tid, entry in zip(prompt_ids, entries):
        if entry is None:
            tokens.append(pb2.PromptTokenLogprob(token_id=tid))
        else:
            tokens.append(pb2.PromptTokenLogprob(token_id=tid, logprob=entry[tid],
                                                 top=_top(entry, n)))
    return pb2.GenerateResponse(prompt_logprobs=pb2.PromptLogprobs(tokens=tokens))


@dataclasses.dataclass
class _Pending:
    """One sample's deltas not yet sent."""

    ids: list[int] = dataclasses.field(default_factory=list)
    texts: list[str] = dataclasses.field(default_factory=list)
    logprobs: list[Any] = dataclasses.field(default_factory=list)
    sent_first: bool = False


class ResponseBuilder:
    """One request's DELTA RequestOutputs -> GenerateResponses.

    With `stream_interval` k > 1, a sample's chunk is held until it carries k tokens (the
    first token and the end always go out at once): fewer messages, less host overhead per
    token, coarser streaming.
    """

    def __init__(self, stream_interval: int = 1,
                 params: SamplingParams | None = None, tools: ToolRequest | None = None,
                 tool_format: str = "hermes") -> None:
        """`tools`: a chat's (its samples' texts are read for calls in `tool_format`, the
        served model's, and each Finished carries them)."""
        if stream_interval < 1:
            raise ValueError(f"stream_interval={stream_interval} must be >= 1")
        self._interval = stream_interval
        self._tools = tools if parses(tools) else None
        self._tool_format = tool_format
        self._texts: dict[int, list[str]] = {}  # with tools: each sample's text so far
        params = params or SamplingParams()
        self._top_n = params.logprobs or 0
        self._prompt_top_n = params.prompt_logprobs
        self._prompt_sent = params.prompt_logprobs is None  # nothing to send
        self._pending: dict[int, _Pending] = {}
        self._finished: set[int] = set()

    def responses(self, out: RequestOutput) -> list[Any]:
        responses = []
        if not self._prompt_sent and out.prompt_logprobs is not None:
            # The engine sets them once the prefill is done, before any token of it.
            responses.append(prompt_logprobs_to_proto(
                out.prompt_token_ids, out.prompt_logprobs, self._prompt_top_n or 0))
            self._prompt_sent = True
        done: dict[int, CompletionOutput] = {}
        touched: set[int] = set()
        for c in out.outputs:
            if c.index in self._finished:
                continue  # a finished sample reappears in its group's later outputs
            p = self._pending.setdefault(c.index, _Pending())
            p.ids.extend(c.delta_token_ids)
            p.texts.append(c.delta_text)
            if self._tools is not None:
                self._texts.setdefault(c.index, []).append(c.delta_text)
            p.logprobs.extend(_logprobs_to_proto(c.delta_logprobs, self._top_n))
            touched.add(c.index)
            if c.finish_reason is not None:
                done[c.index] = c
                self._finished.add(c.index)
        for index in sorted(touched):
            p = self._pending[index]
            c = done.get(index)
            if c is None and p.sent_first and len(p.ids) < self._interval:
                continue  # hold until the interval fills
            text = "".join(p.texts)
            if p.ids or text:
                responses.append(pb2.GenerateResponse(chunk=pb2.Chunk(
                    index=index, token_ids=p.ids, text=text, logprobs=p.logprobs)))
                p.sent_first = True
            self._pending[index] = _Pending(sent_first=p.sent_first)
            if c is not None:
                responses.append(self._finished_message(index, c, out))
        return responses

    def _finished_message(self, index: int, c: CompletionOutput, out: RequestOutput) -> Any:
        m = c.metrics
        usage = pb2.Usage(prompt_tokens=len(out.prompt_token_ids),
                          completion_tokens=c.num_tokens,
                          cached_prompt_tokens=m.num_cached_tokens if m else 0)
        reason = _REASONS[c.finish_reason]  # type: ignore[index]
        finished = pb2.Finished(index=index, reason=reason, usage=usage,
                                timing=timing_to_proto(m))
        if self._tools is not None:
            read = message_of(self._tools, self._tool_format,
                              "".join(self._texts.pop(index, [])))
            if read is not None:
                finished.tool_calls.extend(pb2.ToolCall(
                    id=t["id"], name=t["function"]["name"], arguments=t["function"]["arguments"])
                    for t in read.tool_calls)
                if read.content is not None:
                    finished.content = read.content
        return pb2.GenerateResponse(finished=finished)
