"""What the entry points run on top of `build.py`'s engines: one engine or a replica pool
for offline use, and a served model (engines + how callers name it) started on loop threads
for the servers.

Data flow: `build_offline_engine(config)` -> `build.build_engines` -> one Engine, or a
`ReplicaPool` over the data-parallel replicas (same calls; `LLM`, `jaxserve batch`);
`build_served(config)` -> the engines plus the model's name and format (`ServedModel`) ->
`start_serving`: an `AsyncEngine` per replica on its own loop thread with its Prometheus
view (`EngineMetrics`), behind an `AsyncReplicaPool` when there are several (`jaxserve
serve`, `jaxserve bench`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from jaxserve.config import EngineConfig
from jaxserve.engine.engine import Engine
from jaxserve.models.loading import LoadedModel, detect_format, resolve_model_path
from jaxserve.serving.async_engine import AsyncEngine
from jaxserve.serving.async_replica_pool import AsyncReplicaPool, AsyncServing
from jaxserve.serving.build import build_engines
from jaxserve.serving.metrics import EngineMetrics
from jaxserve.serving.replica_pool import ReplicaPool
from jaxserve.serving.request_stream import DEFAULT_MAX_STREAM_BUFFER_TOKENS
from jaxserve.serving.router import make_router


def build_offline_engine(config: EngineConfig, model: LoadedModel | None = None,
                         warmup: bool = True, progress: bool = True) -> Engine | ReplicaPool:
    """One Engine, or a ReplicaPool over `data_parallel_size` of them (same calls)."""
    if config.slo_admission == "reject":
        raise ValueError("slo_admission='reject' refuses requests as they arrive at a server; "
                         "the offline API (LLM, batch jobs) queues every prompt at once and "
                         "runs them all: use 'queue' (misses are still counted)")
    engines = build_engines(config, model, warmup, progress)
    return engines[0] if len(engines) == 1 else ReplicaPool(engines, make_router(engines))


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """A ready engine and how to describe it to callers."""

    engine: Engine  # the (first) engine: config, plan and tokenizer are the same on all
    name: str  # the --model value or "bundled"; also the metrics' model_name label
    format: str = ""  # gguf | hf | orbax, when known
    replicas: tuple[Engine, ...] = ()  # data parallel: every replica (engine is the first)

    @property
    def engines(self) -> tuple[Engine, ...]:
        return self.replicas or (self.engine,)


def model_name(config: EngineConfig, model: LoadedModel | None = None) -> str:
    """What callers see as the model: the --model value, or "bundled:<file>"."""
    source = model.source if model is not None else resolve_model_path(config.model)
    return config.model or f"bundled:{source.name}"


def build_served(config: EngineConfig, model: LoadedModel | None, progress: bool) -> ServedModel:
    """Size, place and warm up an engine (data parallel: one per replica), ready to attach.
    `model` None: each engine loads config.model straight onto its own devices."""
    engines = build_engines(config, model, warmup=True, progress=progress)
    fmt = model.format if model is not None else detect_format(resolve_model_path(config.model))
    return ServedModel(engine=engines[0], name=model_name(config, model), format=fmt,
                       replicas=tuple(engines) if len(engines) > 1 else ())


def start_serving(served: ServedModel, max_waiting: int | None,
                  on_failure: Callable[[BaseException], None] | None = None,
                  max_stream_buffer_tokens: int | None = DEFAULT_MAX_STREAM_BUFFER_TOKENS
                  ) -> tuple[AsyncServing, EngineMetrics]:
    """Each replica's engine on its own loop thread (an AsyncEngine fed to its Prometheus
    view), behind a router when there are several; started. The metrics' registry holds
    every replica's series. `max_stream_buffer_tokens`: per stream, see `request_stream`."""
    engines = served.engines
    max_tokens = served.engine.config.max_num_batched_tokens
    spec = served.engine.config.speculative_config  # its metrics exist only when on, as vLLM's
    k = None if spec is None else spec.num_speculative_tokens
    metrics = ([EngineMetrics(served.name, max_tokens, num_speculative_tokens=k)]
               if len(engines) == 1 else EngineMetrics.for_replicas(
                   served.name, max_tokens, len(engines), num_speculative_tokens=k))
    for e, m in zip(engines, metrics):
        m.watch_settings(e.scheduler_settings)
    replicas = [AsyncEngine(e, max_waiting, observers=[m], on_failure=on_failure,
                            max_stream_buffer_tokens=max_stream_buffer_tokens)
                for e, m in zip(engines, metrics)]
    serving: AsyncServing = replicas[0] if len(replicas) == 1 else AsyncReplicaPool(
        replicas, make_router(engines))
    serving.start()
    return serving, metrics[0]
