"""POST /v1/chat/completions on the OpenAI HTTP front (`OpenAIHttpFront` routes it here).

Data flow: the front's middleware (API key, OpenAI error JSON) -> `front.ready()` (503 while
loading / draining / failed) -> `http_body.read_json` -> `openai_chat_schema.parse_chat`
(body shape, sampling fields via the registry) -> `openai_stream.start` (admission: content
parts, roles, the chat template, every request check; then the engine: 429 / 503) ->
  stream=true:  DELTA outputs -> `chat.completion.chunk` events: per sample, a first chunk
                with `{"role": "assistant", "content": ""}` (with `echo`, then one with the
                echoed content), then one with each new piece of
                content (and its logprobs), `finish_reason` on the sample's last chunk; with
                `stream_options.include_usage` a final chunk with `"choices": []` and usage
                (and with `continuous_usage_stats` usage in every chunk); `data: [DONE]`;
  stream=false: one FINAL_ONLY output -> a `chat.completion` object, usage with
                `prompt_tokens_details.cached_tokens` (the prefix cache's share of the prompt).
With tools (tool_choice other than none), each sample's text goes through its tool-call
parser (`openai_tools`): the message's `content` and `tool_calls`, in a stream `delta.content`
and `delta.tool_calls` pieces, `finish_reason` "tool_calls" once a call was made.
vLLM's extras: `prompt_logprobs` comes back as the response's top-level `prompt_logprobs`
(in a stream: on the first chunk once the prefill is done); `echo` prepends the last
message's content when that message is an assistant's (`openai_choices.echo_of_chat`).
The request is aborted in the engine however the handler ends (its `finally`), as for
/v1/completions.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any, Callable

from aiohttp import web

from jaxserve.engine.outputs import RequestOutput
from jaxserve.server import openai_chat_schema as chat_schema
from jaxserve.server import openai_schema as schema
from jaxserve.server import openai_stream, openai_tools
from jaxserve.server.http_body import read_json
from jaxserve.server.openai_choices import echo_of_chat, vllm_prompt_logprobs
from jaxserve.serving import tools
from jaxserve.serving.async_engine import RequestStream

if TYPE_CHECKING:
    from jaxserve.server.openai_http import OpenAIHttpFront


async def chat_completions(front: "OpenAIHttpFront", request: web.Request
                           ) -> web.StreamResponse:
    engine, _, admit = front.ready()
    arrival = time.monotonic()
    body = await read_json(request, front.max_body_bytes, front.body_timeout)
    req = chat_schema.parse_chat(body, admit.max_tool_calls)
    model, lora = front.check_model(body)
    front.calls.enter()
    streams: list[RequestStream] = []
    try:
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        run = await openai_stream.start(engine, admit, rid, req.prompt, req.params,
                                        req.priority, arrival, req.stream, streams.append,
                                        req.rename, lora)
        head = {"id": rid, "created": int(time.time()), "model": model}
        decode = openai_stream.decoder(admit)
        top = req.params.logprobs
        # Admitted: the messages are valid by now.
        echo = echo_of_chat(req.prompt.chat or ()) if req.echo else ""
        if req.stream:
            calls = openai_tools.ToolStream(req.tools, admit.tool_format) \
                if req.tools is not None and tools.parses(req.tools) else None
            return await _stream(front, request, req, head, run, decode, echo, calls)
        got = await openai_stream.collect(rid, run.outputs)
        choices = []
        for c in got.outputs:
            lps = None if top is None else chat_schema.logprobs_json(c.logprobs or [], top,
                                                                      decode)
            choice = chat_schema.choice(c, lps, echo + c.text)
            parser = tools.parser(req.tools, admit.tool_format)
            if parser is not None:
                choice["message"] = openai_tools.message(parser, c.text, echo)
                choice["finish_reason"] = openai_tools.finish_reason(c, parser.calls)
            choices.append(choice)
        usage = schema.usage(run.prompt_tokens, sum(c.num_tokens for c in got.outputs),
                             got.cached_tokens)
        body = {**head, "object": "chat.completion", "choices": choices, "usage": usage}
        if req.params.prompt_logprobs is not None:
            body["prompt_logprobs"] = vllm_prompt_logprobs(
                run.prompt_token_ids, got.prompt_logprobs, req.params.prompt_logprobs,
                req.params.prompt_logprobs, decode)
        return web.json_response(body)
    finally:
        for stream in streams:
            stream.abort()  # no-op once finished; disconnects and failed writes land here
        front.calls.exit()


async def _stream(front: "OpenAIHttpFront", request: web.Request,
                  req: chat_schema.ChatRequest, head: dict[str, Any],
                  run: openai_stream.Started, decode: Callable[[int], str], echo: str,
                  calls: openai_tools.ToolStream | None) -> web.StreamResponse:
    head = {**head, "object": "chat.completion.chunk"}
    top = req.params.logprobs
    n_prompt = req.params.prompt_logprobs or 0
    started: set[int] = set()  # samples whose role chunk went out
    done: set[int] = set()
    counts: dict[int, int] = {}
    cached = [0]
    prompt_lps_due = [req.params.prompt_logprobs is not None]  # until sent once

    def usage() -> dict[str, Any]:
        return schema.usage(run.prompt_tokens, sum(counts.values()), cached[0])

    def chunks(out: RequestOutput) -> list[dict[str, Any]]:
        cached[0] = out.num_cached_tokens
        events = []
        for c in out.outputs:
            if c.index not in started:  # the role first, as OpenAI and vLLM send it
                started.add(c.index)
                events.append({**head, "choices": [{
                    "index": c.index, "delta": {"role": "assistant", "content": ""},
                    "logprobs": None, "finish_reason": None}]})
                if echo:  # then the echoed content, as vLLM sends it
                    events.append({**head, "choices": [{
                        "index": c.index, "delta": {"content": echo}, "logprobs": None,
                        "finish_reason": None}]})
            if c.index in done or (not c.delta_token_ids and c.finish_reason is None):
                continue
            if c.finish_reason is not None:
                done.add(c.index)
            counts[c.index] = c.num_tokens
            lp = None if top is None else chat_schema.logprobs_json(c.delta_logprobs, top,
                                                                     decode)
            if calls is None:
                delta = {"content": c.delta_text} if c.delta_text or c.finish_reason is None \
                    else {}
                events.append({**head, "choices": [chat_schema.delta_choice(c, delta, lp)]})
                continue
            delta, reason = calls.step(c)  # a tool call's text may be held back
            if delta or lp is not None or reason is not None:
                events.append({**head, "choices": [
                    chat_schema.delta_choice(c, delta, lp, reason)]})
        if prompt_lps_due[0] and out.prompt_logprobs is not None and events:
            prompt_lps_due[0] = False  # on the first chunk that can carry them
            events[0]["prompt_logprobs"] = vllm_prompt_logprobs(
                run.prompt_token_ids, out.prompt_logprobs, n_prompt, n_prompt, decode)
        if req.include_usage and req.continuous_usage_stats:
            for e in events:
                e["usage"] = usage()
        return events

    def tail() -> list[dict[str, Any]]:
        return [{**head, "choices": [], "usage": usage()}] if req.include_usage else []

    return await openai_stream.stream_sse(request, head["id"], run.outputs, chunks, tail,
                                          front.body_timeout, front.stream_interval)
