"""Wire-level bounds of both fronts, over real sockets: HTTP body parsing (size, nesting depth,
UTF-8, media type, charset), connection timeouts (a head sent a byte at a time, a slow body, an
idle keep-alive connection), gRPC bytes that do not decode, the 500 / INTERNAL catch-all, and
/metrics behind the API key.

The engine is the arithmetic fake runner (no model, no compile): these tests are about the
transport. Timeouts are short here so a closed connection shows up quickly; every wait is on
the socket (EOF), bounded by a generous deadline that only a hung server would reach."""

from __future__ import annotations

import gzip
import http.client
import json
import select
import socket
import time
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.fake_engines import fake_engine

from jaxserve.server.background import BackgroundServer
from jaxserve.server.client import pb2
from jaxserve.server.config import ServerConfig
from jaxserve.engine.json_text import json_depth
from jaxserve.server.http_body import MAX_JSON_DEPTH
from jaxserve.serving.served import ServedModel

KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}
TIMEOUT_S = 0.5  # the server's head / body / idle limits in these tests
DEADLINE_S = 30.0  # far past TIMEOUT_S: reached only when the server never closes
MAX_BODY = 64 << 10
OK_BODY = {"prompt": "w5 w6", "max_tokens": 2}


def start(**cfg: object) -> BackgroundServer:
    config = ServerConfig(port=0, http_port=0, metrics_port=0, max_message_bytes=MAX_BODY,
                          **cfg)  # type: ignore[arg-type]
    return BackgroundServer(config, lambda: ServedModel(fake_engine(), "fake")).start()


@pytest.fixture(scope="module")
def server() -> BackgroundServer:
    srv = start(api_keys=(KEY,), http_keepalive_timeout=TIMEOUT_S,
                http_body_timeout=TIMEOUT_S, grpc_idle_timeout=TIMEOUT_S)
    yield srv
    srv.stop()


def post(srv: BackgroundServer, body: bytes, headers: dict[str, str] | None = None,
         path: str = "/v1/completions") -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", srv.server.http_port, timeout=DEADLINE_S)
    try:
        conn.request("POST", path, body=body, headers={
            "Content-Type": "application/json", **AUTH, **(headers or {})})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def error_of(status_body: tuple[int, dict], status: int) -> str:
    got, body = status_body
    assert got == status, body
    assert body["error"]["type"] == "invalid_request_error", body
    return body["error"]["message"]


def assert_still_serves(srv: BackgroundServer) -> None:
    status, body = post(srv, json.dumps(OK_BODY).encode())
    assert status == 200, body
    assert srv.server.engine.error is None


# --------------------------------------------------------------------------- body parsing
@pytest.mark.parametrize("text", [
    "[]", "{}", '{"a": [[1], {"b": "[[[{{"}]}', '"\\"[[["', "[[[[]]], [[]]]",
    json.dumps({"k": ["x]" * 3, {"y": [["}"]]}]}),
])
def test_json_depth_matches_the_parsed_value(text: str) -> None:
    def depth(value: object) -> int:  # oracle: the parsed value's own nesting
        if isinstance(value, list):
            return 1 + max(map(depth, value), default=0)
        if isinstance(value, dict):
            return 1 + max(map(depth, value.values()), default=0)
        return 0
    assert json_depth(text) == depth(json.loads(text))


def test_an_unterminated_string_is_one_linear_match(server: BackgroundServer) -> None:
    """A body of `"\\"\\"...` with no closing quote: the string pattern must take it in one
    match to the end (a pattern that needs the closing quote fails and restarts at every later
    quote: quadratic, hours of event loop for a 4 MiB body), and the body is a 400."""
    from jaxserve.engine.json_text import _STRING
    body = '"' + '\\"' * 20_000  # 40 KB
    assert [m.span() for m in _STRING.finditer(body)] == [(0, len(body))]
    assert json_depth(body) == 0
    assert "not valid JSON" in error_of(post(server, body.encode()), 400)
    assert_still_serves(server)


def test_deep_nesting_is_a_400_not_a_recursion_error(server: BackgroundServer) -> None:
    deep = b"[" * 30_000 + b"]" * 30_000  # 60 KB: under the size limit
    assert "nests 30000 levels deep" in error_of(post(server, deep), 400)
    ok = b'{"prompt": "w5", "max_tokens": 1, "x": ' + b"[" * (MAX_JSON_DEPTH - 1) + \
        b"]" * (MAX_JSON_DEPTH - 1) + b"}"
    # Parsed whole: the answer is about the field, which no endpoint reads.
    status, reply = post(server, ok)
    assert status == 400 and reply["error"]["param"] == "x", reply
    assert_still_serves(server)


