"""What the mixture-of-experts families (Qwen3-MoE, Qwen2-MoE, Mixtral) share: the
layer-params base classes (`MoELayerParams`, `MixedMoELayerParams` with a dense MLP and a
shared expert; each family subclasses one so `families.family_of_params` tells them apart),
the expert stacks' shapes and TP layout, and the HF checkpoint mapping of per-expert tensors
stacked at load into [E, in, out] (`ExpertStack`) and split back on export.

The block's computation (routing, the grouped expert matmul, the dense test oracle) is
`models/moe_block.py`; its names are re-exported here, so `moe.moe_mlp` and the rest keep
one import path.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from .config import ConfigError, LayerSpec, ModelConfig, MoESpec, hf_int
from .host_arrays import HostArray, normalize_box
from .linear import Weight
from .moe_block import (  # noqa: F401  (re-exported: one import path for the block)
    route,
    router_logits,
    grouped_matmul,
    grouped_matmul_reference,
    grouped_mlp_ragged,
    tile_rows,
    grouped_mlp_tiled,
    grouped_mlp,
    expert_mlp,
    moe_mlp,
    dense_moe_reference)


# ------------------------------------------------------------- the families' shared parts
@struct.dataclass
class MoELayerParams:
    """Per-layer weights of an MoE decoder of sparse layers only, stacked on a leading layer
    axis L. A model whose dense and sparse layers mix (Qwen3-MoE `mlp_only_layers` /
    `decoder_sparse_step`; `MixedMoELayerParams`) has both kinds of MLP stacked over all L,
    zeros on the layers of the other kind (never read: the layer's spec picks its MLP).
    Cost: those zeros' memory; a model of sparse layers only (every Qwen3-MoE / Mixtral
    release) has no dense MLP fields at all."""

    attn_norm: jax.Array  # f[L, hidden]
    wq: Weight  # f[L, hidden, num_heads * head_dim]
    wk: Weight  # f[L, hidden, num_kv_heads * head_dim]
    wv: Weight  # f[L, hidden, num_kv_heads * head_dim]
    wo: Weight  # f[L, num_heads * head_dim, hidden]
    mlp_norm: jax.Array  # f[L, hidden]
    router: jax.Array  # f[L, hidden, E]
    we_gate: jax.Array  # f[L, E, hidden, I_e]
    we_up: jax.Array  # f[L, E, hidden, I_e]
    we_down: jax.Array  # f[L, E, I_e, hidden]
    bq: jax.Array | None = None  # f[L, num_heads * head_dim]   (attention_bias)
    bk: jax.Array | None = None  # f[L, num_kv_heads * head_dim] (attention_bias)
    bv: jax.Array | None = None  # f[L, num_kv_heads * head_dim] (attention_bias)
    q_norm: jax.Array | None = None  # f[L, head_dim] (qk_norm)
    k_norm: jax.Array | None = None  # f[L, head_dim] (qk_norm)


@struct.dataclass
class MixedMoELayerParams(MoELayerParams):
    """MoELayerParams plus what the Qwen-MoE models may have: dense layers' MLP between
    sparse ones, and a shared expert."""

    # dense layers' MLP (a model with dense layers between sparse ones)
    w_gate: Weight | None = None  # f[L, hidden, intermediate]
    w_up: Weight | None = None  # f[L, hidden, intermediate]
    w_down: Weight | None = None  # f[L, intermediate, hidden]
    # the shared expert (Qwen2-MoE)
    ws_gate: Weight | None = None  # f[L, hidden, I_s]
    ws_up: Weight | None = None  # f[L, hidden, I_s]
    ws_down: Weight | None = None  # f[L, I_s, hidden]
    ws_router: jax.Array | None = None  # f[L, hidden, 1] (shared_expert_gate)


# The stacked experts' fields (not `LINEAR_FIELDS`: the CPU engine packs float ones for the
# grouped expert kernel as `PackedExperts`, not as linear weights;
# `quantized_params.quantize_experts` quantizes them per expert, and the grouped matmul of
# `moe_block` takes them float or quantized).
EXPERT_FIELDS = ("we_gate", "we_up", "we_down")
# Tensor parallelism: each expert's intermediate axis split as the dense MLP's is (gate / up
# outputs, down inputs; the down projection's partial sums are all-reduced); the router
# replicated (every device routes every token alike).
TP_LAYOUT = {"attn_norm": "rep", "wq": "col", "wk": "col", "wv": "col", "wo": "row",
             "mlp_norm": "rep", "router": "rep", "we_gate": "expert_col",
             "we_up": "expert_col", "we_down": "expert_row",
             "bq": "vec", "bk": "vec", "bv": "vec", "q_norm": "rep", "k_norm": "rep",
             "w_gate": "col", "w_up": "col", "w_down": "row",
             "ws_gate": "col", "ws_up": "col", "ws_down": "row", "ws_router": "rep"}
KV_FIELDS = ("wk", "wv", "bk", "bv")
LINEAR_FIELDS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "ws_gate", "ws_up",
                 "ws_down")
# The dense MLP fields and the MoE fields: which a layer has depends on its spec.
DENSE_MLP_FIELDS = ("w_gate", "w_up", "w_down")
SPARSE_FIELDS = ("router", *EXPERT_FIELDS, "ws_gate", "ws_up", "ws_down", "ws_router")


def hf_num_experts(d: Mapping[str, object], default: int, source: str) -> int:
    """The expert count of an HF MoE config: `num_experts` (the Hub's Qwen configs) or
    `num_local_experts` (Mixtral, and transformers 5's name for Qwen3-MoE's, which it writes);
    both present must agree."""
    given = {k: d[k] for k in ("num_experts", "num_local_experts") if d.get(k) is not None}
    values = {hf_int(v, k, source) for k, v in given.items()}
    if len(values) > 1:
        raise ConfigError(f"{source}: num_experts={given['num_experts']!r} and "
                          f"num_local_experts={given['num_local_experts']!r} disagree")
    n = values.pop() if values else default
    if n < 0:
        raise ConfigError(f"{source}: num_experts={n} must not be negative")
    return n


def family_tables(layer_params: type) -> tuple[dict[str, str], tuple[str, ...]]:
    """(TP_LAYOUT, LINEAR_FIELDS) restricted to the fields of a family's layer params."""
    fields = layer_params.__dataclass_fields__
    return ({f: k for f, k in TP_LAYOUT.items() if f in fields},
            tuple(f for f in LINEAR_FIELDS if f in fields))


def sparse_layers(d: Mapping[str, object], num_layers: int, source: str) -> list[bool]:
    """Which layers are sparse under Qwen-MoE's `decoder_sparse_step` / `mlp_only_layers`
    (transformers: layer i is sparse unless listed in mlp_only_layers, if num_experts > 0 and
    (i + 1) % decoder_sparse_step == 0)."""
    step = hf_int(d.get("decoder_sparse_step", 1), "decoder_sparse_step", source)
    if step < 1:
        raise ConfigError(f"{source}: decoder_sparse_step={step} must be a positive integer")
    only = d.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers
            for i in only):
        raise ConfigError(f"{source}: mlp_only_layers={only!r} must list layer indices below "
                          f"num_hidden_layers={num_layers}")
    return [i not in only and (i + 1) % step == 0 for i in range(num_layers)]


