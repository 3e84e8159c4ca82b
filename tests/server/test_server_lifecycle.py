"""Health transitions (warmup -> SERVING -> draining), graceful drain, and `jaxserve serve` as a
real process: ready line, `jaxserve client`, SIGTERM drain and exit.

In-process tests gate the engine factory and every model step (events and semaphores), so
each transition is observed deterministically; the subprocess tests use a tiny random model
saved as an HF directory and compare the served text with the offline API's."""

from __future__ import annotations

import json
import logging
import os
import pathlib
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import pytest
from support.engine_fixtures import VOCAB, tiny_engine, tiny_model
from support.hf_models import save_tiny_tokenizer
from support.fake_engines import FailingRunner, GatedRunner, fake_engine
from support.probes import NOT_SERVING, SERVING, health, wait_for

from jaxserve import SamplingParams
from jaxserve.models.hf_loader import save_hf_dir
from jaxserve.server.background import BackgroundServer
from jaxserve.server.client import Client, pb2
from jaxserve.server.config import ServerConfig
from jaxserve.serving.served import ServedModel

DEADLINE_S = 30.0
START_DEADLINE_S = 180.0  # a cold subprocess imports jax and compiles its buckets
def unavailable(target: str) -> str:
    with Client(target, timeout=5) as client:
        with pytest.raises(grpc.RpcError) as err:
            list(client.stream([5], SamplingParams(max_tokens=1)))
    assert err.value.code() is grpc.StatusCode.UNAVAILABLE
    return err.value.details() or ""


def test_health_through_warmup_serving_and_drain() -> None:
    loaded = threading.Event()
    runner = GatedRunner()

    def factory() -> ServedModel:
        assert loaded.wait(DEADLINE_S)  # "warmup" lasts until the test says so
        return ServedModel(fake_engine(runner), "fake")

    srv = BackgroundServer(ServerConfig(port=0, http_port=None), factory).start(wait_ready=False)
    stopper = threading.Thread(target=srv.stop, kwargs=dict(grace=DEADLINE_S))
    try:
        assert health(srv.target) == NOT_SERVING
        assert "loading" in unavailable(srv.target)
        loaded.set()
        wait_for(lambda: health(srv.target) == SERVING, "SERVING")
        with Client(srv.target) as client:
            held = client.stream([5, 6], SamplingParams(max_tokens=4, ignore_eos=True))
            wait_for(lambda: srv.server.engine.num_in_flight == 1, "the request to be admitted")
            stopper.start()
            wait_for(lambda: health(srv.target) == NOT_SERVING, "NOT_SERVING while draining")
            assert "shutting down" in unavailable(srv.target)
            runner.allow(1000)  # the in-flight request finishes within the grace period
            msgs = list(held)
        assert msgs[-1].finished.reason == pb2.LENGTH
        assert msgs[-1].finished.usage.completion_tokens == 4
        stopper.join(DEADLINE_S)
        assert not stopper.is_alive()
    finally:
        loaded.set()
        runner.allow(1000)
        if not stopper.is_alive():
            srv.stop()


class _Seen(logging.Handler):
    def __init__(self, needle: str):
        super().__init__()
        self.needle = needle
        self.event = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.needle in record.getMessage():
            self.event.set()


def test_drain_aborts_what_outlives_the_grace_period() -> None:
    runner = GatedRunner()
    srv = BackgroundServer(ServerConfig(port=0, http_port=None),
                           lambda: ServedModel(fake_engine(runner), "fake")).start()
    seen = _Seen("grace period over")
    logger = logging.getLogger("jaxserve.server.app")
    logger.addHandler(seen)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    stopper = threading.Thread(target=srv.stop, kwargs=dict(grace=0.2))
    try:
        with Client(srv.target) as client:
            held = client.stream([5, 6], SamplingParams(max_tokens=100, ignore_eos=True))
            wait_for(lambda: srv.server.engine.num_in_flight == 1, "the request to be admitted")
            stopper.start()
            assert seen.event.wait(DEADLINE_S)  # the engine is held: nothing could finish
            runner.allow(1000)
            msgs = list(held)
        assert msgs[-1].finished.reason == pb2.ABORT
        assert msgs[-1].finished.usage.completion_tokens < 100
        stopper.join(DEADLINE_S)
        assert not stopper.is_alive()
    finally:
        logger.removeHandler(seen)
        logger.setLevel(old_level)
        runner.allow(1000)


def test_engine_failure_turns_health_not_serving() -> None:
    srv = BackgroundServer(ServerConfig(port=0, http_port=None),
                           lambda: ServedModel(fake_engine(FailingRunner(VOCAB)), "fake")).start()
    try:
        with Client(srv.target, timeout=DEADLINE_S) as client:
            with pytest.raises(grpc.RpcError) as err:
                list(client.stream([5], SamplingParams(max_tokens=2)))
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE
        assert "device lost" in (err.value.details() or "")
        wait_for(lambda: health(srv.target) == NOT_SERVING, "NOT_SERVING after the failure")
        assert "engine failed" in unavailable(srv.target)
    finally:
        srv.stop()


