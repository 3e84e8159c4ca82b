"""The `jaxserve serve` and `jaxserve client` subcommands (registered by `jaxserve.cli`).

Data flow of `serve`: argv -> one flag per EngineConfig field (generated from the dataclass, so
a new engine option becomes a flag by itself) + the ServerConfig flags -> EngineConfig and
ServerConfig (validated: a bad value, or --no-grpc with --no-http, exits 2 with one line) ->
`app.serve`, which listens at once (gRPC :50051 and HTTP :8000 unless told otherwise; health
NOT_SERVING), loads and warms the model, logs one "ready" line with both addresses, and
drains on SIGTERM / SIGINT (exit 0). When the engine fails for good
(`EngineDead`: a lost device) it drains and the process exits 1, for a supervisor to restart.

`client`: PROMPT + sampling flags -> `jaxserve.server.client.Client.stream` -> text deltas to stdout
as they arrive; usage and timing to stderr with -v.

Only argparse at import time: grpc and jax load when a command runs.
"""

from __future__ import annotations

import argparse
import logging
import os
import pathlib
import sys
from typing import Any

from jaxserve.cli.flags import (add_distributed_flags, add_engine_flags, add_sampling_flags,
                                engine_config_from_args, join_or_follow, parse_bytes,
                                sampling_params_from_args)
from jaxserve.config import EngineConfig
from jaxserve.engine.limits import DEFAULT_CLIENT_PRIORITY_RANGE
from jaxserve.server.config import (DEFAULT_HTTP_PORT, DEFAULT_MAX_MESSAGE_BYTES, DEFAULT_PORT,
                                    ServerConfig)
from jaxserve.serving.request_stream import DEFAULT_MAX_STREAM_BUFFER_TOKENS
from jaxserve.serving.tool_prompt import PARSER_CHOICES

log = logging.getLogger("jaxserve.server")
API_KEY_ENV = "JAXSERVE_API_KEY"


def add_serve_parser(sub: Any) -> None:
    s = sub.add_parser("serve", help="serve a model over gRPC and OpenAI-compatible HTTP",
                       description="Serve a model over gRPC (jaxserve.v1.Generation, health, "
                                   f"reflection; port {DEFAULT_PORT}) and the OpenAI-compatible "
                                   f"HTTP API (/v1/chat/completions, /v1/completions, ...; port "
                                   f"{DEFAULT_HTTP_PORT}), one engine behind both.")
    add_engine_flags(s)
    n = s.add_argument_group("server")
    n.add_argument("--host", default="127.0.0.1",
                   help="address both fronts listen on (default 127.0.0.1: this machine only)")
    n.add_argument("--port", type=int, default=DEFAULT_PORT,
                   help=f"gRPC port; 0 picks a free one (default {DEFAULT_PORT})")
    n.add_argument("--no-grpc", action="store_true", help="serve no gRPC front")
    n.add_argument("--http-port", type=int, default=DEFAULT_HTTP_PORT,
                   help="port of the OpenAI-compatible HTTP API (/v1/chat/completions, "
                        "/v1/completions, /v1/models, /health, /metrics, /tokenize, ...), same "
                        f"host, same engine; 0 picks a free one (default {DEFAULT_HTTP_PORT})")
    n.add_argument("--no-http", action="store_true", help="serve no HTTP front")
    n.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model's name(s) on the API (default: the --model value): "
                        "responses and /v1/models report the first, /v1/models lists each, "
                        "and an HTTP request naming another model (nor a loaded LoRA adapter) "
                        "gets a 404")
    n.add_argument("--metrics-port", type=int, default=None,
                   help="also serve Prometheus /metrics on a port of its own (same host; the "
                        "HTTP front serves it too); default: off")
    n.add_argument("--max-waiting", type=int, default=256,
                   help="sequences allowed to wait for a slot; beyond it calls get "
                        "RESOURCE_EXHAUSTED; 0: unbounded (default 256)")
    n.add_argument("--api-key", action="append", default=[],
                   help=f"accept this API key (repeatable; also ${API_KEY_ENV}); callers send "
                        "'authorization: Bearer KEY'")
    n.add_argument("--api-key-file", default=None, help="file with one API key per line")
    n.add_argument("--tls-cert", default=None, help="PEM certificate chain: serve TLS")
    n.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    n.add_argument("--shutdown-grace", type=float, default=30.0,
                   help="seconds in-flight requests get to finish on SIGTERM (default 30)")
    n.add_argument("--max-message-bytes", type=parse_bytes, default=DEFAULT_MAX_MESSAGE_BYTES,
                   help="largest request/response message (default 4MiB)")
    n.add_argument("--tokenizer-threads", type=int, default=2,
                   help="threads that tokenize prompts, per front (default 2)")
    lo, hi = DEFAULT_CLIENT_PRIORITY_RANGE
    n.add_argument("--client-priority-min", type=int, default=lo,
                   help="lowest priority a caller may set (lower runs first; default "
                        f"{lo}: callers may only lower their own); see docs/serving/limits.md")
    n.add_argument("--client-priority-max", type=int, default=hi,
                   help=f"highest priority a caller may set (default {hi})")
    n.add_argument("--stream-interval", type=int, default=1,
                   help="tokens per streamed chunk after the first, gRPC and HTTP (default 1: "
                        "every token); larger values cut per-token overhead, streaming more "
                        "coarsely")
    _add_connection_flags(n)
    n.add_argument("--max-stream-buffer-tokens", type=int,
                   default=DEFAULT_MAX_STREAM_BUFFER_TOKENS,
                   help="tokens a streaming client may leave unread before its request is "
                        "aborted (RESOURCE_EXHAUSTED / an HTTP error event); 0: unbounded "
                        f"(default {DEFAULT_MAX_STREAM_BUFFER_TOKENS})")
    add_distributed_flags(s)


