"""The generation plumbing both OpenAI endpoints share (completions, chat completions).

`start`: an admitted request -> the engine -> its stream and first RequestOutput, with the
engine's refusals as OpenAI errors (QueueFull / SloUnattainable / StreamBufferFull -> 429,
the TTFT forecast's with Retry-After; EngineStopped -> 503, a ValueError -> 400 whose `param`
is in the endpoint's names: `rename`). Then either
  `stream_sse`: DELTA outputs -> `coalesce` (with `--stream-interval` k > 1 a sample's
  tokens are held until k are pending; its first token and its end go at once, as on gRPC)
  -> server-sent events: the endpoint's `chunks(out)` maps each
  output to its chunk objects, `tail()` adds the last ones (usage), then `data: [DONE]`. A
  failed request (`out.error`) gets an `{"error": ...}` event, a client that leaves more than
  the stream buffer unread a `stream_buffer_full` error event, both then the stream's end. A
  write waits at most `body_timeout` seconds on a stuck reader, whose socket is then closed;
  a disconnect ends the stream quietly (the caller's `finally` aborts the request);
  `collect`: FINAL_ONLY outputs -> each sample's final CompletionOutput (and the prompt's
  logprobs), a failed request as a 500 (`server_error`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from typing import Any, AsyncIterator, Callable

from aiohttp import web

from jaxserve.engine.errors import SloUnattainable
from jaxserve.engine.lora_request import LoRARequest
from jaxserve.engine.outputs import (CompletionOutput, RequestOutput, RequestOutputKind,
                                     TokenLogprobs, merge_unread)
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.server import openai_schema as schema
from jaxserve.serving import admission
from jaxserve.serving.async_engine import (EngineStopped, Overloaded, RequestStream,
                                           StreamBufferFull)
from jaxserve.serving.async_replica_pool import AsyncServing
from jaxserve.serving.lora_requests import LoraNotFound

log = logging.getLogger(__name__)


async def _outputs(first: RequestOutput, stream: RequestStream
                   ) -> AsyncIterator[RequestOutput]:
    yield first
    async for out in stream:
        yield out


def decoder(admit: admission.Admission) -> Callable[[int], str]:
    """One token id -> its text (special tokens kept), for logprobs."""
    tok = admit.tokenizer
    return lambda tid: tok.decode([tid], skip_special_tokens=False)


def failed(request_id: str, error: str) -> schema.ApiError:
    """A request the engine finished with ERROR, as OpenAI's server error."""
    return schema.ApiError(500, f"request {request_id} failed: {error}", None, "server_error")


class Started:
    """A request in the engine: its admitted prompt length and its outputs."""

    def __init__(self, admitted: admission.Admitted, stream: RequestStream,
                 first: RequestOutput):
        self.prompt_token_ids = list(admitted.token_ids)
        # The text prompt as admitted (None: token ids, a chat, or a truncated prompt).
        self.prompt_text = admitted.prompt
        self.prompt_tokens = len(admitted.token_ids)
        self.stream = stream
        self.outputs = _outputs(first, stream)


async def start(engine: AsyncServing, admit: admission.Admission, rid: str,
                prompt: admission.PromptInput, params: SamplingParams, priority: int,
                arrival: float, streaming: bool, on_stream: Callable[[RequestStream], None],
                rename: dict[str, str] | None = None,
                lora: LoRARequest | None = None) -> Started:
    """Admit and submit; `on_stream` gets the stream as soon as it exists (the caller aborts
    it in its `finally`, whatever happens next). `rename`: the endpoint's own names of
    registry fields (chat's max_completion_tokens), for a refusal's `param`. `lora`: the
    adapter the body's model named (unloaded meanwhile: 404, as an unknown model)."""
    try:
        admitted = await admit.admit(rid, prompt, params, priority)
        kind = RequestOutputKind.DELTA if streaming else RequestOutputKind.FINAL_ONLY
        stream = engine.submit(rid, admitted, params, priority, arrival, kind, lora)
        on_stream(stream)
        first = await stream.__anext__()  # the engine's own refusal comes here
    except SloUnattainable as e:  # the TTFT forecast (slo_admission reject): retry later
        retry = None if math.isinf(e.predicted_s) else {"Retry-After": str(max(1, math.ceil(
            e.predicted_s - e.target_s)))}
        raise schema.ApiError(429, str(e), None, "rate_limit_error", "slo_unattainable",
                              retry) from None
    except Overloaded as e:  # QueueFull
        raise schema.ApiError(429, str(e), None, "rate_limit_error") from None
    except StreamBufferFull as e:  # a non-streaming request's first output cannot be
        raise schema.ApiError(  # unread for long; a stream's can, before this runs
            429, str(e), None, "rate_limit_error", "stream_buffer_full") from None
    except EngineStopped as e:
        raise schema.unavailable(str(e)) from None
    except LoraNotFound as e:
        raise schema.ApiError(404, str(e), "model", "NotFoundError", 404) from None
    except ValueError as e:
        raise schema.invalid(e, rename) from None
    log.debug("http request admitted request_id=%s prompt_tokens=%d", rid,
              len(admitted.token_ids))
    return Started(admitted, stream, first)


