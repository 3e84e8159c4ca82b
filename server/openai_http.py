"""OpenAI-compatible HTTP front (aiohttp.web): /v1/completions, /v1/models, /health.

It shares the gRPC server's asyncio loop, AsyncEngine and `Admission` (`jaxserve serve
--http-port PORT`; `app.GrpcServer` starts, attaches and stops it).

Data flow of `POST /v1/completions`:
  middleware (API key: `Authorization: Bearer KEY` -> 401; any error -> OpenAI error JSON)
  -> 503 while the model warms up, the server drains, or the engine failed -> JSON body
  -> `parse_completion` (prompt: text, token ids, or a list of one of those; every sampling
  field -> `SamplingParams`, whose ValueError names the field -> 400)
  -> `Admission.admit` (tokenization on a small thread pool, never on the event loop; every
  request check, 400 with `param` naming the field) -> `AsyncEngine.submit` (QueueFull -> 429,
  EngineStopped -> 503) -> the stream's first RequestOutput -> either
    stream=true:  one SSE event `data: {text_completion chunk}` per sample that got new tokens
                  (or finished) in each RequestOutput, then with `stream_options.include_usage`
                  one chunk with `"choices": []` and `"usage"`, then `data: [DONE]`;
    stream=false: one JSON body with every sample's text, finish_reason, logprobs, usage.
However the handler ends (done, client disconnect: aiohttp cancels the handler, or a failed
write), its `finally` aborts the request in the engine, which frees its KV pages. The `model`
field is accepted as given (any string); responses name the served model.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable

from aiohttp import web

from jaxserve.engine.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from jaxserve.engine.request import FinishReason
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.server.auth import ApiKeys
from jaxserve.server.inflight import InFlight
from jaxserve.serving import admission
from jaxserve.serving.async_engine import EngineStopped, QueueFull, RequestStream
from jaxserve.serving.async_replica_pool import ServingEngine
from jaxserve.serving.build import ServedModel

log = logging.getLogger(__name__)
OPEN_PATHS = ("/health",)  # probes send no key
FINISH_REASONS = {FinishReason.EOS: "stop", FinishReason.STOP: "stop",
                  FinishReason.STOP_STRING: "stop", FinishReason.LENGTH: "length",
                  FinishReason.ABORT: "abort"}
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; null: up to max_model_len
# Body fields passed to SamplingParams as they are (after type checks); None means unset.
_SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "min_tokens",
                    "stop", "stop_token_ids", "ignore_eos", "logprobs", "repetition_penalty",
                    "presence_penalty", "frequency_penalty", "include_stop_str_in_output",
                    "skip_special_tokens")
_BOOL_FIELDS = ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "stream",
                "echo")
_JSON_SEPARATORS = (",", ":")
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ApiError(Exception):
    """An error answered with OpenAI's error JSON and an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message = status, message
        self.body = {"error": {"message": message, "type": type_, "param": param, "code": code}}

    def response(self) -> web.Response:
        return web.json_response(self.body, status=self.status)


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


def _unavailable(message: str) -> ApiError:
    return ApiError(503, message, None, "service_unavailable")


def _field_of(error: ValueError, default: str) -> str:
    """This API's name of the field an admission / SamplingParams error is about."""
    field = admission.InvalidRequest.of(error).field or default
    return "prompt" if field == "prompt_token_ids" else field  # ids are a prompt here


def _invalid(error: ValueError) -> ApiError:
    """An admission / engine refusal as a 400 in this API's field names."""
    param = _field_of(error, "prompt")
    return bad_request(admission.InvalidRequest.of(error).message_as(param), param)


