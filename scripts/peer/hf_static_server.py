"""A naive static-batching server over Hugging Face transformers, for benchmarks.

It speaks the same OpenAI `/v1/completions` protocol as `jaxserve serve --http-port` (SSE
streaming, `stream_options.include_usage`, `data: [DONE]`) so one benchmark client can drive
both, and it batches the way naive servers do:

  requests -> `pending` queue -> the batcher waits for the first one, then collects up to
  `--batch-size` of them (or whatever arrived within `--batch-timeout` seconds of the first)
  -> left-pads the prompts -> on ONE worker thread: one prefill forward, then a manual decode
  loop (`model(...)` with `past_key_values`, not `generate`) that samples one token per member
  per step and hands every member's new token/text to the event loop at once
  (`call_soon_threadsafe`) -> each handler streams its own tokens as SSE events.
The batch runs until every member has finished (finished members just stop streaming; their
rows keep being computed); only then is the next batch formed. A client that disconnects is
marked finished, so a batch of gone clients ends early.

Supported request fields: `prompt` (string, token-id list, or a list of one of those),
`max_tokens` (default 16), `temperature` (0 = greedy; default 1), `seed`, `ignore_eos`,
`stream`, `stream_options.include_usage`; `model` is accepted and ignored; other sampling
fields are ignored. Only float32 on CPU.

    python scripts/peer/hf_static_server.py --model DIR --port 0 --batch-size 8 --threads 2
    # prints "ready http://127.0.0.1:PORT" on stdout once listening
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import json
import logging
import time
import uuid
from typing import Any, Callable

from aiohttp import web

log = logging.getLogger("hf_static_server")
_Emit = Callable[[list[tuple["Job", int, str, str | None]]], None]


@dataclasses.dataclass(eq=False)
class Job:
    """One request: its inputs, and a queue of (token id, text delta, finish reason)."""

    ids: list[int]
    max_tokens: int
    temperature: float
    ignore_eos: bool
    seed: int | None
    queue: asyncio.Queue[tuple[int, str, str | None]] = dataclasses.field(
        default_factory=asyncio.Queue)
    cancelled: bool = False  # set by the handler when its client goes away


class BadRequest(ValueError):
    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.param = param


class StaticBatchServer:
    def __init__(self, model_dir: str, batch_size: int, batch_timeout: float):
        import torch
        import transformers

        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32).eval()
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
        self.name = model_dir
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.model.config.eos_token_id
        self.eos_ids = set([eos] if isinstance(eos, int) else (eos or []))
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (min(self.eos_ids) if self.eos_ids else 0)
        self.vocab_size = self.model.config.vocab_size
        self.max_len = self.model.config.max_position_embeddings
        self.batch_size = batch_size
        self.batch_timeout = batch_timeout
        self.pending: asyncio.Queue[Job] = asyncio.Queue()
        self.worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hf-forward")
        self.app = web.Application()
        self.app.router.add_post("/v1/completions", self.completions)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_get("/health", self.health)

    # ----------------------------------------------------------------------- batching
    async def batcher(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self.pending.get()]
            deadline = loop.time() + self.batch_timeout
            while len(batch) < self.batch_size:
                try:
                    batch.append(await asyncio.wait_for(self.pending.get(),
                                                        max(0.0, deadline - loop.time())))
                except asyncio.TimeoutError:
                    break
            batch = [j for j in batch if not j.cancelled]
            if not batch:
                continue
            log.info("batch of %d requests, prompt lengths %s", len(batch),
                     [len(j.ids) for j in batch])

            def emit(items: list[tuple[Job, int, str, str | None]]) -> None:
                loop.call_soon_threadsafe(_deliver, items)

            try:
                await loop.run_in_executor(self.worker, self.run_batch, batch, emit)
            except Exception as e:  # noqa: BLE001 - fail this batch, keep serving
                log.exception("batch failed")
                _deliver([(j, -1, "", f"error: {e!r}") for j in batch])

    def run_batch(self, batch: list[Job], emit: _Emit) -> None:
        """Prefill + decode loop for one static batch (worker thread)."""
        torch = self.torch
        B, L = len(batch), max(len(j.ids) for j in batch)
        input_ids = torch.full((B, L), self.pad_id, dtype=torch.long)
        mask = torch.zeros((B, L), dtype=torch.long)
        for i, j in enumerate(batch):
            input_ids[i, L - len(j.ids):] = torch.tensor(j.ids)
            mask[i, L - len(j.ids):] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        gens = [torch.Generator().manual_seed(j.seed) if j.seed is not None else None
                for j in batch]
        out_ids: list[list[int]] = [[] for _ in batch]
        sent = [""] * B
        done = [False] * B
        with torch.inference_mode():
            out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                             use_cache=True)
            last = positions[:, -1]
            for _ in range(max(j.max_tokens for j in batch)):
                logits = out.logits[:, -1, :].float()
                tokens = [self._sample(logits[i], batch[i].temperature, gens[i])
                          for i in range(B)]
                items = []
                for i, j in enumerate(batch):
                    if done[i] or j.cancelled:
                        done[i] = True
                        continue
                    tok = tokens[i]
                    out_ids[i].append(tok)
                    reason = None
                    if tok in self.eos_ids and not j.ignore_eos:
                        reason = "stop"
                        delta = ""  # the EOS token's own text is never shown
                    else:
                        text = self.tokenizer.decode(out_ids[i], skip_special_tokens=True)
                        delta = ""
                        if not text.endswith("\ufffd"):  # hold back partial UTF-8
                            delta, sent[i] = text[len(sent[i]):], text
                    if reason is None and len(out_ids[i]) >= j.max_tokens:
                        reason = "length"
                    done[i] = reason is not None
                    items.append((j, tok, delta, reason))
                if items:
                    emit(items)
                if all(done):
                    break
                mask = torch.cat([mask, torch.ones((B, 1), dtype=torch.long)], dim=1)
                last = last + 1
                out = self.model(input_ids=torch.tensor(tokens, dtype=torch.long)[:, None],
                                 attention_mask=mask, position_ids=last[:, None],
                                 past_key_values=out.past_key_values, use_cache=True)

    def _sample(self, logits: Any, temperature: float, gen: Any) -> int:
        if temperature == 0:
            return int(logits.argmax())
        probs = self.torch.softmax(logits / temperature, dim=-1)
        return int(self.torch.multinomial(probs, 1, generator=gen))

    # ----------------------------------------------------------------------- HTTP
    def parse(self, body: object) -> tuple[Job, bool, bool]:
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object", None)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str) and prompt:
            ids = self.tokenizer(prompt)["input_ids"]
        elif isinstance(prompt, list) and prompt and all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size
                for t in prompt):
            ids = list(prompt)
        else:
            raise BadRequest("prompt must be a non-empty string or a list of token ids in "
                             f"[0, {self.vocab_size})", "prompt")
        max_tokens = body.get("max_tokens", 16)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1 \
                or len(ids) + max_tokens > self.max_len:
            raise BadRequest(f"max_tokens={max_tokens!r} must be an integer in [1, "
                             f"{self.max_len - len(ids)}]", "max_tokens")
        temperature = body.get("temperature", 1.0)
        if temperature is None:
            temperature = 1.0
        if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) \
                or temperature < 0:
            raise BadRequest(f"temperature={temperature!r} must be a number >= 0",
                             "temperature")
        seed = body.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise BadRequest(f"seed={seed!r} must be an integer", "seed")
        options = body.get("stream_options") or {}
        job = Job(ids, max_tokens, float(temperature), bool(body.get("ignore_eos")), seed)
        return job, bool(body.get("stream")), bool(options.get("include_usage"))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            job, stream, include_usage = self.parse(await request.json())
        except BadRequest as e:
            return _error(400, str(e), e.param)
        except ValueError:
            return _error(400, "the request body is not valid JSON", None)
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                "created": int(time.time()), "model": self.name}
        usage = {"prompt_tokens": len(job.ids), "completion_tokens": 0, "total_tokens": 0}
        self.pending.put_nowait(job)
        resp: web.StreamResponse | None = None
        try:
            if not stream:
                text, reason = "", None
                while reason is None:
                    tok, delta, reason = await job.queue.get()
                    text += delta
                    usage["completion_tokens"] += tok >= 0
                usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
                return web.json_response({**head, "usage": usage, "choices": [
                    {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}]})
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
            await resp.prepare(request)
            reason = None
            while reason is None:
                tok, delta, reason = await job.queue.get()
                usage["completion_tokens"] += tok >= 0
                await resp.write(_sse({**head, "choices": [
                    {"index": 0, "text": delta, "logprobs": None, "finish_reason": reason}]}))
            if include_usage:
                usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
                await resp.write(_sse({**head, "choices": [], "usage": usage}))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        except ConnectionError:  # the client went away mid-stream
            return resp if resp is not None else web.Response(status=499)
        finally:
            job.cancelled = True  # no-op once finished; a gone client stops counting

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.name, "object": "model", "created": 0, "owned_by": "hf-static"}]})

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})


def _deliver(items: list[tuple[Job, int, str, str | None]]) -> None:
    for job, tok, delta, reason in items:
        job.queue.put_nowait((tok, delta, reason))


def _sse(obj: object) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _error(status: int, message: str, param: str | None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "invalid_request_error",
                                        "param": param, "code": None}}, status=status)


async def serve(args: argparse.Namespace) -> None:
    server = StaticBatchServer(args.model, args.batch_size, args.batch_timeout)
    runner = web.AppRunner(server.app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    port = runner.addresses[0][1]
    batcher = asyncio.ensure_future(server.batcher())
    print(f"ready http://{args.host}:{port}", flush=True)
    try:
        await asyncio.Event().wait()  # until the process is killed / interrupted
    finally:
        batcher.cancel()
        await runner.cleanup()
        server.worker.shutdown(wait=False, cancel_futures=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF model directory (config, safetensors, "
                   "tokenizer)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument("--batch-size", type=int, default=8, help="requests per static batch")
    p.add_argument("--batch-timeout", type=float, default=0.05,
                   help="seconds to wait for more requests after the first (default 0.05)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = p.parse_args(argv)
    if args.batch_size < 1 or args.batch_timeout < 0:
        p.error("--batch-size must be >= 1 and --batch-timeout >= 0")
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        asyncio.run(serve(args))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
