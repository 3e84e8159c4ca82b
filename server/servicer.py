"""The `jaxserve.v1.Generation` service on grpc.aio: Generate (streaming), Tokenize, GetModelInfo.

Data flow of Generate: refused with UNAVAILABLE while the model warms up or the server drains
-> `proto_map.parse_request` -> `Admission.admit` (tokenization on a small thread pool, never on
the event loop nor the engine thread, and every request check) -> `AsyncEngine.submit` (QueueFull
-> RESOURCE_EXHAUSTED at once; DELTA outputs) -> for each RequestOutput the stream yields (the
stream coalesces what arrived while this handler was blocked writing to a slow client) ->
`ResponseBuilder` -> GenerateResponse messages (a PromptLogprobs first when asked for).
However the call ends (finished, client cancel, disconnect, deadline: grpc.aio cancels the
handler), the `finally` aborts the request in the engine, which frees its pages on its next
iteration.

LoRA: `lora_name` names a loaded adapter (`serving.lora_requests.resolve_model`: empty or
the base model's name is none); an unknown one is NOT_FOUND (HTTP's 404 for an unknown
model), also when the adapter is unloaded between the check and the engine queueing it.

Status codes: INVALID_ARGUMENT for any bad field (message names it in this service's words,
`proto_map.error_message`, and its range; a duplicate in-flight request_id too),
RESOURCE_EXHAUSTED when the waiting queue is full or when the client left more than
`max_stream_buffer_tokens` tokens unread (the request was aborted; the message says so),
UNAVAILABLE while warming up / draining / after an engine failure, INTERNAL for bugs and for
a request a failed engine step finished with ERROR (the message names the request and the
failure; the chunks of earlier outputs were sent, the failing output's own tokens are not).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from typing import Any, AsyncIterator, Callable

import grpc

from jaxserve.engine.outputs import RequestOutputKind
from jaxserve.server import proto_map, stubs
from jaxserve.server.admin import lora_to_proto
from jaxserve.server.inflight import InFlight
from jaxserve.serving import admission
from jaxserve.serving.async_engine import EngineStopped, Overloaded, StreamBufferFull
from jaxserve.serving.async_replica_pool import AsyncServing
from jaxserve.serving.lora_adapters import LoraAdmin
from jaxserve.serving.lora_requests import LoraNotFound
from jaxserve.serving.served import ServedModel

log = logging.getLogger(__name__)
_stubs = stubs.load()
pb2 = _stubs.pb2
SERVICE_NAME = pb2.DESCRIPTOR.services_by_name["Generation"].full_name


def model_info(served: ServedModel) -> Any:
    eng = served.engine
    lim = eng.limits
    return pb2.ModelInfo(
        model=served.name, format=served.format, vocab_size=lim.vocab_size,
        max_model_len=lim.max_model_len, page_size=lim.page_size,
        num_kv_pages=lim.num_kv_pages, max_num_seqs=lim.max_num_seqs,
        max_num_batched_tokens=lim.max_num_batched_tokens,
        eos_token_ids=list(lim.eos_token_ids), dtype=eng.config.dtype,
        max_logprobs=lim.max_logprobs, max_n=lim.max_n,
        chat_roles=list(admission.CHAT_ROLES),
        has_chat_template=bool(getattr(eng.tokenizer, "chat_template", None)))


class GenerationServicer(_stubs.grpc.GenerationServicer):
    def __init__(self, tokenizer_threads: int = 2, stream_interval: int = 1):
        self._stream_interval = stream_interval
        self._tokenizer_threads = tokenizer_threads
        self._engine: AsyncServing | None = None
        self._admission: admission.Admission | None = None
        self._info: Any = None
        self._live: Callable[[], dict[str, Any]] = dict
        self._loras: LoraAdmin | None = None
        self.calls = InFlight()  # in flight / draining: read by the server's drain

    # ----------------------------------------------------------------------- lifecycle
    def attach(self, engine: AsyncServing, served: ServedModel,
               admit: admission.Admission | None = None, loras: LoraAdmin | None = None
               ) -> None:
        """Start serving calls on `engine` (after warmup); `admit`: the served model's
        admission shared with the other front (None: one of its own); `close` closes it.
        `loras`: its LoRA adapters (None: its own, the base model named `served.name`)."""
        self._info = model_info(served)
        self._loras = loras or LoraAdmin(engine, served.engine, (served.name,))
        self._live = served.engine.scheduler_settings  # every replica holds the same
        self._admission = admit or admission.Admission(
            served.engine.limits, served.engine.tokenizer, self._tokenizer_threads)
        self._engine = engine

    def close(self) -> None:
        if self._admission is not None:
            self._admission.close()  # idempotent

    async def _admit(self, context: grpc.aio.ServicerContext
                     ) -> tuple[AsyncServing, admission.Admission]:
        if self.calls.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        engine, admit = self._engine, self._admission
        if engine is None or admit is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                "the model is loading; retry when health reports SERVING")
        assert engine is not None and admit is not None
        if engine.error is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"the engine failed: {engine.error!r}")
        return engine, admit

    # ----------------------------------------------------------------------- RPCs
    async def Generate(self, request: Any, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[Any]:
        engine, admit = await self._admit(context)
        arrival = time.monotonic()
        rid = request.request_id
        if not rid:
            rid = f"req-{uuid.uuid4().hex}"
            await context.send_initial_metadata((("x-request-id", rid),))
        self.calls.enter()
        stream = None
        try:
            try:
                parsed = proto_map.parse_request(request, admit.max_tool_calls)
                params = parsed.params
                assert self._loras is not None
                lora = self._loras.resolve(request.lora_name or None)
                admitted = await admit.admit(rid, parsed.prompt, params, request.priority)
                stream = engine.submit(rid, admitted, params, request.priority, arrival,
                                       RequestOutputKind.DELTA, lora)
            except Overloaded as e:  # QueueFull
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
            except EngineStopped as e:
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
            except LoraNotFound as e:
                await context.abort(grpc.StatusCode.NOT_FOUND, _lora_missing(e))
            except ValueError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, proto_map.error_message(e))
            assert stream is not None
            log.debug("request admitted request_id=%s prompt_tokens=%d n=%d", rid,
                      len(admitted.token_ids), params.n)
            builder = proto_map.ResponseBuilder(self._stream_interval, params, parsed.tools,
                                                admit.tool_format)
            try:
                async for out in stream:
                    if out.error is not None:  # a failed step finished it: no Finished
                        await context.abort(grpc.StatusCode.INTERNAL,
                                            f"request {rid!r} failed: {out.error}")
                    for response in builder.responses(out):
                        yield response
            except (StreamBufferFull, Overloaded) as e:  # Overloaded: SloUnattainable
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
            except EngineStopped as e:
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
            except LoraNotFound as e:  # unloaded between the check and the engine
                await context.abort(grpc.StatusCode.NOT_FOUND, _lora_missing(e))
            except ValueError as e:  # refused by the engine itself
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, proto_map.error_message(e))
        except (grpc.aio.AbortError, asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as e:  # noqa: BLE001 - a bug: report it, keep serving others
            log.exception("Generate failed request_id=%s", rid)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {e!r}")
        finally:
            if stream is not None:
                stream.abort()  # no-op once finished; cancel / disconnect / deadline land here
            self.calls.exit()

    async def Tokenize(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        _, admit = await self._admit(context)
        try:
            inp = proto_map.input_from_proto(request, "text")
            if request.HasField("add_special_tokens"):
                inp = dataclasses.replace(inp, add_special_tokens=request.add_special_tokens)
            ids = await admit.tokenize(inp)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                proto_map.error_message(e, "text"))
        return pb2.TokenizeResponse(token_ids=ids)

    async def GetModelInfo(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._admit(context)
        info = pb2.ModelInfo()
        info.CopyFrom(self._info)
        # The scheduler limits as they are now (the admin endpoint may have changed them).
        live = self._live()
        info.max_num_seqs = live["max_num_seqs"]
        info.max_num_batched_tokens = live["max_num_batched_tokens"]
        if self._loras is not None:
            info.lora_adapters.extend(lora_to_proto(r) for r in self._loras.list())
        return info


def _lora_missing(e: LoraNotFound) -> str:
    return f"lora_name {e.name!r}: no LoRA adapter of that name is loaded"
