"""Bad input, backpressure, auth, TLS and message limits over a real channel.

The engines here run the arithmetic fake runner (no model, no compile), so these tests are
about the server's behaviour, not the model's: every bad field gets INVALID_ARGUMENT naming the
field and its range, and the server keeps serving with every KV page free afterwards."""

from __future__ import annotations

import asyncio
import datetime
import re
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.fake_engines import GatedRunner, fake_engine

from jaxserve import SamplingParams
from jaxserve.server import stubs
from jaxserve.server.background import BackgroundServer
from jaxserve.server.client import AsyncClient, Client, pb2
from jaxserve.server.config import ServerConfig
from jaxserve.serving.served import ServedModel

DEADLINE_S = 20.0
KV_PAGES = 12  # 96 tokens of KV: less than one max_model_len (128) sequence


def start(engine, **cfg: object) -> BackgroundServer:  # noqa: ANN001
    return BackgroundServer(ServerConfig(port=0, http_port=None, **cfg),  # type: ignore[arg-type]
                            lambda: ServedModel(engine, "fake")).start()


@pytest.fixture(scope="module")
def server() -> BackgroundServer:
    probe = fake_engine()
    engine = fake_engine(kv_cache_memory=KV_PAGES * probe.plan.kv_bytes_per_page)
    srv = start(engine, max_message_bytes=64 << 10)
    yield srv
    srv.stop()


def request(**kw: object):  # noqa: ANN201 - a GenerateRequest
    sampling = kw.pop("sampling", {})
    sp = pb2.SamplingParams(**sampling)  # type: ignore[arg-type]
    return pb2.GenerateRequest(sampling=sp, **kw)  # type: ignore[arg-type]


def chat(*roles: str):  # noqa: ANN201
    return pb2.ChatMessages(messages=[pb2.ChatMessage(role=r, content="w5") for r in roles])