# --------------------------------------------------------------------------- subprocess
# Two token buckets (a decode bucket and the whole step): the served process, its second
# launch and the in-process oracle each warm up 7 executables instead of the powers of two's
# ~20 (compiles are most of these tests' time); the bucket set is test_buckets' subject.
SERVE_FLAGS = ["--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--page-size", "8",
               "--max-model-len", "512", "--attention-impl", "reference",
               "--kv-cache-memory", "1MiB", "--token-buckets", "8,32"]
ENGINE_CFG = dict(max_num_seqs=4, max_num_batched_tokens=32, page_size=8, max_model_len=512,
                  attention_impl="reference", kv_cache_memory=1 << 20, token_buckets=(8, 32))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    d = tmp_path_factory.mktemp("tiny-hf")
    model = tiny_model()
    save_hf_dir(d, model.config, model.params)
    save_tiny_tokenizer(d, VOCAB)
    return d


@pytest.fixture(scope="module")
def env() -> dict:
    # The test session's compilation cache (conftest: JAX_COMPILATION_CACHE_DIR, with
    # JAXSERVE_COMPILATION_CACHE_DIR empty so the CLI keeps it): the second launch skips the
    # first's XLA compiles, and both reuse what other tests' servers compiled.
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


class ServeProcess:
    """`jaxserve serve` on free ports (gRPC, and HTTP unless `flags` say --no-http); `target`
    and `http_url` from its ready line."""

    def __init__(self, model_dir: pathlib.Path, env: dict, *flags: str):
        cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--model", str(model_dir),
               "--port", "0", *([] if "--no-http" in flags else ["--http-port", "0"]),
               *SERVE_FLAGS, *flags]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                     text=True, env=env)
        self.lines: queue.Queue[str] = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.http_url: str | None = None
        self.target = self._wait_ready()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.put(line)

    def _wait_ready(self) -> str:
        deadline = time.monotonic() + START_DEADLINE_S
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.proc.kill()
                raise AssertionError("no ready line; stderr:\n" + "".join(self.log))
            self.log.append(line)
            m = re.search(r"ready: serving .* on (\S+:\d+)(?: http=(\S+))?", line)
            if m:
                self.http_url = m.group(2)
                return m.group(1)

    def wait_exit(self) -> int:
        rc = self.proc.wait(DEADLINE_S)
        while not self.lines.empty():
            self.log.append(self.lines.get())
        return rc


def test_serve_process_client_cli_and_sigterm_drain(model_dir: pathlib.Path, env: dict) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    oracle = tiny_engine(**ENGINE_CFG)
    oracle.add_request("o", "w5 w6 w7", params)
    while oracle.has_unfinished():
        for out in oracle.step():
            want = out.outputs[0]
    server = ServeProcess(model_dir, env, "--shutdown-grace", "30",
                          "--served-model-name", "tiny-a", "tiny-b")
    try:
        assert server.target.startswith("127.0.0.1:")
        assert health(server.target) == SERVING
        # Both fronts by default, named on the ready line; the model under its served names.
        assert server.http_url is not None and server.http_url.startswith("http://127.0.0.1:")
        assert "ready: serving tiny-a on" in server.log[-1]
        with urllib.request.urlopen(server.http_url + "/v1/models", timeout=DEADLINE_S) as r:
            assert [m["id"] for m in json.load(r)["data"]] == ["tiny-a", "tiny-b"]
        cli = subprocess.run([sys.executable, "-m", "jaxserve.cli", "client", "w5 w6 w7",
                              "--target", server.target, "--max-tokens", "40"],
                             capture_output=True, text=True, env=env, timeout=DEADLINE_S)
        assert cli.returncode == 0, cli.stderr
        with Client(server.target) as client:
            call = client.stream("w5 w6 w7", params)
            first = next(call)
            server.proc.send_signal(signal.SIGTERM)
            msgs = [first, *call]
        rc = server.wait_exit()
    finally:
        server.proc.kill()
    assert cli.stdout == want.text + "\n"
    assert "".join(m.chunk.text for m in msgs if m.HasField("chunk")) == want.text
    assert msgs[-1].finished.reason == pb2.LENGTH  # finished within the grace period
    assert rc == 0, "".join(server.log)
    log = "".join(server.log)
    assert "draining" in log and "stopped" in log


def test_sigterm_with_no_grace_aborts_in_flight(model_dir: pathlib.Path, env: dict) -> None:
    server = ServeProcess(model_dir, env, "--shutdown-grace", "0", "--no-http")
    try:
        assert server.http_url is None
        with Client(server.target) as client:
            call = client.stream([5, 6, 7], SamplingParams(max_tokens=500, ignore_eos=True))
            first = next(call)
            server.proc.send_signal(signal.SIGTERM)
            msgs = [first, *call]
        rc = server.wait_exit()
    finally:
        server.proc.kill()
    assert msgs[-1].finished.reason == pb2.ABORT
    assert msgs[-1].finished.usage.completion_tokens < 500
    assert rc == 0, "".join(server.log)
