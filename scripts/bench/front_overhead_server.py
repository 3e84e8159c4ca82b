"""The server side of scripts/bench/front_overhead.py (its sibling, imported): a tiny random
checkpoint and one `jaxserve serve` subprocess with every port explicit.

Data flow: `jaxserve.models.tiny.write_tiny_checkpoint(dir)` -> an HF folder (random 2-layer
Llama weights through jaxserve's own `save_hf_dir`, a word-level tokenizer "w3", "w4", ...
with a chat template) -> `serve(model, Ports(grpc, http, metrics), flags)`: `python -m
jaxserve.cli serve --port G --http-port H --metrics-port M ...` (explicit ports: this keeps
working whatever the serving defaults are), its output in a temporary file; the context manager yields once HTTP /health
answers 200 (a tqdm line shows the wait) and terminates the server on exit. A server that
exits early raises with its log.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Iterator

import aiohttp
from tqdm.auto import tqdm


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass(frozen=True)
class Ports:
    grpc: int
    http: int
    metrics: int


@contextlib.contextmanager
def serve(model: str | None, ports: Ports, engine_flags: list[str],
          timeout: float) -> Iterator[None]:
    """`jaxserve serve` with every port explicit; yields once /health answers 200."""
    cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--host", "127.0.0.1",
           "--port", str(ports.grpc), "--http-port", str(ports.http),
           "--metrics-port", str(ports.metrics), "--max-waiting", "0", *engine_flags]
    if model is not None:
        cmd += ["--model", model]
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        asyncio.run(_wait_healthy(proc, f"http://127.0.0.1:{ports.http}/health", timeout, log))
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


async def _wait_healthy(proc: subprocess.Popen, url: str, timeout: float, log: Any) -> None:
    t0 = time.monotonic()
    with tqdm(desc="server loading + compiling", unit="s", bar_format="{desc}: {elapsed}") as bar:
        async with aiohttp.ClientSession() as session:
            while True:
                if proc.poll() is not None:
                    log.seek(0)
                    raise RuntimeError(f"the server exited ({proc.returncode}):\n{log.read()}")
                if time.monotonic() - t0 > timeout:
                    raise TimeoutError(f"the server was not healthy within {timeout:g} s")
                with contextlib.suppress(aiohttp.ClientError):
                    async with session.get(url) as resp:
                        if resp.status == 200:
                            return
                await asyncio.sleep(0.5)  # polling a subprocess: nothing to await on
                bar.refresh()