def _ready(c: CompletionOutput, sent_first: set[int], interval: int) -> bool:
    """Whether a sample's pending delta goes out now: its end, its first token, or
    `interval` tokens."""
    n = len(c.delta_token_ids)
    return c.finish_reason is not None or (
        n > 0 and (c.index not in sent_first or n >= interval))


async def coalesce(outputs: AsyncIterator[RequestOutput], interval: int
                   ) -> AsyncIterator[RequestOutput]:
    """DELTA outputs regrouped so each sample's tokens go out `interval` at a time after its
    first (fewer, larger SSE chunks); a sample's end flushes it, a failed request flushes
    everything. Each yielded output holds only the samples that are due."""
    if interval <= 1:
        async for out in outputs:
            yield out
        return
    pending: RequestOutput | None = None
    sent_first: set[int] = set()
    async for out in outputs:  # each output is ours once read: merging in place is safe
        if pending is None:
            pending = out
        else:
            merge_unread(pending, out)
        if pending.error is not None:
            due, held = pending.outputs, []
        else:
            due = [c for c in pending.outputs if _ready(c, sent_first, interval)]
            held = [c for c in pending.outputs if not _ready(c, sent_first, interval)]
        if due:
            sent_first.update(c.index for c in due if c.delta_token_ids)
            yield dataclasses.replace(pending, outputs=due)
            pending = dataclasses.replace(pending, outputs=held) if held else None
    if pending is not None and pending.outputs:
        yield pending  # not expected: the last output finishes every sample


async def stream_sse(request: web.Request, request_id: str,
                     outputs: AsyncIterator[RequestOutput],
                     chunks: Callable[[RequestOutput], list[dict[str, Any]]],
                     tail: Callable[[], list[dict[str, Any]]],
                     body_timeout: float, interval: int = 1) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache",
                                       "X-Request-Id": request_id})
    await resp.prepare(request)

    async def write(data: bytes) -> None:
        # A client that stops reading blocks this once the socket buffers fill (its request
        # is aborted by the bounded stream buffer meanwhile): it gets body_timeout seconds.
        try:
            async with asyncio.timeout(body_timeout):
                await resp.write(data)
        except TimeoutError:
            raise ConnectionResetError(f"the client read nothing for "
                                       f"{body_timeout:g} s") from None

    try:
        try:
            async for out in coalesce(outputs, interval):
                if out.error is not None:
                    await write(schema.sse(failed(request_id, out.error).body))
                    break
                for chunk in chunks(out):
                    await write(schema.sse(chunk))
        except StreamBufferFull as e:
            await write(schema.sse(schema.ApiError(
                429, str(e), None, "rate_limit_error", "stream_buffer_full").body))
        except EngineStopped as e:
            await write(schema.sse(schema.unavailable(str(e)).body))
        for chunk in tail():
            await write(schema.sse(chunk))
        await write(schema.sse("[DONE]"))
        await resp.write_eof()
    except ConnectionError as e:  # the client went away: the caller's `finally` aborts
        log.debug("client disconnected request_id=%s: %s", request_id, e)
        if request.transport is not None:
            request.transport.close()  # (a stuck reader's socket: not left open)
    return resp


@dataclasses.dataclass
class Collected:
    """A non-streaming request's end: every sample's final output, by index; the prompt
    tokens the prefix cache served; the prompt's logprobs when asked for."""

    outputs: list[CompletionOutput]
    cached_tokens: int
    prompt_logprobs: list[TokenLogprobs | None] | None


async def collect(request_id: str, outputs: AsyncIterator[RequestOutput]) -> Collected:
    final: dict[int, CompletionOutput] = {}
    cached = 0
    prompt_logprobs = None
    try:
        async for out in outputs:
            cached = out.num_cached_tokens
            prompt_logprobs = out.prompt_logprobs or prompt_logprobs
            for c in out.outputs:
                if c.index not in final or final[c.index].finish_reason is None:
                    final[c.index] = c
    except EngineStopped as e:
        raise schema.unavailable(str(e)) from None
    error = next((c.error for c in final.values() if c.error is not None), None)
    if error is not None:
        raise failed(request_id, error)
    return Collected([c for _, c in sorted(final.items())], cached, prompt_logprobs)
