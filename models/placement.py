"""Tensor parallelism: where each weight and the KV pages live on a JAX device mesh, and
placing a params pytree there one device slice at a time.

Data flow: `tensor_parallel_size` -> `make_tp_mesh` (a 1-D Mesh, axis "model") ->
`kv_head_replication(cfg, tp)` decides whether KV heads must be replicated (`tp_model_config`
is the config the sharded model runs with) -> `place_params`: params whose leaves are host
sources (numpy arrays, memmaps, the lazy views of `host_arrays.py`) or jax arrays ->
`with_replicated_kv_heads` (K/V projections become `RepeatedHeads` views: nothing is copied)
-> `param_shardings` (one NamedSharding per leaf, from `param_specs`) -> `place_leaf` per
leaf: `jax.make_array_from_callback(shape, sharding, lambda box: leaf[box])`. JAX calls back
once per *addressable* device with that device's box, so each device receives only its own
slice, no device ever holds a full split leaf, and under multi-process `jax.distributed` each
process reads only the slices of its own devices. `load_model(path, dtype, mesh)` loads
through the same placement. The runner then creates the KV pages on `kv_sharding` and places
every step's inputs `replicated`; `paged_forward(..., mesh=mesh)` runs attention under
`jax.shard_map`, and XLA partitions the rest of the step from these shardings.

Host memory: the callbacks of one leaf run before that leaf is copied, so the host peak is this
process's slices of one leaf (the whole leaf for a replicated one), not the model.

The layout (Megatron style; the mesh axis is `paged.MODEL_AXIS`), per layer field from the
family's `TP_LAYOUT` (`models/llama.py`):
  wq / wk / wv (and biases), w_gate / w_up: columns (outputs) split;
  wo / w_down: rows (inputs) split, so each block ends in one all-reduce;
  embed [vocab, hidden] / lm_head [hidden, vocab]: split by vocabulary, replicated when tp does
  not divide it; norms (and q/k norms): replicated;
  MoE expert stacks [L, E, in, out]: each expert's intermediate axis split as the dense MLP's;
  with `expert_parallel` split on E instead (whole experts per device: models/moe_parallel.py);
  KV pages [L * num_pages, 2 * Hkv, page_size, D]: split on the 2 * Hkv axis, so each device
  holds the pages of its own KV heads (rows 2h / 2h + 1 stay together); a quantized cache's
  scales [L * num_pages, 2 * Hkv, page_size] split on the same axis.
KV heads that tp does not divide: when tp is a multiple of num_kv_heads, each KV head is
replicated tp / num_kv_heads times (every device holds exactly one, shared by its query heads,
as in vLLM); per-device KV bytes are then 1 / num_kv_heads of one copy instead of 1 / tp.
num_heads must divide by tp.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .config import ModelConfig
from .families import ModelParams, family
from .host_arrays import RepeatedHeads
from .moe_parallel import check_expert_parallel
from .paged import MODEL_AXIS, kv_specs
from .quant import QuantizedWeight
from .safetensors_io import CheckpointError



def kv_head_replication(cfg: ModelConfig, tp: int) -> int:
    """How many copies of each KV head tp devices need (1: none)."""
    if cfg.num_heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide num_heads={cfg.num_heads}")
    if cfg.num_kv_heads % tp == 0:
        return 1
    if tp % cfg.num_kv_heads:
        raise ValueError(f"tensor_parallel_size={tp} and num_kv_heads={cfg.num_kv_heads}: one "
                         "must divide the other")
    return tp // cfg.num_kv_heads


def _quant_spec(spec: P, w: QuantizedWeight, tp: int) -> QuantizedWeight:
    """The specs of a quantized weight's arrays, from its float weight's `spec`: values split
    as the weight; scales (and zeros) [.., K / G, N] split on N alike, and on K when the
    groups divide by tp. Otherwise (per-column scales, or groups a device's rows cut through:
    a 32-row GGUF block over 16 rows per device) the scales stay whole on every device over
    the split K, and each device reads the rows of them its values need: they are small
    (int4 in groups of 32: 1/4 of the values' bytes, f32 scales and zeros)."""
    parts = list(spec) + [None] * (len(w.shape) - len(spec))
    if parts[-2] is not None and w.scales.shape[-2] % tp:
        parts[-2] = None
    scale_spec = P(*parts)
    return QuantizedWeight(spec, scale_spec, None if w.zeros is None else scale_spec,
                           w.scheme, w.act_fp8)


def _with_quant_specs(specs: ModelParams, params: ModelParams, tp: int) -> ModelParams:
    """`specs` with each field that `params` holds quantized expanded to its arrays' specs."""
    layers = {f: _quant_spec(getattr(specs.layers, f), w, tp)
              for f in type(params.layers).__dataclass_fields__
              if isinstance(w := getattr(params.layers, f), QuantizedWeight)}
    out = dataclasses.replace(specs, layers=dataclasses.replace(specs.layers, **layers))
    if isinstance(params.lm_head, QuantizedWeight):
        out = dataclasses.replace(out, lm_head=_quant_spec(specs.lm_head, params.lm_head, tp))
    if isinstance(params.embed, QuantizedWeight):  # stored transposed: [hidden, vocab]
        transposed = P(*reversed(tuple(specs.embed) + (None,) * (2 - len(specs.embed))))
        out = dataclasses.replace(out, embed=_quant_spec(transposed, params.embed, tp))
    return out


def param_specs(cfg: ModelConfig, tp: int, params: ModelParams | None = None,
                expert_parallel: bool = False) -> ModelParams:
    """The family's params of PartitionSpecs (None where the config has no such leaf); with
    `params`, its quantized weights get one spec per array (`_quant_spec`);
    `expert_parallel`: MoE expert stacks split whole by expert (`models/moe_parallel.py`;
    ValueError where the model cannot be)."""
    if expert_parallel:
        check_expert_parallel(cfg, tp)
    fam = family(cfg)
    shapes = fam.param_shapes(cfg)
    by_kind = {"col": P(None, None, MODEL_AXIS),  # [L, in, out]: split outputs
               "row": P(None, MODEL_AXIS, None),  # [L, in, out]: split inputs
               "vec": P(None, MODEL_AXIS),        # [L, out] biases of split outputs
               # MoE experts [L, E, in, out]: each expert's intermediate axis split, as the
               # dense MLP's (gate / up outputs, down inputs)
               "expert_col": P(None, None, None, MODEL_AXIS),
               "expert_row": P(None, None, MODEL_AXIS, None),
               "rep": P()}
    if expert_parallel:  # [L, E, in, out]: whole experts per device
        by_kind.update(expert_col=P(None, MODEL_AXIS, None, None),
                       expert_row=P(None, MODEL_AXIS, None, None))
    layers = fam.LayerParams(**{
        f: by_kind[kind] if f"layers.{f}" in shapes else None
        for f, kind in fam.TP_LAYOUT.items()})
    # A vocabulary that tp does not divide (only toy ones) stays replicated.
    by_vocab = cfg.vocab_size % tp == 0
    rep = P()
    lm_head = None if cfg.tie_word_embeddings else (P(None, MODEL_AXIS) if by_vocab else rep)
    # A family's further top-level leaves (`TOP_TP_LAYOUT`: Gemma 4's per-layer token table,
    # split by rows as the embedding when tp divides them, and its replicated projection).
    extra = {f: (P(MODEL_AXIS, None) if kind == "vocab_rows" and shapes[f][0] % tp == 0
                 else rep)
             for f, kind in getattr(fam, "TOP_TP_LAYOUT", {}).items() if f in shapes}
    specs = fam.Params(embed=P(MODEL_AXIS, None) if by_vocab else rep, layers=layers,
                       final_norm=rep, lm_head=lm_head, **extra)
    return specs if params is None else _with_quant_specs(specs, params, tp)


def param_shardings(cfg: ModelConfig, mesh: Mesh, params: ModelParams | None = None,
                    expert_parallel: bool = False) -> ModelParams:
    """The family's params of the NamedSharding each leaf is placed on (`params`,
    `expert_parallel`: see param_specs)."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec),
                        param_specs(cfg, mesh.shape[MODEL_AXIS], params, expert_parallel),
                        is_leaf=lambda x: isinstance(x, P))


def with_replicated_kv_heads(params: ModelParams, cfg: ModelConfig, tp: int) -> ModelParams:
    """K/V projections (and biases) as views with each head repeated for tp devices.

    Leaves that already have the replicated width (params placed by an earlier call) are kept,
    so placing placed params again is a no-op.
    """
    rep = kv_head_replication(cfg, tp)
    if rep == 1:
        return params
    lp = params.layers
    views = {}
    for field in family(cfg).KV_FIELDS:
        leaf = getattr(lp, field)
        if leaf is None or leaf.shape[-1] == cfg.kv_size * rep:
            continue
        if leaf.shape[-1] != cfg.kv_size:
            raise ValueError(f"layers.{field} has last axis {leaf.shape[-1]}; expected "
                             f"{cfg.kv_size} (num_kv_heads={cfg.num_kv_heads} x head_dim)")
        # A quantized weight's arrays all end in the output axis: each is repeated alike.
        views[field] = jax.tree.map(lambda a: RepeatedHeads(a, cfg.num_kv_heads, rep), leaf)
    return dataclasses.replace(params, layers=dataclasses.replace(lp, **views))


def place_leaf(leaf: object, sharding: NamedSharding, name: str = "leaf") -> jax.Array:
    """One leaf onto `sharding`, each addressable device reading only its own box."""
    if isinstance(leaf, jax.Array):
        if leaf.sharding.is_equivalent_to(sharding, leaf.ndim):
            return leaf  # already where it belongs (e.g. an Orbax restore onto its sharding)
        if not leaf.is_fully_addressable:  # another process holds parts: let XLA reshard
            return jax.device_put(leaf, sharding)
    shape = tuple(leaf.shape)  # type: ignore[attr-defined]

    def read(box: tuple[slice, ...]) -> object:
        return leaf[box]  # type: ignore[index]

    try:
        return jax.make_array_from_callback(shape, sharding, read,
                                            dtype=leaf.dtype)  # type: ignore[attr-defined]
    except CheckpointError:
        raise  # already names the file and tensor
    except (ValueError, TypeError) as e:
        raise ValueError(f"cannot place {name} {shape} on {sharding.spec}: {e}") from e


def place_params(params: ModelParams, cfg: ModelConfig, mesh: Mesh,
                 expert_parallel: bool = False) -> ModelParams:
    """Every leaf of `params` (host sources or jax arrays) onto its tensor-parallel sharding
    (`expert_parallel`: experts split whole, see param_specs)."""
    params = with_replicated_kv_heads(params, cfg, mesh.shape[MODEL_AXIS])
    shardings = param_shardings(cfg, mesh, params, expert_parallel)
    named = jax.tree_util.tree_flatten_with_path(params)[0]
    leaves, treedef = jax.tree_util.tree_flatten(params)
    targets = treedef.flatten_up_to(shardings)
    placed = [place_leaf(leaf, target, jax.tree_util.keystr(path))
              for (path, leaf), target in zip(named, targets)]
    assert len(placed) == len(leaves)
    return jax.tree_util.tree_unflatten(treedef, placed)


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


def kv_sharding(mesh: Mesh, quantized: bool = False) -> NamedSharding:
    """KV pages [L * num_pages, 2 * Hkv, page_size, D] split by KV head; `quantized`: a
    QuantizedKV of shardings, the scales [L * num_pages, 2 * Hkv, page_size] split alike."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), kv_specs(quantized),
                        is_leaf=lambda x: isinstance(x, P))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())
