"""OpenAI-compatible HTTP front (aiohttp.web): /v1/completions, /v1/chat/completions
(`openai_chat`), /v1/models, /health, /metrics (Prometheus text), vLLM's /version,
/tokenize, /detokenize (`openai_extras`), and the live scheduler settings at /admin/scheduler
(`admin`), vLLM's LoRA adapter endpoints (`openai_lora`); the generation plumbing both
completions endpoints share is `openai_stream`.

It shares the gRPC server's asyncio loop, AsyncEngine and `Admission` (`jaxserve serve`
listens on :8000 by default, `--http-port PORT` / `--no-http`; `app.GrpcServer` starts,
attaches and stops it).

Model names (vLLM's --served-model-name): with `served_model_names` set, /v1/models lists
each, responses name the first, and a body whose `model` is another name gets a 404
(`NotFoundError`, param "model"), on every endpoint that takes a body; an absent or null
`model` means the served model. Without them the front answers to any `model` string (it
serves one model) and reports the model's own name, unless LoRA is on: then the base model
answers to the model's own name only. A loaded LoRA adapter's name runs that adapter and is
the responses' `model` (`openai_lora`).

Connections (aiohttp's protocol, configured in `start`): a request head must arrive complete
within `keepalive_timeout` seconds of the connection opening or of the previous response, and
an idle keep-alive connection is closed after as long (aiohttp arms one timer for both; a
client sending its headers a byte at a time is cut off by it). The body then has
`body_timeout` seconds (`http_body.read_body`: 408, connection closed).

Data flow of `POST /v1/completions`:
  middleware (API key: `Authorization: Bearer KEY` -> 401; any error -> OpenAI error JSON;
  an unexpected exception is a bug: logged with its traceback, answered 500)
  -> 503 while the model warms up, the server drains, or the engine failed
  -> `http_body.read_json` (Content-Type / charset -> 415, size -> 413, time -> 408, strict
  UTF-8, nesting depth and JSON syntax -> 400)
  -> `openai_schema.parse_completion` (prompt: text, token ids, or a list of one of those;
  every sampling field -> `SamplingParams`, whose ValueError names the field -> 400)
  -> the `model` name (404 unless served or a loaded adapter, see above)
  -> `Admission.admit` (tokenization on a small thread pool, never on the event loop; every
  request check, 400 with `param` naming the field) -> `AsyncEngine.submit` (QueueFull -> 429,
  EngineStopped -> 503) -> the stream's first RequestOutput -> either
    stream=true:  DELTA outputs (coalesced by the stream while a write waits on a slow
                  client, and to `stream_interval` tokens per sample after the first, as
                  the gRPC front does); one SSE event `data: {text_completion chunk}` per
                  sample that got new tokens (or finished) in each RequestOutput, then with
                  `stream_options.include_usage` one chunk with `"choices": []` and
                  `"usage"` (with `continuous_usage_stats`, usage in every chunk too),
                  then `data: [DONE]`. A client that leaves more than
                  `max_stream_buffer_tokens` unread has its request aborted: it gets an
                  error event (`{"error": {..., "code": "stream_buffer_full"}}`), then
                  `[DONE]`;
    stream=false: one FINAL_ONLY output -> one JSON body with every sample's text,
                  finish_reason, logprobs, usage.
  `echo`: the prompt's text (a token-id prompt's decoded, special tokens kept) goes before
  each sample's text, in a stream within the sample's first chunk (as vLLM sends it); with
  `logprobs` the legacy object covers the prompt's tokens first (the engine computes them:
  `openai_schema` raises prompt_logprobs to `logprobs`). vLLM's `prompt_logprobs` comes back
  as each choice's `prompt_logprobs` (in a stream: in the sample's first chunk). Shapes and
  ranks: `openai_choices`.
A request a failed engine step finished (finish reason ERROR) gets a 500 OpenAI error JSON
(`server_error`, the message naming the failure), or in a stream an `{"error": ...}` event
and then the stream's end.
However the handler ends (done, client disconnect: aiohttp cancels the handler, or a failed
write), its `finally` aborts the request in the engine, which frees its KV pages.

GET /metrics: the served model's Prometheus registry (the text `--metrics-port` serves), with
the same auth policy: it asks for the API key when keys are set unless `open_metrics`
(`--metrics-no-auth`); 503 while the model loads.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from typing import Any, Awaitable, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from jaxserve.engine.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from jaxserve.engine.lora_request import LoRARequest
from jaxserve.server import admin, openai_chat, openai_extras, openai_lora, openai_stream
from jaxserve.server import openai_choices as choices
from jaxserve.server import openai_schema as schema
from jaxserve.server.auth import ApiKeys
from jaxserve.server.http_body import read_json
from jaxserve.server.inflight import InFlight
from jaxserve.serving import admission
from jaxserve.serving.async_engine import RequestStream
from jaxserve.serving.async_replica_pool import AsyncServing
from jaxserve.serving.admin_settings import SchedulerAdmin
from jaxserve.serving.lora_adapters import LoraAdmin
from jaxserve.serving.served import ServedModel

log = logging.getLogger(__name__)
OPEN_PATHS = ("/health",)  # probes send no key
METRICS_PATH = "/metrics"
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_MAX_LINGER_S = 10.0  # aiohttp's default lingering_time
_CLOSE_AFTER = (408, 413)  # the rest of the body may never come, or is not wanted


# --------------------------------------------------------------------------- the app
class OpenAIHttpFront:
    """The aiohttp application and its listener; see the module docstring."""

    def __init__(self, api_keys: tuple[str, ...] = (), tokenizer_threads: int = 2,
                 max_body_bytes: int = 4 << 20, keepalive_timeout: float = 20.0,
                 body_timeout: float = 60.0, *, stream_interval: int = 1,
                 served_model_names: tuple[str, ...] = (), open_metrics: bool = False,
                 enable_admin: bool = False):
        self._auth = ApiKeys(api_keys) if api_keys else None
        # /admin/scheduler (`admin.py`): behind the key, or with none only when enabled.
        self.requires_key, self.enable_admin = self._auth is not None, enable_admin
        self.admin: SchedulerAdmin | None = None
        self.loras: LoraAdmin | None = None  # the adapters (`openai_lora`)
        self._open_paths = OPEN_PATHS + ((METRICS_PATH,) if open_metrics else ())
        self.stream_interval = stream_interval  # tokens per SSE chunk after the first
        self._model_names = served_model_names
        self._registry: CollectorRegistry | None = None
        self._tokenizer_threads = tokenizer_threads
        self.max_body_bytes = max_body_bytes
        self._keepalive_timeout = keepalive_timeout
        self.body_timeout = body_timeout
        self._engine: AsyncServing | None = None
        self._served: ServedModel | None = None
        self._admission: admission.Admission | None = None
        self.calls = InFlight()  # in flight / draining: read by the server's drain
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

        @web.middleware
        async def middleware(request: web.Request, handler: _Handler) -> web.StreamResponse:
            return await self._guard(request, handler)

        self.app = web.Application(middlewares=[middleware], client_max_size=max_body_bytes)
        routes: list[tuple[str, str, Callable[..., Awaitable[web.StreamResponse]]]] = [
            ("POST", "/v1/chat/completions", openai_chat.chat_completions),
            ("GET", "/version", openai_extras.version),
            ("POST", "/tokenize", openai_extras.tokenize),
            ("POST", "/detokenize", openai_extras.detokenize),
            ("GET", admin.PATH, admin.get_scheduler), ("POST", admin.PATH, admin.post_scheduler),
            ("POST", openai_lora.LOAD_PATH, openai_lora.load_adapter),
            ("POST", openai_lora.UNLOAD_PATH, openai_lora.unload_adapter)]
        self.app.router.add_post("/v1/completions", self.completions)
        for method, path, handler in routes:  # the endpoints in other modules
            self.app.router.add_route(method, path, functools.partial(handler, self))
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get(METRICS_PATH, self.metrics)

    # ----------------------------------------------------------------------- lifecycle
    async def start(self, host: str, port: int) -> int:
        """Listen on host:port (0: a free port); returns the bound port."""
        # handler_cancellation: a client disconnect cancels its handler, whose `finally`
        # then aborts the request in the engine.
        # keepalive_timeout: aiohttp arms it when a connection opens and after each response,
        # and closes the connection when it fires while no complete request head has come:
        # the idle limit and the head-read deadline in one.
        # lingering_time: after an answer that left the body unread (408, 413, 401), aiohttp
        # keeps reading (and dropping) it this long so the client sees the answer rather
        # than a reset; no longer than a body may take anyway.
        runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None,
                               keepalive_timeout=self._keepalive_timeout,
                               lingering_time=min(_MAX_LINGER_S, self.body_timeout))
        await runner.setup()
        site = web.TCPSite(runner, host, port, reuse_port=False)
        try:
            await site.start()
        except OSError as e:
            await runner.cleanup()
            raise OSError(f"cannot listen on {host}:{port} for HTTP (another server there? "
                          f"choose another HTTP port, or turn HTTP off): {e}") from None
        self._runner = runner
        self.port = int(runner.addresses[0][1])
        return self.port

    def attach(self, engine: AsyncServing, served: ServedModel,
               admit: admission.Admission | None = None,
               registry: CollectorRegistry | None = None,
               scheduler: SchedulerAdmin | None = None,
               loras: LoraAdmin | None = None) -> None:
        """Serve `engine`; `admit`: the served model's admission, shared with the gRPC front
        (None: one of its own). `stop` closes it. `registry`: its metrics, for /metrics.
        `scheduler`, `loras`: its live settings and its LoRA adapters (None: its own)."""
        self._admission = admit or admission.Admission(
            served.engine.limits, served.engine.tokenizer, self._tokenizer_threads)
        self.admin = scheduler or SchedulerAdmin(engine)
        self.loras = loras or LoraAdmin(engine, served.engine,
                                        self._model_names or (served.name,))
        self._engine, self._served, self._registry = engine, served, registry

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._admission is not None:
            self._admission.close()  # idempotent; the gRPC front has stopped by now

    # ----------------------------------------------------------------------- plumbing
    async def _guard(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        """API key check, and every error as OpenAI's error JSON."""
        try:
            if self._auth is not None and request.path not in self._open_paths and \
                    not self._auth.allows(request.headers.get("Authorization")):
                raise schema.ApiError(401, "missing or invalid API key: send the header "
                               "'Authorization: Bearer <key>'", None, "authentication_error",
                               "invalid_api_key")
            return await handler(request)
        except schema.ApiError as e:
            response = e.response()
            if e.status in _CLOSE_AFTER:
                response.force_close()
            return response
        except web.HTTPException as e:  # unknown route, wrong method
            if e.status < 400:
                raise
            return schema.ApiError(e.status, e.reason, None, "invalid_request_error").response()
        except Exception:  # noqa: BLE001 - a bug, never the client's input: log it, answer 500
            log.exception("unhandled error in %s %s", request.method, request.path)
            return schema.ApiError(500, "internal server error (a bug; the server logged it)",
                                   None, "internal_server_error").response()

    def ready(self) -> tuple[AsyncServing, ServedModel, admission.Admission]:
        engine, served, admit = self._engine, self._served, self._admission
        if self.calls.draining:
            raise schema.unavailable("the server is shutting down")
        if engine is None or served is None or admit is None:
            raise schema.unavailable("the model is loading; retry when /health answers 200")
        if engine.error is not None:
            raise schema.unavailable(f"the engine failed: {engine.error!r}")
        return engine, served, admit

    def check_model(self, body: dict[str, Any]) -> tuple[str, LoRARequest | None]:
        """(the responses' `model`, the adapter to run under or None) of the body's `model`
        (a string or absent by now); 404 for an unknown name (module docstring)."""
        _, served, _ = self.ready()
        assert self.loras is not None
        lora = openai_lora.resolve(self.loras, body, strict=bool(self._model_names))
        return (served.name, None) if lora is None else (lora.lora_name, lora)

    # ----------------------------------------------------------------------- endpoints
    async def health(self, request: web.Request) -> web.Response:
        try:
            self.ready()
        except schema.ApiError as e:
            return web.json_response({"status": "unavailable", "reason": e.message},
                                     status=503)
        return web.json_response({"status": "ok"})

    async def models(self, request: web.Request) -> web.Response:
        _, served, admit = self.ready()
        assert self.loras is not None
        return web.json_response({"object": "list", "data": openai_lora.model_cards(
            self.loras, [{"id": name, "object": "model", "created": 0, "owned_by": "jaxserve",
                          "root": served.name, "max_model_len": admit.limits.max_model_len}
                         for name in self._model_names or (served.name,)])})

    async def metrics(self, request: web.Request) -> web.Response:
        registry = self._registry
        if registry is None:
            raise schema.unavailable("the model is loading; metrics come with it")
        # Off the loop: a scrape walks every family (histograms included).
        text = await asyncio.get_running_loop().run_in_executor(None, generate_latest, registry)
        return web.Response(body=text, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        engine, _, admit = self.ready()
        arrival = time.monotonic()
        body = await read_json(request, self.max_body_bytes, self.body_timeout)
        req = schema.parse_completion(body)
        model, lora = self.check_model(body)
        self.calls.enter()
        streams: list[RequestStream] = []
        try:
            rid = f"cmpl-{uuid.uuid4().hex}"
            run = await openai_stream.start(engine, admit, rid, req.prompt, req.params,
                                            req.priority, arrival, req.stream, streams.append,
                                            req.rename, lora)
            head = {"id": rid, "object": "text_completion", "created": int(time.time()),
                    "model": model}
            decode = openai_stream.decoder(admit)
            # The echoed prompt: the client's text, or the text of the token ids admitted
            # (its token ids, or what truncate_prompt_tokens kept).
            echo = None if not req.echo else run.prompt_text if run.prompt_text is not None \
                else await admit.detokenize(run.prompt_token_ids)
            if req.stream:
                return await self._stream(request, req, head, run, decode, echo)
            got = await openai_stream.collect(rid, run.outputs)
            pairs = choices.prompt_pairs(run.prompt_token_ids, got.prompt_logprobs)
            out = [self._choice(req, c, c.text, c.logprobs or [], True, echo, pairs, decode, 0)[0]
                   for c in got.outputs]
            completion = sum(c.num_tokens for c in got.outputs)
            return web.json_response({**head, "choices": out, "usage": schema.usage(
                run.prompt_tokens, completion)})
        finally:
            for stream in streams:
                stream.abort()  # no-op once finished; disconnects and failed writes land here
            self.calls.exit()

    @staticmethod
    def _choice(req: schema.CompletionRequest, c: CompletionOutput, text: str,
                entries: list[TokenLogprobs], first: bool, echo: str | None,
                prompt: list[choices.Pair], decode: Callable[[int], str], offset: int
                ) -> tuple[dict[str, Any], int]:
        """One text_completion choice for `text` and its tokens' `entries`, where `first`
        (the whole response, or a stream's first chunk of a sample) puts the prompt in front
        when `echo` is its text and carries vLLM's prompt_logprobs when asked for; `offset`:
        where the text starts in the sample's. Also the offset after it."""
        n = req.params.logprobs
        echoed = first and echo is not None
        pairs = (prompt if echoed else []) + choices.generated_pairs(entries)
        lp, end = (None, offset) if n is None else \
            choices.legacy_logprobs(pairs, decode, offset, n)
        body = schema.choice(c, f"{echo}{text}" if echoed else text, lp)
        if first and req.prompt_logprobs is not None:
            body["prompt_logprobs"] = choices.vllm_prompt_logprobs(
                [t for t, _ in prompt], [e for _, e in prompt], req.prompt_logprobs,
                req.params.prompt_logprobs or 0, decode)
        return body, end

    async def _stream(self, request: web.Request, req: schema.CompletionRequest,
                      head: dict[str, Any], run: openai_stream.Started,
                      decode: Callable[[int], str], echo: str | None) -> web.StreamResponse:
        done: set[int] = set()
        counts: dict[int, int] = {}
        offsets: dict[int, int] = {}  # where each sample's next logprobs' text starts
        prompt: list[list[choices.Pair]] = [choices.prompt_pairs(run.prompt_token_ids, None)]

        def chunks(out: RequestOutput) -> list[dict[str, Any]]:
            if out.prompt_logprobs is not None:  # DELTA: on the first output after prefill
                prompt[0] = choices.prompt_pairs(run.prompt_token_ids, out.prompt_logprobs)
            events = []
            for c in out.outputs:
                if c.index in done or (not c.delta_token_ids and c.finish_reason is None):
                    continue
                if c.finish_reason is not None:
                    done.add(c.index)
                counts[c.index] = c.num_tokens
                first = c.index not in offsets
                body, end = self._choice(req, c, c.delta_text, c.delta_logprobs, first, echo,
                                         prompt[0], decode, offsets.get(c.index, 0))
                # Continuous with the echoed prompt tokens' offsets, then by text sent.
                offsets[c.index] = (end if first and echo is not None and
                                    req.params.logprobs is not None else
                                    offsets.get(c.index, 0) + len(body["text"]))
                events.append({**head, "choices": [body]})
                if req.include_usage and req.continuous_usage_stats:
                    events[-1]["usage"] = schema.usage(run.prompt_tokens, sum(counts.values()))
            return events

        def tail() -> list[dict[str, Any]]:
            if not req.include_usage:
                return []
            return [{**head, "choices": [],
                     "usage": schema.usage(run.prompt_tokens, sum(counts.values()))}]

        return await openai_stream.stream_sse(request, head["id"], run.outputs, chunks, tail,
                                              self.body_timeout, self.stream_interval)