def test_body_bounds(server: BackgroundServer) -> None:
    big = json.dumps({"prompt": "w5 " * MAX_BODY}).encode()
    status, body = post(server, big)
    assert status == 413 and str(MAX_BODY) in body["error"]["message"], body
    bomb = gzip.compress(b'{"prompt": "w5", "x": "' + b"a" * (50 * MAX_BODY) + b'"}')
    assert len(bomb) < MAX_BODY  # small on the wire, 50x the limit once inflated
    status, body = post(server, bomb, {"Content-Encoding": "gzip"})
    assert status == 413, body
    assert "not valid UTF-8" in error_of(post(server, b'{"prompt": "w5 \xff\xfe"}'), 400)
    assert "not valid JSON" in error_of(post(server, b'{"prompt": '), 400)
    assert "NaN is not JSON" in error_of(post(server, b'{"prompt": "w5", "top_p": NaN}'), 400)
    assert "4300 digits" in error_of(post(server, b'{"seed": ' + b"9" * 5000 + b"}"), 400)
    # A lone surrogate escaped in JSON is valid JSON; in an ignored field it harms nothing.
    assert post(server, b'{"prompt": "w5", "max_tokens": 1, "user": "\\ud800"}')[0] == 200
    assert_still_serves(server)


def test_media_type_and_charset(server: BackgroundServer) -> None:
    body = json.dumps(OK_BODY).encode()
    status, err = post(server, body, {"Content-Type": "application/json; charset=foo"})
    assert status == 415 and "charset 'foo'" in err["error"]["message"], err
    status, err = post(server, body, {"Content-Type": "application/json; charset=latin-1"})
    assert status == 415 and "latin-1" in err["error"]["message"], err
    status, err = post(server, body, {"Content-Type": "text/plain"})
    assert status == 415 and "'text/plain' is not JSON" in err["error"]["message"], err
    for ok in ("application/json; charset=UTF-8", "application/json;charset=utf8",
               "application/vnd.api+json"):
        assert post(server, body, {"Content-Type": ok})[0] == 200, ok
    conn = http.client.HTTPConnection("127.0.0.1", server.server.http_port, timeout=DEADLINE_S)
    conn.putrequest("POST", "/v1/completions")  # no Content-Type at all: JSON, as FastAPI does
    for name, value in {**AUTH, "Content-Length": str(len(body))}.items():
        conn.putheader(name, value)
    conn.endheaders(body)
    assert conn.getresponse().status == 200
    conn.close()


