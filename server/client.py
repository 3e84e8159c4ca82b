"""A small Python client for the jaxserve gRPC server: sync (`Client`) and asyncio (`AsyncClient`).

Data flow: prompt text / token ids / chat messages + SamplingParams (the offline API's class,
validated locally) -> `build_request` -> GenerateRequest -> `Generation.Generate` over a
channel (TLS when `root_certificates` or `tls=True`; the API key as `authorization: Bearer`
metadata) -> GenerateResponse stream: `stream()` yields the messages as they arrive,
`generate()` folds them into one `Completion` per sample (with `prompt_logprobs` asked for,
each Completion carries the request's PromptLogprobs, as `prompt_logprobs_of` reads them).
`lora_name=NAME` runs a request under a loaded LoRA adapter; `Client.load_lora_adapter` /
`unload_lora_adapter` / `list_lora_adapters` manage them (the Admin service).

    from jaxserve.client import Client
    from jaxserve import SamplingParams
    with Client("127.0.0.1:50051") as c:
        for msg in c.stream("Hello", SamplingParams(max_tokens=32)):
            if msg.HasField("chunk"):
                print(msg.chunk.text, end="", flush=True)
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, AsyncIterator, Iterator, Mapping, Sequence

import grpc

from jaxserve.engine.lora_request import LoRARequest
from jaxserve.engine.sampling_params import FIELDS as SAMPLING_FIELDS
from jaxserve.engine.sampling_params import SPECS as SAMPLING_SPECS
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.server import stubs
from jaxserve.server.admin_wire import changes_from_proto, settings_to_proto

_stubs = stubs.load()
pb2 = _stubs.pb2
DEFAULT_TARGET = "127.0.0.1:50051"
_REASONS = {v.number: v.name for v in pb2.FinishReason.DESCRIPTOR.values}


@dataclasses.dataclass
class Completion:
    """One sample of a finished request, folded from its stream."""

    index: int
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[Any] = dataclasses.field(default_factory=list)  # TokenLogprob messages
    finish_reason: str | None = None  # STOP | LENGTH | EOS | STOP_STRING | ABORT
    usage: Any = None  # Usage message
    timing: Any = None  # Timing message
    # The request's prompt logprobs (the same for every sample), in the offline API's shape:
    # one entry per prompt token, None for the first, else {prompt token: logprob, top-N}.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # A chat with tools: the sample's text read for calls (OpenAI's shape: {"id", "type",
    # "function": {"name", "arguments"}}) and the text around them (None: calls only).
    tool_calls: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    content: str | None = None


def prompt_logprobs_of(msg: Any) -> list[dict[int, float] | None]:
    """A PromptLogprobs message as `RequestOutput.prompt_logprobs` holds them (float32 on
    the wire): per prompt token None (the first) or {token: logprob, top ids: logprobs}."""
    out: list[dict[int, float] | None] = []
    for t in msg.tokens:
        if not t.HasField("logprob"):
            out.append(None)
        else:
            entry = {t.token_id: t.logprob}
            for top in t.top:
                entry.setdefault(top.token_id, top.logprob)
            out.append(entry)
    return out


def _fill_spec(msg: Any, fields: Mapping[str, Any]) -> None:
    """Set a spec message's fields: a JSON value as its text, a list into the one repeated
    field of its wrapper message."""
    for name, value in fields.items():
        if isinstance(value, (list, tuple)):
            sub = getattr(msg, name)
            getattr(sub, sub.DESCRIPTOR.fields[0].name).extend(value)
        elif name == "json":  # a schema travels as its JSON text
            setattr(msg, name, json.dumps(value))
        else:
            setattr(msg, name, value)


def sampling_to_proto(params: SamplingParams) -> Any:
    """The proto form of `params` (every registry field under its own name): the server
    rebuilds an equal SamplingParams. None stays unset (max_tokens: up to max_model_len, as
    None means offline; seed: the server draws one)."""
    sp = pb2.SamplingParams()
    for f in SAMPLING_FIELDS:
        value = getattr(params, f.name)
        if value is None:
            continue
        if f.type is dict:  # stored as (key, value) pairs
            getattr(sp, f.name).update(dict(value))
        elif f in SAMPLING_SPECS:  # a nested message of the spec's one set field
            _fill_spec(getattr(sp, f.name), value.as_mapping())
        elif f.type is tuple:
            getattr(sp, f.name).extend(value)
        else:
            setattr(sp, f.name, value)
    return sp


def fill_chat(chat: Any, messages: Sequence[Mapping[str, Any]],
              tools: Sequence[Mapping[str, Any]] | None = None,
              tool_choice: str | Mapping[str, Any] | None = None,
              parallel_tool_calls: bool | None = None) -> None:
    """Set a ChatMessages message from OpenAI-shaped messages (with tool turns: assistant
    `tool_calls`, `tool_call_id`), tools (sent as their JSON text), tool_choice ("none",
    "auto", "required" or {"type": "function", "function": {"name"}}) and
    parallel_tool_calls."""
    for m in messages:
        msg = pb2.ChatMessage(role=m["role"], content=m.get("content") or "",
                              tool_call_id=m.get("tool_call_id") or "", name=m.get("name") or "")
        for call in m.get("tool_calls") or ():
            fn = call["function"]
            args = fn.get("arguments", "")
            msg.tool_calls.append(pb2.ToolCall(
                id=call.get("id", ""), name=fn["name"],
                arguments=args if isinstance(args, str) else json.dumps(args)))
        chat.messages.append(msg)
    chat.tools.extend(pb2.Tool(json=json.dumps(t)) for t in tools or ())
    if isinstance(tool_choice, Mapping):
        chat.tool_choice_function = tool_choice["function"]["name"]
    elif tool_choice is not None:
        chat.tool_choice = tool_choice
    if parallel_tool_calls is not None:
        chat.parallel_tool_calls = parallel_tool_calls


def build_request(prompt: str | Sequence[int] | None = None,
                  params: SamplingParams | Mapping[str, Any] | None = None, *,
                  messages: Sequence[Mapping[str, Any]] | None = None, request_id: str = "",
                  priority: int = 0, tools: Sequence[Mapping[str, Any]] | None = None,
                  tool_choice: str | Mapping[str, Any] | None = None,
                  parallel_tool_calls: bool | None = None, lora_name: str = "") -> Any:
    """A GenerateRequest from text, token ids or chat `messages` (exactly one of them; a
    chat may give tools, `fill_chat`); `lora_name`: a loaded LoRA adapter ("": none)."""
    if (prompt is None) == (messages is None):
        raise ValueError("pass exactly one of prompt (text or token ids) and messages")
    if params is None:
        params = SamplingParams()
    elif not isinstance(params, SamplingParams):
        params = SamplingParams(**params)
    req = pb2.GenerateRequest(request_id=request_id, sampling=sampling_to_proto(params),
                              priority=priority, lora_name=lora_name)
    if messages is None and (tools or tool_choice is not None or
                             parallel_tool_calls is not None):
        raise ValueError("tools, tool_choice and parallel_tool_calls need messages")
    if messages is not None:
        fill_chat(req.chat, messages, tools, tool_choice, parallel_tool_calls)
    elif isinstance(prompt, str):
        req.prompt = prompt
    else:
        req.token_ids.ids.extend(int(t) for t in prompt)  # type: ignore[union-attr]
    return req


def fold(responses: Sequence[Any] | Iterator[Any]) -> list[Completion]:
    """Fold a GenerateResponse stream into one Completion per sample, by index."""
    by_index: dict[int, Completion] = {}
    prompt_lps = None
    for msg in responses:
        if msg.HasField("prompt_logprobs"):
            prompt_lps = prompt_logprobs_of(msg.prompt_logprobs)
        elif msg.HasField("chunk"):
            c = by_index.setdefault(msg.chunk.index, Completion(msg.chunk.index))
            c.text += msg.chunk.text
            c.token_ids.extend(msg.chunk.token_ids)
            c.logprobs.extend(msg.chunk.logprobs)
        else:
            f = msg.finished
            c = by_index.setdefault(f.index, Completion(f.index))
            c.finish_reason = _REASONS.get(f.reason, str(f.reason))
            c.usage, c.timing = f.usage, f.timing
            c.tool_calls = [{"id": t.id, "type": "function",
                             "function": {"name": t.name, "arguments": t.arguments}}
                            for t in f.tool_calls]
            c.content = f.content if f.HasField("content") else None
    for c in by_index.values():
        c.prompt_logprobs = prompt_lps
    return [by_index[i] for i in sorted(by_index)]


def _credentials(root_certificates: bytes | None, tls: bool) -> grpc.ChannelCredentials | None:
    if root_certificates is None and not tls:
        return None
    return grpc.ssl_channel_credentials(root_certificates=root_certificates)


class _Base:
    def __init__(self, api_key: str | None, timeout: float | None):
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self.timeout = timeout

    def _kw(self, timeout: float | None) -> dict[str, Any]:
        return {"metadata": self._metadata,
                "timeout": self.timeout if timeout is None else timeout}

    def stream(self, prompt: str | Sequence[int] | None = None,
               params: SamplingParams | Mapping[str, Any] | None = None, *,
               messages: Sequence[Mapping[str, Any]] | None = None, request_id: str = "",
               priority: int = 0, timeout: float | None = None, lora_name: str = "",
               **chat: Any) -> Any:
        """The Generate call (sync: iterate it; asyncio: `async for msg in call`); either
        way `call.cancel()` aborts the request. `self.stub` is the subclass's. `chat`: a
        chat's tools, tool_choice and parallel_tool_calls (`build_request`). `lora_name`:
        a loaded LoRA adapter to run under (a grpc.RpcError NOT_FOUND if none is)."""
        req = build_request(prompt, params, messages=messages, request_id=request_id,
                            priority=priority, lora_name=lora_name, **chat)
        return self.stub.Generate(req, **self._kw(timeout))


class Client(_Base):
    """Blocking client. `stream()` returns the call: iterate it, or `.cancel()` it."""

    def __init__(self, target: str = DEFAULT_TARGET, api_key: str | None = None,
                 root_certificates: bytes | None = None, tls: bool = False,
                 timeout: float | None = None, options: Sequence[tuple[str, Any]] = ()):
        super().__init__(api_key, timeout)
        creds = _credentials(root_certificates, tls)
        self.channel = grpc.secure_channel(target, creds, options) if creds else \
            grpc.insecure_channel(target, options)
        self.stub = _stubs.grpc.GenerationStub(self.channel)
        self.admin = _stubs.grpc.AdminStub(self.channel)

    def generate(self, prompt: str | Sequence[int] | None = None,
                 params: SamplingParams | Mapping[str, Any] | None = None,
                 **kw: Any) -> list[Completion]:
        return fold(self.stream(prompt, params, **kw))

    def tokenize(self, text: str | None = None, *,
                 messages: Sequence[Mapping[str, str]] | None = None,
                 add_special_tokens: bool | None = None) -> list[int]:
        return list(self.stub.Tokenize(_tokenize_request(text, messages, add_special_tokens),
                                       **self._kw(None)).token_ids)

    def model_info(self) -> Any:
        return self.stub.GetModelInfo(pb2.ModelInfoRequest(), **self._kw(None))

    def scheduler_settings(self) -> dict[str, Any]:
        """The server's live scheduler settings (the Admin service; needs the API key, or a
        server run with --enable-admin), with None where the proto says none."""
        return changes_from_proto(self.admin.GetSchedulerConfig(
            pb2.GetSchedulerConfigRequest(), **self._kw(None)))

    def update_scheduler(self, **changes: Any) -> dict[str, Any]:
        """Change live scheduler settings (`max_num_seqs=16, ttft_slo=0.5, ...`; None: unset
        a budget / SLO), all or none; the settings the server now runs with. A refusal is a
        grpc.RpcError (INVALID_ARGUMENT naming the field and the limit)."""
        return changes_from_proto(self.admin.UpdateSchedulerConfig(
            settings_to_proto(changes), **self._kw(None)))

    def load_lora_adapter(self, lora_name: str, lora_path: str,
                          lora_int_id: int | None = None) -> LoRARequest:
        """Load a PEFT adapter directory on the server as `lora_name` (the Admin gate, as
        `update_scheduler`); INVALID_ARGUMENT naming the problem for a bad or duplicate one."""
        return lora_of(self.admin.LoadLoraAdapter(pb2.LoadLoraAdapterRequest(
            lora_name=lora_name, lora_path=lora_path, lora_int_id=lora_int_id),
            **self._kw(None)))

    def unload_lora_adapter(self, lora_name: str,
                            lora_int_id: int | None = None) -> LoRARequest:
        """Unload an adapter (NOT_FOUND: none of that name); the one unloaded."""
        return lora_of(self.admin.UnloadLoraAdapter(pb2.UnloadLoraAdapterRequest(
            lora_name=lora_name, lora_int_id=lora_int_id), **self._kw(None)))

    def list_lora_adapters(self) -> list[LoRARequest]:
        """The server's loaded adapters, in load order."""
        return [lora_of(a) for a in self.admin.ListLoraAdapters(
            pb2.ListLoraAdaptersRequest(), **self._kw(None)).adapters]

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


