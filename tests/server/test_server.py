"""The gRPC server end to end: a real server on 127.0.0.1 (free port), real channels, a tiny
random model. The oracle is the offline Engine (what `LLM.generate` drives) with the same
config, model and seeds: every stream must carry exactly its tokens and text."""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
import pytest
from support.engine_fixtures import tiny_engine, tiny_logprob_atol
from support.grpc_streams import check_stream_shape
from support.openai_front import CONFIG
from support.probes import wait_pages_free
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from jaxserve import SamplingParams
from jaxserve.server.background import BackgroundServer
from jaxserve.server.client import AsyncClient, Client, fold
from jaxserve.server.config import ServerConfig
from jaxserve.serving.served import ServedModel


@pytest.fixture(scope="module")
def server() -> BackgroundServer:
    srv = BackgroundServer(ServerConfig(port=0, http_port=None, metrics_port=0),
                           lambda: ServedModel(tiny_engine(**CONFIG), "tiny", "hf")).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def oracle():  # noqa: ANN201 - an Engine
    return tiny_engine(**CONFIG)


def offline(engine, requests) -> list:  # noqa: ANN001
    """The offline API's loop (LLM._run): add everything, step to completion."""
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"o{i}", prompt, params)
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return [finals[f"o{i}"] for i in range(len(requests))]


def engine_of(server: BackgroundServer):  # noqa: ANN201
    return server.server.engine.engine


REQUESTS = [
    ("w5 w9 w33 w7", SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)),
    ([3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19],
     SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=20, logprobs=3)),
    ([40] * 30, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)),
    ("w100 w101", SamplingParams(temperature=0.7, top_k=20, repetition_penalty=1.2, seed=1,
                                 max_tokens=16, stop=["w7"], ignore_eos=True)),
    ([42], SamplingParams(temperature=0.0, max_tokens=8, min_tokens=3)),
    ("w5 w9", SamplingParams(temperature=0.9, seed=3, max_tokens=8, ignore_eos=True,
                             logit_bias={7: 3.0, 9: -100.0, 30: 0.5})),
]


def test_streams_equal_offline_api(server: BackgroundServer, oracle) -> None:  # noqa: ANN001
    expected = offline(oracle, REQUESTS)

    async def collect(call) -> list:  # noqa: ANN001
        return [m async for m in call]

    async def main() -> list:
        async with AsyncClient(server.target) as client:
            return await asyncio.gather(*(collect(client.stream(p, sp)) for p, sp in REQUESTS))

    results = asyncio.run(main())
    for (prompt, params), want, msgs in zip(REQUESTS, expected, results):
        check_stream_shape(msgs, params.n)
        got = fold(msgs)
        assert len(got) == params.n
        for g, w in zip(got, want.outputs):
            assert g.token_ids == w.token_ids, prompt
            assert g.text == w.text, prompt
            assert g.finish_reason == w.finish_reason.name
            assert g.usage.prompt_tokens == len(want.prompt_token_ids)
            assert g.usage.completion_tokens == len(w.token_ids)
            t = g.timing
            assert 0 <= t.queue_s <= t.ttft_s <= t.e2e_s and t.decode_s <= t.e2e_s
            if params.logprobs is not None:
                assert [lp.token_id for lp in g.logprobs] == w.token_ids
                for lp, entry in zip(g.logprobs, w.logprobs):
                    # Batch neighbours change XLA's float summation order: within
                    # tiny_logprob_atol (derived from the test model's weights; the wire's
                    # float32 field is exact for the engine's float32 logprobs).
                    assert {lp.token_id: lp.logprob, **{t.token_id: t.logprob for t in lp.top}} \
                        == pytest.approx(entry, abs=tiny_logprob_atol())
    wait_pages_free(server)


def test_logit_bias_forces_a_token(server: BackgroundServer, oracle) -> None:  # noqa: ANN001
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True,
                            logit_bias={123: 100.0})
    want = offline(oracle, [([42, 43], params)])[0].outputs[0].token_ids
    with Client(server.target) as client:
        got = fold(list(client.stream([42, 43], params)))[0].token_ids
    assert got == want == [123] * 5


def test_chat_tokenize_and_model_info(server: BackgroundServer, oracle) -> None:  # noqa: ANN001
    messages = [{"role": "system", "content": "w3"}, {"role": "user", "content": "w8 w9"}]
    ids = oracle.tokenizer.apply_chat_template(messages, True, tokenize=True)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    want = offline(oracle, [(ids, params)])[0].outputs[0]
    with Client(server.target) as client:
        assert client.tokenize(messages=messages) == list(ids)
        assert client.tokenize("w5 w6") == oracle.tokenizer.encode("w5 w6")
        got = client.generate(messages=messages, params=params)[0]
        info = client.model_info()
    assert got.token_ids == want.token_ids and got.text == want.text
    assert (info.model, info.vocab_size, info.max_model_len, info.page_size) == \
        ("tiny", 211, 512, 8)
    assert info.num_kv_pages == oracle.scheduler.allocator.num_usable_pages
    assert list(info.chat_roles) == ["system", "user", "assistant", "tool", "developer"]


def test_32_concurrent_streams(server: BackgroundServer, oracle) -> None:  # noqa: ANN001
    requests = [([3 + (7 * i + j) % 200 for j in range(5 + i % 23)],
                 SamplingParams(temperature=0.0, max_tokens=4 + i % 9, ignore_eos=True))
                for i in range(32)]
    expected = offline(oracle, requests)

    async def main() -> list:
        async with AsyncClient(server.target) as client:
            return await asyncio.gather(*(client.generate(p, sp) for p, sp in requests))

    results = asyncio.run(main())
    assert [r[0].token_ids for r in results] == [e.outputs[0].token_ids for e in expected]
    wait_pages_free(server)


