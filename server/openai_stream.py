"""The generation plumbing both OpenAI endpoints share (completions, chat completions).

`start`: an admitted request -> the engine -> its stream and first RequestOutput, with the
engine's refusals as OpenAI errors (QueueFull / StreamBufferFull -> 429, EngineStopped ->
503, a ValueError -> 400). Then either
  `stream_sse`: DELTA outputs -> server-sent events: the endpoint's `chunks(out)` maps each
  output to its chunk objects, `tail()` adds the last ones (usage), then `data: [DONE]`. A
  failed request (`out.error`) gets an `{"error": ...}` event, a client that leaves more than
  the stream buffer unread a `stream_buffer_full` error event, both then the stream's end. A
  write waits at most `body_timeout` seconds on a stuck reader, whose socket is then closed;
  a disconnect ends the stream quietly (the caller's `finally` aborts the request);
  `collect`: FINAL_ONLY outputs -> each sample's final CompletionOutput, a failed request
  as a 500 (`server_error`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Callable

from aiohttp import web

from jaxserve.engine.outputs import CompletionOutput, RequestOutput, RequestOutputKind
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.server import openai_schema as schema
from jaxserve.serving import admission
from jaxserve.serving.async_engine import (EngineStopped, QueueFull, RequestStream,
                                           StreamBufferFull)
from jaxserve.serving.async_replica_pool import AsyncServing

log = logging.getLogger(__name__)


async def _outputs(first: RequestOutput, stream: RequestStream
                   ) -> AsyncIterator[RequestOutput]:
    yield first
    async for out in stream:
        yield out


def failed(request_id: str, error: str) -> schema.ApiError:
    """A request the engine finished with ERROR, as OpenAI's server error."""
    return schema.ApiError(500, f"request {request_id} failed: {error}", None, "server_error")


class Started:
    """A request in the engine: its admitted prompt length and its outputs."""

    def __init__(self, admitted: admission.Admitted, stream: RequestStream,
                 first: RequestOutput):
        self.prompt_tokens = len(admitted.token_ids)
        self.stream = stream
        self.outputs = _outputs(first, stream)


async def start(engine: AsyncServing, admit: admission.Admission, rid: str,
                prompt: admission.PromptInput, params: SamplingParams, priority: int,
                arrival: float, streaming: bool, on_stream: Callable[[RequestStream], None]
                ) -> Started:
    """Admit and submit; `on_stream` gets the stream as soon as it exists (the caller aborts
    it in its `finally`, whatever happens next)."""
    try:
        admitted = await admit.admit(rid, prompt, params, priority)
        kind = RequestOutputKind.DELTA if streaming else RequestOutputKind.FINAL_ONLY
        stream = engine.submit(rid, admitted, params, priority, arrival, kind)
        on_stream(stream)
        first = await stream.__anext__()  # the engine's own refusal comes here
    except QueueFull as e:
        raise schema.ApiError(429, str(e), None, "rate_limit_error") from None
    except StreamBufferFull as e:  # a non-streaming request's first output cannot be
        raise schema.ApiError(  # unread for long; a stream's can, before this runs
            429, str(e), None, "rate_limit_error", "stream_buffer_full") from None
    except EngineStopped as e:
        raise schema.unavailable(str(e)) from None
    except ValueError as e:
        raise schema.invalid(e) from None
    log.debug("http request admitted request_id=%s prompt_tokens=%d", rid,
              len(admitted.token_ids))
    return Started(admitted, stream, first)


async def stream_sse(request: web.Request, request_id: str,
                     outputs: AsyncIterator[RequestOutput],
                     chunks: Callable[[RequestOutput], list[dict[str, Any]]],
                     tail: Callable[[], list[dict[str, Any]]],
                     body_timeout: float) -> web.StreamResponse:
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
            async for out in outputs:
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


async def collect(request_id: str, outputs: AsyncIterator[RequestOutput]
                  ) -> tuple[list[CompletionOutput], int]:
    """Every sample's final output, by index, and the prompt tokens the prefix cache
    served."""
    final: dict[int, CompletionOutput] = {}
    cached = 0
    try:
        async for out in outputs:
            cached = out.num_cached_tokens
            for c in out.outputs:
                if c.index not in final or final[c.index].finish_reason is None:
                    final[c.index] = c
    except EngineStopped as e:
        raise schema.unavailable(str(e)) from None
    error = next((c.error for c in final.values() if c.error is not None), None)
    if error is not None:
        raise failed(request_id, error)
    return [c for _, c in sorted(final.items())], cached
