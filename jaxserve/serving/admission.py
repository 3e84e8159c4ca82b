"""Admission: a caller's prompt -> token ids, and every check a request passes before the engine.

Both fronts (gRPC, OpenAI HTTP) admit requests through one `Admission` per served model, and
the offline API (`LLM`, `jaxserve batch`) through the same functions, synchronously, so the same
bad input gets the same error text everywhere. Data flow: a `PromptInput` (text, token ids or
chat messages, with a chat's tools) -> `admit_input` (chat roles, count and size, the tools'
parameter schemas, the chat template with the tools and tool turns (`tool_prompt`), then
`EngineLimits.admit`: sampling fields against the vocabulary, empty prompt, valid Unicode,
the prompt byte bound, tokenization, vocabulary, max_model_len / max_tokens, KV fit, the
structured-output grammar) -> an `Admitted` request, which
the engine queues without checking again. Duplicate in-flight ids are refused by what the
request is submitted to (`AsyncEngine`, `AsyncReplicaPool`, `Engine`), through the one
`limits.check_not_in_flight`.

`Admission` (the fronts) also checks the client's priority against the operator's range and
tokenizes off the event loop in two lanes: inputs over `LARGE_INPUT_CHARS` on their own small
pool, the rest on another, so a burst of large prompts (each bounded by the prompt byte bound,
which is checked on the loop before any hop) delays only other large prompts, never the small
requests behind them.

Every error raised here is an `InvalidRequest` (a ValueError) whose `field` names the field in
the offline API's words; the fronts rename it to their wire names (`InvalidRequest.message_as`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
from typing import Any, Mapping, Sequence

from jaxserve.engine.limits import (DEFAULT_CLIENT_PRIORITY_RANGE, Admitted, EngineLimits,
                                    InvalidRequest, check_priority, check_prompt_text,
                                    check_request_id, check_size)
from jaxserve.engine.sampling_params import SamplingParams, check_text, show
from jaxserve.models.chat_template import ChatTemplate
from jaxserve.models.tokenizer import Tokenizer
from jaxserve.serving import tool_prompt
from jaxserve.serving.tools import check_schemas, check_tools

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
# OpenAI's newer name for the system role: rendered as "system", which every chat template
# knows (OpenAI and vLLM treat the two alike for such models).
ROLE_ALIASES = {"developer": "system"}
MAX_CHAT_MESSAGES = 1024
# Inputs longer than this (characters; a chat: all contents) are tokenized in the large lane.
# About 4k tokens of English: a few milliseconds of tokenizer time.
LARGE_INPUT_CHARS = 16 << 10
MAX_CHAT_TEMPLATE_CHARS = 64 << 10  # a request's own chat template (compiled per request)
# What a request's template may build without engine limits to size it (the prompt byte bound
# otherwise: a longer text cannot fit in max_model_len tokens).
MAX_RENDER_CHARS = 16 << 20
# Template variables a request's chat_template_kwargs cannot set: the renderer's own inputs.
RESERVED_TEMPLATE_VARS = ("messages", "add_generation_prompt", "continue_final_message",
                          "tokenize", "chat_template")

__all__ = ["Admission", "Admitted", "CHAT_ROLES", "InvalidRequest", "LARGE_INPUT_CHARS",
           "MAX_CHAT_MESSAGES", "PromptInput", "admit_input", "check_chat", "input_chars",
           "render_chat", "tokenize"]


@dataclasses.dataclass(frozen=True)
class PromptInput:
    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    chat: tuple[dict[str, str], ...] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    # Chat only (vLLM's request extras): a template replacing the tokenizer's (refused unless
    # the Admission trusts request templates), extra template variables, and rendering that
    # ends inside the final message so the model continues it.
    chat_template: str | None = None
    chat_template_kwargs: Mapping[str, Any] | None = None
    continue_final_message: bool = False
    # Chat only: OpenAI tool objects the template renders (`tools.check_tools` shapes them;
    # each one's parameters schema is compiled at admission).
    tools: tuple[dict[str, Any], ...] | None = None


def _content(i: int, role: str, content: object) -> str:
    """A message's content as one string: a string, or a list of text parts
    ({"type": "text", "text": ...}) joined with newlines, as vLLM joins them; an assistant's
    may be null (OpenAI's shape of a turn that only called tools), read as ""."""
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":
        return ""
    if not isinstance(content, list):
        raise InvalidRequest(f"messages[{i}].content must be a string or a list of "
                             "{\"type\": \"text\", \"text\": ...} parts", "messages")
    texts = []
    for j, part in enumerate(content):
        where = f"messages[{i}].content[{j}]"
        if not isinstance(part, dict):
            raise InvalidRequest(f"{where} must be an object like "
                                 "{\"type\": \"text\", \"text\": ...}", "messages")
        if part.get("type") != "text":
            raise InvalidRequest(f"{where}.type={show(part.get('type'))} is not supported: "
                                 "only \"text\" parts are", "messages")
        if not isinstance(part.get("text"), str):
            raise InvalidRequest(f"{where}.text must be a string", "messages")
        texts.append(part["text"])
    return "\n".join(texts)


def check_chat(messages: Sequence[Any], max_bytes: int | None = None
               ) -> tuple[dict[str, Any], ...]:
    """A non-empty list of at most MAX_CHAT_MESSAGES {"role", "content"} objects with known
    roles ("developer" read as "system") and valid Unicode text contents (strings, or lists of
    text parts, joined) of at most `max_bytes` UTF-8 bytes in all (the prompt byte bound: a
    template only adds text around them). Other keys (name, tool_call_id, ...) pass through
    to the template; `Admission` bounds them with the contents (`input_chars`)."""
    if not isinstance(messages, (list, tuple)):
        raise InvalidRequest("messages must be a list of {role, content} objects", "messages")
    if not messages:
        raise InvalidRequest("messages must not be empty", "messages")
    if len(messages) > MAX_CHAT_MESSAGES:
        raise InvalidRequest(f"messages has {len(messages)} messages; at most "
                             f"{MAX_CHAT_MESSAGES}", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise InvalidRequest(f"messages[{i}] must be an object like {{\"role\": ..., "
                                 "\"content\": ...}", "messages")
    what = " (the sum of the contents)"
    check_size("messages", _chat_chars(messages), max_bytes, what)  # before reading them
    out = []
    for i, m in enumerate(messages):
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise InvalidRequest(f"messages[{i}].role={show(role)} must be one of "
                                 f"{', '.join(CHAT_ROLES)}", "messages")
        out.append({**m, "role": ROLE_ALIASES.get(role, role),
                    "content": _content(i, role, m.get("content"))})
    size = sum(check_text("messages", m["content"], f"[{i}].content") for i, m in enumerate(out))
    check_size("messages", size, max_bytes, what)
    return tuple(out)


def _template_vars(kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        raise InvalidRequest("chat_template_kwargs must be an object", "chat_template_kwargs")
    reserved = sorted(set(kwargs) & set(RESERVED_TEMPLATE_VARS))
    if reserved:
        raise InvalidRequest(f"chat_template_kwargs cannot set {', '.join(reserved)}: "
                             "use the request fields", "chat_template_kwargs")
    return dict(kwargs)


def _render_text(msgs: list[dict[str, Any]], tokenizer: Tokenizer, add_generation_prompt: bool,
                 template: str | None, variables: dict[str, Any], max_chars: int) -> str:
    """The prompt text; `template`: the request's own (None: the tokenizer's), bounded in
    what it builds by `max_chars` (`models/template_limits.py`)."""
    if template is None:
        return tokenizer.apply_chat_template(msgs, add_generation_prompt, **variables)
    # The request's own template gets the variables the tokenizer's would (special tokens).
    specials = {k: v for k in ("unk_token", "pad_token")
                if (v := getattr(tokenizer, k, None)) is not None}
    specials.update(variables)
    bos = specials.pop("bos_token", tokenizer.bos_token)
    eos = specials.pop("eos_token", tokenizer.eos_token)
    return ChatTemplate(template, max_chars).render(msgs, add_generation_prompt, bos, eos,
                                                    **specials)


def _continue_final(text: str, msgs: list[dict[str, Any]]) -> str:
    """`text` cut right after the final message's content (as transformers'
    continue_final_message does), so the model continues that message."""
    final = msgs[-1]["content"].strip()
    at = text.rfind(final) if final else -1
    if at < 0:
        raise InvalidRequest("continue_final_message: the final message's content does not "
                             "appear in the rendered chat (or is empty)",
                             "continue_final_message")
    return text[:at + len(final)]


def render_chat(messages: Sequence[Any], tokenizer: Tokenizer,
                add_generation_prompt: bool = True,
                limits: EngineLimits | None = None, *, chat_template: str | None = None,
                chat_template_kwargs: Mapping[str, Any] | None = None,
                continue_final_message: bool = False,
                tools: Sequence[Mapping[str, Any]] | None = None,
                tool_format: str | None = None) -> list[int]:
    """The token ids of a conversation through the model's chat template, or `chat_template`
    (with `chat_template_kwargs` as extra variables; `continue_final_message`: end inside the
    final message, which needs add_generation_prompt=False). `limits`: its contents bounded by
    the prompt byte bound first. `tools`: OpenAI tool objects, rendered with the messages'
    tool turns (`tool_prompt`) for a model that calls them in `tool_format` (None: the one
    its template shows)."""
    msgs = check_chat(messages, limits.max_prompt_bytes if limits is not None else None)
    variables = _template_vars(chat_template_kwargs)
    if continue_final_message and add_generation_prompt:
        raise InvalidRequest("continue_final_message=true needs add_generation_prompt=false "
                             "(both cannot be set)", "continue_final_message")
    if chat_template is not None and not isinstance(chat_template, str):
        raise InvalidRequest("chat_template must be a string", "chat_template")
    if chat_template is not None and len(chat_template) > MAX_CHAT_TEMPLATE_CHARS:
        raise InvalidRequest(f"chat_template is {len(chat_template)} characters long; at most "
                             f"{MAX_CHAT_TEMPLATE_CHARS}", "chat_template")
    request = check_tools(tools) if tools else None
    if request is not None and "tools" in variables:
        raise InvalidRequest("chat_template_kwargs cannot set tools when the request gives "
                             "tools", "chat_template_kwargs")
    fmt = tool_format or tool_prompt.detect_format(tokenizer.chat_template)
    source = chat_template if chat_template is not None else tokenizer.chat_template
    turns, extra = tool_prompt.prepare(msgs, request.tools if request else None, source, fmt)
    variables.update(extra)
    try:
        text = _render_text(turns, tokenizer, add_generation_prompt, chat_template, variables,
                            limits.max_prompt_bytes if limits is not None else MAX_RENDER_CHARS)
    except Exception as e:  # noqa: BLE001 - ChatTemplateError, message shapes: the caller's
        field = "messages" if chat_template is None else "chat_template"
        raise InvalidRequest(f"{field} could not be rendered with the "
                             f"{'chat' if chat_template is None else 'request'} template: "
                             f"{type(e).__name__}: {e}", field) from None
    if continue_final_message:
        text = _continue_final(text, turns)
    return tokenizer.encode(text, add_special_tokens=False)


def tokenize(inp: PromptInput, tokenizer: Tokenizer, limits: EngineLimits | None = None,
             tool_format: str | None = None) -> list[int]:
    """Token ids of the input exactly as the offline API computes them (blocking); `limits`:
    texts bounded by the prompt byte bound before they are tokenized; `tool_format`: the
    served model's tool-call format (`render_chat`)."""
    max_bytes = limits.max_prompt_bytes if limits is not None else None
    if inp.token_ids is not None:
        return list(inp.token_ids)
    if inp.text is not None:
        check_prompt_text(inp.text, max_bytes)
        return tokenizer.encode(inp.text, add_special_tokens=inp.add_special_tokens)
    assert inp.chat is not None
    return render_chat(inp.chat, tokenizer, inp.add_generation_prompt, limits,
                       chat_template=inp.chat_template,
                       chat_template_kwargs=inp.chat_template_kwargs,
                       continue_final_message=inp.continue_final_message,
                       tools=inp.tools, tool_format=tool_format)


def admit_input(inp: PromptInput, params: SamplingParams, limits: EngineLimits,
                tokenizer: Tokenizer, tool_format: str | None = None) -> Admitted:
    """Every request check of one prompt (blocking: it tokenizes)."""
    if inp.text is not None:
        return limits.admit(inp.text, params, lambda text: tokenizer.encode(
            text, add_special_tokens=inp.add_special_tokens))
    if inp.chat is not None:
        limits.check_params(params)  # before the template runs
    request = check_tools(inp.tools) if inp.tools else None
    if request is not None and limits.grammars is not None:  # without: no grammar at all
        check_schemas(request.tools, limits.grammars.compile)
    return limits.admit(tokenize(inp, tokenizer, limits, tool_format), params)


def input_chars(inp: PromptInput) -> int:
    """The input's text length in characters (cheap: no encoding): a lower bound of its
    UTF-8 size, used to refuse oversized inputs on the event loop and to pick a lane. A
    chat counts every string value a template may render: the messages' (contents, names,
    tool ids, ...), the tools' and chat_template_kwargs'."""
    if inp.text is not None:
        return len(inp.text)
    if inp.chat is None:
        return 0
    return _string_chars(inp.chat) + _string_chars(inp.chat_template_kwargs) + \
        _string_chars(inp.tools)


def _string_chars(value: object) -> int:
    """Characters of the string values in a JSON-like value (mapping keys are names, not
    text), without recursion: its depth is the client's (the HTTP body bounds it, other
    callers may not)."""
    total, stack = 0, [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, Mapping):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return total


def _chat_chars(messages: Sequence[Any]) -> int:
    """The contents' characters (what the strict size check in `check_chat` bounds)."""
    return sum(_content_chars(m.get("content")) for m in messages if isinstance(m, Mapping))


def _content_chars(content: object) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(p["text"]) for p in content
                   if isinstance(p, dict) and isinstance(p.get("text"), str))
    return 0


class Admission:
    """One served model's admission for the async fronts: the engine's limits, its tokenizer,
    the priority range clients may use, and the two tokenizer lanes (thread pools) shared by
    both fronts: `threads` workers for small inputs, half as many (at least one) for large."""

    def __init__(self, limits: EngineLimits, tokenizer: Tokenizer, threads: int = 2,
                 client_priority_range: tuple[int, int] = DEFAULT_CLIENT_PRIORITY_RANGE,
                 trust_request_chat_template: bool = False, tool_call_parser: str = "auto",
                 max_tool_calls: int | None = None):
        self.limits = limits
        # How this model's tool calls read (--tool-call-parser; auto: from its template).
        self.tool_format = tool_prompt.resolve_format(tool_call_parser, tokenizer.chat_template)
        # At most this many calls in one response (--max-tool-calls; None: unbounded).
        self.max_tool_calls = max_tool_calls
        # A request's own chat template runs arbitrary (sandboxed) Jinja on a tokenizer
        # thread: what it builds is bounded (`models/template_limits.py`), its time is not,
        # so a template that loops for hours would hold that lane.
        # It is refused unless the operator trusts the clients (vLLM's
        # --trust-request-chat-template).
        self.trust_request_chat_template = trust_request_chat_template
        self.tokenizer = tokenizer
        self.client_priority_range = client_priority_range
        self._pool = concurrent.futures.ThreadPoolExecutor(
            threads, thread_name_prefix="jaxserve-tokenize")
        self._large_pool = concurrent.futures.ThreadPoolExecutor(
            max(1, threads // 2), thread_name_prefix="jaxserve-tokenize-large")

    def _lane(self, inp: PromptInput) -> concurrent.futures.ThreadPoolExecutor:
        """The lane of a text / chat input, after its checks that need no tokenizer (on the
        loop, linear in the input, itself bounded: an input that cannot fit never takes a
        worker)."""
        if inp.chat is not None:
            if inp.chat_template is not None and not self.trust_request_chat_template:
                raise InvalidRequest("chat_template in a request is refused: this server does "
                                     "not trust request chat templates (jaxserve serve "
                                     "--trust-request-chat-template)", "chat_template")
            _template_vars(inp.chat_template_kwargs)  # its shape, before counting it
            check_chat(inp.chat, self.limits.max_prompt_bytes)
            check_size("messages", input_chars(inp), self.limits.max_prompt_bytes,
                       " (every string of the messages, tools and chat_template_kwargs)")
        else:
            check_prompt_text(inp.text, self.limits.max_prompt_bytes)
        return self._large_pool if input_chars(inp) > LARGE_INPUT_CHARS else self._pool

    async def tokenize(self, inp: PromptInput) -> list[int]:
        if inp.token_ids is not None:
            return list(inp.token_ids)  # nothing to tokenize: skip the thread hop
        return await asyncio.get_running_loop().run_in_executor(
            self._lane(inp), tokenize, inp, self.tokenizer, self.limits, self.tool_format)

    async def admit(self, request_id: str, inp: PromptInput, params: SamplingParams,
                    priority: int = 0) -> Admitted:
        """Every request check (InvalidRequest naming the field), the client's priority
        included; the result goes to `submit` as the prompt."""
        check_request_id(request_id)
        check_priority(priority, self.client_priority_range)
        if inp.text is None and inp.chat is None:  # token ids: cheap, stay on the loop
            return admit_input(inp, params, self.limits, self.tokenizer)
        self.limits.check_params(params)
        return await asyncio.get_running_loop().run_in_executor(
            self._lane(inp), admit_input, inp, params, self.limits, self.tokenizer,
            self.tool_format)

    async def detokenize(self, token_ids: Sequence[Any]) -> str:
        """The text of prompt-like token ids (checked as a prompt's: non-empty, within
        max_model_len and the vocabulary; special tokens kept), off the event loop."""
        ids = self.limits.check_prompt_ids(token_ids)
        return await asyncio.get_running_loop().run_in_executor(
            self._pool, lambda: self.tokenizer.decode(ids, skip_special_tokens=False))

    def close(self) -> None:
        for pool in (self._pool, self._large_pool):
            pool.shutdown(wait=False, cancel_futures=True)
