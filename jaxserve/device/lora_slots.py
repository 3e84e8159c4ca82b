"""The device's adapter slots: the LoRA stacks every step reads, and loading one adapter in.

Data flow: `LoRAConfig` + the (tensor-parallel) model config -> `DeviceLoraSlots` creates the
zeroed stacks (`models.lora.init_lora_stacks`, max_loras + 1 slots padded to max_lora_rank, in
the model's dtype; split like their projections over the mesh) -> the engine's slot table
decides which adapter goes to which slot and calls `ModelRunner.load_lora(slot, adapter)` ->
`load`: the adapter's host arrays (`models.lora_loader.LoraAdapter.weights`) laid out as one
slot (`models.lora.slot_arrays`), placed, and written by `write_slot_jit` (slot as data, stacks
donated: compiled once, at warmup, for every slot) -> every step passes `stacks` to the forward
beside the per-token slots of the batch.

Ordering: a load is queued on the device after every step already dispatched and before the
next, and it replaces the stacks functionally, so a step in flight reads the slot's old
adapter; the engine only reloads a slot no running sequence uses (`engine/lora_slots.py`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxserve.lora_config import LoRAConfig
from jaxserve.models import placement
from jaxserve.models.config import ModelConfig
from jaxserve.models.lora import (LoraStacks, init_lora_stacks, lora_specs, slot_arrays,
                                  write_slot_jit)
from jaxserve.models.paged import MODEL_AXIS


class DeviceLoraSlots:
    """Owns the LoRA stacks on the device (`stacks`, read by every step)."""

    def __init__(self, cfg: ModelConfig, lora: LoRAConfig, dtype: Any,
                 mesh: Mesh | None = None, kv_rep: int = 1):
        """`cfg`: the model config the step runs (under tensor parallelism the sharded one,
        `placement.tp_model_config`); `kv_rep`: how many times its K/V heads were replicated
        for the mesh (`placement.kv_head_replication`), so an adapter's wk / wv outputs are
        repeated alike. The stacks are built from the original head count's shapes times
        `kv_rep`, i.e. from `cfg` as given."""
        self.cfg = cfg
        self.lora = lora
        self.kv_rep = kv_rep
        self.mesh = mesh
        self.shardings: LoraStacks | None = None
        if mesh is not None:
            self.shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec),
                                          lora_specs(cfg),
                                          is_leaf=lambda x: isinstance(x, PartitionSpec))
        self.stacks = init_lora_stacks(cfg, lora.num_slots, lora.max_lora_rank, dtype,
                                       self.shardings)
        self.last_load_s = 0.0  # seconds the last `load` took (placing and writing)

    @property
    def num_slots(self) -> int:
        return self.lora.num_slots

    def _base_cfg(self) -> ModelConfig:
        """The config an adapter's shapes follow: the checkpoint's K/V head count."""
        if self.kv_rep == 1:
            return self.cfg
        return dataclasses.replace(self.cfg, num_kv_heads=self.cfg.num_kv_heads // self.kv_rep)

    def load(self, slot: int, weights: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
        """Write one adapter's weights (field -> (a [L, in, r], b [L, r, out])) into `slot`
        (1..max_loras); ValueError naming the slot or field on what does not fit."""
        if not 1 <= slot < self.num_slots:
            raise ValueError(f"LoRA slot {slot} is not in [1, {self.num_slots - 1}] "
                             "(slot 0 is the base model's)")
        start = time.perf_counter()
        arrays = slot_arrays(self._base_cfg(), weights, self.lora.max_lora_rank, self.kv_rep)
        if self.shardings is None:
            placed = jax.device_put(arrays)
        else:
            placed = jax.device_put(arrays, jax.tree.map(_one_slot, self.shardings))
        self.stacks = write_slot_jit(self.stacks, np.int32(slot), placed)
        jax.block_until_ready(self.stacks)
        self.last_load_s = time.perf_counter() - start

    def warmup(self) -> None:
        """Compile the slot write (zeros into slot 1: no adapter is loaded yet)."""
        self.load(1, {})


def _one_slot(stack: NamedSharding) -> NamedSharding:
    """The sharding of one slot of a stack [L, S, ...]: the stack's without its slot axis."""
    parts = tuple(stack.spec) + (None,) * (4 - len(stack.spec))
    return NamedSharding(stack.mesh, PartitionSpec(parts[0], *parts[2:]))


def kv_replication(cfg: ModelConfig, mesh: Mesh | None) -> int:
    """K/V head copies the mesh needs (`placement.kv_head_replication`; 1 without a mesh)."""
    return 1 if mesh is None else placement.kv_head_replication(cfg, mesh.shape[MODEL_AXIS])
