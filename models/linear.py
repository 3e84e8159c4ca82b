"""Linear weights in every form the engine holds them, and `x @ W` over each.

A linear weight is stored [in_features, out_features] (x @ w), stacked over layers on axis 0:
a plain array, a `QuantizedWeight` (`models/quant.py`; a quantized tied embedding is stored
transposed, as the lm_head it also is) or, on a CPU host, a `PackedWeight` in the C++ dense
kernel's panels (`models/packing.py`). `linear` runs whichever it is given; `decoder.scan_layers`
hands a layer a packed stack whole with its index rather than a slice (a slice is a copy of the
layer's weights every step). A `LoraWeight` is any of those
with the multi-LoRA stacks of its projection beside it (`models/lora.py` wraps the target fields
for one step): `linear` adds each row's own adapter delta (`kernels_pallas.lora`) to the base
product; scan_layers slices its base like any weight and hands it the stacks whole, with `layer`
set (the delta reads that layer's slots in place). An MoE layer's expert stacks [L, E, in, out] are not linear weights
of their own (the grouped MLP reads three at once), but on a CPU host they are packed the same
way, per expert (`PackedExperts`, run by `models/moe_block.grouped_mlp`), and read in place alike.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as PS

from ..kernels_pallas.dense_cpu import PANEL, dense_packed
from ..kernels_pallas.dense_qdot_cpu import QdotPanels, dense_qdot_packed, qdot_columns
from ..kernels_pallas.dense_quant_cpu import QuantPanels, dense_quant_packed, dequantize_columns
from ..kernels_pallas.lora import lora_delta
from .quant import QuantizedWeight


@struct.dataclass
class PackedWeight:
    """A linear weight W [in, out] (or a stack of them) in the CPU dense kernel's 16-column
    panels (`kernels_pallas.dense_cpu`), float or quantized (`dense_quant_cpu`); `x @ W`
    runs that kernel."""

    # f32[(L,) ceil(out / 16), in, 16], quantized panels, or int8 / int4 quad panels
    panels: jax.Array | QuantPanels | QdotPanels
    out_features: int = struct.field(pytree_node=False)
    layer: jax.Array | None = None  # i32[]: the layer of a stack (set by scan_layers)
    # The kernel's instruction set (cpu_build.dense_isas(); None: the best this CPU runs).
    isa: str | None = struct.field(pytree_node=False, default=None)

    def matmul(self, x: jax.Array) -> jax.Array:
        if isinstance(self.panels, QdotPanels):
            return dense_qdot_packed(x.astype(jnp.float32), self.panels, self.layer,
                                     self.out_features, isa=self.isa).astype(x.dtype)
        if isinstance(self.panels, QuantPanels):
            return dense_quant_packed(x.astype(jnp.float32), self.panels, self.layer,
                                      self.out_features, isa=self.isa).astype(x.dtype)
        return dense_packed(x, self.panels, self.layer, self.out_features, isa=self.isa)

    def rows(self, ids: jax.Array) -> jax.Array:
        """W^T[ids] -> [..., in]: rows of the transposed weight (a tied embedding's lookup)."""
        if isinstance(self.panels, QdotPanels):
            return qdot_columns(self.panels, ids)
        if isinstance(self.panels, QuantPanels):
            return dequantize_columns(self.panels, ids)
        return self.panels[ids // PANEL, :, ids % PANEL]


@struct.dataclass
class PackedExperts:
    """An expert stack W [L, E, in, out] (gate, up or down) in the CPU grouped expert kernel's
    16-column panels (`kernels_pallas.moe_grouped_cpu`), in the checkpoint's float32 or
    bfloat16. Quantized experts would be another panel type beside `panels` (not yet)."""

    panels: jax.Array  # f32 | bf16[L, E, ceil(out / 16), in, 16]
    out_features: int = struct.field(pytree_node=False)
    layer: jax.Array | None = None  # i32[]: the layer of the stack (set by scan_layers)
    # The kernel's instruction set (cpu_build.dense_isas(); None: the best this CPU runs).
    isa: str | None = struct.field(pytree_node=False, default=None)

    @property
    def num_experts(self) -> int:
        return self.panels.shape[-4]


# Stacks that scan_layers hands a layer whole, with `layer` set, rather than sliced.
PACKED_STACKS = (PackedWeight, PackedExperts)

Weight = jax.Array | PackedWeight | QuantizedWeight


@struct.dataclass
class LoraWeight:
    """A target projection's base weight with the adapter slots' low-rank stacks beside it
    and the slot of every row of the step (`models/lora.attach`)."""

    base: Weight  # [in, out] one layer's (sliced by scan_layers), or a packed stack
    a: jax.Array  # f[L, S, in, R]: every layer's slots, whole
    b: jax.Array  # f[L, S, R, out] (the adapter's scaling folded in)
    slots: jax.Array  # i32[T]: each row's adapter slot (0: none)
    layer: jax.Array | None = None  # i32[]: the layer (set by scan_layers)
    # Tensor parallelism: the mesh, its axis, and how the projection is split over it
    # ("col": outputs, "row": inputs; the stacks are split alike, `models/lora.lora_specs`).
    mesh: Mesh | None = struct.field(pytree_node=False, default=None)
    axis: str = struct.field(pytree_node=False, default="model")
    split: str = struct.field(pytree_node=False, default="rep")

    def delta(self, x: jax.Array) -> jax.Array:
        """[..., in] -> [..., out]: each row's own adapter's update (zero on slot 0)."""
        if self.layer is None:
            raise ValueError("a LoraWeight is read inside scan_layers (its layer unset)")
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] != self.slots.shape[0]:
            raise ValueError(f"LoRA slots give {self.slots.shape[0]} rows, x has "
                             f"{rows.shape[0]} ({tuple(x.shape)})")
        if self.mesh is None or self.split == "rep":
            y = lora_delta(rows, self.a, self.b, self.slots, self.layer)
        else:
            y = self._sharded(rows)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def _sharded(self, rows: jax.Array) -> jax.Array:
        """The delta under tensor parallelism, each device on its own slice as the base
        projection is: a column-split one gives each device its outputs (x whole, b's
        columns); a row-split one sums the devices' partial products (x's and a's slices of
        the inputs; the sum of (x_d @ a_d) @ b over devices is (x @ a) @ b, b being linear).
        The kernel runs per device (a custom call XLA could not split itself)."""
        ax, rep = self.axis, PS()
        if self.split == "col":
            specs = (rep, rep, PS(None, None, None, ax), PS(None, ax))

            def local(x: jax.Array, a: jax.Array, b: jax.Array, s: jax.Array,
                      i: jax.Array) -> jax.Array:
                return lora_delta(x, a, b, s, i)
        else:
            specs = (PS(None, ax), PS(None, None, ax, None), rep, rep)

            def local(x: jax.Array, a: jax.Array, b: jax.Array, s: jax.Array,
                      i: jax.Array) -> jax.Array:
                return jax.lax.psum(lora_delta(x, a, b, s, i), ax)
        x_spec, a_spec, b_spec, out_spec = specs
        return jax.shard_map(local, mesh=self.mesh,
                             in_specs=(x_spec, a_spec, b_spec, rep, rep), out_specs=out_spec,
                             check_vma=False)(rows, self.a, self.b, self.slots, self.layer)


def split_stacked(w: object) -> tuple[object, object | None]:
    """A layer-params field -> (what scan_layers slices per layer, what it hands whole with
    `layer` set): a packed stack is handed whole; a LoraWeight's stacks are handed whole and
    its base follows its own kind; anything else is sliced."""
    if isinstance(w, PACKED_STACKS):
        return None, w
    if isinstance(w, LoraWeight):
        if isinstance(w.base, PACKED_STACKS):
            return None, w
        return w.base, w.replace(base=None)
    return w, None


def join_stacked(sliced: object, whole: object, layer: jax.Array) -> object:
    """The layer's field from `split_stacked`'s parts: the whole part with `layer` set (a
    LoraWeight's base being the sliced part unless it is packed)."""
    if isinstance(whole, LoraWeight):
        base = whole.base.replace(layer=layer) if whole.base is not None else sliced
        return whole.replace(base=base, layer=layer)
    return whole.replace(layer=layer)  # type: ignore[attr-defined]


def linear(x: jax.Array, w: Weight | LoraWeight, b: jax.Array | None = None) -> jax.Array:
    """x [..., in] @ w [in, out] (+ b [out]) in x's dtype."""
    if isinstance(w, LoraWeight):
        y = linear(x, w.base) + w.delta(x)
        return y if b is None else y + b.astype(x.dtype)
    if isinstance(w, (PackedWeight, QuantizedWeight)):
        y = w.matmul(x)
    else:
        y = jnp.einsum("...i,io->...o", x, w.astype(x.dtype))
    return y if b is None else y + b.astype(x.dtype)