def test_stream_interval_coalesces_chunks(oracle) -> None:  # noqa: ANN001
    from jaxserve.server.proto_map import ResponseBuilder

    builder = ResponseBuilder(stream_interval=4)
    oracle.add_request("si", [5, 6, 7], SamplingParams(n=2, seed=3, max_tokens=11,
                                                       ignore_eos=True))
    msgs = []
    while oracle.has_unfinished():
        for out in oracle.step():
            msgs += builder.responses(out)
            final = out
    check_stream_shape(msgs, 2)
    for index, got in enumerate(fold(msgs)):
        assert got.token_ids == final.outputs[index].token_ids
        assert got.text == final.outputs[index].text
        sizes = [len(m.chunk.token_ids) for m in msgs
                 if m.HasField("chunk") and m.chunk.index == index]
        assert sizes == [1, 4, 4, 2]  # the first token at once, then 4 at a time, then the rest


LONG = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)


def assert_aborted_early(server: BackgroundServer, before: dict) -> None:
    """The request ended as ABORT in the engine, long before its 500 tokens."""
    after = scrape(server)
    key = ("jaxserve:request_success_total", (("finished_reason", "abort"),))
    assert after.get(key, 0) - before.get(key, 0) == 1
    gen = ("jaxserve:generation_tokens_total", ())
    assert after[gen] - before[gen] < LONG.max_tokens


def test_cancel_mid_stream_frees_every_page(server: BackgroundServer) -> None:
    before = scrape(server)
    with Client(server.target) as client:
        call = client.stream([5, 6, 7, 8], LONG)
        # No request_id given: the server assigned one and says which.
        assert dict(call.initial_metadata())["x-request-id"].startswith("req-")
        chunks = 0
        for msg in call:
            assert msg.HasField("chunk")
            chunks += 1
            if chunks == 2:
                break
        assert engine_of(server).scheduler.allocator.usage > 0
        call.cancel()
        wait_pages_free(server)
        assert_aborted_early(server, before)
        # The server carries on.
        assert client.generate([5], SamplingParams(max_tokens=2))[0].finish_reason == "LENGTH"


def test_disconnect_frees_every_page(server: BackgroundServer) -> None:
    before = scrape(server)
    client = Client(server.target)
    call = client.stream([9, 10, 11], LONG)
    assert next(call).HasField("chunk")
    client.close()  # the connection goes away mid-stream
    wait_pages_free(server)
    assert_aborted_early(server, before)


def test_deadline_aborts_the_request(server: BackgroundServer) -> None:
    before = scrape(server)
    with Client(server.target) as client:
        with pytest.raises(grpc.RpcError) as err:
            for _ in client.stream([12, 13], LONG, timeout=0.15):
                pass
    assert err.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    wait_pages_free(server)
    assert_aborted_early(server, before)


def test_health_and_reflection(server: BackgroundServer) -> None:
    with grpc.insecure_channel(server.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", "jaxserve.v1.Generation"):
            status = health.Check(health_pb2.HealthCheckRequest(service=name)).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        resp = next(refl.ServerReflectionInfo(iter([
            reflection_pb2.ServerReflectionRequest(list_services="")])))
        names = {s.name for s in resp.list_services_response.service}
        assert {"jaxserve.v1.Generation", "grpc.health.v1.Health"} <= names
        resp = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
            file_containing_symbol="jaxserve.v1.Generation")])))
        fd = descriptor_pb2.FileDescriptorProto.FromString(
            resp.file_descriptor_response.file_descriptor_proto[0])
        assert fd.package == "jaxserve.v1"
        assert [m.name for m in fd.service[0].method] == ["Generate", "Tokenize", "GetModelInfo"]


def scrape(server: BackgroundServer) -> dict:
    url = f"http://127.0.0.1:{server.server.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    values = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            values[(s.name, labels)] = s.value
    return values


def test_metrics_endpoint_counts_requests(server: BackgroundServer) -> None:
    wait_pages_free(server)
    before = scrape(server)
    with Client(server.target) as client:
        got = client.generate([5, 6, 7], SamplingParams(max_tokens=7, ignore_eos=True))[0]
    assert got.finish_reason == "LENGTH"
    wait_pages_free(server)
    after = scrape(server)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)

    assert delta("jaxserve:generation_tokens_total") == 7
    assert delta("jaxserve:prompt_tokens_total") == 3
    assert delta("jaxserve:request_success_total", finished_reason="length") == 1
    assert delta("jaxserve:time_to_first_token_seconds_count") == 1
    assert delta("jaxserve:e2e_request_latency_seconds_count") == 1
    assert delta("jaxserve:request_queue_time_seconds_count") == 1
    assert delta("jaxserve:time_per_output_token_seconds_count") == 1
    assert delta("jaxserve:inter_token_latency_seconds_count") == 6
    assert delta("jaxserve:iteration_tokens_total_count") >= 7  # prefill + 6 decodes
    assert delta("jaxserve:prefix_cache_queries_total") >= 0
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                  "compiles_after_warmup"):
        assert (f"jaxserve:{gauge}", ()) in after
    # The gauge mirrors the engine's compile guard (whether it stays 0 is the engine's test).
    assert after[("jaxserve:compiles_after_warmup", ())] == \
        engine_of(server).runner.compiles_after_warmup
    assert after[("jaxserve:kv_cache_usage_perc", ())] == 0