# --------------------------------------------------------------------------- requests
@dataclasses.dataclass(frozen=True)
class CompletionRequest:
    prompt: admission.PromptInput
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_prompt(prompt: object) -> admission.PromptInput:
    """A string, a list of token ids, or a list holding exactly one of those."""
    if prompt is None:
        raise bad_request("prompt is required: a string or a list of token ids", "prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):  # empty prompts are refused by admission
        return admission.PromptInput(text=prompt)
    if isinstance(prompt, list):
        if all(_is_int(t) for t in prompt):
            return admission.PromptInput(token_ids=tuple(prompt))
        if all(isinstance(p, (str, list)) for p in prompt):
            raise bad_request(f"prompt holds a batch of {len(prompt)} prompts; this server "
                              "takes one prompt per request", "prompt")
    raise bad_request("prompt must be a string or a list of token ids", "prompt")


def parse_completion(body: object) -> CompletionRequest:
    """Validate a /v1/completions body; ApiError(400) naming the field otherwise."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    for name in _BOOL_FIELDS:
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise bad_request(f"{name}={body[name]!r} must be a boolean", name)
    if "model" in body and body["model"] is not None and not isinstance(body["model"], str):
        raise bad_request(f"model={body['model']!r} must be a string", "model")
    if body.get("echo"):
        raise bad_request("echo=true is not supported", "echo")
    if body.get("suffix") is not None:
        raise bad_request("suffix is not supported", "suffix")
    if body.get("best_of") is not None and body["best_of"] != body.get("n", 1):
        raise bad_request("best_of is not supported (leave it unset or equal to n)", "best_of")
    stream = bool(body.get("stream"))
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise bad_request("stream_options is only allowed with stream=true",
                              "stream_options")
        if not isinstance(options, dict) or not isinstance(
                options.get("include_usage", False), bool):
            raise bad_request("stream_options must be an object like {\"include_usage\": true}",
                              "stream_options")
        include_usage = bool(options.get("include_usage", False))
    prompt = parse_prompt(body.get("prompt"))
    kwargs: dict[str, Any] = {name: body[name] for name in _SAMPLING_FIELDS
                              if body.get(name) is not None}
    kwargs["max_tokens"] = body.get("max_tokens", DEFAULT_MAX_TOKENS)
    stop = kwargs.get("stop")
    if stop is not None and not isinstance(stop, str) and not (
            isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise bad_request("stop must be a string or a list of strings", "stop")
    ids = kwargs.get("stop_token_ids")
    if ids is not None and not isinstance(ids, list):
        raise bad_request("stop_token_ids must be a list of token ids", "stop_token_ids")
    if kwargs.get("top_k") == 0 and _is_int(kwargs["top_k"]):
        kwargs["top_k"] = -1  # vLLM accepts 0 for "disabled" as well
    try:
        params = SamplingParams(**kwargs)
    except ValueError as e:
        raise bad_request(str(e), _field_of(e, "prompt")) from None
    return CompletionRequest(prompt, params, stream, include_usage)


# --------------------------------------------------------------------------- responses
def _logprobs_json(entries: list[TokenLogprobs], decode: Callable[[int], str],
                   offset: int) -> dict[str, Any]:
    """OpenAI's legacy completions logprobs object (`offset`: where these tokens' text
    starts in the completion)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for entry in entries:
        tid, lp = next(iter(entry.items()))  # the sampled token first, then the top-N
        text = decode(tid)
        tokens.append(text)
        token_lps.append(lp)
        tops.append({decode(t): v for t, v in entry.items()})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


def _choice(c: CompletionOutput, text: str, logprobs: dict[str, Any] | None) -> dict[str, Any]:
    reason = FINISH_REASONS[c.finish_reason] if c.finish_reason is not None else None
    return {"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": reason}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _sse(obj: object) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=_JSON_SEPARATORS)
    return f"data: {data}\n\n".encode()


async def _outputs(first: RequestOutput, stream: RequestStream
                   ) -> AsyncIterator[RequestOutput]:
    yield first
    async for out in stream:
        yield out


