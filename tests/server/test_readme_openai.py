"""The README's `openai` SDK examples (chat; structured output), run as written against a
live server (tiny model, HTTP on a free loopback port; only the base_url is substituted), so
they cannot rot.

Oracle: the offline `LLM.chat` over an engine with the same config, greedy, the same messages
and token budget: the example must print exactly that text.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import pathlib
import re

import pytest
from support.engine_fixtures import tiny_engine
from support.fake_engines import bpe_engine
from support.openai_front import CONFIG

from jaxserve import SamplingParams
from jaxserve.server.background import BackgroundServer
from jaxserve.server.config import ServerConfig
from jaxserve.serving.served import ServedModel

pytest.importorskip("openai")
README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
URL = "http://127.0.0.1:8000/v1"


def readme_example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    sdk = [b for b in blocks if "from openai import OpenAI" in b]
    assert len(sdk) == 1, "the README has one openai SDK example"
    return sdk[0]


def test_readme_openai_chat_example_runs(llm) -> None:  # noqa: ANN001
    code = readme_example()
    assert code.count(URL) == 1 and "stream=True" in code
    assert len(code.strip().splitlines()) <= 12  # the README promises a short example
    with BackgroundServer(ServerConfig(port=0, http_port=0),
                          lambda: ServedModel(tiny_engine(**CONFIG), "tiny", "hf")) as srv:
        live = code.replace(URL, f"http://127.0.0.1:{srv.server.http_port}/v1")
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compile(live, "README.md:openai-example", "exec"), {})  # noqa: S102
    messages = re.search(r"messages=(\[.*?\]),\n", code, re.S)
    assert messages is not None
    greedy = SamplingParams(max_tokens=64, temperature=0)
    want = llm.chat(ast.literal_eval(messages.group(1)), greedy, use_tqdm=False)[0]
    want = want.outputs[0].text
    assert want and printed.getvalue() == want + "\n"


def test_readme_structured_output_example_runs() -> None:
    """The README's response_format example (it reuses the chat example's `client`), run
    against a server whose fake engine speaks a byte-level BPE tokenizer: it must print a
    dict that validates against the example's own schema."""
    import jsonschema

    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    [code] = [b for b in blocks if "response_format" in b and "client." in b]
    assert "from openai import OpenAI" not in code  # a continuation of the chat example
    with BackgroundServer(ServerConfig(port=0, http_port=0),
                          lambda: ServedModel(bpe_engine(), "tiny", "hf")) as srv:
        url = f"http://127.0.0.1:{srv.server.http_port}/v1"
        setup = f"from openai import OpenAI\nclient = OpenAI(base_url={url!r}, api_key='x')\n"
        scope: dict = {}
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compile(setup + code, "README.md:structured-example", "exec"), scope)  # noqa: S102
    assert printed.getvalue().startswith("{")
    jsonschema.validate(json.loads(scope["reply"].choices[0].message.content), scope["schema"])
