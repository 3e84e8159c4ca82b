"""The request kinds of the soak (`jaxserve.cli.bench.soak`, run by `scripts/soak/soak.py`): each
sends one request and names its outcome.

A kind is `Kind(weight, send, expected)`: `send(ctx, rng)` makes one call (gRPC or HTTP) with
random parameters drawn from `rng` and returns an outcome label; `expected` is the set of
labels that are fine for that kind (anything else is reported as unexpected and fails the
soak). Labels:
  ok                        every sample finished normally (EOS / LENGTH / STOP / STOP_STRING),
                            with no more tokens than max_tokens and one logprobs entry per
                            token when logprobs were asked for
  finish:<REASON>           the call ended but a sample finished with another reason
                            (ABORT, ERROR, ...)
  cancelled                 the client cancelled the call on purpose (random cancellations)
  deadline                  the gRPC deadline passed (short deadlines) / the HTTP client
                            timeout passed
  grpc:<CODE>               the call failed with that status (INVALID_ARGUMENT for bad input)
  http:<STATUS>             the HTTP answer had that status (400 for bad input)
  error:<ExceptionType>     the client itself failed (connection reset, ...): always unexpected

  stream_error              an HTTP stream ended with an `{"error": ...}` event

Fault injection (`FAULT_KINDS`, run only when the server was started with
`--fault-injection-token T`, `Ctx.fault_token`): requests whose prompt starts with T fail in
their first step on purpose; the server must answer them with INTERNAL / 500 / an error event
while the other kinds see nothing unusual, and the soak's end checks (0 KV pages held, 0
running / waiting, health SERVING) show the failure stayed with its own request. Normal
prompts never start with T (`_prompt` draws ids >= 3; the tiny model's T is its EOS id 2).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
from typing import Any, Awaitable, Callable

import aiohttp
import grpc

from jaxserve.server.client import AsyncClient, fold, pb2

NORMAL_FINISH = frozenset({"EOS", "LENGTH", "STOP", "STOP_STRING"})
HTTP_NORMAL_FINISH = frozenset({"stop", "length"})


@dataclasses.dataclass(frozen=True)
class Ctx:
    """What every request needs: the clients and the served model's limits."""

    grpc: AsyncClient
    http: aiohttp.ClientSession
    http_url: str  # http://host:port
    model: str
    vocab_size: int
    max_prompt: int  # prompt tokens drawn in [1, max_prompt]
    max_tokens: int  # max_tokens drawn in [1, max_tokens]
    long_tokens: int  # max_tokens of the requests that are cancelled or time out mid-way
    max_n: int
    deadline_s: tuple[float, float]  # short gRPC deadlines / HTTP timeouts drawn in this range
    fault_token: int | None = None  # the server's --fault-injection-token (None: off)


Send = Callable[[Ctx, random.Random], Awaitable[str]]


@dataclasses.dataclass(frozen=True)
class Kind:
    weight: float
    send: Send
    expected: frozenset[str]


# ------------------------------------------------------------------------------ parameters
def _prompt(ctx: Ctx, rng: random.Random) -> list[int]:
    return [rng.randrange(3, ctx.vocab_size) for _ in range(rng.randint(1, ctx.max_prompt))]


def _sampling(ctx: Ctx, rng: random.Random) -> dict[str, Any]:
    """Valid sampling fields: n > 1, logprobs, seeds and penalties some of the time."""
    p: dict[str, Any] = {"max_tokens": rng.randint(1, ctx.max_tokens),
                         "temperature": rng.choice([0.0, 0.7, 1.0])}
    if rng.random() < 0.3:
        p["n"] = rng.randint(2, min(4, ctx.max_n))
    if rng.random() < 0.3:
        p["logprobs"] = rng.randint(0, 5)
    if rng.random() < 0.3:
        p["seed"] = rng.randrange(2**32)
    if rng.random() < 0.2:
        p.update(top_k=rng.randint(1, 50), top_p=0.9, presence_penalty=0.5)
    if rng.random() < 0.2:
        p["ignore_eos"] = True
    return p


