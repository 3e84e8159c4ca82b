"""Clients of a BackgroundServer's HTTP front, for tests: its base URL, a JSON POST, the SSE
`data:` payloads of a streamed completion, and an `openai` SDK client."""

from __future__ import annotations

import json
from typing import Any

import aiohttp

from jaxserve.server.background import BackgroundServer


def url_of(server: BackgroundServer) -> str:
    """The server's HTTP base URL on loopback."""
    return f"http://127.0.0.1:{server.server.http_port}"


async def call(url: str, path: str, body: Any, headers: dict | None = None) -> tuple[int, Any]:
    """POST `body` (a JSON value, or str / bytes sent as they are) to `url + path`: the
    status and the decoded JSON reply."""
    async with aiohttp.ClientSession() as session:
        data = body if isinstance(body, (str, bytes)) else json.dumps(body)
        async with session.post(url + path, data=data, headers={
                "Content-Type": "application/json", **(headers or {})}) as resp:
            return resp.status, await resp.json()


async def post(url: str, body: Any, headers: dict | None = None) -> tuple[int, Any]:
    """`call` on /v1/completions."""
    return await call(url, "/v1/completions", body, headers)


async def stream_events(url: str, body: dict) -> list[Any]:
    """Every SSE `data:` payload of a streamed /v1/completions, decoded (`[DONE]` kept as the
    string)."""
    events = []
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/completions", json={**body, "stream": True}) as resp:
            assert resp.status == 200, await resp.text()
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            raw = (await resp.read()).decode()
    assert raw.endswith("\n\n")
    for block in raw.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def openai_client(server: BackgroundServer, key: str):  # noqa: ANN201 - openai.OpenAI
    """The official SDK against the server's /v1 (no retries: a failure shows as it is)."""
    import openai

    return openai.OpenAI(base_url=f"{url_of(server)}/v1", api_key=key, max_retries=0,
                         timeout=60)
