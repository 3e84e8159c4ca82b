"""Where the load generator sends requests: a jaxserve gRPC server or an OpenAI HTTP server.

Data flow: `open_target(url)` -> a `Target` (`grpc://host:port` -> GrpcTarget; `http(s)://...`
-> OpenAITarget, which speaks `/v1/completions` with `stream: true` as vLLM, SGLang and
jaxserve's own HTTP front do) -> `await target.open()` (connects, learns the model name and
vocabulary size when the server tells) -> `await target.send(request, record)` per request: it
stamps the record at send, at each streamed event carrying tokens, and at the end; any failure
becomes `record.error` (never an exception: one bad request must not stop a run).

Both targets ask for the same thing: the prompt as given (token ids or text), max_tokens,
ignore_eos (fixed output lengths), greedy decoding unless a temperature is set.
"""

from __future__ import annotations

import asyncio
import json
from typing import Protocol

import aiohttp
import grpc

from jaxserve.cli.bench.report import RequestRecord
from jaxserve.cli.bench.workload import BenchRequest


class Target(Protocol):
    name: str
    model: str
    vocab_size: int | None  # None: the server does not say
    max_model_len: int | None

    async def open(self) -> None: ...

    async def send(self, req: BenchRequest, rec: RequestRecord) -> None: ...

    async def close(self) -> None: ...


class GrpcTarget:
    """jaxserve's `jaxserve.v1.Generation/Generate` stream."""

    def __init__(self, address: str, api_key: str | None = None, temperature: float = 0.0,
                 timeout: float | None = None):
        self.address = address
        self.name = f"grpc://{address}"
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
                else:
                    u = msg.finished.usage
                    rec.prompt_tokens = u.prompt_tokens
                    rec.output_tokens = u.completion_tokens
            rec.finish()
        except grpc.aio.AioRpcError as e:
            rec.error = f"{e.code().name}: {e.details()}"

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()


class OpenAITarget:
    """Any OpenAI-compatible `/v1/completions` server, streaming (Server-Sent Events)."""

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

    async def send(self, req: BenchRequest, rec: RequestRecord) -> None:
        assert self._session is not None, "open() first"
        body = {"model": self.model, "max_tokens": req.max_tokens, "ignore_eos": True,
                "temperature": self._temperature, "stream": True,
                "stream_options": {"include_usage": True},
                "prompt": req.prompt if isinstance(req.prompt, str) else list(req.prompt)}
        rec.begin()
        counted = 0
        try:
            async with self._session.post(f"{self.base_url}/v1/completions", json=body) as resp:
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
                    if event.get("choices"):
                        # One event per token (vLLM, jaxserve) -- possibly with empty text
                        # while a multi-byte character is incomplete: count events.
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


def open_target(url: str, model: str | None = None, api_key: str | None = None,
                temperature: float = 0.0, timeout: float | None = None) -> Target:
    """`grpc://host:port` (or bare host:port) -> GrpcTarget; `http(s)://...` -> OpenAITarget."""
    if url.startswith(("http://", "https://")):
        return OpenAITarget(url, model, api_key, temperature, timeout)
    address = url[len("grpc://"):] if url.startswith("grpc://") else url
    if not address or ":" not in address:
        raise ValueError(f"target={url!r}: expected grpc://HOST:PORT or http(s)://HOST:PORT")
    return GrpcTarget(address, api_key, temperature, timeout)
