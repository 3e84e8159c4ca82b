"""Fixtures shared by several server test modules.

Session-scoped: built once per pytest process (per xdist worker), each warmup's compiles
paid once instead of once per module, and shut down when the session ends. Each is pure for
its tests: a test drives every request it starts to completion (the server's tests wait for
its pages to drain, `support.probes.wait_pages_free`), so the next one, in this module or
another, finds it as a fresh one would be but for its prefix cache. Servers a single module
uses, or configured its own way, stay that module's (module-scoped, under their own names).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
from support.engine_fixtures import tiny_engine
from support.openai_front import CONFIG, SDK_KEY

from jaxserve import LLM
from jaxserve.server.background import BackgroundServer
from jaxserve.server.config import ServerConfig
from jaxserve.serving.served import ServedModel


@pytest.fixture(scope="session")
def llm() -> Iterator[LLM]:
    """The offline API over an engine like the OpenAI front servers' (support.openai_front's
    CONFIG): the oracle of test_openai_chat, _echo, _sdk, _serving, test_readme_openai and
    test_prompt_logprobs_grpc."""
    obj = LLM.__new__(LLM)  # LLM() loads a checkpoint; the facade's own code is what is tested
    obj.engine = tiny_engine(**CONFIG)
    obj.config = obj.engine.config
    obj._ids = itertools.count()
    yield obj
    obj.close()


@pytest.fixture(scope="session")
def sdk_server() -> Iterator[BackgroundServer]:
    """A server (gRPC + HTTP on free loopback ports) of CONFIG's tiny engine that asks for
    API key SDK_KEY: the `openai` SDK's peer in test_openai_sdk and test_openai_echo."""
    srv = BackgroundServer(ServerConfig(port=0, http_port=0, api_keys=(SDK_KEY,)),
                           lambda: ServedModel(tiny_engine(**CONFIG), "tiny", "hf")).start()
    yield srv
    srv.stop()
