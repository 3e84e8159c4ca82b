"""A server started with a speculative config (n-gram lookup by default; a draft model and an
EAGLE-3 head in the slow tier) streams what it generates without speculation, over gRPC and
OpenAI HTTP, and reports what it speculated: the spec_decode families on /metrics and the
draft / accepted counts in each gRPC Timing. Oracle: the same
request opted out (`speculative: false`: no draft, one token per step) on the same server;
greedy and seeded sampled requests give the same tokens with or without speculation (the
engine's tests check that against the rollout and an engine without a speculative config:
tests/engine/test_speculation_model.py).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.engine_fixtures import FEW_TOKEN_BUCKETS, tiny_engine, tiny_model
from support.probes import wait_pages_free
from support.tiers import slow

from jaxserve import SamplingParams
from jaxserve.config import SpeculativeConfig
from jaxserve.models import tiny
from jaxserve.models.hf_loader import save_hf_dir
from jaxserve.server.background import BackgroundServer
from jaxserve.server.client import Client, fold
from jaxserve.server.config import ServerConfig
from jaxserve.serving.served import ServedModel

CFG = dict(max_num_seqs=8, max_num_batched_tokens=64, page_size=4, max_model_len=96,
           token_buckets=FEW_TOKEN_BUCKETS)
SPEC = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3,
                                    "prompt_lookup_min": 1, "prompt_lookup_max": 3})
BASE = [5, 6, 7, 8, 9, 10]
REQUESTS = [(BASE * 3 + BASE[:3], SamplingParams(temperature=0.0, max_tokens=30,
                                                  ignore_eos=True)),
            (BASE * 2 + [11, 5, 6], SamplingParams(temperature=0.9, top_p=0.9, seed=4,
                                                   max_tokens=30, ignore_eos=True))]


def method_spec(method: str, root: pathlib.Path) -> SpeculativeConfig:
    """`SPEC`, or a draft_model / eagle3 config over a checkpoint written under `root`."""
    if method == "ngram":
        return SPEC
    if method == "draft_model":
        draft = tiny_model(seed=1)
        path = root / "draft"
        save_hf_dir(path, draft.config, draft.params)
        tiny.save_word_tokenizer(path, draft.config.vocab_size)
    else:
        from support.eagle3_oracle import HEAD_CONFIG, random_weights, write_head  # torch

        head = HEAD_CONFIG | {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}  # 2 layers
        path = write_head(root / "head", head, random_weights(head, seed=3))
    return SpeculativeConfig.from_dict({"method": method, "model": str(path),
                                        "num_speculative_tokens": 3})


@pytest.fixture(scope="module", params=["ngram", pytest.param("draft_model", marks=slow(
    "the server maps the same fields whatever the method; the draft model's engine is "
    "tested in tests/serving/test_spec_draft_build.py")), pytest.param("eagle3", marks=slow(
    "as the draft model's; the head's engine: tests/serving/test_spec_eagle3_build.py"))])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> BackgroundServer:
    spec = method_spec(request.param, tmp_path_factory.mktemp("spec"))
    srv = BackgroundServer(ServerConfig(port=0, http_port=0, metrics_port=0),
                           lambda: ServedModel(tiny_engine(speculative_config=spec, **CFG),
                                               "tiny", "hf")).start()
    yield srv
    srv.stop()


def metric(server: BackgroundServer, name: str) -> float:
    url = f"http://127.0.0.1:{server.server.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name)


def test_grpc_and_http_equal_the_requests_opted_out(server: BackgroundServer) -> None:
    with Client(server.target) as client:
        got = [fold(list(client.stream(p, sp)))[0] for p, sp in REQUESTS]
        off = [fold(list(client.stream(p, dataclasses.replace(sp, speculative=False))))[0]
               for p, sp in REQUESTS]
    assert [g.token_ids for g in got] == [o.token_ids for o in off]
    assert sum(g.timing.spec_num_draft_tokens for g in got) > 0
    assert all(0 <= g.timing.spec_num_accepted_tokens <= g.timing.spec_num_draft_tokens
               for g in got)
    assert all(o.timing.spec_num_draft_tokens == 0 for o in off)
    prompt, params = REQUESTS[0]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": params.max_tokens,
            "temperature": 0.0, "ignore_eos": True}
    req = urllib.request.Request(f"http://127.0.0.1:{server.server.http_port}/v1/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        doc = json.loads(resp.read())
    assert doc["choices"][0]["text"] == off[0].text
    wait_pages_free(server)
    assert metric(server, "jaxserve:spec_decode_num_draft_tokens_total") > 0
    assert metric(server, "jaxserve:spec_decode_acceptance_length_count") == \
        metric(server, "jaxserve:spec_decode_num_drafts_total") > 0
