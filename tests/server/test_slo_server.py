"""SLO targets through the servers (fake engine, real fronts on 127.0.0.1).

With `slo_admission="reject"`, a request whose TTFT forecast passes its priority level's
target is refused with HTTP 429 (`code` slo_unattainable, a Retry-After header) or gRPC
RESOURCE_EXHAUSTED, both carrying the predicted time; a level whose target the forecast meets
is served; the engine carries on, no page leaks, and /metrics counts the refusals and shows
the step-time model's series. The forecast's oracle: a step-time model seeded with a law in
which every step takes 0.5 s or more, so any prompt's first token is predicted past 0.01 s
and before 1,000 s.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.fake_engines import GREEDY, arithmetic, fake_engine
from support.probes import wait_pages_free

from jaxserve import SamplingParams
from jaxserve.engine.step_time_model import StepFeatures
from jaxserve.server.background import BackgroundServer
from jaxserve.server.client import Client
from jaxserve.server.config import ServerConfig
from jaxserve.serving.served import ServedModel


def _engine():  # noqa: ANN202
    engine = fake_engine(ttft_slo="0=1000,1=0.01", itl_slo=5.0, slo_admission="reject")
    engine.scheduler.budget.model.seed(
        [(StepFeatures(t, min(t, 4), 0), 0.5 + 0.01 * t) for t in (1, 8, 32, 64)])
    return engine


@pytest.fixture(scope="module")
def server() -> BackgroundServer:
    srv = BackgroundServer(ServerConfig(port=0, http_port=0, metrics_port=0,
                                        client_priority_range=(0, 1)),
                           lambda: ServedModel(_engine(), "fake")).start()
    yield srv
    srv.stop()


def _metrics(server: BackgroundServer) -> dict[tuple, float]:
    url = f"http://127.0.0.1:{server.server.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def _http(server: BackgroundServer, priority: int, chat: bool = False
          ) -> tuple[int, dict, dict]:
    body = {"model": "fake", "max_tokens": 3, "temperature": 0.0, "priority": priority}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if chat else
                {"prompt": [5, 6, 7]})
    path = "/v1/chat/completions" if chat else "/v1/completions"
    req = urllib.request.Request(f"http://127.0.0.1:{server.server.http_port}{path}",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def test_a_forecast_ttft_miss_is_refused_with_the_predicted_wait(server: BackgroundServer
                                                                  ) -> None:
    status, headers, doc = _http(server, priority=1)
    assert status == 429, doc
    assert doc["error"]["code"] == "slo_unattainable"
    assert "0.01 s for priority 1" in doc["error"]["message"]
    assert int(headers["Retry-After"]) >= 1
    status, _, doc = _http(server, priority=1, chat=True)  # chat reads priority too
    assert status == 429 and doc["error"]["code"] == "slo_unattainable", doc
    with Client(server.target) as client:
        with pytest.raises(grpc.RpcError) as err:
            list(client.stream([5, 6], SamplingParams(max_tokens=2), priority=1))
        assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "s predicted" in err.value.details()
        served = list(client.stream([8, 9], SamplingParams(max_tokens=4, **GREEDY)))
    assert [t for m in served if m.HasField("chunk") for t in m.chunk.token_ids] == \
        arithmetic([8, 9], 4)
    status, _, doc = _http(server, priority=0)
    assert status == 200 and doc["choices"][0]["finish_reason"] == "length"
    wait_pages_free(server)
    m = _metrics(server)
    refused = [v for (name, labels), v in m.items()
               if name == "jaxserve:slo_ttft_unattainable_total"
               and ("priority", "1") in labels]
    assert refused == [3.0]
    met = [v for (name, labels), v in m.items() if name == "jaxserve:slo_requests_total"
           and ("priority", "0") in labels and ("slo", "ttft") in labels
           and ("outcome", "met") in labels]
    assert met == [2.0]
    assert any(name == "jaxserve:slo_step_time_measured_seconds" and v > 0
               for (name, _), v in m.items())
    assert any(name == "jaxserve:slo_step_token_budget_count" and v > 0
               for (name, _), v in m.items())
