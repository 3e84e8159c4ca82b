"""The multi-LoRA parts of building an engine (`build.py` calls these; `spec_build.py` is the
same for speculative decoding).

Data flow: `EngineConfig.lora_config` -> `check_supported` (what LoRA cannot run with yet is
refused by name, before anything loads) -> `device_slots`: the adapter stacks created on the
engine's devices right after its weights, so the free memory the KV pages are sized from is
read with them already allocated -> the runner holds them -> `adapter_loader`: the callable
the engine's registry loads a PEFT directory with (`models.lora_loader`, checked against the
checkpoint's config and `max_lora_rank`) -> `register_modules`: the `--lora-modules` adapters
registered (and loaded, so a bad one fails the start-up) before serving.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxserve.config import EngineConfig
from jaxserve.device.lora_slots import DeviceLoraSlots, kv_replication
from jaxserve.models.config import ModelConfig
from jaxserve.models.lora import stacks_nbytes
from jaxserve.models.lora_loader import load_peft_adapter

log = logging.getLogger(__name__)


def check_supported(config: EngineConfig) -> None:
    """ValueError naming what LoRA does not run with (nothing is loaded yet)."""
    if config.lora_config is None:
        return
    if jax.process_count() > 1:
        # A load is a device write every process would have to repeat in step order.
        raise ValueError("enable_lora over several processes (jax.distributed) is not "
                         "supported: serve LoRA from a single-host engine")
    if config.batch_invariant:
        raise ValueError("enable_lora with batch_invariant=True is not supported: the "
                         "adapter delta's summation order is not fixed per row")


def device_slots(config: EngineConfig, cfg: ModelConfig, run_cfg: ModelConfig,
                 mesh: Mesh | None, dtype: Any) -> DeviceLoraSlots | None:
    """The engine's adapter stacks (None without LoRA): `run_cfg` the config the step runs
    (K/V heads replicated for the mesh), `cfg` the checkpoint's."""
    lora = config.lora_config
    if lora is None:
        return None
    slots = DeviceLoraSlots(run_cfg, lora, dtype, mesh, kv_replication(cfg, mesh))
    log.info("LoRA: %d slots of rank %d (%.1f MiB)", lora.max_loras, lora.max_lora_rank,
             stacks_nbytes(run_cfg, lora.num_slots, lora.max_lora_rank, dtype) / 2**20)
    return slots


def adapter_loader(config: EngineConfig, cfg: ModelConfig) -> Callable[..., Any] | None:
    """path -> LoraAdapter, checked against the checkpoint's config `cfg` (None w/o LoRA)."""
    lora = config.lora_config
    if lora is None:
        return None
    return functools.partial(load_peft_adapter, cfg=cfg, max_rank=lora.max_lora_rank)


def stacks_dtype(config: EngineConfig, quantized: bool) -> Any:
    """The stacks' dtype: `lora_dtype`; auto: the model's (vLLM's rule), except bfloat16 for
    a float32 model whose weights are stored quantized (`quantized`: the bundled Q4_1 GGUF).
    Such a model has no float weights to match; its 4-8-bit base errs far more than the
    adapters' bfloat16 rounding (2^-8), while float32 stacks would double what each decode
    step reads for them and, on CPU, forgo the bfloat16 dot products (csrc/lora_bf16_dot.h):
    8 rank-16 adapters cost the bundled model ~22% of its decode throughput in float32
    (docs/benchmarks)."""
    lora = config.lora_config
    name = config.dtype if lora is None else lora.lora_dtype
    if name == "auto":
        name = "bfloat16" if quantized and config.dtype == "float32" else config.dtype
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[name]