def _check_samples(completions: list, p: dict[str, Any]) -> str:
    """Label of a finished gRPC call's samples (see the module docstring)."""
    if len(completions) != p.get("n", 1):
        return f"samples:{len(completions)}"
    for c in completions:
        if c.finish_reason not in NORMAL_FINISH:
            return f"finish:{c.finish_reason}"
        if len(c.token_ids) > p["max_tokens"]:
            return "too_many_tokens"
        if "logprobs" in p and len(c.logprobs) != len(c.token_ids):
            return "logprobs_missing"
    return "ok"


def _grpc_label(e: grpc.aio.AioRpcError) -> str:
    code = e.code()
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return "deadline"
    if code is grpc.StatusCode.CANCELLED:
        return "cancelled"
    return f"grpc:{code.name}"


# ------------------------------------------------------------------------------------ gRPC
async def grpc_stream(ctx: Ctx, rng: random.Random) -> str:
    p = _sampling(ctx, rng)
    try:
        msgs = [m async for m in ctx.grpc.stream(_prompt(ctx, rng), p)]
    except grpc.aio.AioRpcError as e:
        return _grpc_label(e)
    return _check_samples(fold(msgs), p)


async def grpc_unary(ctx: Ctx, rng: random.Random) -> str:
    """The whole answer at once (`generate`), a text prompt, sometimes a Tokenize first."""
    p = _sampling(ctx, rng)
    try:
        if rng.random() < 0.3:
            await ctx.grpc.tokenize("hello world")
        return _check_samples(await ctx.grpc.generate("hello world " * rng.randint(1, 4), p), p)
    except grpc.aio.AioRpcError as e:
        return _grpc_label(e)


async def grpc_cancel(ctx: Ctx, rng: random.Random) -> str:
    """Read 0-3 messages of a long request, then cancel the call."""
    p = dict(_sampling(ctx, rng), max_tokens=ctx.long_tokens, ignore_eos=True)
    call = ctx.grpc.stream(_prompt(ctx, rng), p)
    try:
        for _ in range(rng.randint(0, 3)):
            msg = await call.read()
            if msg is grpc.aio.EOF:
                return "ok"
    except grpc.aio.AioRpcError as e:
        return _grpc_label(e)
    call.cancel()
    return "cancelled"


async def grpc_deadline(ctx: Ctx, rng: random.Random) -> str:
    p = dict(_sampling(ctx, rng), max_tokens=ctx.long_tokens)
    try:
        msgs = [m async for m in ctx.grpc.stream(_prompt(ctx, rng), p,
                                                  timeout=rng.uniform(*ctx.deadline_s))]
    except grpc.aio.AioRpcError as e:
        return _grpc_label(e)
    return _check_samples(fold(msgs), p)


# Requests every server must refuse with INVALID_ARGUMENT (built as raw protos: the client's
# SamplingParams would refuse them before they are sent).
GRPC_BAD: tuple[Callable[[Ctx], Any], ...] = (
    lambda c: pb2.GenerateRequest(token_ids=pb2.TokenIds(ids=[])),
    lambda c: pb2.GenerateRequest(token_ids=pb2.TokenIds(ids=[5]),
                                  sampling=pb2.SamplingParams(temperature=-1.0)),
    lambda c: pb2.GenerateRequest(token_ids=pb2.TokenIds(ids=[5]),
                                  sampling=pb2.SamplingParams(top_p=2.0)),
    lambda c: pb2.GenerateRequest(token_ids=pb2.TokenIds(ids=[5]),
                                  sampling=pb2.SamplingParams(n=c.max_n + 1)),
    lambda c: pb2.GenerateRequest(token_ids=pb2.TokenIds(ids=[5]),
                                  sampling=pb2.SamplingParams(logprobs=1000)),
    lambda c: pb2.GenerateRequest(token_ids=pb2.TokenIds(ids=[5]),
                                  sampling=pb2.SamplingParams(max_tokens=-1)),
    lambda c: pb2.GenerateRequest(token_ids=pb2.TokenIds(ids=[5]),
                                  sampling=pb2.SamplingParams(max_tokens=2, min_tokens=5)),
    lambda c: pb2.GenerateRequest(token_ids=pb2.TokenIds(ids=[5]),
                                  sampling=pb2.SamplingParams(presence_penalty=5.0)),
    lambda c: pb2.GenerateRequest(token_ids=pb2.TokenIds(ids=[-1])),
)