IDS = pb2.TokenIds(ids=[5, 6, 7])
BAD = [
    (request(), r"input is missing: set one of prompt, token_ids or chat"),
    (request(prompt=""), r"prompt must not be empty"),
    (request(token_ids=pb2.TokenIds()), r"token_ids.ids must not be empty"),
    (request(token_ids=pb2.TokenIds(ids=[5] * 200)),
     r"prompt has 200 tokens; max_model_len=128 allows at most 127"),
    (request(prompt="w5 " * 130), r"prompt has 130 tokens; max_model_len=128"),
    (request(token_ids=pb2.TokenIds(ids=[5, 999])),
     r"token_ids.ids\[1\]=999 is outside the vocabulary \[0, 211\)"),
    (request(token_ids=pb2.TokenIds(ids=[-1])), r"token_ids.ids\[0\]=-1 is outside"),
    (request(token_ids=IDS, sampling=dict(temperature=-0.5)),
     r"sampling.temperature=-0.5 must be 0 \(greedy\) or in \[1e-05, 100\]"),
    (request(token_ids=IDS, sampling=dict(temperature=float("nan"))),
     r"sampling.temperature=nan must be a finite number 0 \(greedy\) or in"),
    (request(token_ids=IDS, sampling=dict(temperature=float("inf"))),
     r"sampling.temperature=inf must be a finite number"),
    (request(token_ids=IDS, sampling=dict(top_p=0.0)), r"sampling.top_p=0.0 must be in \(0, 1\]"),
    (request(token_ids=IDS, sampling=dict(top_p=1.5)), r"sampling.top_p=1.5 must be in \(0, 1\]"),
    (request(token_ids=IDS, sampling=dict(top_k=2**31 - 1)),
     r"sampling.top_k=2147483647 must be -1 or 0 \(disabled\) or in \[1, 211\] \(the "
     r"vocabulary size\)"),
    (request(token_ids=IDS, sampling=dict(top_k=-2)), r"sampling.top_k=-2 must be -1"),
    (request(token_ids=IDS, sampling=dict(min_p=-0.25)),
     r"sampling.min_p=-0.25 must be in \[0, 1\]"),
    (request(token_ids=IDS, sampling=dict(min_p=1.5)), r"sampling.min_p=1.5 must be in \[0, 1\]"),
    (request(token_ids=IDS, sampling=dict(max_tokens=-1)),
     r"sampling.max_tokens=-1 must be an integer in \[0, "),
    (request(token_ids=IDS, sampling=dict(max_tokens=126)),
     r"sampling.max_tokens=126 is over the limit: .* max_tokens must be in \[0, 125\]"),
    (request(token_ids=IDS, sampling=dict(logprobs=21)),
     r"sampling.logprobs=21 must be an integer in \[0, 20\]"),
    (request(token_ids=IDS, sampling=dict(n=17)), r"sampling.n=17 must be an integer in \[1, 16\]"),
    (request(token_ids=IDS, sampling=dict(n=-1)), r"sampling.n=-1 must be an integer in \[1, 16\]"),
    (request(token_ids=IDS, sampling=dict(stop=["w9"] * 17)),
     r"sampling.stop has 17 strings; at most 16"),
    (request(token_ids=IDS, sampling=dict(stop=["x" * 257])),
     r"sampling.stop\[0\] is 257 characters long; at most 256"),
    (request(token_ids=IDS, sampling=dict(min_tokens=9, max_tokens=4)),
     r"sampling.min_tokens=9 must be <= max_tokens=4"),
    (request(token_ids=IDS, sampling=dict(repetition_penalty=0.0)),
     r"sampling.repetition_penalty=0.0 must be in \[0.01, 100\]"),
    (request(token_ids=IDS, sampling=dict(presence_penalty=2.5)),
     r"sampling.presence_penalty=2.5 must be in \[-2, 2\]"),
    (request(token_ids=IDS, sampling=dict(stop_token_ids=[-3])),
     r"sampling.stop_token_ids\[0\]=-3 must be an integer in \[0, 2147483647\]"),
    (request(chat=chat("user", "robot")),
     r"chat.messages\[1\].role='robot' must be one of system, user, assistant, tool"),
    (request(chat=chat()), r"chat.messages must not be empty"),
    (request(request_id="x" * 300, token_ids=IDS),
     r"request_id is 300 characters long; at most 256"),
    # JSON text nested past the C parser's recursion limit (a RecursionError: once INTERNAL)
    (request(token_ids=IDS, sampling=dict(structured_outputs=pb2.StructuredOutputs(
        json="[" * 2000 + "]" * 2000))),
     r"^sampling.structured_outputs.json nests 2000 levels deep; at most 64 are allowed$"),
    # Never fits the KV cache (13 pages needed, 12 exist): refused, not queued forever.
    (request(token_ids=IDS, sampling=dict(max_tokens=100)),
     r"need 13 KV pages but the cache holds only 12"),
]


def all_pages_free(server: BackgroundServer) -> bool:
    alloc = server.server.engine.engine.scheduler.allocator
    return alloc.num_free_pages == alloc.num_usable_pages


@pytest.mark.parametrize("req,message", BAD, ids=[m[:40] for _, m in BAD])
def test_bad_field_is_invalid_argument(server: BackgroundServer, req: object,
                                       message: str) -> None:
    with Client(server.target) as client:
        with pytest.raises(grpc.RpcError) as err:
            list(client.stub.Generate(req, timeout=DEADLINE_S))
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert re.search(message, err.value.details()), err.value.details()
        # ... and the server carries on, with no page leaked.
        ok = client.generate([5, 6], SamplingParams(max_tokens=3, ignore_eos=True))[0]
        assert ok.finish_reason == "LENGTH" and len(ok.token_ids) == 3
    assert all_pages_free(server)


def test_oversized_message_is_refused(server: BackgroundServer) -> None:
    with Client(server.target) as client:
        with pytest.raises(grpc.RpcError) as err:
            list(client.stream("w5 " * 30000, SamplingParams(max_tokens=1)))
        assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert client.generate([5], SamplingParams(max_tokens=1))[0].finish_reason is not None