def _add_connection_flags(n: Any) -> None:
    d = ServerConfig()  # the defaults, declared once there
    n.add_argument("--http-keepalive-timeout", type=float, default=d.http_keepalive_timeout,
                   help="HTTP: seconds a connection gets to send a complete request head "
                        "(from opening, or from the previous response), and that an idle "
                        f"keep-alive connection stays open (default {d.http_keepalive_timeout:g})")
    n.add_argument("--http-body-timeout", type=float, default=d.http_body_timeout,
                   help="HTTP: seconds the request body gets to arrive after its head; then "
                        f"408 and the connection closes (default {d.http_body_timeout:g})")
    n.add_argument("--grpc-idle-timeout", type=float, default=d.grpc_idle_timeout,
                   help="gRPC: close connections with no call for this many seconds "
                        f"(GOAWAY; default {d.grpc_idle_timeout:g})")
    n.add_argument("--grpc-keepalive-time", type=float, default=d.grpc_keepalive_time,
                   help="gRPC: ping connections with calls this often (seconds) and drop "
                        f"those that do not answer (default {d.grpc_keepalive_time:g})")
    n.add_argument("--enable-admin", action="store_true",
                   help="serve the admin endpoint (live scheduler settings: HTTP "
                        "/admin/scheduler, gRPC Admin) without an API key; with --api-key it "
                        "is on anyway, behind the key (default: refused when there is no key)")
    n.add_argument("--metrics-no-auth", action="store_true",
                   help="serve /metrics to anyone even when API keys are set (default: "
                        "/metrics asks for the key like the API)")
    n.add_argument("--trust-request-chat-template", action="store_true",
                   help="let chat requests bring their own chat_template (default: refused). "
                        "Trusted clients only: a template is code; what it builds is bounded "
                        "(a 400 past the prompt bound) but its time is not: one can hold a "
                        "tokenizer thread")
    n.add_argument("--tool-call-parser", choices=PARSER_CHOICES, default=d.tool_call_parser,
                   help="how the model writes tool calls, read back for tool_choice auto: "
                        "hermes (<tool_call>{...}</tool_call>) or llama3_json (a bare JSON "
                        "object); auto: the format its chat template shows (hermes when it "
                        f"shows none; default {d.tool_call_parser})")
    n.add_argument("--max-tool-calls", type=int, default=d.max_tool_calls, metavar="N",
                   help="at most N tool calls in one chat response: the grammar of "
                        "tool_choice required allows no more, and calls past N in the text "
                        "of tool_choice auto are dropped (default: unbounded, as OpenAI; "
                        "parallel_tool_calls=false in a request still means one)")


def add_client_parser(sub: Any) -> None:
    c = sub.add_parser("client", help="stream a completion from a running server",
                       description="Send PROMPT to a jaxserve gRPC server and stream the text.")
    c.add_argument("prompt", metavar="PROMPT", help="the prompt text")
    c.add_argument("--target", default=f"127.0.0.1:{DEFAULT_PORT}", help="server host:port")
    c.add_argument("--chat", action="store_true", help="send PROMPT as a user chat message")
    c.add_argument("--lora-name", default="", metavar="NAME",
                   help="run under the server's loaded LoRA adapter NAME (default: none)")
    add_sampling_flags(c, {"max_tokens": 64, "temperature": 0.0},
                       exclude=("n", "logprobs"))  # it prints one text
    c.add_argument("--api-key", default=None, help=f"API key (default: ${API_KEY_ENV})")
    c.add_argument("--tls", action="store_true", help="use TLS with the system's CAs")
    c.add_argument("--tls-ca", default=None, help="PEM CA certificate to trust (implies --tls)")
    c.add_argument("--timeout", type=float, default=None, help="deadline in seconds")


