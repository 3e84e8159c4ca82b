"""Fixtures shared by several engine test modules (session-scoped: built once per pytest
process, each warmup's compiles paid once).

`small_llm`: the offline API over a small tiny engine (4 sequences, a 32-token step, 8-token
pages, 128 positions) of `support.engine_fixtures.tiny_model()`: test_logit_bias's and
test_token_filter's, whose oracles roll the same model out. Each test drives its requests to
completion, so the next finds the engine idle."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
from support.engine_fixtures import tiny_engine, tiny_model

from jaxserve import LLM

SMALL_CONFIG = dict(max_num_seqs=4, max_num_batched_tokens=32, page_size=8, max_model_len=128)


@pytest.fixture(scope="session")
def small_llm() -> Iterator[LLM]:
    obj = LLM.__new__(LLM)  # LLM() loads a checkpoint; the facade's own code is what is used
    obj.engine = tiny_engine(tiny_model(), **SMALL_CONFIG)
    obj.config = obj.engine.config
    obj._ids = itertools.count()
    yield obj
    obj.close()
