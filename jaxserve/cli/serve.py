"""The `jaxserve serve` and `jaxserve client` subcommands (registered by `jaxserve.cli`).

Data flow of `serve`: argv -> one flag per EngineConfig field (generated from the dataclass, so
a new engine option becomes a flag by itself) + the ServerConfig flags -> EngineConfig and
ServerConfig (validated: a bad value exits 2 with one line) -> `app.serve`, which listens
at once (health NOT_SERVING), loads and warms the model, logs one "ready" line with the
address, and drains on SIGTERM / SIGINT.

`client`: PROMPT + sampling flags -> `jaxserve.client.Client.stream` -> text deltas to stdout
as they arrive; usage and timing to stderr with -v.

Only argparse at import time: grpc and jax load when a command runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import pathlib
import re
import sys
from typing import Any

from jaxserve.config import DTYPES, DistributedConfig, EngineConfig
from jaxserve.server.config import DEFAULT_MAX_MESSAGE_BYTES, DEFAULT_PORT, ServerConfig

log = logging.getLogger("jaxserve.server")
API_KEY_ENV = "JAXSERVE_API_KEY"
_ENGINE_HELP = {
    "model": "model to serve: an HF directory, a GGUF file or a jaxserve checkpoint; "
             "default: the bundled SmolLM2-135M-Instruct",
    "dtype": "parameter dtype",
    "kv_cache_dtype": "KV cache dtype (default: --dtype)",
    "max_num_seqs": "sequences in one step",
    "max_num_batched_tokens": "tokens (decodes + prefill chunks) in one step",
    "max_model_len": "prompt + generated tokens of one sequence (default: the model's, "
                     "capped at 4096)",
    "page_size": "tokens per KV page",
    "kv_cache_memory": "bytes for KV pages, e.g. 2GiB (default: a fraction of free memory)",
    "kv_cache_memory_fraction": "fraction of free memory for KV pages when --kv-cache-memory "
                                "is not given",
    "enable_prefix_caching": "reuse KV pages of shared prompt prefixes",
    "attention_impl": "auto | reference | pallas_tpu | pallas_gpu",
    "token_buckets": "comma-separated step token buckets (default: powers of two)",
    "seq_buckets": "comma-separated sequence buckets (default: one per token bucket)",
    "seed": "seed of the seeds drawn for requests that give none",
    "tensor_parallel_size": "devices one engine's step is split over (weights by head, MLP "
                            "column and vocabulary; KV pages by KV head)",
    "multihost_keepalive_s": "several hosts: idle seconds after which process 0 tells the "
                             "others it is alive",
    "data_parallel_size": "independent engine replicas, each on its own tensor-parallel "
                          "devices; requests go to the least loaded or prefix-holding one",
    "compilation_cache_dir": "JAX persistent compilation cache directory (default: "
                             "$JAXSERVE_COMPILATION_CACHE_DIR or ~/.cache/jaxserve/xla)",
}
_CHOICES = {"dtype": DTYPES, "kv_cache_dtype": DTYPES}
_UNITS = {"": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3}


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 1073741824, 512MiB, 2GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers")


def _engine_flag_type(field: dataclasses.Field) -> Any:
    kind = str(field.type)
    if field.name == "kv_cache_memory":
        return parse_bytes
    if kind.startswith("tuple"):
        return parse_int_list
    if kind.startswith("int"):
        return int
    if kind.startswith("float"):
        return float
    return str


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine (every EngineConfig field)")
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        help_ = _ENGINE_HELP.get(f.name, f.name.replace("_", " "))
        if str(f.type) == "bool":
            g.add_argument(flag, dest=f"engine_{f.name}", action=argparse.BooleanOptionalAction,
                           default=f.default, help=help_)
            continue
        shown = "" if f.default is None or "default" in help_ else f" (default: {f.default})"
        g.add_argument(flag, dest=f"engine_{f.name}", type=_engine_flag_type(f),
                       default=f.default, choices=_CHOICES.get(f.name),
                       metavar=None if f.name in _CHOICES else f.name.upper(),
                       help=help_ + shown)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f"engine_{f.name}")
                           for f in dataclasses.fields(EngineConfig)})


def add_serve_parser(sub: Any) -> None:
    s = sub.add_parser("serve", help="serve a model over gRPC (and optionally HTTP)",
                       description="Serve a model over gRPC (jaxserve.v1.Generation, health, "
                                   "reflection) with optional Prometheus metrics and an "
                                   "optional OpenAI-compatible HTTP API (--http-port).")
    add_engine_flags(s)
    n = s.add_argument_group("server")
    n.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only)")
    n.add_argument("--port", type=int, default=DEFAULT_PORT,
                   help=f"gRPC port; 0 picks a free one (default {DEFAULT_PORT})")
    n.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus /metrics on this port (same host); default: off")
    n.add_argument("--http-port", type=int, default=None,
                   help="also serve the OpenAI-compatible HTTP API (/v1/completions, "
                        "/v1/models, /health) on this port (same host, same engine); "
                        "0 picks a free one; default: off")
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
                   help="threads that tokenize prompts (default 2)")
    n.add_argument("--stream-interval", type=int, default=1,
                   help="tokens per streamed chunk after the first (default 1: every token); "
                        "larger values cut per-token overhead, streaming more coarsely")
    add_distributed_flags(s)


def add_distributed_flags(p: argparse.ArgumentParser) -> None:
    d = p.add_argument_group("several hosts (jax.distributed; see README)")
    d.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="process 0's address for jax.distributed; every process passes the "
                        "same value")
    d.add_argument("--num-processes", type=int, default=1,
                   help="processes (hosts) in the job (default 1)")
    d.add_argument("--process-id", type=int, default=0,
                   help="this process's index; 0 runs the scheduler (and any server or "
                        "output), the others run its steps on their devices (default 0)")


def join_or_follow(args: argparse.Namespace, cfg: EngineConfig) -> int | None:
    """With --num-processes > 1: join the jax.distributed job (before anything else touches a
    JAX backend); on a process > 0, build the same runner as process 0 and run its steps until
    it stops, returning the exit code. None: carry on (process 0, or a single process)."""
    dist = DistributedConfig(coordinator=args.coordinator, num_processes=args.num_processes,
                             process_id=args.process_id)
    if not dist.enabled:
        return None
    from jaxserve.device import multihost
    from jaxserve.llm import build_follower

    multihost.initialize(dist)
    if dist.is_leader:
        return None
    log.info("process %d of %d: following %s", dist.process_id, dist.num_processes,
             dist.coordinator)
    runner = build_follower(cfg)
    stats = multihost.follow(runner)
    log.info("process %d: the leader stopped; ran steps=%d keepalives=%d "
             "compiles_after_warmup=%d", dist.process_id, stats.steps, stats.keepalives,
             runner.compiles_after_warmup)
    return 0


def add_client_parser(sub: Any) -> None:
    c = sub.add_parser("client", help="stream a completion from a running server",
                       description="Send PROMPT to a jaxserve gRPC server and stream the text.")
    c.add_argument("prompt", metavar="PROMPT", help="the prompt text")
    c.add_argument("--target", default=f"127.0.0.1:{DEFAULT_PORT}", help="server host:port")
    c.add_argument("--chat", action="store_true", help="send PROMPT as a user chat message")
    c.add_argument("--max-tokens", type=int, default=64, help="new tokens at most (default 64)")
    c.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    c.add_argument("--top-p", type=float, default=1.0)
    c.add_argument("--top-k", type=int, default=-1)
    c.add_argument("--seed", type=int, default=None)
    c.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
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


def cmd_serve(args: argparse.Namespace) -> int:
    import asyncio

    engine_cfg = engine_config_from_args(args)
    # The lifecycle lines (listening, ready, draining, stopped) show even when quiet.
    log.setLevel(logging.DEBUG if args.verbose else logging.INFO)
    rc = join_or_follow(args, engine_cfg)
    if rc is not None:
        return rc
    server_cfg = ServerConfig(
        host=args.host, port=args.port, metrics_port=args.metrics_port,
        http_port=args.http_port,
        max_waiting=args.max_waiting or None, api_keys=_api_keys(args), tls_cert=args.tls_cert,
        tls_key=args.tls_key, shutdown_grace=args.shutdown_grace,
        max_message_bytes=args.max_message_bytes, tokenizer_threads=args.tokenizer_threads,
        stream_interval=args.stream_interval)
    from jaxserve.server.app import serve

    built: list[Any] = []  # the ServedModel, to release its runners after serving
    build = _factory(engine_cfg, progress=args.verbose)

    def factory() -> Any:
        built.append(build())
        return built[-1]

    try:
        asyncio.run(serve(server_cfg, factory))
    except OSError as e:  # bind failures, unreadable TLS files
        raise ValueError(str(e)) from e
    finally:
        # Multi-host: this tells the other processes to stop (LeaderRunner.close).
        for served in built:
            for engine in served.engines:
                engine.close()
    return 0


def _factory(cfg: EngineConfig, progress: bool) -> Any:
    def build() -> Any:
        from jaxserve.server.servicer import build_served

        # No model passed: the engine loads it straight onto its devices' shardings.
        return build_served(cfg, None, progress)

    return build


def cmd_client(args: argparse.Namespace) -> int:
    import grpc

    from jaxserve.engine.sampling_params import SamplingParams
    from jaxserve.server.client import Client, pb2

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            stop=tuple(args.stop))
    root = pathlib.Path(args.tls_ca).read_bytes() if args.tls_ca else None
    key = args.api_key or os.environ.get(API_KEY_ENV) or None
    with Client(args.target, api_key=key, root_certificates=root, tls=args.tls,
                timeout=args.timeout) as client:
        prompt = None if args.chat else args.prompt
        messages = [{"role": "user", "content": args.prompt}] if args.chat else None
        try:
            for msg in client.stream(prompt, params, messages=messages):
                if msg.HasField("chunk"):
                    print(msg.chunk.text, end="", flush=True)
                elif args.verbose:
                    f = msg.finished
                    print(f"\n[sample {f.index}: {f.usage.completion_tokens} tokens, "
                          f"reason={pb2.FinishReason.Name(f.reason)}, ttft={f.timing.ttft_s:.3f}s "
                          f"e2e={f.timing.e2e_s:.3f}s]", file=sys.stderr)
        except grpc.RpcError as e:
            print(f"\njaxserve client: error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    print()
    return 0
