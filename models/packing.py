"""Params for the CPU dense kernel: every linear weight packed into 16-column panels.

Data flow: LlamaParams as loaded (f32 on one CPU device, weights [L, in, out]) ->
`pack_params` -> the same tree with each linear weight a `PackedWeight`
(f32[L, ceil(out / 16), in, 16]; `kernels_pallas.dense_cpu` says why) -> the engine's step,
where `_linear` runs the C++ kernel and `scan_layers` reads each layer in place. A tied
embedding is packed transposed, as the lm_head it also is; token lookups read its columns.
Norms and biases stay as they are. Packing runs leaf by leaf on the host; the unpacked tree
lives until the caller drops it (at load, the peak is twice the weights).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..kernels_pallas.dense_cpu import pack_panels
from .llama import LayerParams, LlamaParams, PackedWeight

LINEAR_FIELDS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def can_pack(params: LlamaParams) -> str | None:
    """None if `params` can be packed, else why not (the kernel is float32, one device)."""
    for leaf in jax.tree_util.tree_leaves(params):
        if leaf.dtype != jnp.float32:
            return f"the weights are {leaf.dtype}, the CPU dense kernel takes float32"
        if len(leaf.sharding.device_set) != 1:
            return "the weights are sharded over several devices"
    return None


def _pack(w: jax.Array, transpose: bool = False) -> PackedWeight:
    host = np.asarray(w).T if transpose else np.asarray(w)
    panels = pack_panels(host)
    # Placed as the weight was: committed to its device, or not (an uncommitted step's
    # outputs are uncommitted, and the sampler is compiled for those).
    placed = (jax.device_put(panels, next(iter(w.sharding.device_set))) if w.committed
              else jnp.asarray(panels))
    return PackedWeight(panels=placed, out_features=int(host.shape[-1]))


def pack_params(params: LlamaParams) -> LlamaParams:
    """Every linear weight of `params` (and the lm_head, or the tied embedding) packed."""
    why = can_pack(params)
    if why is not None:
        raise ValueError(f"cannot pack the weights for the CPU dense kernel: {why}")
    layers: LayerParams = params.layers
    for name in LINEAR_FIELDS:
        w = getattr(layers, name)
        if not isinstance(w, PackedWeight):
            layers = layers.replace(**{name: _pack(w)})
    params = params.replace(layers=layers)
    if params.lm_head is not None:
        return params.replace(lm_head=_pack(params.lm_head))
    return params.replace(embed=_pack(params.embed, transpose=True))
