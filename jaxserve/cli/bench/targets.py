"""Where the load generator sends requests: a jaxserve gRPC server or an OpenAI HTTP server.

Data flow: `open_target(url, endpoint=...)` -> a `Target` (`grpc://host:port` -> GrpcTarget;
`http(s)://...` -> OpenAITarget, which speaks `/v1/completions`, or with endpoint="chat"
OpenAIChatTarget, `/v1/chat/completions`; both with `stream: true` and
`stream_options.include_usage`, as vLLM, SGLang and jaxserve's own HTTP front serve them) ->
`await target.open()` (connects, learns the model name and vocabulary size when the server
tells) -> `await target.prepare(requests)` before the clock starts (the chat target renders
token-id prompts as text there) -> `await target.send(request, record)` per request: it stamps
the record at send, at each streamed event carrying tokens, and at the end; any failure
becomes `record.error` (never an exception: one bad request must not stop a run).

Every target asks for the same thing: the prompt as given (token ids or text), max_tokens,
ignore_eos (fixed output lengths), greedy decoding unless a temperature is set. Both HTTP
endpoints share one SSE reader (`OpenAITarget.send`); they differ in the body and in which
event is a token event:
  completions  every event with a choice (its text may be "" while a multi-byte character is
               incomplete): one per token, or per few tokens when the server coalesces;
  chat         every choice whose delta has content (possibly ""), except the role
               announcement `{"role": "assistant", "content": ""}` that opens the stream and
               a final `{}` delta that only brings finish_reason: neither is a token.
Output tokens are the usage chunk's `completion_tokens` (vLLM's `bench serve` takes the
same), the count of token events only when a server sends no usage.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Protocol, Sequence

import aiohttp
import grpc

from jaxserve.cli.bench.report import RequestRecord
from jaxserve.cli.bench.workload import BenchRequest


ENDPOINTS = ("completions", "chat")  # of HTTP targets; a gRPC target's is "generate"
# The chat workload's system message when the workload has no common prefix of its own.
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."


class Target(Protocol):
    name: str
    endpoint: str  # "generate" (gRPC), "completions" or "chat" (OpenAI HTTP)
    model: str
    vocab_size: int | None  # None: the server does not say
    max_model_len: int | None

    async def open(self) -> None: ...

    async def prepare(self, reqs: Sequence[BenchRequest]) -> None: ...

    async def send(self, req: BenchRequest, rec: RequestRecord) -> None: ...

    async def close(self) -> None: ...


class GrpcTarget:
    """jaxserve's `jaxserve.v1.Generation/Generate` stream."""

    def __init__(self, address: str, api_key: str | None = None, temperature: float = 0.0,
                 timeout: float | None = None):
        self.address = address
        self.name = f"grpc://{address}"
        self.endpoint = "generate"
        self.model = ""
        self.vocab_size: int | None = None
        self.max_model_len: int | None = None
        self._api_key = api_key
        self._temperature = temperature
        self._timeout = timeout
        self._client = None

    async def open(self) -> None:
        from jaxserve.server.client import AsyncClient

        # Large prompts as token ids exceed gRPC's 4 MB default only at ~1M tokens; fine.
        self._client = AsyncClient(self.address, api_key=self._api_key, timeout=self._timeout)
        try:
            info = await self._client.model_info()
        except grpc.aio.AioRpcError as e:
            await self._client.close()
            raise ConnectionError(f"{self.name}: GetModelInfo failed: {e.code().name}: "
                                  f"{e.details()}") from None
        self.model, self.vocab_size = info.model, info.vocab_size
        self.max_model_len = info.max_model_len

    async def prepare(self, reqs: Sequence[BenchRequest]) -> None:
        pass  # prompts go as they are: token ids or text

    async def send(self, req: BenchRequest, rec: RequestRecord) -> None:
        from jaxserve.engine.sampling_params import SamplingParams

        assert self._client is not None, "open() first"
        params = SamplingParams(max_tokens=req.max_tokens, ignore_eos=True,
                                temperature=self._temperature)
        prompt = req.prompt if isinstance(req.prompt, str) else list(req.prompt)
        rec.begin()
        try:
            async for msg in self._client.stream(prompt, params):
                if msg.HasField("chunk"):
                    rec.on_tokens(len(msg.chunk.token_ids))
                elif msg.HasField("finished"):  # (no PromptLogprobs: never asked for)
                    u, t = msg.finished.usage, msg.finished.timing
                    rec.prompt_tokens = u.prompt_tokens
                    rec.output_tokens = u.completion_tokens
                    rec.spec_draft_tokens = t.spec_num_draft_tokens
                    rec.spec_accepted_tokens = t.spec_num_accepted_tokens
            rec.finish()
        except grpc.aio.AioRpcError as e:
            rec.error = f"{e.code().name}: {e.details()}"

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()


