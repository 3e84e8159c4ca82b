"""One real tiny engine behind both fronts with LoRA on: a PEFT adapter loaded at runtime over
HTTP runs on the device and the fronts' tokens are the offline API's for the same adapter on
the same engine (the offline path is checked against HF transformers with the adapter merged
in tests/serving/test_lora_llm.py; this checks what the servers add: resolution, runtime
load through the real PEFT loader, the request's adapter reaching the step), base requests
beside it keep the base tokens, and after the unload the name is a 404 / NOT_FOUND."""

from __future__ import annotations

import asyncio
import pathlib

import aiohttp
import grpc
import pytest
from support.engine_fixtures import tiny_engine
from support.http_clients import call
from support.lora_fakes import write_peft_dir
from support.openai_front import CONFIG
from support.tiers import slow

from jaxserve import LoRARequest, SamplingParams
from jaxserve.lora_config import LoRAConfig
from jaxserve.server.background import BackgroundServer
from jaxserve.server.client import Client
from jaxserve.server.config import ServerConfig
from jaxserve.serving.served import ServedModel

PROMPT = [11, 12, 13, 14, 15]
TOKENS = 6
GREEDY = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)


async def post_text(where: str, body: dict) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session:
        async with session.post(where, json=body) as resp:
            return resp.status, await resp.text()


def offline(engine, lora: LoRARequest | None) -> list[int]:  # noqa: ANN001
    engine.add_request("o", PROMPT, GREEDY, lora_request=lora)
    final = None
    while engine.has_unfinished():
        final = next((o for o in engine.step() if o.finished), final)
    return list(final.outputs[0].token_ids)


@slow("a tiny engine with LoRA compiled for itself: ~20 s on 2 cores; the fronts' LoRA paths "
      "run in the default tier on fake-runner engines (test_lora_server.py)")
def test_runtime_adapter_through_both_fronts(tmp_path: pathlib.Path) -> None:
    path = str(write_peft_dir(tmp_path / "a", 0, rank=8, seed=7, std=0.5))
    engine = tiny_engine(**CONFIG, enable_prefix_caching=False,
                         lora_config=LoRAConfig(max_loras=1, max_lora_rank=8))
    # The oracle first, offline on the same engine: then the adapter is unloaded again.
    base = offline(engine, None)
    want = offline(engine, LoRARequest("a", 1, path))
    assert want != base  # the adapter changes the greedy tokens
    assert engine.remove_lora("a")
    compiles = engine.runner.compiles_after_warmup
    srv = BackgroundServer(ServerConfig(port=0, http_port=0, enable_admin=True),
                           lambda: ServedModel(engine, "tiny")).start()
    url = f"http://127.0.0.1:{srv.server.http_port}"
    body = {"prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}

    def http_text(model: str) -> tuple[int, str | dict]:
        status, got = asyncio.run(call(url, "/v1/completions", {**body, "model": model}))
        return status, got["choices"][0]["text"] if status == 200 else got

    try:
        assert http_text("a")[0] == 404
        status, text = asyncio.run(post_text(url + "/v1/load_lora_adapter",
                                             {"lora_name": "a", "lora_path": path}))
        assert (status, text) == (200, "Success: LoRA adapter 'a' added successfully.")
        text = engine.tokenizer.decode
        assert text(want) != text(base)
        assert http_text("a") == (200, text(want))
        assert http_text("tiny") == (200, text(base))
        with Client(srv.target) as c:
            assert c.generate(PROMPT, GREEDY, lora_name="a")[0].token_ids == want
            assert c.generate(PROMPT, GREEDY)[0].token_ids == base
            c.unload_lora_adapter("a")
            with pytest.raises(grpc.RpcError) as e:
                c.generate(PROMPT, GREEDY, lora_name="a")
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
        assert http_text("a")[0] == 404
        assert engine.runner.compiles_after_warmup == compiles  # adapters never recompile
    finally:
        srv.stop()
