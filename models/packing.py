"""Params for the CPU dense kernel: every linear weight packed into 16-column panels.

Data flow: a family's params as loaded (f32 on one CPU device, weights [L, in, out]) ->
`pack_params` -> the same tree with each linear weight a `PackedWeight`
(f32[L, ceil(out / 16), in, 16]; `kernels_pallas.dense_cpu` says why) -> the engine's step,
where `_linear` runs the C++ kernel and `scan_layers` reads each layer in place. A tied
embedding is packed transposed, as the lm_head it also is; token lookups read its columns.
A `QuantizedWeight` (`models/quant.py`) is packed the same way into quantized panels
(`kernels_pallas.dense_quant_cpu`; a quantized tied embedding is already transposed). Norms
and biases stay as they are. Packing runs leaf by leaf on the host; the unpacked tree
lives until the caller drops it (at load, the peak is twice the weights).
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np

from ..kernels_pallas.dense_cpu import pack_panels
from ..kernels_pallas.dense_quant_cpu import pack_quant
from .families import ModelParams, family_of_params
from .linear import PackedWeight
from .llama import LINEAR_FIELDS
from .quant import QuantizedWeight


__all__ = ["LINEAR_FIELDS", "can_pack", "pack_params"]  # LINEAR_FIELDS: the Llama family's


def can_pack(params: ModelParams) -> str | None:
    """None if `params` can be packed, else why not (the kernel takes float32 or quantized
    weights on one device)."""
    for node in jax.tree_util.tree_leaves(params,
                                          is_leaf=lambda x: isinstance(x, QuantizedWeight)):
        arrays = jax.tree_util.tree_leaves(node)
        if not isinstance(node, QuantizedWeight) and node.dtype != jnp.float32:
            return f"the weights are {node.dtype}, the CPU dense kernel takes float32"
        if any(len(a.sharding.device_set) != 1 for a in arrays):
            return "the weights are sharded over several devices"
    return None


def _pack(w: jax.Array | QuantizedWeight, transpose: bool = False,
          isa: str | None = None) -> PackedWeight:
    if isinstance(w, QuantizedWeight):  # a quantized tied embedding is already transposed
        panels = pack_quant(np.asarray(w.values), np.asarray(w.scales),
                            None if w.zeros is None else np.asarray(w.zeros), w.scheme)
        out_features, like = w.shape[-1], w.values
    else:
        host = np.asarray(w).T if transpose else np.asarray(w)
        panels, out_features, like = pack_panels(host), host.shape[-1], w
    # Placed as the weight was: committed to its device, or not (an uncommitted step's
    # outputs are uncommitted, and the sampler is compiled for those).
    device = next(iter(like.sharding.device_set))
    placed = jax.tree.map(lambda a: jax.device_put(a, device) if like.committed
                          else jnp.asarray(a), panels)
    return PackedWeight(panels=placed, out_features=int(out_features), isa=isa)


def pack_params(params: ModelParams, isa: str | None = None) -> ModelParams:
    """Every linear weight of `params` (and the lm_head, or the tied embedding) packed, run by
    the kernel's `isa` variant (None: the best this CPU runs; cpu_build.dense_isas())."""
    why = can_pack(params)
    if why is not None:
        raise ValueError(f"cannot pack the weights for the CPU dense kernel: {why}")
    layers = params.layers
    for name in family_of_params(params).LINEAR_FIELDS:
        w = getattr(layers, name)
        if not isinstance(w, PackedWeight):
            layers = layers.replace(**{name: _pack(w, isa=isa)})
    params = params.replace(layers=layers)
    if params.lm_head is not None:
        return params.replace(lm_head=_pack(params.lm_head, isa=isa))
    return params.replace(embed=_pack(params.embed, transpose=True, isa=isa))