def moe_param_shapes(cfg: ModelConfig, base: dict[str, tuple[int, ...]]
                     ) -> dict[str, tuple[int, ...]]:
    """`base` (the attention / norm / head shapes) plus the MLP fields the layers need."""
    L, H = cfg.num_layers, cfg.hidden_size
    specs = cfg.layer_specs
    moe = next((s.moe for s in specs if s.moe is not None), None)
    shapes = dict(base)
    if moe is not None:
        E, I = moe.num_experts, moe.intermediate_size
        shapes.update({"layers.router": (L, H, E), "layers.we_gate": (L, E, H, I),
                       "layers.we_up": (L, E, H, I), "layers.we_down": (L, E, I, H)})
        S = moe.shared_intermediate_size
        if S:
            shapes.update({"layers.ws_gate": (L, H, S), "layers.ws_up": (L, H, S),
                           "layers.ws_down": (L, S, H), "layers.ws_router": (L, H, 1)})
    if any(s.moe is None for s in specs):
        I = cfg.intermediate_size
        shapes.update({"layers.w_gate": (L, H, I), "layers.w_up": (L, H, I),
                       "layers.w_down": (L, I, H)})
    return shapes


def _layer_has(spec: LayerSpec, field: str) -> bool:
    """Whether a layer of `spec` has `field` in its checkpoint (a sparse layer has no dense
    MLP, a dense one no router / experts)."""
    if field in DENSE_MLP_FIELDS:
        return spec.moe is None
    return spec.moe is not None or field not in SPARSE_FIELDS