class AsyncClient(_Base):
    """asyncio client; create and use it inside one running event loop."""

    def __init__(self, target: str = DEFAULT_TARGET, api_key: str | None = None,
                 root_certificates: bytes | None = None, tls: bool = False,
                 timeout: float | None = None, options: Sequence[tuple[str, Any]] = ()):
        super().__init__(api_key, timeout)
        creds = _credentials(root_certificates, tls)
        self.channel = grpc.aio.secure_channel(target, creds, options) if creds else \
            grpc.aio.insecure_channel(target, options)
        self.stub = _stubs.grpc.GenerationStub(self.channel)

    async def generate(self, prompt: str | Sequence[int] | None = None,
                       params: SamplingParams | Mapping[str, Any] | None = None,
                       **kw: Any) -> list[Completion]:
        return fold([msg async for msg in self.stream(prompt, params, **kw)])

    async def iter_text(self, prompt: str | Sequence[int] | None = None,
                        params: SamplingParams | Mapping[str, Any] | None = None,
                        **kw: Any) -> AsyncIterator[str]:
        """Sample 0's text deltas as they arrive."""
        async for msg in self.stream(prompt, params, **kw):
            if msg.HasField("chunk") and msg.chunk.index == 0 and msg.chunk.text:
                yield msg.chunk.text

    async def tokenize(self, text: str | None = None, *,
                       messages: Sequence[Mapping[str, str]] | None = None,
                       add_special_tokens: bool | None = None) -> list[int]:
        resp = await self.stub.Tokenize(_tokenize_request(text, messages, add_special_tokens),
                                        **self._kw(None))
        return list(resp.token_ids)

    async def model_info(self) -> Any:
        return await self.stub.GetModelInfo(pb2.ModelInfoRequest(), **self._kw(None))

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.close()


def lora_of(msg: Any) -> LoRARequest:
    """A LoraAdapter message as the offline API's LoRARequest."""
    return LoRARequest(msg.lora_name, msg.lora_int_id, msg.lora_path)


def _tokenize_request(text: str | None, messages: Sequence[Mapping[str, str]] | None,
                      add_special_tokens: bool | None) -> Any:
    if (text is None) == (messages is None):
        raise ValueError("pass exactly one of text and messages")
    req = pb2.TokenizeRequest()
    if text is not None:
        req.text = text
    else:
        req.chat.messages.extend(pb2.ChatMessage(role=m["role"], content=m["content"])
                                 for m in messages or ())
    if add_special_tokens is not None:
        req.add_special_tokens = add_special_tokens
    return req