class OpenAITarget:
    """Any OpenAI-compatible `/v1/completions` server, streaming (Server-Sent Events)."""

    endpoint = "completions"
    path = "/v1/completions"

    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None,
                 temperature: float = 0.0, timeout: float | None = None):
        self.base_url = base_url.rstrip("/")
        if self.base_url.endswith("/v1"):
            self.base_url = self.base_url[:-3]
        self.name = self.base_url
        self.model = model or ""
        self.vocab_size: int | None = None
        self.max_model_len: int | None = None
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._temperature = temperature
        self._timeout = timeout
        self._session: aiohttp.ClientSession | None = None

    async def open(self) -> None:
        # No pool limit: the load generator's own concurrency is the only bound.
        self._session = aiohttp.ClientSession(
            headers=self._headers, connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=self._timeout))
        try:
            async with self._session.get(f"{self.base_url}/v1/models") as resp:
                resp.raise_for_status()
                models = (await resp.json()).get("data") or []
        except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
            await self._session.close()
            raise ConnectionError(f"{self.name}: GET /v1/models failed: {e}") from None
        if models:
            self.model = self.model or models[0].get("id", "")
            self.max_model_len = models[0].get("max_model_len")

    async def prepare(self, reqs: Sequence[BenchRequest]) -> None:
        pass  # token ids go as a list of ints, text as text

    def _common(self) -> dict[str, Any]:
        return {"model": self.model, "ignore_eos": True, "temperature": self._temperature,
                "stream": True, "stream_options": {"include_usage": True}}

    async def _body(self, req: BenchRequest) -> dict[str, Any]:
        prompt = req.prompt if isinstance(req.prompt, str) else list(req.prompt)
        return {**self._common(), "max_tokens": req.max_tokens, "prompt": prompt}

    def _carries_tokens(self, choice: dict[str, Any]) -> bool:
        # One event per token (vLLM, jaxserve) -- possibly with empty text while a multi-byte
        # character is incomplete: count events.
        return True

    async def send(self, req: BenchRequest, rec: RequestRecord) -> None:
        assert self._session is not None, "open() first"
        try:
            body = await self._body(req)  # (the chat target may ask the server: not timed)
        except ConnectionError as e:
            rec.error = str(e)
            return
        rec.begin()
        counted = 0
        try:
            async with self._session.post(f"{self.base_url}{self.path}", json=body) as resp:
                if resp.status != 200:
                    rec.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                    return
                async for raw in resp.content:
                    line = raw.decode("utf-8", "replace").strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    event = json.loads(data)
                    if "error" in event and not event.get("choices"):
                        rec.error = f"error event: {json.dumps(event['error'])[:300]}"
                        return
                    choices = event.get("choices")
                    if choices and self._carries_tokens(choices[0]):
                        rec.on_tokens(1)
                        counted += 1
                    usage = event.get("usage")
                    if usage:
                        rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                        rec.output_tokens = int(usage.get("completion_tokens") or counted)
            rec.finish()
        except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError,
                ValueError) as e:
            rec.error = f"{type(e).__name__}: {e}"

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