class ExpertStack:
    """A layer's E per-expert checkpoint tensors, each [out, in] (HF linears), seen as the
    stacked [E, in, out]: a box reads, for each expert it covers, only the rows / columns it
    covers, transposed (`host_arrays`' contract)."""

    def __init__(self, parts: Sequence[HostArray]) -> None:
        out, inp = parts[0].shape
        self.parts, self.shape = tuple(parts), (len(parts), inp, out)
        self.dtype = parts[0].dtype

    @property
    def ndim(self) -> int:
        return 3

    def __getitem__(self, index: object) -> np.ndarray:
        e, i, o = normalize_box(index, self.shape, "expert stack")
        rows = [np.asarray(self.parts[j][o, i]).T for j in range(e.start, e.stop)]
        if not rows:
            return np.zeros((0, i.stop - i.start, o.stop - o.start), self.dtype)
        return np.ascontiguousarray(np.stack(rows))

    def __repr__(self) -> str:
        return f"ExpertStack({len(self.parts)} x {self.parts[0]!r})"


def hf_layer_part(cfg: ModelConfig, names: Mapping[str, tuple[str, bool]],
                  expert_names: Mapping[str, str], field: str, i: int, suffix: str,
                  fetch: Callable[[str, tuple[int, ...]], HostArray]) -> HostArray:
    """Layer i's checkpoint tensor(s) of `field` at the stacked per-layer shape
    (`hf_loader`'s hook): an expert field gathers its E tensors `expert_names[field]`
    (formatted with the expert index) into an `ExpertStack`; a field the layer does not have
    (the other kind of MLP) is zeros, read from nothing."""
    from .families import family  # a family module's function: the registry imports it

    spec = cfg.layer_specs[i]
    stacked = family(cfg).param_shapes(cfg)[f"layers.{field}"][1:]
    transpose = names[field][1]
    if not _layer_has(spec, field):
        return np.broadcast_to(np.float32(0), stacked[::-1] if transpose else stacked)
    if field in EXPERT_FIELDS:
        E, inp, out = stacked
        parts = [fetch(expert_names[field].format(e=e), (out, inp)) for e in range(E)]
        return ExpertStack(parts)
    return fetch(suffix, stacked)


def hf_layer_export(cfg: ModelConfig, expert_names: Mapping[str, str], field: str, i: int,
                    t: np.ndarray) -> np.ndarray | dict[str, np.ndarray] | None:
    """The inverse of `hf_layer_part` on one layer's tensor: an expert stack [E, in, out] as
    {suffix: [out, in]} per expert; None for the MLP kind the layer does not have."""
    spec = cfg.layer_specs[i]
    if not _layer_has(spec, field):
        return None
    if field in EXPERT_FIELDS:
        return {expert_names[field].format(e=e): np.ascontiguousarray(t[e].T)
                for e in range(t.shape[0])}
    return t


def random_params(template: Any, key: jax.Array, dtype: jnp.dtype, scale: float) -> Any:
    """Random leaves for a params template of ShapeDtypeStructs: norms near 1, the rest
    scale * N(0, 1) (tests, benchmarks)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(template)
    keys = jax.random.split(key, max(len(flat), 1))
    out = []
    for k, (path, leaf) in zip(keys, flat):
        noise = jax.random.normal(k, leaf.shape, jnp.float32)
        one = "norm" in jax.tree_util.keystr(path)
        out.append(((1.0 + 0.1 * noise) if one else scale * noise).astype(dtype))
    return jax.tree_util.tree_unflatten(treedef, out)


def moe_spec_of(cfg: ModelConfig) -> MoESpec | None:
    return next((s.moe for s in cfg.layer_specs if s.moe is not None), None)


def with_moe(spec: LayerSpec, moe: MoESpec | None) -> LayerSpec:
    return dataclasses.replace(spec, moe=moe)
