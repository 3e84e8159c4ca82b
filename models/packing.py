"""Params for the CPU dense kernel: every linear weight packed into 16-column panels.

Data flow: a family's params as loaded (f32 on one CPU device, weights [L, in, out]) ->
`pack_params` -> the same tree with each linear weight a `PackedWeight`
(f32[L, ceil(out / 16), in, 16]; `kernels_pallas.dense_cpu` says why) -> the engine's step,
where `_linear` runs the C++ kernel and `scan_layers` reads each layer in place. A tied
embedding is packed transposed, as the lm_head it also is; token lookups read its columns.
A `QuantizedWeight` (`models/quant.py`) is packed the same way into quantized panels
(`kernels_pallas.dense_quant_cpu`; a quantized tied embedding is already transposed), or, for
int8 / int4 weights where the kernel runs integer dots and int8_activations allows, into the
quad panels of `kernels_pallas.dense_qdot_cpu` (activations quantized to int8 per row). An MoE
model's expert stacks [L, E, in, out] (`EXPERT_FIELDS`) become `PackedExperts`
(f32 | bf16[L, E, ceil(out / 16), in, 16], per expert the same panels) for the grouped expert
kernel (`kernels_pallas.moe_grouped_cpu`); `pack_experts` packs them alone, in their own
float32 or bfloat16, where the rest stays XLA's (a bfloat16 model). Norms
and biases stay as they are. Packing runs leaf by leaf on the host; the unpacked tree
lives until the caller drops it (at load, the peak is twice the weights).
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np

from ..kernels_pallas.cpu_build import MOE_GROUPED_TARGETS, dense_isas, dense_target
from ..kernels_pallas.dense_cpu import pack_panels
from ..kernels_pallas.dense_qdot_cpu import pack_qdot, qdot_scheme_supported
from ..kernels_pallas.dense_quant_cpu import pack_quant
from ..kernels_pallas.moe_grouped_cpu import WEIGHT_DTYPES, pack_expert_panels
from .families import ModelParams, family_of_params
from .linear import PackedExperts, PackedWeight
from .llama import LINEAR_FIELDS
from .quant import QuantizedWeight


__all__ = ["LINEAR_FIELDS", "can_pack", "can_pack_experts", "pack_experts",
           "pack_experts_where_possible", "pack_params"]  # LINEAR_FIELDS: the Llama family's


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


def _expert_stacks(params: ModelParams) -> dict[str, jax.Array]:
    """The model's unpacked expert stacks by field ({} for a model without experts)."""
    fields = getattr(family_of_params(params), "EXPERT_FIELDS", ())
    stacks = {f: getattr(params.layers, f) for f in fields}
    return {f: w for f, w in stacks.items() if w is not None and not isinstance(w, PackedExperts)}


def can_pack_experts(params: ModelParams) -> str | None:
    """None if `params` has expert stacks the grouped kernel can take (float32 or bfloat16
    on one device), else why not."""
    stacks = _expert_stacks(params)
    if not stacks:
        return "the model has no (unpacked) expert stacks"
    if hasattr(params.layers, "be_gate"):  # gpt-oss: moe_biased's MLP, not grouped_mlp
        return "the experts have biases and a clamped SwiGLU; the grouped kernel runs SwiGLU"
    for name, w in stacks.items():
        if not isinstance(w, jax.Array) or str(w.dtype) not in WEIGHT_DTYPES:
            what = type(w).__name__ if not isinstance(w, jax.Array) else w.dtype
            return f"the experts' {name} is {what}, the grouped kernel takes {WEIGHT_DTYPES}"
        if len(w.sharding.device_set) != 1:
            return "the expert weights are sharded over several devices"
    return None


def pack_experts(params: ModelParams, isa: str | None = None) -> ModelParams:
    """`params` with its expert stacks packed for the grouped expert kernel, each in its own
    dtype, run by the kernel's `isa` (None: the best this CPU runs); a ValueError naming why
    where they cannot be."""
    why = can_pack_experts(params)
    if why is not None:
        raise ValueError(f"cannot pack the experts for the CPU grouped kernel: {why}")
    packed = {}
    for name, w in _expert_stacks(params).items():
        panels = pack_expert_panels(np.asarray(w), str(w.dtype))
        device = next(iter(w.sharding.device_set))
        placed = jax.device_put(panels, device) if w.committed else jnp.asarray(panels)
        packed[name] = PackedExperts(panels=placed, out_features=int(w.shape[-1]), isa=isa)
    return params.replace(layers=params.layers.replace(**packed))


