"""Offline API shaped like vLLM's: `LLM(model=...).generate(prompts, SamplingParams(...))`.

Data flow: keyword arguments -> EngineConfig (validated) -> `build_engine` loads the model,
derives pages and buckets from free memory (`sizing.plan_engine`), creates the ModelRunner
(KV pages on device) and compiles every bucket -> `generate` adds every prompt to the Engine
and steps it until all are finished, returning RequestOutputs in input order.

Data parallel (`data_parallel_size` > 1): `build_engines` builds one such engine per row of a
(data, model) mesh of the local devices and `generate` drives them as a `ReplicaPool`.
"""

from __future__ import annotations

import itertools
import logging
from typing import Sequence

import jax
import jax.numpy as jnp
from tqdm.auto import tqdm

from . import sharding
from .config import EngineConfig, RuntimeConfig, apply_runtime
from .engine import Engine
from .kernels_pallas import padded_head_dim, select_impl
from .model_runner import ModelRunner
from .multihost import LeaderRunner, agree_min
from .models.loading import LoadedModel, load_model
from .models.paged import MODEL_AXIS
from .outputs import RequestOutput
from .replica_pool import ReplicaPool
from .router import make_router
from .sampling_params import SamplingParams
from .sizing import EnginePlan, available_host_memory, free_device_memory, plan_engine

log = logging.getLogger(__name__)

Prompt = str | Sequence[int]
DATA_AXIS = "data"  # replicas; each row of the mesh is one replica's "model" axis
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def build_engine(config: EngineConfig, model: LoadedModel | None = None,
                 warmup: bool = True, progress: bool = True,
                 devices: Sequence[jax.Device] | None = None,
                 memory_share: float = 1.0) -> Engine:
    """Load (unless given), size, place and compile: a ready-to-step Engine.

    `devices`: the tensor_parallel_size devices this engine runs on (a data-parallel replica's
    row of the mesh); None: the first ones. `memory_share`: the fraction of free host
    memory this engine may size its KV pages from when the devices do not report their own
    (CPU, where data-parallel replicas share one host's memory).

    Under `jax.distributed` (several processes) this runs on process 0 only, and its runner
    announces every step to the other processes, which run `build_follower` + `follow`.
    """
    if jax.process_index() != 0:
        raise ValueError(f"build_engine on process {jax.process_index()}: only process 0 "
                         "runs the engine; the others run multihost.follow(build_follower())")
    model, plan, runner = _build_runner(config, model, devices, memory_share)
    if jax.process_count() > 1:
        runner = LeaderRunner(runner, config.multihost_keepalive_s)
    if warmup:
        runner.warmup(progress)
    return Engine(config, plan, runner, model.tokenizer, model.config.eos_token_ids)


def build_follower(config: EngineConfig) -> ModelRunner:
    """A process > 0's share of a multi-host engine: the same runner process 0 builds (same
    mesh, shapes and KV pages), driven by `multihost.follow`."""
    if jax.process_count() == 1 or jax.process_index() == 0:
        raise ValueError("build_follower is for processes > 0 of a jax.distributed job")
    return _build_runner(config, None, None, 1.0)[2]


def _build_runner(config: EngineConfig, model: LoadedModel | None,
                  devices: Sequence[jax.Device] | None,
                  memory_share: float) -> tuple[LoadedModel, EnginePlan, ModelRunner]:
    if config.compilation_cache_dir:
        apply_runtime(RuntimeConfig(compilation_cache_dir=config.compilation_cache_dir))
    tp = config.tensor_parallel_size
    if jax.process_count() > 1 and (config.data_parallel_size > 1 or devices is not None):
        raise ValueError(f"data_parallel_size={config.data_parallel_size}: data parallelism "
                         "is per host; across hosts run one server per replica")
    device = devices[0] if devices is not None else jax.local_devices()[0]
    mesh = None
    if tp > 1 or devices is not None:
        mesh = sharding.make_tp_mesh(tp, None if devices is None else list(devices))
    # A model not given loads straight into its shardings (each device reads only its own
    # slice of the checkpoint); shard_params then hands those params back unchanged.
    model = model or load_model(config.model, config.dtype, mesh=mesh)
    run_cfg, params = model.config, model.params
    if mesh is not None:
        run_cfg = sharding.tp_model_config(model.config, tp)
        params = sharding.shard_params(model.params, model.config, mesh)
    attn_impl = select_impl(config.attention_impl)
    kv_dtype = _DTYPES[config.kv_cache_dtype or config.dtype]
    # Pallas kernels want lane-aligned head dims; the jnp reference takes any.
    kv_head_dim = None if attn_impl == "reference" else padded_head_dim(model.config.head_dim)
    free = free_device_memory(device)
    # Under tensor parallelism the KV budget is still one device's free memory for all the
    # pages: conservative (each device holds 1 / tp of them, or 1 / num_kv_heads when KV
    # heads are replicated), and right on CPU where the virtual devices share host memory.
    if free is None:
        free = int(available_host_memory() * memory_share)
    # Several processes must build the very same step: they size from the smallest budget.
    plan = plan_engine(config, run_cfg, jnp.dtype(kv_dtype).itemsize, agree_min(free),
                       kv_head_dim)
    log.info("KV cache: %d pages of %d tokens (%.1f MiB), attention=%s, devices=%s",
             plan.scheduler.num_pages - 1, plan.scheduler.page_size,
             plan.kv_budget_bytes / 2**20, attn_impl,
             [d.id for d in (mesh.devices.flat if mesh is not None else [device])])
    runner = ModelRunner(run_cfg, params, plan.batch_shape, plan.scheduler.num_pages,
                         kv_dtype, attn_impl, kv_head_dim, mesh)
    return model, plan, runner