async def grpc_bad(ctx: Ctx, rng: random.Random) -> str:
    try:
        [m async for m in ctx.grpc.stub.Generate(rng.choice(GRPC_BAD)(ctx), timeout=30)]
    except grpc.aio.AioRpcError as e:
        return _grpc_label(e)
    return "ok"


# ------------------------------------------------------------------------------------ HTTP
def _body(ctx: Ctx, rng: random.Random, stream: bool) -> dict[str, Any]:
    p = _sampling(ctx, rng)
    prompt: Any = _prompt(ctx, rng) if rng.random() < 0.5 else "hello world"
    return {"model": ctx.model, "prompt": prompt, "stream": stream, **p}


def _check_choices(choices: list[dict], body: dict[str, Any]) -> str:
    if len(choices) != body.get("n", 1):
        return f"samples:{len(choices)}"
    for ch in choices:
        if ch.get("finish_reason") not in HTTP_NORMAL_FINISH:
            return f"finish:{ch.get('finish_reason')}"
    return "ok"


async def http_completion(ctx: Ctx, rng: random.Random) -> str:
    body = _body(ctx, rng, stream=False)
    async with ctx.http.post(f"{ctx.http_url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            return f"http:{resp.status}"
        answer = await resp.json()
    usage = answer["usage"]["completion_tokens"]
    if usage > body["max_tokens"] * body.get("n", 1):
        return "too_many_tokens"
    return _check_choices(answer["choices"], body)


async def _read_sse(resp: aiohttp.ClientResponse, body: dict[str, Any],
                    stop_after: int | None = None) -> str:
    """Read server-sent events to `data: [DONE]` (or `stop_after` events: "cancelled")."""
    finish: dict[int, str] = {}
    events = 0
    async for line in resp.content:
        if not line.startswith(b"data: "):
            continue
        data = line[len(b"data: "):].strip()
        if data == b"[DONE]":
            choices = [{"finish_reason": finish.get(i)} for i in range(body.get("n", 1))]
            return _check_choices(choices, body)
        events += 1
        if data.startswith(b'{"error"'):
            return "stream_error"
        if stop_after is not None and events >= stop_after:
            return "cancelled"
        for ch in json.loads(data).get("choices", []):
            if ch.get("finish_reason"):
                finish[ch["index"]] = ch["finish_reason"]
    return "no_done"


async def http_stream(ctx: Ctx, rng: random.Random) -> str:
    body = _body(ctx, rng, stream=True)
    async with ctx.http.post(f"{ctx.http_url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            return f"http:{resp.status}"
        return await _read_sse(resp, body)


async def http_cancel(ctx: Ctx, rng: random.Random) -> str:
    """A long stream whose client goes away after 1-3 events (the connection is closed)."""
    body = dict(_body(ctx, rng, stream=True), max_tokens=ctx.long_tokens, ignore_eos=True)
    async with ctx.http.post(f"{ctx.http_url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            return f"http:{resp.status}"
        label = await _read_sse(resp, body, stop_after=rng.randint(1, 3))
        resp.close()  # drop the connection, not just the read: the server must abort
        return label


async def http_timeout(ctx: Ctx, rng: random.Random) -> str:
    """A client-side timeout, the HTTP form of a short deadline."""
    body = dict(_body(ctx, rng, stream=rng.random() < 0.5), max_tokens=ctx.long_tokens)
    timeout = aiohttp.ClientTimeout(total=rng.uniform(*ctx.deadline_s))
    try:
        async with ctx.http.post(f"{ctx.http_url}/v1/completions", json=body,
                                 timeout=timeout) as resp:
            if resp.status != 200:
                return f"http:{resp.status}"
            if body["stream"]:
                return await _read_sse(resp, body)
            return _check_choices((await resp.json())["choices"], body)
    except asyncio.TimeoutError:
        return "deadline"


# Bodies every server must refuse with 400 (raw bytes or JSON).
HTTP_BAD: tuple[bytes | dict[str, Any], ...] = (
    b"{", b"[]", b"\xff\xfe", {}, {"prompt": None}, {"prompt": "hi", "temperature": -1},
    {"prompt": "hi", "n": 1000}, {"prompt": "hi", "max_tokens": -1},
    {"prompt": "hi", "logprobs": 1000}, {"prompt": "hi", "top_p": 5},
    {"prompt": "hi", "stream": "yes"}, {"prompt": [[1, 2], [3]]}, {"prompt": ""},
)


async def http_bad(ctx: Ctx, rng: random.Random) -> str:
    bad = rng.choice(HTTP_BAD)
    data = bad if isinstance(bad, bytes) else json.dumps(bad).encode()
    async with ctx.http.post(f"{ctx.http_url}/v1/completions", data=data,
                             headers={"Content-Type": "application/json"}) as resp:
        await resp.read()
        return "ok" if resp.status == 200 else f"http:{resp.status}"


# ------------------------------------------------------------------------- fault injection
def _fault_prompt(ctx: Ctx, rng: random.Random) -> list[int]:
    assert ctx.fault_token is not None, "fault kinds need --fault-injection-token"
    return [ctx.fault_token, *_prompt(ctx, rng)]


async def grpc_fault(ctx: Ctx, rng: random.Random) -> str:
    p = _sampling(ctx, rng)
    try:
        msgs = [m async for m in ctx.grpc.stream(_fault_prompt(ctx, rng), p)]
    except grpc.aio.AioRpcError as e:
        return _grpc_label(e)
    return _check_samples(fold(msgs), p)


async def http_fault(ctx: Ctx, rng: random.Random) -> str:
    body = dict(_body(ctx, rng, stream=rng.random() < 0.5), prompt=_fault_prompt(ctx, rng))
    async with ctx.http.post(f"{ctx.http_url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            return f"http:{resp.status}"
        if body["stream"]:
            return await _read_sse(resp, body)
        return _check_choices((await resp.json())["choices"], body)


def _fs(*labels: str) -> frozenset[str]:
    return frozenset(labels)


# Name -> kind. About 20% of requests are cancellations or short deadlines / timeouts.
# RESOURCE_EXHAUSTED / 429 are admission refusals under load (past --max-waiting): fine.
BUSY = ("grpc:RESOURCE_EXHAUSTED",)
KINDS: dict[str, Kind] = {
    "grpc_stream": Kind(25, grpc_stream, _fs("ok", *BUSY)),
    "grpc_unary": Kind(10, grpc_unary, _fs("ok", *BUSY)),
    "grpc_cancel": Kind(10, grpc_cancel, _fs("cancelled", "ok", *BUSY)),
    "grpc_deadline": Kind(5, grpc_deadline, _fs("deadline", "ok", *BUSY)),
    "grpc_bad": Kind(5, grpc_bad, _fs("grpc:INVALID_ARGUMENT")),
    "http_completion": Kind(15, http_completion, _fs("ok", "http:429")),
    "http_stream": Kind(15, http_stream, _fs("ok", "http:429")),
    "http_cancel": Kind(5, http_cancel, _fs("cancelled", "ok", "http:429")),
    "http_timeout": Kind(5, http_timeout, _fs("deadline", "ok", "http:429")),
    "http_bad": Kind(5, http_bad, _fs("http:400")),
}
# Run only against a server with --fault-injection-token (soak.SoakConfig.fault_token).
FAULT_KINDS: dict[str, Kind] = {
    "grpc_fault": Kind(3, grpc_fault, _fs("grpc:INTERNAL", *BUSY)),
    "http_fault": Kind(3, http_fault, _fs("http:500", "stream_error", "http:429")),
}
