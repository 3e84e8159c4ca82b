"""scripts/peer/hf_static_server.py as a real subprocess on a free port: three concurrent streaming
greedy requests share one static batch (different prompt lengths: left padding; different
max_tokens: members finish at different steps), and each stream must carry exactly what
transformers' own `generate` produces for that prompt alone."""

from __future__ import annotations

import asyncio
import json
import pathlib
import queue
import subprocess
import sys
import threading

import aiohttp
from support.hf_models import build_hf_model, save_tiny_tokenizer

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "peer" / "hf_static_server.py"
READY_TIMEOUT_S = 120.0


def wait_ready(proc: subprocess.Popen) -> str:
    """The URL from the script's `ready http://HOST:PORT` line (other lines skipped)."""
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.put(line)
        lines.put("")

    threading.Thread(target=pump, daemon=True).start()
    while True:
        try:
            line = lines.get(timeout=READY_TIMEOUT_S)
        except queue.Empty:
            raise AssertionError("the server printed no ready line in time") from None
        if not line:
            raise AssertionError(f"the server exited with {proc.wait()}")
        if line.startswith("ready "):
            return line.split()[1]


async def stream(url: str, body: dict) -> list:
    events = []
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            async for line in resp.content:
                line = line.decode().strip()
                if line.startswith("data: "):
                    payload = line[len("data: "):]
                    events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def test_static_batch_streams_equal_hf_generate(tmp_path: pathlib.Path) -> None:
    import torch
    import transformers

    model = build_hf_model("llama2_mha", tmp_path)
    save_tiny_tokenizer(tmp_path, 211)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    requests = [
        ({"prompt": "w5 w9 w33 w7 w8 w100", "max_tokens": 12}, None),
        ({"prompt": [17, 18], "max_tokens": 5}, [17, 18]),
        ({"prompt": ["w40 w41 w42"], "max_tokens": 9}, None),
    ]
    expected = []
    for body, ids in requests:
        prompt = body["prompt"][0] if isinstance(body["prompt"], list) and \
            isinstance(body["prompt"][0], str) else body["prompt"]
        ids = ids or tok(prompt)["input_ids"]
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                                 dtype=torch.long), max_new_tokens=body["max_tokens"],
                                 do_sample=False, pad_token_id=0)
        gen = out[0, len(ids):].tolist()
        expected.append((len(ids), gen, tok.decode(gen, skip_special_tokens=True)))

    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--model", str(tmp_path), "--port",
                             "0", "--batch-size", "4", "--batch-timeout", "0.5",
                             "--threads", "1"], stdout=subprocess.PIPE,
                            stderr=(tmp_path / "stderr.txt").open("w"), text=True)
    try:
        url = wait_ready(proc)

        async def main() -> list:
            return await asyncio.gather(*(stream(url, {
                "model": "x", **body, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}) for body, _ in requests))

        results = asyncio.run(main())
    finally:
        proc.kill()
        proc.wait(30)
    log = (tmp_path / "stderr.txt").read_text()
    assert "batch of 3 requests" in log, log  # one static batch for all three
    for (n_prompt, gen, text), events in zip(expected, results):
        *chunks, usage, done = events
        assert done == "[DONE]"
        assert len(chunks) == len(gen)  # one event per generated token
        assert all(c["object"] == "text_completion" and len(c["choices"]) == 1
                   for c in chunks)
        assert "".join(c["choices"][0]["text"] for c in chunks) == text
        reasons = [c["choices"][0]["finish_reason"] for c in chunks]
        assert reasons[:-1] == [None] * (len(gen) - 1)
        assert reasons[-1] == ("stop" if gen[-1] == 2 else "length")
        assert usage["choices"] == []
        assert usage["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": len(gen),
                                  "total_tokens": n_prompt + len(gen)}