class OpenAIChatTarget(OpenAITarget):
    """`/v1/chat/completions`, streaming: each request as a system message + a user turn.

    Token-id prompts become text through the server's `POST /detokenize` (vLLM's and
    jaxserve's shape: {"tokens": [...]} -> {"prompt": text}), in `prepare`, before the clock
    starts; the server then renders the messages with its chat template, so a prompt is the
    completions prompt plus the system text and the template's role markers (the usage chunk
    reports the real count). Text prompts go as they are."""

    endpoint = "chat"
    path = "/v1/chat/completions"

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._texts: dict[tuple[int, ...], str] = {}

    async def prepare(self, reqs: Sequence[BenchRequest]) -> None:
        parts = dict.fromkeys(p for r in reqs for p in _chat_parts(r) if isinstance(p, tuple))
        missing = [p for p in parts if p not in self._texts]
        limit = asyncio.Semaphore(16)

        async def one(ids: tuple[int, ...]) -> None:
            async with limit:
                await self._text(ids)

        await asyncio.gather(*(one(ids) for ids in missing))

    async def _text(self, part: str | tuple[int, ...]) -> str:
        if isinstance(part, str):
            return part
        if part not in self._texts:
            assert self._session is not None, "open() first"
            body = {"model": self.model, "tokens": list(part)}
            try:
                async with self._session.post(f"{self.base_url}/detokenize",
                                              json=body) as resp:
                    if resp.status != 200:
                        raise ConnectionError(
                            f"{self.name}: POST /detokenize answered HTTP {resp.status} "
                            f"({(await resp.text())[:200]}); the chat endpoint renders "
                            "token-id prompts as text there: use a server that has it (vLLM, "
                            "jaxserve) or text prompts (--workload jsonl)")
                    self._texts[part] = str((await resp.json())["prompt"])
            except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError,
                    KeyError) as e:
                raise ConnectionError(f"{self.name}: POST /detokenize failed: "
                                      f"{type(e).__name__}: {e}") from None
        return self._texts[part]

    async def _body(self, req: BenchRequest) -> dict[str, Any]:
        system, user = _chat_parts(req)
        messages = [{"role": "system", "content": await self._text(system)},
                    {"role": "user", "content": await self._text(user)}]
        # max_completion_tokens: the chat field (max_tokens is its deprecated alias).
        return {**self._common(), "max_completion_tokens": req.max_tokens,
                "messages": messages}

    def _carries_tokens(self, choice: dict[str, Any]) -> bool:
        return chat_delta_carries_tokens(choice)


def chat_delta_carries_tokens(choice: dict[str, Any]) -> bool:
    """Whether one `chat.completion.chunk` choice brings generated tokens: its delta has
    content (or reasoning_content), possibly "" while a multi-byte character is incomplete;
    not the role announcement (`role` with empty content) nor a `{}` finish-only delta."""
    delta = choice.get("delta") or {}
    text = delta.get("content")
    if text is None:
        text = delta.get("reasoning_content")
    if text is None:
        return False
    return bool(text) or "role" not in delta


def _chat_parts(req: BenchRequest) -> tuple[str | tuple[int, ...], str | tuple[int, ...]]:
    """(system, user) of a request: its `system_len` leading ids and the rest, or the default
    system prompt and the whole prompt."""
    if isinstance(req.prompt, str) or req.system_len <= 0:
        return DEFAULT_SYSTEM_PROMPT, req.prompt
    return req.prompt[:req.system_len], req.prompt[req.system_len:]


def open_target(url: str, model: str | None = None, api_key: str | None = None,
                temperature: float = 0.0, timeout: float | None = None,
                endpoint: str | None = None) -> Target:
    """`grpc://host:port` (or bare host:port) -> GrpcTarget; `http(s)://...` -> OpenAITarget
    (endpoint "completions", the default) or OpenAIChatTarget (endpoint "chat")."""
    if endpoint is not None and endpoint not in ENDPOINTS:
        raise ValueError(f"endpoint={endpoint!r} must be one of {ENDPOINTS}")
    if url.startswith(("http://", "https://")):
        cls = OpenAIChatTarget if endpoint == "chat" else OpenAITarget
        return cls(url, model, api_key, temperature, timeout)
    if endpoint is not None:
        raise ValueError(f"endpoint={endpoint!r} is an OpenAI HTTP endpoint: give an "
                         f"http(s)://HOST:PORT target, not {url!r}")
    address = url[len("grpc://"):] if url.startswith("grpc://") else url
    if not address or ":" not in address:
        raise ValueError(f"target={url!r}: expected grpc://HOST:PORT or http(s)://HOST:PORT")
    return GrpcTarget(address, api_key, temperature, timeout)
