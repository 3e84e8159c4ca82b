"""A GrpcServer on its own asyncio loop in a daemon thread: for tests, benchmarks, notebooks.

Data flow: `start()` launches the thread, which runs `GrpcServer.start()` + `load()` and then
waits for a stop request; the caller blocks until the server is SERVING (or re-raises what
failed). `stop(grace)` hands the stop request to the server's loop and waits for the drain.
The process-level entry point with signal handling is `jaxserve.server.app.serve`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

from jaxserve.server.app import EngineFactory, GrpcServer
from jaxserve.server.config import ServerConfig


class BackgroundServer:
    def __init__(self, cfg: ServerConfig, factory: EngineFactory):
        self.server = GrpcServer(cfg, factory)
        self._listening: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._started: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._finished = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._grace: float | None = None
        self._thread = threading.Thread(target=self._run, name="jaxserve-grpc", daemon=True)

    @property
    def target(self) -> str:
        """host:port for a client channel."""
        return self.server.address

    def start(self, timeout: float = 600.0, wait_ready: bool = True) -> "BackgroundServer":
        """Start; return once SERVING (or, with `wait_ready=False`, once listening)."""
        self._thread.start()
        self._listening.result(timeout)
        if wait_ready:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 600.0) -> None:
        self._started.result(timeout)

    def stop(self, grace: float = 0.0, timeout: float = 120.0) -> None:
        """Drain (in-flight calls get `grace` seconds) and stop; waits for it."""
        if self._loop is not None and self._stop is not None and not self._finished.is_set():
            self._grace = grace
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the server did not stop within {timeout}s")

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:  # noqa: BLE001 - surfaced through start()
            for future in (self._listening, self._started):
                if not future.done():
                    future.set_exception(e)
        finally:
            for future in (self._listening, self._started):
                if not future.done():
                    future.set_exception(RuntimeError("the server stopped before it was ready"))
            self._finished.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            await self.server.start()
            self._listening.set_result(None)
            loading = asyncio.ensure_future(self.server.load())
            stopping = asyncio.ensure_future(self._stop.wait())
            await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if loading.done():
                loading.result()  # a failed load raises here
                self._started.set_result(None)
                await stopping
            else:
                loading.cancel()
        finally:
            await self.server.shutdown(self._grace)