def pack_experts_where_possible(params: ModelParams, isa: str | None = None) -> ModelParams:
    """Where the dense weights stay XLA's (e.g. bfloat16), an MoE model's float32 / bfloat16
    experts still go to the C++ grouped kernel on a CPU host whose kernels built; else
    `params` as they are (the MoE block's XLA path)."""
    if (can_pack_experts(params) is None and jax.local_devices()[0].platform == "cpu"
            and dense_target(MOE_GROUPED_TARGETS["float32"], isa) is not None):
        return pack_experts(params, isa=isa)
    return params


def qdot_choice(w: QuantizedWeight, isa: str | None, int8_activations: str,
                max_group: int = 32) -> bool:
    """Whether quantized weight `w` runs the integer dots (activations quantized to int8 in
    groups of up to `max_group`) on the dense kernel's `isa` (None: the best this CPU runs):
    int8_activations auto: where it can; on: it must (a ValueError saying why not); off:
    never."""
    if int8_activations == "off":
        return False
    resolved = isa if isa is not None else next(iter(dense_isas()), None)
    why = qdot_scheme_supported(w.scheme, w.group_size, resolved, max_group)
    if why is not None and int8_activations == "on":
        raise ValueError(f"int8_activations='on': {why}")
    return why is None


def _pack(w: jax.Array | QuantizedWeight, transpose: bool = False,
          isa: str | None = None, qdot_group: int | None = None,
          fast_quant: bool = False) -> PackedWeight:
    """`qdot_group`: pack for the integer dots with activation groups of up to that size;
    `fast_quant`: quantized weights with float activations take the few-row path's faster,
    not row-invariant sums (`dense_quant_cpu.QuantPanels.fast`)."""
    if isinstance(w, QuantizedWeight):  # a quantized tied embedding is already transposed
        args = (np.asarray(w.values), np.asarray(w.scales),
                None if w.zeros is None else np.asarray(w.zeros), w.scheme)
        panels = pack_quant(*args, fast=fast_quant) if qdot_group is None else \
            pack_qdot(*args, qdot_group)
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


def pack_params(params: ModelParams, isa: str | None = None, int8_activations: str = "off",
                int8_activation_group_size: int = 32, fast_quant: bool = False) -> ModelParams:
    """Every linear weight of `params` (and the lm_head, or the tied embedding) packed, run by
    the kernel's `isa` variant (None: the best this CPU runs; cpu_build.dense_isas()).

    int8_activations (auto | on | off) and int8_activation_group_size: EngineConfig's; which
    int8 / int4 weights are packed for the integer dots (`qdot_choice`), their activations
    quantized in groups of up to that size; 'on' with no such weight is a ValueError.
    fast_quant: the other quantized weights (float activations) take the decode path that is
    faster but not batch invariant (the engine's default mode; `_pack`)."""
    why = can_pack(params)
    if why is not None:
        raise ValueError(f"cannot pack the weights for the CPU dense kernel: {why}")

    def pack(w, transpose: bool = False) -> PackedWeight:  # noqa: ANN001
        qdot = isinstance(w, QuantizedWeight) and qdot_choice(
            w, isa, int8_activations, int8_activation_group_size)
        chosen.append(qdot)
        return _pack(w, transpose=transpose, isa=isa,
                     qdot_group=int8_activation_group_size if qdot else None,
                     fast_quant=fast_quant)

    chosen: list[bool] = []
    layers = params.layers
    for name in family_of_params(params).LINEAR_FIELDS:
        w = getattr(layers, name)
        # None: a field this model does not have (an MoE model's dense MLP, shared expert)
        if w is not None and not isinstance(w, PackedWeight):
            layers = layers.replace(**{name: pack(w)})
    params = params.replace(layers=layers)
    if can_pack_experts(params) is None:  # else they keep the MoE block's XLA path
        params = pack_experts(params, isa=isa)
    if params.lm_head is not None:
        params = params.replace(lm_head=pack(params.lm_head))
    else:
        params = params.replace(embed=pack(params.embed, transpose=True))
    if int8_activations == "on" and not any(chosen):
        raise ValueError("int8_activations='on', but no weight is int8 or int4 (quantize them "
                         "with --quantization int8 / int4, or load a GGUF's Q8_0 / Q4 blocks)")
    return params
