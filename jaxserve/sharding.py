"""Tensor parallelism over a JAX device mesh: which axis of each weight and of the KV pages
lives on which device, for XLA's SPMD partitioner to compile one program for all of them.

Data flow: `tensor_parallel_size` (EngineConfig) -> `make_tp_mesh` (a 1-D Mesh, axis
"model") -> `kv_head_replication(model_cfg, tp)` decides whether KV heads must be replicated ->
`shard_params` (`models/placement.py`: KV heads replicated as lazy views if needed, then every
leaf placed with `jax.make_array_from_callback`, each device reading only its own slice of a
host source or of a jax array, so no device holds a full split leaf; `load_model(path, dtype,
mesh)` loads straight through the same placement) -> the runner places the KV pages with
`kv_sharding` and every step's inputs replicated; `paged_forward(..., mesh=mesh)` runs
attention under `jax.shard_map`, each device on its own heads, and the rest of the step is
partitioned by XLA from these shardings.

Layout (Megatron style, per layer):
  wq / wk / wv (and their biases): columns split by head over "model";
  wo: rows split by head -> one all-reduce after the attention block;
  w_gate / w_up: columns split; w_down: rows split -> one all-reduce after the MLP;
  embed [vocab, hidden] and lm_head [hidden, vocab]: split by vocabulary (replicated when tp
  does not divide the vocabulary);
  norms (and q/k norms, shared by heads): replicated;
  KV pages [L * num_pages, 2 * Hkv, page_size, D]: split on the 2 * Hkv axis, so each device
  holds the pages of its own KV heads (rows 2h / 2h + 1 stay together).
KV heads that do not divide by tp: when tp is a multiple of num_kv_heads, each KV head is
replicated tp / num_kv_heads times (so every device holds exactly one, shared by its query
heads, as in vLLM); per-device KV bytes are then 1 / num_kv_heads of one copy instead of 1 / tp.
num_heads must divide by tp.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .models.config import ModelConfig
from .models.llama import LlamaParams
from .models.paged import KV_PAGES_SPEC, MODEL_AXIS
from .models.placement import kv_head_replication, param_shardings, place_params

__all__ = ["make_tp_mesh", "kv_head_replication", "tp_model_config", "shard_params",
           "param_shardings", "kv_sharding", "replicated"]


def make_tp_mesh(tp: int, devices: list | None = None) -> Mesh:
    """A 1-D mesh of the first `tp` of `devices` (default: `jax.devices()`, every process's
    devices in a multi-process job), axis "model"."""
    devices = list(devices if devices is not None else jax.devices())
    if tp < 1 or tp > len(devices):
        raise ValueError(f"tensor_parallel_size={tp} needs {tp} devices; {len(devices)} "
                         f"available ({devices[0].platform if devices else 'none'})")
    return Mesh(np.array(devices[:tp]), (MODEL_AXIS,))


def tp_model_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The config the sharded model runs with (KV heads replicated where needed)."""
    rep = kv_head_replication(cfg, tp)
    return cfg if rep == 1 else dataclasses.replace(cfg, num_kv_heads=cfg.num_kv_heads * rep)


def shard_params(params: LlamaParams, cfg: ModelConfig, mesh: Mesh) -> LlamaParams:
    """Replicate KV heads if tp needs it, then place every leaf on its sharding.

    Leaves may be host sources (numpy, memmaps, lazy checkpoint views) or jax arrays; each
    device receives only its slice. Params already placed on this mesh come back unchanged.
    """
    return place_params(params, cfg, mesh)


def kv_sharding(mesh: Mesh) -> NamedSharding:
    """KV pages [L * num_pages, 2 * Hkv, page_size, D] split by KV head."""
    return NamedSharding(mesh, KV_PAGES_SPEC)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())