def build_engines(config: EngineConfig, model: LoadedModel | None = None,
                  warmup: bool = True, progress: bool = True) -> list[Engine]:
    """`data_parallel_size` independent engines, replica i on row i of a (data, model) mesh
    of the local devices; each has its own scheduler, KV pages and compiled step.

    Every replica compiles before any compile guard is armed: replicas run on different
    devices, so each compiles its own executables, and a guard armed early would count the
    next replica's warmup as serving compiles.
    """
    dp = config.data_parallel_size
    if dp == 1:
        return [build_engine(config, model, warmup, progress)]
    # Given no model, each replica loads the checkpoint straight onto its own devices (a
    # memory-mapped re-read per replica) rather than staging one copy on device 0.
    rows = replica_device_rows(dp, config.tensor_parallel_size)
    engines = [build_engine(config, model, warmup=False, progress=progress, devices=row,
                            memory_share=1.0 / dp) for row in rows]
    if warmup:
        for i, eng in enumerate(engines):
            log.info("compiling data-parallel replica %d/%d", i + 1, dp)
            eng.runner.warmup(progress, arm=False)
        for eng in engines:
            eng.runner.arm()
    return engines


def build_offline_engine(config: EngineConfig, model: LoadedModel | None = None,
                         warmup: bool = True, progress: bool = True) -> Engine | ReplicaPool:
    """One Engine, or a ReplicaPool over `data_parallel_size` of them (same calls)."""
    engines = build_engines(config, model, warmup, progress)
    return engines[0] if len(engines) == 1 else ReplicaPool(engines, make_router(engines))


def replica_device_rows(dp: int, tp: int) -> list[list[jax.Device]]:
    """The rows of the (data, model) mesh: the devices of each data-parallel replica."""
    devices = jax.local_devices()
    if dp * tp > len(devices):
        raise ValueError(f"data_parallel_size={dp} x tensor_parallel_size={tp} needs {dp * tp} "
                         f"devices; {len(devices)} local {devices[0].platform} device(s)")
    # make_mesh orders the devices by the interconnect's topology where it has one (TPU),
    # so each replica's tensor-parallel group sits on neighbouring chips.
    mesh = jax.make_mesh((dp, tp), (DATA_AXIS, MODEL_AXIS), devices=devices[:dp * tp])
    return [list(row) for row in mesh.devices]


class LLM:
    """Offline batch generation. Keyword arguments are EngineConfig fields."""

    def __init__(self, model: str | None = None, **kwargs: object):
        self.config = EngineConfig(model=model, **kwargs)  # type: ignore[arg-type]
        self.engine = build_offline_engine(self.config)
        self._ids = itertools.count()

    def close(self) -> None:
        """Release the engine (several hosts: the other processes stop following)."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def tokenizer(self):  # noqa: ANN201 - jaxserve.models.tokenizer.Tokenizer
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None
                 ) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids); outputs in input order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None:
            params: list[SamplingParams] = [SamplingParams()] * len(prompts)
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        prio = list(priority) if priority is not None else [0] * len(prompts)
        ids = [f"llm-{next(self._ids)}" for _ in prompts]
        added: list[str] = []
        try:
            for rid, p, sp, pr in zip(ids, prompts, params, prio):
                self.engine.add_request(rid, p, sp, priority=pr)
                added.append(rid)
        except ValueError:
            for rid in added:  # leave the engine as we found it
                self.engine.abort(rid)
            while self.engine.has_unfinished():
                self.engine.step()
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: Sequence[dict] | Sequence[Sequence[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.tokenizer.apply_chat_template(list(c), add_generation_prompt,
                                                      tokenize=True) for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm) as bar:
            toks = 0
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    toks += sum(len(c.delta_token_ids) for c in out.outputs)
                    if out.finished:
                        final[out.request_id] = out
                        bar.update(1)
                bar.set_postfix(tok_s=f"{toks / max(bar.format_dict['elapsed'], 1e-9):.1f}")
        return [final[i] for i in ids]


__all__ = ["LLM", "SamplingParams", "build_engine", "build_engines", "build_offline_engine"]
