"""The `jaxserve.v1.Generation` service on grpc.aio: Generate (streaming), Tokenize, GetModelInfo.

Data flow of Generate: admission (refused with UNAVAILABLE while the model warms up or the
server drains) -> `convert.parse_request` -> tokenization on a small thread pool (never on the
event loop nor the engine thread) -> `admission.check_prompt` -> `AsyncEngine.submit` (QueueFull
-> RESOURCE_EXHAUSTED at once) -> for each RequestOutput the stream yields (plus any already
queued behind it, coalesced) -> `ResponseBuilder` -> GenerateResponse messages. However the
call ends (finished, client cancel, disconnect, deadline: grpc.aio cancels the handler), the
`finally` aborts the request in the engine, which frees its pages on its next iteration.

Status codes: INVALID_ARGUMENT for any bad field (message names it and its range, including the
engine's own KV-fit refusal), RESOURCE_EXHAUSTED when the waiting queue is full,
UNAVAILABLE while warming up / draining / after an engine failure, INTERNAL for bugs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import time
import uuid
from typing import Any, AsyncIterator

import grpc

from jaxserve.engine.sampling_params import MAX_LOGPROBS, MAX_N
from jaxserve.server import convert, stubs
from jaxserve.server.inflight import InFlight
from jaxserve.serving import admission
from jaxserve.serving.async_engine import EngineStopped, QueueFull
from jaxserve.serving.async_replica_pool import ServingEngine
from jaxserve.serving.build import ServedModel

log = logging.getLogger(__name__)
_stubs = stubs.load()
pb2 = _stubs.pb2
SERVICE_NAME = pb2.DESCRIPTOR.services_by_name["Generation"].full_name


def model_info(served: ServedModel) -> Any:
    eng = served.engine
    tok = eng.tokenizer
    return pb2.ModelInfo(
        model=served.name, format=served.format, vocab_size=eng.plan.batch_shape.vocab_size,
        max_model_len=eng.plan.scheduler.max_model_len, page_size=eng.plan.scheduler.page_size,
        num_kv_pages=eng.plan.scheduler.num_pages - 1, max_num_seqs=eng.config.max_num_seqs,
        max_num_batched_tokens=eng.config.max_num_batched_tokens,
        eos_token_ids=list(eng.eos_token_ids), dtype=eng.config.dtype,
        max_logprobs=MAX_LOGPROBS, max_n=MAX_N, chat_roles=list(admission.CHAT_ROLES),
        has_chat_template=bool(getattr(tok, "chat_template", None)))


class GenerationServicer(_stubs.grpc.GenerationServicer):
    def __init__(self, tokenizer_threads: int = 2, stream_interval: int = 1):
        self._stream_interval = stream_interval
        self._pool = concurrent.futures.ThreadPoolExecutor(
            tokenizer_threads, thread_name_prefix="jaxserve-tokenize")
        self._engine: ServingEngine | None = None
        self._served: ServedModel | None = None
        self._info: Any = None
        self.calls = InFlight()  # in flight / draining: read by the server's drain

    # ----------------------------------------------------------------------- lifecycle
    def attach(self, engine: ServingEngine, served: ServedModel) -> None:
        """Start serving calls on `engine` (after warmup)."""
        self._info = model_info(served)
        self._served = served
        self._engine = engine

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _admit(self, context: grpc.aio.ServicerContext) -> tuple[ServingEngine, ServedModel]:
        if self.calls.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        engine, served = self._engine, self._served
        if engine is None or served is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                "the model is loading; retry when health reports SERVING")
        assert engine is not None and served is not None
        if engine.error is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"the engine failed: {engine.error!r}")
        return engine, served

    async def _tokenize(self, inp: admission.PromptInput, served: ServedModel) -> list[int]:
        if inp.token_ids is not None:
            return list(inp.token_ids)  # nothing to tokenize: skip the thread hop
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, admission.tokenize, inp,
                                          served.engine.tokenizer)

    # ----------------------------------------------------------------------- RPCs
    async def Generate(self, request: Any, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[Any]:
        engine, served = await self._admit(context)
        arrival = time.monotonic()
        rid = request.request_id
        if not rid:
            rid = f"req-{uuid.uuid4().hex}"
            await context.send_initial_metadata((("x-request-id", rid),))
        self.calls.enter()
        stream = None
        try:
            try:
                inp, params = convert.parse_request(request)
                ids = await self._tokenize(inp, served)
                plan = served.engine.plan
                admission.check_prompt(ids, params, plan.batch_shape.vocab_size,
                                     plan.scheduler.max_model_len)
                stream = engine.submit(rid, ids, params, request.priority, arrival)
            except QueueFull as e:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
            except EngineStopped as e:
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
            except ValueError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            assert stream is not None
            log.debug("request admitted request_id=%s prompt_tokens=%d n=%d", rid, len(ids),
                      params.n)
            builder = convert.ResponseBuilder(self._stream_interval)
            try:
                async for out in stream:
                    for response in builder.responses([out, *stream.drain_ready()]):
                        yield response
            except EngineStopped as e:
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
            except ValueError as e:  # refused by the engine itself (e.g. cannot fit the KV)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
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
        _, served = await self._admit(context)
        try:
            inp = convert.input_from_proto(request, "text")
            if request.HasField("add_special_tokens"):
                inp = dataclasses.replace(inp, add_special_tokens=request.add_special_tokens)
            ids = await self._tokenize(inp, served)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb2.TokenizeResponse(token_ids=ids)

    async def GetModelInfo(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._admit(context)
        return self._info
