"""Multi-LoRA on the device: the adapter slots' stacks, writing an adapter into a slot, and
wrapping a step's target projections.

Data flow: `LoRAConfig` (max_loras, max_lora_rank) + the model config -> `lora_targets` (the
family's projections an adapter may target: q/k/v/o and a dense MLP's gate/up/down; an MoE
layer's experts are not among them) -> `init_lora_stacks`: per target field zeroed
a f[L, S, in, R] and b f[L, S, R, out] (S = max_loras + 1 slots; slot 0 stays zero: "no
adapter"), owned by the runner, split under tensor parallelism as the projection they modify
(`lora_specs`). Loading an adapter: its host arrays (`lora_loader.LoraAdapter`: per field
a [L, in, r], b [L, r, out], the scaling folded into b) -> `slot_arrays` (padded to R, zero
for the fields it does not target, K/V heads repeated as `placement` repeats the base's) ->
`write_slot` (the slot is data and the stacks donated: one compile serves every slot, and a
load is an in-place update of one slot). Each step: `attach(layers, stacks, token_slots)`
wraps every target field in a `linear.LoraWeight`; `decoder.scan_layers` hands the stacks to
each layer whole with its index and `linear` adds each row's own delta
(`kernels_pallas.lora`). Nothing here depends on which adapters are loaded: adding, switching
and mixing adapters never recompiles.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from .config import ModelConfig
from .families import family
from .linear import LoraWeight
from .paged import MODEL_AXIS

# The projections an adapter may target, as layer-params fields (PEFT's q_proj ... down_proj).
LORA_FIELDS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


@struct.dataclass
class LoraStacks:
    """Every adapter slot's low-rank matrices, per target field (the runner owns them)."""

    a: dict[str, jax.Array]  # field -> f[L, S, in, R]
    b: dict[str, jax.Array]  # field -> f[L, S, R, out] (each adapter's scaling folded in)


def lora_targets(cfg: ModelConfig) -> dict[str, tuple[int, int, int]]:
    """field -> (L, in, out) of the projections this model's adapters may target: the
    family's linear fields among LORA_FIELDS that are plain [L, in, out] projections (an MoE
    family's w_gate / w_up / w_down are expert stacks: not targets)."""
    shapes = family(cfg).param_shapes(cfg)
    out = {}
    for f in LORA_FIELDS:
        shape = shapes.get(f"layers.{f}")
        if shape is not None and len(shape) == 3:
            out[f] = tuple(shape)
    return out  # type: ignore[return-value]


def stacks_nbytes(cfg: ModelConfig, num_slots: int, rank: int, dtype: object) -> int:
    """Device bytes of the stacks (what the KV budget must leave them)."""
    size = jnp.dtype(dtype).itemsize
    return sum(num_slots * L * (i + o) * rank * size for L, i, o in lora_targets(cfg).values())


def init_lora_stacks(cfg: ModelConfig, num_slots: int, rank: int, dtype: object,
                     shardings: LoraStacks | None = None) -> LoraStacks:
    """Zeroed stacks of `num_slots` slots padded to `rank` (on `shardings` when given)."""
    targets = lora_targets(cfg)
    shapes = LoraStacks(a={f: (L, num_slots, i, rank) for f, (L, i, o) in targets.items()},
                        b={f: (L, num_slots, rank, o) for f, (L, i, o) in targets.items()})

    def zeros(shape: tuple[int, ...], sharding: Any = None) -> jax.Array:
        if sharding is None:
            return jnp.zeros(shape, dtype)
        return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()

    is_shape = lambda x: isinstance(x, tuple)  # noqa: E731
    if shardings is None:
        return jax.tree.map(zeros, shapes, is_leaf=is_shape)
    return jax.tree.map(zeros, shapes, shardings, is_leaf=is_shape)