def test_duplicate_in_flight_request_id_and_burst_backpressure() -> None:
    runner = GatedRunner()
    srv = start(fake_engine(runner, max_num_seqs=1, max_num_batched_tokens=16), max_waiting=4)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    try:
        with Client(srv.target) as client:
            held = client.stream([5, 6], params, request_id="same")
            deadline = time.monotonic() + DEADLINE_S
            while srv.server.engine.num_in_flight == 0:  # admitted (and held at its step)
                assert time.monotonic() < deadline
                time.sleep(0.005)
            with pytest.raises(grpc.RpcError) as err:
                list(client.stream([7], params, request_id="same"))
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert "request_id='same' is already in flight" in err.value.details()

            async def burst() -> list:
                async with AsyncClient(srv.target) as aclient:
                    calls = [aclient.generate([5, i + 3], params, timeout=DEADLINE_S)
                             for i in range(12)]
                    tasks = [asyncio.ensure_future(c) for c in calls]
                    # Refusals arrive at once, while no step can complete.
                    refused = 0
                    for t in asyncio.as_completed(tasks):
                        try:
                            await t
                        except grpc.aio.AioRpcError as e:
                            assert e.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
                            assert "max_waiting=4" in e.details()
                            refused += 1
                        if refused + srv.server.engine.num_in_flight == 13:
                            break
                    assert runner.steps == 0
                    runner.allow(1000)
                    return await asyncio.gather(*tasks, return_exceptions=True)

            results = asyncio.run(burst())
            ok = [r for r in results if not isinstance(r, BaseException)]
            refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
            assert len(ok) + len(refused) == 12
            assert 1 <= len(ok) <= 4 and len(refused) >= 8
            assert all(r[0].finish_reason == "LENGTH" for r in ok)
            assert [m.finished.reason for m in held if m.HasField("finished")] == [pb2.LENGTH]
        deadline = time.monotonic() + DEADLINE_S
        while not all_pages_free(srv) or srv.server.engine.num_in_flight:
            assert time.monotonic() < deadline
            time.sleep(0.005)
    finally:
        runner.allow(1000)
        srv.stop()


def test_api_keys() -> None:
    srv = start(fake_engine(), api_keys=("k1-secret", "k2-secret"))
    params = SamplingParams(max_tokens=2)
    try:
        for key in (None, "wrong", "k1-secre", "k1-secret-"):
            with Client(srv.target, api_key=key) as client:
                with pytest.raises(grpc.RpcError) as err:
                    list(client.stream([5], params))
                assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
                with pytest.raises(grpc.RpcError) as err:
                    client.model_info()
                assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
        for key in ("k1-secret", "k2-secret"):
            with Client(srv.target, api_key=key) as client:
                assert client.generate([5], params)[0].finish_reason is not None
        with grpc.insecure_channel(srv.target) as channel:  # probes need no key
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            assert status.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.RpcError) as err:  # a key, but not as a Bearer token
                list(stubs.load().grpc.GenerationStub(channel).Generate(
                    request(token_ids=IDS), metadata=(("authorization", "Basic k1-secret"),)))
            assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
    finally:
        srv.stop()


def test_no_auth_ignores_authorization_metadata(server: BackgroundServer) -> None:
    with Client(server.target, api_key="anything") as client:
        assert client.generate([5], SamplingParams(max_tokens=1))[0].finish_reason is not None


def self_signed(tmp_path) -> tuple:  # noqa: ANN001
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), False)
            .sign(key, hashes.SHA256()))
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    (tmp_path / "cert.pem").write_bytes(cert_pem)
    (tmp_path / "key.pem").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    return str(tmp_path / "cert.pem"), str(tmp_path / "key.pem"), cert_pem


def test_tls_with_api_key(tmp_path) -> None:  # noqa: ANN001
    cert, key, cert_pem = self_signed(tmp_path)
    srv = start(fake_engine(), tls_cert=cert, tls_key=key, api_keys=("tls-key",))
    override = (("grpc.ssl_target_name_override", "localhost"),)
    try:
        with Client(srv.target, api_key="tls-key", root_certificates=cert_pem,
                    options=override) as client:
            assert client.generate([5], SamplingParams(max_tokens=2))[0].finish_reason
        with Client(srv.target, api_key="tls-key", timeout=5) as plain:  # no TLS: refused
            with pytest.raises(grpc.RpcError) as err:
                plain.model_info()
            assert err.value.code() is grpc.StatusCode.UNAVAILABLE
    finally:
        srv.stop()
