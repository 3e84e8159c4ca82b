"""The server's lifecycle (the gRPC and the OpenAI HTTP front): listen, warm up, serve, drain,
stop.

Data flow:
  `start()`   with `port` set (not None): a grpc.aio server with the Generation servicer, the
              Admin servicer (live scheduler settings, `admin.py`), the standard health
              service (NOT_SERVING for now), reflection, the API-key
              interceptor when keys are set, then `grpc_wire.WireGuardInterceptor`
              (undecodable bytes -> INVALID_ARGUMENT), bounded message sizes, idle-connection
              and keepalive limits; binds host:port (TLS when configured) and starts;
              with `http_port` set, the OpenAI-compatible HTTP front
              (`openai_http.OpenAIHttpFront`, same loop, same host, same API keys) on that
              port. Both are on by default (ServerConfig); at least one is.
  `load()`    runs the engine factory (model load + XLA warmup) on a daemon thread while the
              event loop keeps answering health checks -> the served model renamed to the
              first `served_model_names` entry, if any -> AsyncEngine (its own step thread)
              with the Prometheus observer -> the LoRA adapters' admin (`serving.
              lora_adapters`; a --lora-modules adapter named as the base model fails the
              start-up) -> servicer and HTTP front attached (the front
              also serves the registry at GET /metrics) -> health SERVING -> the one "ready"
              log line naming every address. /metrics (on `metrics_port` and on the HTTP
              port) asks for the API key when keys are set, unless `metrics_no_auth`.
  `shutdown()` health NOT_SERVING, new calls refused with UNAVAILABLE (HTTP: 503), in-flight
              calls of both fronts get `shutdown_grace` seconds to finish, the rest are
              aborted (each stream ends with a Finished(ABORT) message / an "abort"
              finish_reason), then the servers, engine thread and metrics stop.
`serve()` strings these together and turns SIGTERM / SIGINT into `shutdown()`.

A fatal engine failure (`EngineDead`: the device is lost; a failed step that only hurts some
requests is handled inside the engine) flips health to NOT_SERVING with the reason (the
fronts answer UNAVAILABLE / 503 naming it) and sets `failed`; `serve()` then drains, stops
and raises EngineDead, so `jaxserve serve` exits non-zero and a supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import pathlib
import signal
import threading
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from jaxserve.engine.errors import EngineDead
from jaxserve.server import stubs
from jaxserve.server import admin
from jaxserve.server.auth import ApiKeyInterceptor, ApiKeys
from jaxserve.server.config import GRPC_KEEPALIVE_TIMEOUT_S, ServerConfig
from jaxserve.server.grpc_wire import WireGuardInterceptor
from jaxserve.server.inflight import InFlight
from jaxserve.server.openai_http import OpenAIHttpFront
from jaxserve.server.servicer import SERVICE_NAME, GenerationServicer
from jaxserve.serving.admission import Admission
from jaxserve.serving.async_replica_pool import AsyncServing
from jaxserve.serving.admin_settings import SchedulerAdmin
from jaxserve.serving.lora_adapters import LoraAdmin
from jaxserve.serving.served import ServedModel, start_serving
from jaxserve.serving.metrics import EngineMetrics, MetricsHttpServer

log = logging.getLogger(__name__)
EngineFactory = Callable[[], ServedModel]
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
_SERVING = health_pb2.HealthCheckResponse.SERVING
_HEALTH_NAMES = ("", SERVICE_NAME)


def grpc_options(cfg: ServerConfig) -> list[tuple[str, int]]:
    """grpc core channel arguments of the server: message bounds and connection hygiene."""
    return [
        ("grpc.max_receive_message_length", cfg.max_message_bytes),
        ("grpc.max_send_message_length", cfg.max_message_bytes),
        # A second server on a busy port must fail, not silently share it.
        ("grpc.so_reuseport", 0),
        # An open connection with no call costs a socket and HTTP/2 state: GOAWAY after this.
        ("grpc.max_connection_idle_ms", int(cfg.grpc_idle_timeout * 1000)),
        # Connections with calls: a peer that vanished without a FIN is found by a ping.
        ("grpc.keepalive_time_ms", int(cfg.grpc_keepalive_time * 1000)),
        ("grpc.keepalive_timeout_ms", int(GRPC_KEEPALIVE_TIMEOUT_S * 1000)),
    ]


def _call_in_thread(fn: EngineFactory) -> "asyncio.Future[ServedModel]":
    """Run `fn` on a daemon thread (a stuck warmup must not keep the process alive)."""
    future: concurrent.futures.Future[ServedModel] = concurrent.futures.Future()

    def run() -> None:
        # A stop during warmup cancels the future: what comes later has nowhere to go.
        try:
            value = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                future.set_exception(e)
            return
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            future.set_result(value)

    threading.Thread(target=run, name="jaxserve-load", daemon=True).start()
    return asyncio.wrap_future(future)


class GrpcServer:
    def __init__(self, cfg: ServerConfig, factory: EngineFactory):
        self.cfg = cfg
        self._factory = factory
        self.servicer = GenerationServicer(cfg.tokenizer_threads, cfg.stream_interval)
        self.health = health.aio.HealthServicer()
        self.admin = admin.AdminServicer(bool(cfg.api_keys), cfg.enable_admin)
        self.engine: AsyncServing | None = None
        self.metrics: EngineMetrics | None = None
        self._metrics_http: MetricsHttpServer | None = None
        self._server: grpc.aio.Server | None = None
        self.port: int | None = None
        self.metrics_port: int | None = None
        self.http: OpenAIHttpFront | None = None if cfg.http_port is None else OpenAIHttpFront(
            cfg.api_keys, cfg.tokenizer_threads, cfg.max_message_bytes,
            cfg.http_keepalive_timeout, cfg.http_body_timeout,
            stream_interval=cfg.stream_interval, served_model_names=cfg.served_model_names,
            open_metrics=cfg.metrics_no_auth, enable_admin=cfg.enable_admin)
        self.http_port: int | None = None
        self.failed = asyncio.Event()  # set on the loop when the engine fails for good
        self._started = False

    @property
    def address(self) -> str:
        """The gRPC front's host:port ("HOST:None" when it is off)."""
        return f"{self.cfg.host}:{self.port}"

    async def start(self) -> int | None:
        """Bind and start answering (health NOT_SERVING until `load()`); returns the gRPC
        port (None: no gRPC front)."""
        if self.cfg.port is not None:
            await self._start_grpc()
        if self.http is not None:
            self.http_port = await self.http.start(self.cfg.host, self.cfg.http_port or 0)
        self._started = True
        log.info("listening %s tls=%s auth=%s state=NOT_SERVING", self._addresses(),
                 bool(self.cfg.tls_cert), bool(self.cfg.api_keys))
        return self.port

    async def _start_grpc(self) -> None:
        cfg = self.cfg
        # The key check first: an unauthenticated caller's bytes are never decoded.
        interceptors: list[grpc.aio.ServerInterceptor] = \
            [ApiKeyInterceptor(cfg.api_keys)] if cfg.api_keys else []
        interceptors.append(WireGuardInterceptor())
        server = grpc.aio.server(interceptors=interceptors, options=grpc_options(cfg))
        for name in _HEALTH_NAMES:
            await self.health.set(name, _NOT_SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        stubs.load().grpc.add_GenerationServicer_to_server(self.servicer, server)
        stubs.load().grpc.add_AdminServicer_to_server(self.admin, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, admin.SERVICE_NAME,
             health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME), server)
        bind = cfg.address
        try:
            if cfg.tls_cert and cfg.tls_key:
                creds = grpc.ssl_server_credentials([(pathlib.Path(cfg.tls_key).read_bytes(),
                                                      pathlib.Path(cfg.tls_cert).read_bytes())])
                port = server.add_secure_port(bind, creds)
            else:
                port = server.add_insecure_port(bind)
        except RuntimeError as e:  # grpc's "Failed to bind"
            raise OSError(f"cannot listen on {bind}: {e}") from None
        if port == 0:  # older grpc versions report a failed bind this way
            raise OSError(f"cannot listen on {bind} (address in use or not available)")
        await server.start()
        self._server, self.port = server, port

    def _addresses(self) -> str:
        """Where each front listens, as the log lines name them: the gRPC host:port first
        (scripts parse `on HOST:PORT`; `grpc=off` without it), then `http=URL`."""
        grpc_part = self.address if self.port is not None else "grpc=off"
        if self.http_port is None:
            return grpc_part
        return f"{grpc_part} http=http://{self.cfg.address_for(self.http_port)}"

    async def load(self) -> None:
        """Build the engine off the event loop, start its thread, then report SERVING."""
        served = await _call_in_thread(self._factory)
        cfg = self.cfg
        if cfg.served_model_names:  # what every front and the metrics call the model
            served = dataclasses.replace(served, name=cfg.served_model_names[0])
        loop = asyncio.get_running_loop()

        def on_failure(error: BaseException) -> None:
            # Called on the engine thread: hop onto the event loop to flip health.
            loop.call_soon_threadsafe(self._engine_failed, error)

        self.engine, self.metrics = start_serving(served, cfg.max_waiting, on_failure,
                                                  cfg.max_stream_buffer_tokens)
        # One admission (limits, tokenizer, tokenizer threads) for both fronts, with
        # --tokenizer-threads threads per front.
        threads = cfg.tokenizer_threads * (2 if self.http is not None else 1)
        admit = Admission(served.engine.limits, served.engine.tokenizer, threads,
                          cfg.client_priority_range, cfg.trust_request_chat_template,
                          cfg.tool_call_parser, cfg.max_tool_calls)
        log.debug("tool calls read as %s (--tool-call-parser %s)", admit.tool_format,
                  cfg.tool_call_parser)
        scheduler = SchedulerAdmin(self.engine)  # the admin endpoint's, both fronts
        # The LoRA adapters (both fronts): the base model answers to its served names.
        loras = LoraAdmin(self.engine, served.engine, cfg.served_model_names or (served.name,))
        loras.check_startup()
        self.servicer.attach(self.engine, served, admit, loras)
        self.admin.attach(scheduler, loras)
        if self.http is not None:
            self.http.attach(self.engine, served, admit, self.metrics.registry, scheduler,
                             loras)
        if cfg.metrics_port is not None:
            authorize = None if cfg.metrics_no_auth or not cfg.api_keys else \
                ApiKeys(cfg.api_keys).allows
            self._metrics_http = MetricsHttpServer(self.metrics.registry, cfg.host,
                                                   cfg.metrics_port, authorize)
            self.metrics_port = self._metrics_http.port
        await self._set_health(_SERVING)
        metrics = f" metrics=http://{cfg.host}:{self.metrics_port}/metrics" \
            if self.metrics_port is not None else ""
        log.info("ready: serving %s on %s%s", served.name, self._addresses(), metrics)

    def _engine_failed(self, error: BaseException) -> None:
        log.error("engine failed, health NOT_SERVING: %r", error)
        asyncio.ensure_future(self._set_health(_NOT_SERVING))
        self.failed.set()

    def _fronts(self) -> list[InFlight]:
        return [self.servicer.calls] + ([self.http.calls] if self.http is not None else [])

    def _num_active(self) -> int:
        return sum(c.active for c in self._fronts())

    async def _wait_idle(self, timeout: float) -> bool:
        """Wait until neither front has a call in flight; False when `timeout` passed."""
        return all(await asyncio.gather(*(c.wait_idle(timeout) for c in self._fronts())))

    async def _set_health(self, status: int) -> None:
        for name in _HEALTH_NAMES:
            await self.health.set(name, status)

    async def shutdown(self, grace: float | None = None) -> None:
        """Drain: NOT_SERVING, refuse new calls, let in-flight calls finish for `grace`
        seconds (default: the config's), abort the rest, stop everything."""
        grace = self.cfg.shutdown_grace if grace is None else grace
        await self.health.enter_graceful_shutdown()
        for calls in self._fronts():
            calls.draining = True  # each front now refuses new calls
        started = self._started
        if started:
            log.info("draining in_flight=%d grace_s=%.1f", self._num_active(), grace)
        if not await self._wait_idle(grace) and self.engine is not None:
            self.engine.abort_all()
            log.info("grace period over; aborted in_flight=%d", self._num_active())
            # Each aborted stream still sends its Finished(ABORT) message.
            await self._wait_idle(10.0)
        if self._server is not None:
            await self._server.stop(1.0)
        if self.http is not None:
            await self.http.stop()
        if self.engine is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.engine.stop, 30.0)
        if self._metrics_http is not None:
            self._metrics_http.close()
        self.servicer.close()
        if started:
            log.info("stopped %s", self._addresses())


async def serve(cfg: ServerConfig, factory: EngineFactory,
                stop: asyncio.Event | None = None) -> None:
    """Run a server until `stop` is set or the process gets SIGTERM / SIGINT, then drain.
    Raises EngineDead, after draining, when the engine failed for good."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    installed = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
        except (NotImplementedError, RuntimeError, ValueError):
            pass  # not the main thread (embedded use): the caller sets `stop` itself
    server = GrpcServer(cfg, factory)
    failure: BaseException | None = None
    try:
        await server.start()
        loading = asyncio.ensure_future(server.load())
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if loading.done():
            loading.result()  # a failed load raises here
            failed = asyncio.ensure_future(server.failed.wait())
            await asyncio.wait({stopping, failed}, return_when=asyncio.FIRST_COMPLETED)
            stopping.cancel()
            failed.cancel()
            if server.failed.is_set():
                failure = server.engine.error if server.engine is not None else None
        else:
            loading.cancel()
            log.info("stop requested during warmup")
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
        await server.shutdown()
    if failure is None and server.engine is not None and server.engine.error is not None:
        failure = server.engine.error  # it failed while draining: still a restart
    if failure is not None:
        raise EngineDead(f"the engine failed: {failure}") from failure