def lora_specs(cfg: ModelConfig, stacks_or_targets: LoraStacks | None = None) -> LoraStacks:
    """The PartitionSpecs of the stacks under tensor parallelism, from the family's layout of
    each projection: a column-split projection (outputs split) has b split on its outputs and a
    whole; a row-split one (inputs split) has a split on its inputs and b whole. Each device
    then computes its own share of the delta the way it computes the base's."""
    layout = family(cfg).TP_LAYOUT
    a, b = {}, {}
    for f in lora_targets(cfg):
        if layout[f] == "col":
            a[f], b[f] = P(), P(None, None, None, MODEL_AXIS)
        elif layout[f] == "row":
            a[f], b[f] = P(None, None, MODEL_AXIS, None), P()
        else:
            a[f], b[f] = P(), P()
    return LoraStacks(a=a, b=b)


def slot_arrays(cfg: ModelConfig, weights: Mapping[str, tuple[np.ndarray, np.ndarray]],
                rank: int, kv_rep: int = 1) -> LoraStacks:
    """One adapter's per-field host arrays (a [L, in, r], b [L, r, out]) as one slot's
    arrays of the stacks: a [L, in, R], b [L, R, out] zero-padded to `rank`, zeros for the
    targets it does not adapt; with K/V heads replicated `kv_rep` times for tensor
    parallelism (`placement.kv_head_replication`), wk / wv's b columns repeated per head as
    the base weight's are. ValueError naming the field on a shape that does not fit."""
    targets = lora_targets(cfg)
    unknown = sorted(set(weights) - set(targets))
    if unknown:
        raise ValueError(f"the adapter targets {unknown}, which this model cannot adapt "
                         f"(targets: {sorted(targets)})")
    a_out, b_out = {}, {}
    for f, (L, i, o) in targets.items():
        a_full = np.zeros((L, i, rank), np.float32)
        b_full = np.zeros((L, rank, o), np.float32)
        if f in weights:
            a, b = (np.asarray(w, np.float32) for w in weights[f])
            r = a.shape[-1]
            if a.shape != (L, i, r) or b.shape != (L, r, o) or r > rank:
                raise ValueError(f"adapter field {f}: a {a.shape} / b {b.shape} do not fit "
                                 f"[L={L}, in={i}, r<={rank}] / [L, r, out={o}]")
            a_full[..., :r], b_full[:, :r] = a, b
        if kv_rep > 1 and f in ("wk", "wv"):
            heads = b_full.reshape(L, rank, cfg.num_kv_heads, cfg.head_dim)
            b_full = np.repeat(heads, kv_rep, axis=2).reshape(L, rank, -1)
        a_out[f], b_out[f] = a_full, b_full
    return LoraStacks(a=a_out, b=b_out)


def write_slot(stacks: LoraStacks, slot: jax.Array, arrays: LoraStacks) -> LoraStacks:
    """The stacks with slot `slot` (i32[], data) holding `arrays` (`slot_arrays`' layout);
    jit it with the stacks donated (`write_slot_jit`): an in-place update of one slot."""
    def put(stack: jax.Array, one: jax.Array) -> jax.Array:
        return jax.lax.dynamic_update_index_in_dim(stack, one.astype(stack.dtype), slot, 1)

    return jax.tree.map(put, stacks, arrays)


write_slot_jit = jax.jit(write_slot, donate_argnums=0)


def attach(layers: Any, stacks: LoraStacks, token_slots: jax.Array, cfg: ModelConfig,
           mesh: Mesh | None = None) -> Any:
    """The layer params with every target field a LoraWeight over `stacks` and the step's
    per-token slots i32[T] (`decoder.scan_layers` then slices the bases and hands the stacks
    whole, with the layer set). `mesh`: tensor parallel; each delta then runs split as its
    projection (the family's TP_LAYOUT)."""
    layout = family(cfg).TP_LAYOUT
    wrapped = {f: LoraWeight(base=getattr(layers, f), a=stacks.a[f], b=stacks.b[f],
                             slots=token_slots, mesh=mesh, axis=MODEL_AXIS,
                             split=layout[f] if layout[f] in ("col", "row") else "rep")
               for f in stacks.a}
    return layers.replace(**wrapped)