def _api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    keys = list(args.api_key)
    if args.api_key_file:
        lines = pathlib.Path(args.api_key_file).read_text().splitlines()
        keys += [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    if os.environ.get(API_KEY_ENV):
        keys.append(os.environ[API_KEY_ENV])
    return tuple(dict.fromkeys(keys))


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The `serve` flags as a ServerConfig (ValueError names a bad value)."""
    return ServerConfig(
        host=args.host, port=None if args.no_grpc else args.port,
        metrics_port=args.metrics_port, http_port=None if args.no_http else args.http_port,
        served_model_names=tuple(args.served_model_name or ()),
        max_waiting=args.max_waiting or None, api_keys=_api_keys(args), tls_cert=args.tls_cert,
        tls_key=args.tls_key, shutdown_grace=args.shutdown_grace,
        max_message_bytes=args.max_message_bytes, tokenizer_threads=args.tokenizer_threads,
        stream_interval=args.stream_interval,
        http_keepalive_timeout=args.http_keepalive_timeout,
        http_body_timeout=args.http_body_timeout, grpc_idle_timeout=args.grpc_idle_timeout,
        grpc_keepalive_time=args.grpc_keepalive_time, metrics_no_auth=args.metrics_no_auth,
        enable_admin=args.enable_admin,
        client_priority_range=(args.client_priority_min, args.client_priority_max),
        trust_request_chat_template=args.trust_request_chat_template,
        tool_call_parser=args.tool_call_parser, max_tool_calls=args.max_tool_calls,
        max_stream_buffer_tokens=args.max_stream_buffer_tokens or None)


def cmd_serve(args: argparse.Namespace) -> int:
    import asyncio

    engine_cfg = engine_config_from_args(args)
    # The lifecycle lines (listening, ready, draining, stopped) show even when quiet.
    log.setLevel(logging.DEBUG if args.verbose else logging.INFO)
    if args.verbose:  # the SLO policy's line a second (its decision, prediction, fit)
        logging.getLogger("jaxserve.slo").setLevel(logging.DEBUG)
    rc = join_or_follow(args, engine_cfg)
    if rc is not None:
        return rc
    server_cfg = server_config_from_args(args)
    from jaxserve.server.app import serve

    built: list[Any] = []  # the ServedModel, to release its runners after serving
    build = _factory(engine_cfg, progress=args.verbose)

    def factory() -> Any:
        built.append(build())
        return built[-1]

    from jaxserve.engine.errors import EngineDead

    try:
        asyncio.run(serve(server_cfg, factory))
    except OSError as e:  # bind failures, unreadable TLS files
        raise ValueError(str(e)) from e
    except EngineDead as e:
        log.error("exiting with status 1: %s", e)
        return 1
    finally:
        # Multi-host: this tells the other processes to stop (LeaderRunner.close).
        for served in built:
            for engine in served.engines:
                engine.close()
    return 0


def _factory(cfg: EngineConfig, progress: bool) -> Any:
    def build() -> Any:
        from jaxserve.serving.served import build_served

        # No model passed: the engine loads it straight onto its devices' shardings.
        return build_served(cfg, None, progress)

    return build


def cmd_client(args: argparse.Namespace) -> int:
    import grpc

    from jaxserve.cli.prompt_logprobs import format_prompt_logprobs
    from jaxserve.server.client import Client, pb2, prompt_logprobs_of

    params = sampling_params_from_args(args)
    root = pathlib.Path(args.tls_ca).read_bytes() if args.tls_ca else None
    key = args.api_key or os.environ.get(API_KEY_ENV) or None
    with Client(args.target, api_key=key, root_certificates=root, tls=args.tls,
                timeout=args.timeout) as client:
        prompt = None if args.chat else args.prompt
        messages = [{"role": "user", "content": args.prompt}] if args.chat else None
        scored = None  # the PromptLogprobs message, printed after the text
        try:
            for msg in client.stream(prompt, params, messages=messages,
                                     lora_name=args.lora_name):
                if msg.HasField("prompt_logprobs"):
                    scored = msg.prompt_logprobs
                elif msg.HasField("chunk"):
                    print(msg.chunk.text, end="", flush=True)
                elif args.verbose:
                    f, t = msg.finished, msg.finished.timing
                    spec = (f" accepted={t.spec_num_accepted_tokens}/{t.spec_num_draft_tokens}"
                            " drafted" if t.spec_num_draft_tokens else "")
                    print(f"\n[sample {f.index}: {f.usage.completion_tokens} tokens, "
                          f"reason={pb2.FinishReason.Name(f.reason)}, ttft={t.ttft_s:.3f}s "
                          f"e2e={t.e2e_s:.3f}s{spec}]", file=sys.stderr)
        except grpc.RpcError as e:
            print(f"\njaxserve client: error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    print()
    if scored is not None:
        print(format_prompt_logprobs([t.token_id for t in scored.tokens],
                                     prompt_logprobs_of(scored), params.prompt_logprobs or 0))
    return 0
