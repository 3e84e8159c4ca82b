"""An in-process jaxserve gRPC server for benchmarks that need to pick the engine's settings.

Data flow: EngineConfig + an already loaded model (loaded once, reused across the tuner's grid)
-> `GrpcServer` on 127.0.0.1, a free port, no waiting-queue bound -> start, build + warm up the
engine (every bucket compiled before the first measured request) -> yields the address ->
drain with no grace and stop, dropping the engine (its KV pages) before the next point.

The load generator then talks to it over real gRPC from the same event loop: the same client
path as a remote server, minus the network.
"""

from __future__ import annotations

import contextlib
from typing import AsyncIterator

from jaxserve.config import EngineConfig
from jaxserve.models.loading import LoadedModel


@contextlib.asynccontextmanager
async def local_server(config: EngineConfig, model: LoadedModel,
                       progress: bool = False) -> AsyncIterator[str]:
    """`async with local_server(cfg, model) as address:` -> "127.0.0.1:PORT", ready."""
    from jaxserve.server.app import GrpcServer
    from jaxserve.server.config import ServerConfig
    from jaxserve.serving.served import build_served

    server = GrpcServer(ServerConfig(port=0, http_port=None, max_waiting=None),
                        lambda: build_served(config, model, progress))
    try:
        await server.start()
        await server.load()
        yield server.address
    finally:
        await server.shutdown(grace=0.0)
