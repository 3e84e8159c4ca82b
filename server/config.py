"""ServerConfig: the network-facing knobs of `jaxserve serve`, validated once at the edge.

Built by the CLI (flags; API keys also from `JAXSERVE_API_KEY` there, never read here) or by
code embedding a server, and passed to `jaxserve.server.app.GrpcServer`. The engine's own
knobs stay in `jaxserve.config.EngineConfig`.

The defaults are `jaxserve serve`'s (vLLM-style): gRPC on 127.0.0.1:50051 and the OpenAI HTTP
front on 127.0.0.1:8000. Code that embeds a server (tests, benchmarks) passes `port=0` /
`http_port=0` (a free port) or None (that front off), never the fixed defaults by accident.
"""

from __future__ import annotations

import dataclasses
import pathlib

from jaxserve.engine.limits import DEFAULT_CLIENT_PRIORITY_RANGE
from jaxserve.serving.request_stream import DEFAULT_MAX_STREAM_BUFFER_TOKENS
from jaxserve.serving.tool_prompt import PARSER_CHOICES

DEFAULT_PORT = 50051  # gRPC
DEFAULT_HTTP_PORT = 8000  # the OpenAI-compatible front, where vLLM listens
DEFAULT_MAX_MESSAGE_BYTES = 4 << 20  # gRPC's own receive default
MIN_TIMEOUT_S, MAX_TIMEOUT_S = 0.01, 86400.0  # bounds of every connection timeout knob
GRPC_KEEPALIVE_TIMEOUT_S = 20.0  # a keepalive ping unanswered this long closes the connection


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"  # loopback only unless the operator opens it
    port: int | None = DEFAULT_PORT  # gRPC; 0: pick a free port (the ready line tells
    # which); None: no gRPC front
    metrics_port: int | None = None  # None: no /metrics server of its own; 0: a free port
    http_port: int | None = DEFAULT_HTTP_PORT  # the OpenAI-compatible front (with /metrics);
    # 0: a free port; None: no HTTP front
    # The names the HTTP front answers to (vLLM's --served-model-name): the first is the one
    # responses, /v1/models, gRPC's model info and the metrics' model_name label report;
    # a request naming another gets a 404. Empty: the model's own name, any `model` accepted.
    served_model_names: tuple[str, ...] = ()
    max_waiting: int | None = 256  # sequences waiting to be scheduled; None: unbounded
    api_keys: tuple[str, ...] = ()  # empty: no authentication
    tls_cert: str | None = None  # PEM certificate chain file
    tls_key: str | None = None  # PEM private key file
    shutdown_grace: float = 30.0  # seconds in-flight requests get to finish on SIGTERM
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    tokenizer_threads: int = 2  # workers that tokenize prompts off the event loop
    # Tokens per streamed chunk after the first (1: every token as it comes); larger values
    # send fewer messages, cutting per-token host overhead at the cost of coarser streaming.
    stream_interval: int = 1
    # Connection hygiene (docs/serving/limits.md, "Connections and timeouts"). HTTP: a
    # request head must arrive complete within http_keepalive_timeout seconds of the
    # connection opening or of the previous response, and an idle keep-alive connection
    # closes after as long; the body then has http_body_timeout seconds (else 408,
    # connection closed).
    http_keepalive_timeout: float = 20.0
    http_body_timeout: float = 60.0
    # gRPC: a connection with no call for grpc_idle_timeout seconds gets GOAWAY
    # (max_connection_idle); one with calls is pinged every grpc_keepalive_time seconds and
    # closed when the ping is not answered within GRPC_KEEPALIVE_TIMEOUT_S.
    grpc_idle_timeout: float = 300.0
    grpc_keepalive_time: float = 60.0
    # /metrics asks for the API key when api_keys are set, unless this says otherwise.
    metrics_no_auth: bool = False
    # The admin endpoint (live scheduler settings: HTTP /admin/scheduler, gRPC Admin) asks
    # for the API key; with no api_keys it is refused (403 / PERMISSION_DENIED) unless this
    # opens it to every caller (a trusted network only).
    enable_admin: bool = False
    # The priorities callers of the fronts may set (lower runs first; the proto field is
    # int32). The default lets a client only lower its own; the offline API is not limited.
    client_priority_range: tuple[int, int] = DEFAULT_CLIENT_PRIORITY_RANGE
    # A chat request may bring its own chat_template (vLLM's --trust-request-chat-template):
    # off by default; for trusted clients only, since a template is code (sandboxed, bounded
    # in what it builds but not in time) that can hold a tokenizer thread.
    trust_request_chat_template: bool = False
    # Tokens (over all samples) a stream may leave unread before its request is aborted with
    # RESOURCE_EXHAUSTED / an error event naming this knob; outputs that arrive while the
    # client is not reading are coalesced up to it. None: no bound (coalescing only).
    max_stream_buffer_tokens: int | None = DEFAULT_MAX_STREAM_BUFFER_TOKENS
    # How the model writes tool calls (vLLM's --tool-call-parser): "hermes" (<tool_call>
    # tags), "llama3_json" (a bare JSON object), or "auto": the format its chat template shows.
    tool_call_parser: str = "auto"
    # At most this many tool calls in one response (vLLM has none; OpenAI none): bounds the
    # "required" grammar's array and drops the calls past it read from "auto" text. None:
    # unbounded; parallel_tool_calls=false in a request still means one.
    max_tool_calls: int | None = None

    def __post_init__(self) -> None:
        for name in ("port", "metrics_port", "http_port"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= 65535):
                raise ValueError(f"{name}={value!r} must be a port number in [0, 65535]")
        if self.port is None and self.http_port is None:
            raise ValueError("both fronts are off (gRPC port and HTTP port None, or --no-grpc "
                             "with --no-http): nothing would serve the model")
        if not isinstance(self.served_model_names, tuple) or not all(
                isinstance(n, str) and n for n in self.served_model_names):
            raise ValueError(f"served_model_names={self.served_model_names!r} must be a tuple "
                             "of non-empty names")
        if self.max_waiting is not None and self.max_waiting < 1:
            raise ValueError(f"max_waiting={self.max_waiting} must be >= 1")
        if any(not k for k in self.api_keys):
            raise ValueError("api_keys must not contain an empty key")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key must be given together")
        for name in ("tls_cert", "tls_key"):
            path = getattr(self, name)
            if path is not None and not pathlib.Path(path).is_file():
                raise ValueError(f"{name}={path!r} is not a readable file")
        if not self.shutdown_grace >= 0:
            raise ValueError(f"shutdown_grace={self.shutdown_grace} must be >= 0 seconds")
        if not 1024 <= self.max_message_bytes <= 1 << 30:
            raise ValueError(f"max_message_bytes={self.max_message_bytes} must be in "
                             "[1024, 2**30]")
        if not 1 <= self.stream_interval <= 1024:
            raise ValueError(f"stream_interval={self.stream_interval} must be in [1, 1024]")
        lo, hi = self.client_priority_range
        if not -2**31 <= lo <= hi <= 2**31 - 1:
            raise ValueError(f"client_priority_range={self.client_priority_range!r} must be "
                             "(lo, hi) with -2**31 <= lo <= hi <= 2**31 - 1")
        if not 1 <= self.tokenizer_threads <= 64:
            raise ValueError(f"tokenizer_threads={self.tokenizer_threads} must be in [1, 64]")
        for name in ("http_keepalive_timeout", "http_body_timeout", "grpc_idle_timeout",
                     "grpc_keepalive_time"):
            value = getattr(self, name)
            if not MIN_TIMEOUT_S <= value <= MAX_TIMEOUT_S:  # also refuses NaN
                raise ValueError(f"{name}={value} must be in [{MIN_TIMEOUT_S}, "
                                 f"{MAX_TIMEOUT_S:g}] seconds")
        if self.tool_call_parser not in PARSER_CHOICES:
            raise ValueError(f"tool_call_parser={self.tool_call_parser!r} must be one of "
                             f"{', '.join(PARSER_CHOICES)}")
        if self.max_tool_calls is not None and not (
                isinstance(self.max_tool_calls, int) and self.max_tool_calls >= 1):
            raise ValueError(f"max_tool_calls={self.max_tool_calls!r} must be >= 1 (or None: "
                             "unbounded)")
        if self.max_stream_buffer_tokens is not None and self.max_stream_buffer_tokens < 1:
            raise ValueError(f"max_stream_buffer_tokens={self.max_stream_buffer_tokens} must "
                             "be >= 1 (or None: unbounded)")

    @property
    def address(self) -> str:
        return self.address_for(self.port)

    def address_for(self, port: int | None) -> str:
        """host:port on this config's host (IPv6 hosts bracketed)."""
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") \
            else self.host
        return f"{host}:{port}"