def test_a_bug_is_a_logged_json_500(server: BackgroundServer, monkeypatch: pytest.MonkeyPatch,
                                    caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> None:
        raise RuntimeError("injected")
    monkeypatch.setattr(server.server.http, "ready", broken)
    status, body = post(server, json.dumps(OK_BODY).encode())
    assert status == 500 and body["error"]["type"] == "internal_server_error", body
    assert "injected" not in body["error"]["message"]  # no internals to the client
    assert any(r.exc_info and "injected" in str(r.exc_info[1]) for r in caplog.records)


# --------------------------------------------------------------------------- connections
def drip_until_closed(sock: socket.socket, data: bytes) -> bytes:
    """Send `data` one byte at a time, pausing on the socket between bytes (a slowloris
    client), until the server closes the connection; return what it answered. Fails if
    `data` runs out or the deadline passes with the connection still open."""
    received = b""
    deadline = time.monotonic() + DEADLINE_S
    for i in range(len(data)):
        assert time.monotonic() < deadline, "the server kept a slow connection open"
        try:
            sock.sendall(data[i:i + 1])
        except (BrokenPipeError, ConnectionResetError):
            return received
        readable, _, _ = select.select([sock], [], [], 0.05)
        if readable:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                return received
            if not chunk:
                return received
            received += chunk
    raise AssertionError("the server kept a slow connection open")


def read_until_eof(sock: socket.socket) -> bytes:
    sock.settimeout(DEADLINE_S)
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


def connect(srv: BackgroundServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", srv.server.http_port), timeout=DEADLINE_S)


def test_a_head_sent_byte_by_byte_is_cut_off(server: BackgroundServer) -> None:
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 4000
    with connect(server) as sock:
        assert drip_until_closed(sock, head) == b""  # closed without an answer
    assert_still_serves(server)


def test_a_slow_body_gets_408_and_the_connection_closes(server: BackgroundServer) -> None:
    body = json.dumps({**OK_BODY, "pad": "x" * 4000}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with connect(server) as sock:
        sock.sendall(head)
        answer = drip_until_closed(sock, body)
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert b"did not arrive within 0.5 s" in answer
    assert_still_serves(server)


def test_an_idle_keep_alive_connection_is_closed(server: BackgroundServer) -> None:
    with connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # keep-alive by default
        answer = read_until_eof(sock)
    assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b'{"status": "ok"}'), answer


def test_config_refuses_bad_timeouts() -> None:
    for name in ("http_keepalive_timeout", "http_body_timeout", "grpc_idle_timeout",
                 "grpc_keepalive_time"):
        for bad in (0.0, -1.0, float("nan"), 1e9):
            with pytest.raises(ValueError, match=name):
                ServerConfig(**{name: bad})  # type: ignore[arg-type]


# --------------------------------------------------------------------------- gRPC
def raw_call(srv: BackgroundServer, method: str, data: bytes, streaming: bool,
             key: str | None = KEY) -> grpc.StatusCode:
    with grpc.insecure_channel(srv.target) as channel:
        kw = dict(request_serializer=lambda b: b, response_deserializer=lambda b: b)
        md = (("authorization", f"Bearer {key}"),) if key else ()
        try:
            if streaming:
                list(channel.unary_stream(method, **kw)(data, timeout=DEADLINE_S, metadata=md))
            else:
                channel.unary_unary(method, **kw)(data, timeout=DEADLINE_S, metadata=md)
        except grpc.RpcError as e:
            assert "does not decode" in e.details() or e.code() != grpc.StatusCode.INVALID_ARGUMENT
            return e.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("data", [b"\xff\xff\xff\xff", b"\x12\x05\xc3\x28ab", b"\x0a\x80"])
def test_undecodable_grpc_bytes_are_invalid_argument(server: BackgroundServer,
                                                     data: bytes) -> None:
    # \x12\x05\xc3\x28ab: field 2 (prompt), 5 bytes, not UTF-8; \x0a\x80: truncated varint.
    base = "/jaxserve.v1.Generation/"
    assert raw_call(server, base + "Generate", data, True) == grpc.StatusCode.INVALID_ARGUMENT
    assert raw_call(server, base + "Tokenize", data, False) == grpc.StatusCode.INVALID_ARGUMENT
    assert raw_call(server, "/grpc.health.v1.Health/Check", data, False) == \
        grpc.StatusCode.INVALID_ARGUMENT
    # Without the key the bytes are never decoded: the key check answers first.
    assert raw_call(server, base + "Generate", data, True, key=None) == \
        grpc.StatusCode.UNAUTHENTICATED
    ok = pb2.GenerateRequest(prompt="w5", sampling=pb2.SamplingParams(max_tokens=2))
    assert raw_call(server, base + "Generate", ok.SerializeToString(), True) == \
        grpc.StatusCode.OK
    with grpc.insecure_channel(server.target) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    assert health.status == health_pb2.HealthCheckResponse.SERVING


def http2_frame_types(data: bytes) -> list[int]:
    types, pos = [], 0
    while pos + 9 <= len(data):
        length = int.from_bytes(data[pos:pos + 3], "big")
        types.append(data[pos + 3])
        pos += 9 + length
    return types


def test_an_idle_grpc_connection_gets_goaway(server: BackgroundServer) -> None:
    with socket.create_connection(("127.0.0.1", server.server.port), timeout=DEADLINE_S) as sock:
        sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes(3) + b"\x04" + bytes(5))
        answer = read_until_eof(sock)  # HTTP/2 preface + empty SETTINGS, then nothing
    goaway = 0x7
    assert goaway in http2_frame_types(answer), answer
    assert b"idle" in answer


def test_a_grpc_bug_is_a_logged_internal(server: BackgroundServer,
                                         monkeypatch: pytest.MonkeyPatch,
                                         caplog: pytest.LogCaptureFixture) -> None:
    async def broken(*_args: object) -> None:
        raise RuntimeError("injected")
    monkeypatch.setattr(server.server.servicer, "_admit", broken)
    code = raw_call(server, "/jaxserve.v1.Generation/GetModelInfo", b"", False)
    assert code == grpc.StatusCode.INTERNAL
    assert any(r.exc_info and "injected" in str(r.exc_info[1]) for r in caplog.records)


# --------------------------------------------------------------------------- metrics
def scrape(srv: BackgroundServer, headers: dict[str, str]) -> tuple[int, str]:
    req = urllib.request.Request(f"http://127.0.0.1:{srv.server.metrics_port}/metrics",
                                 headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=DEADLINE_S) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_metrics_ask_for_the_api_key(server: BackgroundServer) -> None:
    assert scrape(server, {})[0] == 401
    assert scrape(server, {"Authorization": "Bearer wrong"})[0] == 401
    status, text = scrape(server, AUTH)
    assert status == 200 and "jaxserve:num_requests_running" in text


def test_metrics_no_auth_serves_anyone() -> None:
    srv = start(api_keys=(KEY,), metrics_no_auth=True)
    try:
        status, text = scrape(srv, {})
        assert status == 200 and "jaxserve:num_requests_running" in text
    finally:
        srv.stop()


def test_serve_flags_reach_the_server_config(monkeypatch: pytest.MonkeyPatch) -> None:
    from jaxserve.cli.main import build_parser
    from jaxserve.cli.serve import API_KEY_ENV, server_config_from_args

    monkeypatch.delenv(API_KEY_ENV, raising=False)

    def config(*argv: str) -> ServerConfig:
        return server_config_from_args(build_parser().parse_args(["serve", *argv]))
    assert config() == ServerConfig()  # the flags' defaults are the config's
    got = config("--http-keepalive-timeout", "5", "--http-body-timeout", "7",
                 "--grpc-idle-timeout", "9", "--grpc-keepalive-time", "11", "--metrics-no-auth",
                 "--trust-request-chat-template")
    assert (got.http_keepalive_timeout, got.http_body_timeout, got.grpc_idle_timeout,
            got.grpc_keepalive_time, got.metrics_no_auth, got.trust_request_chat_template) == \
        (5.0, 7.0, 9.0, 11.0, True, True)