# --------------------------------------------------------------------------- the app
class OpenAIHttpFront:
    """The aiohttp application and its listener; see the module docstring."""

    def __init__(self, api_keys: tuple[str, ...] = (), tokenizer_threads: int = 2,
                 max_body_bytes: int = 4 << 20):
        self._auth = ApiKeys(api_keys) if api_keys else None
        self._tokenizer_threads = tokenizer_threads
        self._engine: ServingEngine | None = None
        self._served: ServedModel | None = None
        self._admission: admission.Admission | None = None
        self.calls = InFlight()  # in flight / draining: read by the server's drain
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

        @web.middleware
        async def middleware(request: web.Request, handler: _Handler) -> web.StreamResponse:
            return await self._guard(request, handler)

        self.app = web.Application(middlewares=[middleware], client_max_size=max_body_bytes)
        self.app.router.add_post("/v1/completions", self.completions)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_get("/health", self.health)

    # ----------------------------------------------------------------------- lifecycle
    async def start(self, host: str, port: int) -> int:
        """Listen on host:port (0: a free port); returns the bound port."""
        # handler_cancellation: a client disconnect cancels its handler, whose `finally`
        # then aborts the request in the engine.
        runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, port, reuse_port=False)
        try:
            await site.start()
        except OSError as e:
            await runner.cleanup()
            raise OSError(f"cannot listen on {host}:{port} for HTTP: {e}") from None
        self._runner = runner
        self.port = int(runner.addresses[0][1])
        return self.port

    def attach(self, engine: ServingEngine, served: ServedModel,
               admit: admission.Admission | None = None) -> None:
        """Serve `engine`; `admit`: the served model's admission, shared with the gRPC front
        (None: one of its own). `stop` closes it."""
        self._admission = admit or admission.Admission(
            served.engine.limits, served.engine.tokenizer, self._tokenizer_threads)
        self._engine, self._served = engine, served

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
            if self._auth is not None and request.path not in OPEN_PATHS and \
                    not self._auth.allows(request.headers.get("Authorization")):
                raise ApiError(401, "missing or invalid API key: send the header "
                               "'Authorization: Bearer <key>'", None, "authentication_error",
                               "invalid_api_key")
            return await handler(request)
        except ApiError as e:
            return e.response()
        except web.HTTPException as e:  # unknown route, wrong method, body too large
            if e.status < 400:
                raise
            return ApiError(e.status, e.reason, None, "invalid_request_error").response()

    def _ready(self) -> tuple[ServingEngine, ServedModel, admission.Admission]:
        engine, served, admit = self._engine, self._served, self._admission
        if self.calls.draining:
            raise _unavailable("the server is shutting down")
        if engine is None or served is None or admit is None:
            raise _unavailable("the model is loading; retry when /health answers 200")
        if engine.error is not None:
            raise _unavailable(f"the engine failed: {engine.error!r}")
        return engine, served, admit

    # ----------------------------------------------------------------------- endpoints
    async def health(self, request: web.Request) -> web.Response:
        try:
            self._ready()
        except ApiError as e:
            return web.json_response({"status": "unavailable", "reason": e.message},
                                     status=503)
        return web.json_response({"status": "ok"})

    async def models(self, request: web.Request) -> web.Response:
        _, served, admit = self._ready()
        return web.json_response({"object": "list", "data": [{
            "id": served.name, "object": "model", "created": 0, "owned_by": "jaxserve",
            "max_model_len": admit.limits.max_model_len}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        engine, served, admit = self._ready()
        arrival = time.monotonic()
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            raise bad_request("the request body is not valid JSON") from None
        req = parse_completion(body)
        self.calls.enter()
        stream: RequestStream | None = None
        try:
            rid = f"cmpl-{uuid.uuid4().hex}"
            try:
                admitted = await admit.admit(rid, req.prompt, req.params)
                stream = engine.submit(rid, admitted, req.params, 0, arrival)
                first = await stream.__anext__()  # the engine's own refusal comes here
            except QueueFull as e:
                raise ApiError(429, str(e), None, "rate_limit_error") from None
            except EngineStopped as e:
                raise _unavailable(str(e)) from None
            except ValueError as e:
                raise _invalid(e) from None
            ids = admitted.token_ids
            log.debug("http request admitted request_id=%s prompt_tokens=%d", rid, len(ids))
            head = {"id": rid, "object": "text_completion", "created": int(time.time()),
                    "model": served.name}
            decode = self._decoder(admit)
            outputs = _outputs(first, stream)
            if req.stream:
                return await self._stream(request, req, head, outputs, len(ids), decode)
            return await self._collect(head, outputs, len(ids), req.params, decode)
        finally:
            if stream is not None:
                stream.abort()  # no-op once finished; disconnects and failed writes land here
            self.calls.exit()

    @staticmethod
    def _decoder(admit: admission.Admission) -> Callable[[int], str]:
        tok = admit.tokenizer
        return lambda tid: tok.decode([tid], skip_special_tokens=False)

    async def _stream(self, request: web.Request, req: CompletionRequest, head: dict[str, Any],
                      outputs: AsyncIterator[RequestOutput], prompt_tokens: int,
                      decode: Callable[[int], str]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache",
                                           "X-Request-Id": head["id"]})
        await resp.prepare(request)
        done: set[int] = set()
        counts: dict[int, int] = {}
        try:
            try:
                async for out in outputs:
                    for c in out.outputs:
                        if c.index in done or (not c.delta_token_ids and c.finish_reason is None):
                            continue
                        if c.finish_reason is not None:
                            done.add(c.index)
                        counts[c.index] = len(c.token_ids)
                        lp = None if req.params.logprobs is None else _logprobs_json(
                            c.delta_logprobs, decode, len(c.text) - len(c.delta_text))
                        await resp.write(_sse({**head, "choices": [
                            _choice(c, c.delta_text, lp)]}))
            except EngineStopped as e:
                await resp.write(_sse(_unavailable(str(e)).body))
            if req.include_usage:
                await resp.write(_sse({**head, "choices": [],
                                       "usage": _usage(prompt_tokens, sum(counts.values()))}))
            await resp.write(_sse("[DONE]"))
            await resp.write_eof()
        except ConnectionError:  # the client went away: the caller's `finally` aborts
            log.debug("client disconnected request_id=%s", head["id"])
        return resp

    async def _collect(self, head: dict[str, Any], outputs: AsyncIterator[RequestOutput],
                       prompt_tokens: int, params: SamplingParams,
                       decode: Callable[[int], str]) -> web.Response:
        final: dict[int, CompletionOutput] = {}
        try:
            async for out in outputs:
                for c in out.outputs:
                    if c.index not in final or final[c.index].finish_reason is None:
                        final[c.index] = c
        except EngineStopped as e:
            raise _unavailable(str(e)) from None
        choices = [_choice(c, c.text, _logprobs_json(c.logprobs or [], decode, 0)
                           if params.logprobs is not None else None)
                   for _, c in sorted(final.items())]
        completion = sum(len(c.token_ids) for c in final.values())
        return web.json_response({**head, "choices": choices,
                                  "usage": _usage(prompt_tokens, completion)})
