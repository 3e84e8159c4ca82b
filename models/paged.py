"""The engine's model step over paged KV: one ragged batch of new tokens -> logits to sample.

Data flow: token_ids i32[T] (prefill chunks and decode tokens of S sequences end to end) ->
embed -> for each layer (`decoder.scan_layers` over the stacked params, one scan per group of
layers of equal `LayerSpec`, the whole KV array in the carry so XLA updates it in place):
q/k/v + RoPE at each token's position -> `write_kv_and_attend` with the layer's own
`sliding_window`, `soft_cap` and query scale from its spec: the new K/V go into their slots,
then ragged paged attention reads each sequence's pages through its block table (one custom
call on CPU) -> ... -> final norm ->
logits only at `logits_indices` (one row per sequence). `paged_hidden` stops before the final
norm: the runner keeps every token's hidden state for the prompt logprobs pass
(`jaxserve.device.prompt_logprobs`).

KV layout: f[L * num_pages, 2 * Hkv, page_size, D_pages]: the `kernels_pallas` per-layer
page layout with the layers' pages laid end to end (layer i owns pages [i * num_pages,
(i + 1) * num_pages)); page 0 of each layer is the trash page padding tokens write into.
Layer i is never sliced out (a slice would copy the layer's pages every step): its block
tables and slots are offset by i * num_pages pages, so the scatter and the attention's page
reads touch only the pages they need, in place. The array is stored flat rather than as
[L, num_pages, ...]: reshaping the scan-carried KV inside the loop, even to a bitcast-able
shape, made XLA:CPU copy the whole KV once a step (~40 ms for 750 MB on a 2-core host).
KV groups (`models/kv_groups.py`, models with sliding-window and global layers): the array is
f[slots * num_pages, ...] instead, one run of pages per layer slot of a group; layer i reads
its group's block table (`md.block_tables` i32[G, S, W], slots `md.slot_mapping` i32[G, T])
offset by its slot's run, both picked by the scan index (a dynamic index of the small
tables, no copy of KV). A sliding group's table has the trash page where its pages slid out
of the window; the attention masks those keys, so they are never read into the softmax.
A quantized cache (`kv_cache_dtype` int8 / fp8) is a `QuantizedKV`: the same pages in int8 /
float8_e4m3fn plus f32 scales [L * num_pages, 2 * Hkv, page_size], carried, offset and sharded
(by KV head, axis 1) the same way; q, k and v then stay in the model's dtype (write_kv
quantizes, the attention dequantizes on the fly).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax.sharding import Mesh
from jax.sharding import PartitionSpec as PS

from ..kernels_pallas import (AttentionMetadata, KVPages, QuantizedKV, init_kv_pages,
                              kv_pages_shape, write_kv_and_attend)
from .blocks import embed, lm_logits, per_layer_inputs
from .config import LayerSpec, ModelConfig
from .decoder import decoder_layer, init_shared_kv, scan_layers
from .kv_groups import kv_groups, kv_layer_slots
from .moe_block import moe_mlp, sharded_grouped_mlp
from .moe_parallel import ep_moe_mlp


MODEL_AXIS = "model"  # the tensor-parallel mesh axis (models/placement.py)
# KV pages [L * num_pages, 2 * Hkv, page_size, D] split by KV head over MODEL_AXIS.
KV_PAGES_SPEC = PS(None, MODEL_AXIS, None, None)
# Their scales [L * num_pages, 2 * Hkv, page_size] (quantized caches) split the same way.
KV_SCALES_SPEC = PS(None, MODEL_AXIS, None)


def kv_specs(quantized: bool) -> PS | QuantizedKV:
    """The partition spec pytree of a KV cache: one spec, or a QuantizedKV of two."""
    if quantized:
        return QuantizedKV(KV_PAGES_SPEC, KV_SCALES_SPEC)  # type: ignore[arg-type]
    return KV_PAGES_SPEC


def init_kv_cache(cfg: ModelConfig, num_pages: int, page_size: int, dtype: object,
                  head_dim: int | None = None) -> KVPages:
    """Zeroed KV cache of `kv_cache_shape` (a QuantizedKV for int8 / float8_e4m3fn)."""
    return init_kv_pages(kv_layer_slots(cfg) * num_pages, page_size, cfg.num_kv_heads,
                         head_dim or cfg.head_dim, dtype)


def kv_cache_shape(cfg: ModelConfig, num_pages: int, page_size: int,
                   head_dim: int | None = None) -> tuple[int, ...]:
    """Shape of the KV pages of all layers, laid end to end (`num_pages` per layer);
    `head_dim` may be padded for a kernel's alignment."""
    return kv_pages_shape(kv_layer_slots(cfg) * num_pages, page_size, cfg.num_kv_heads,
                          head_dim or cfg.head_dim)


def paged_forward(params: Any, kv_pages: KVPages, token_ids: jax.Array,
                  positions: jax.Array, md: AttentionMetadata, logits_indices: jax.Array,
                  cfg: ModelConfig, attn_impl: str = "reference",
                  mesh: Mesh | None = None, expert_parallel: bool = False
                  ) -> tuple[jax.Array, KVPages]:
    """-> (f32[S, vocab] logits at `logits_indices`, updated kv_pages). Pure; jit it."""
    hidden, kv_pages = paged_hidden(params, kv_pages, token_ids, positions, md, cfg,
                                    attn_impl, mesh, expert_parallel)
    return lm_logits(cfg, params, hidden[logits_indices]), kv_pages


def paged_hidden(params: Any, kv_pages: KVPages, token_ids: jax.Array,
                 positions: jax.Array, md: AttentionMetadata, cfg: ModelConfig,
                 attn_impl: str = "reference", mesh: Mesh | None = None,
                 expert_parallel: bool = False, aux_layers: tuple[int, ...] = ()
                 ) -> tuple[jax.Array, KVPages] | tuple[jax.Array, KVPages, jax.Array]:
    """-> ([T, hidden] last layer's output of every token (before the final norm), updated
    kv_pages). Pure; jit it. `lm_logits` of a row gives that token's next-token logits.

    `aux_layers` (static, strictly increasing, each in [0, num_layers]): also return, third,
    the auxiliary hidden states an EAGLE-3 head reads (`models/eagle3.py`), f[T, n * hidden]:
    for each index i in order, the residual stream entering layer i (= layer i - 1's output;
    0: the embeddings, num_layers: the last layer's output before the final norm), as vLLM's
    `aux_hidden_state_layers` / SGLang's `layers_to_capture` take them (`hidden + residual`
    before layer i runs), concatenated along the features. Empty (the default): the step is
    exactly the one without the option (no extra carry, no extra output).

    With a `mesh` (tensor parallel, axis "model"; see `placement`), the KV write and
    the attention run under `jax.shard_map`: each device on its own query / KV heads and its
    slice of the KV pages, with the metadata replicated; XLA partitions the rest.
    `expert_parallel` (with a mesh): the MoE layers' experts are split whole over the same
    axis and their MLP runs under its own `jax.shard_map` (`moe_parallel.ep_moe_mlp`).
    """
    if expert_parallel and mesh is None:
        raise ValueError("expert_parallel=True needs a mesh (tensor_parallel_size > 1)")
    aux_slot = _aux_slots(aux_layers, cfg.num_layers)
    if expert_parallel:
        moe = functools.partial(ep_moe_mlp, mesh=mesh, axis=MODEL_AXIS)
    elif mesh is not None:
        # MoE layers under tensor parallelism: the Pallas grouped matmul cannot be split by
        # XLA, so it runs per device on the experts' slices (moe_block.sharded_grouped_mlp).
        moe = functools.partial(moe_mlp, mlp=sharded_grouped_mlp(mesh, MODEL_AXIS))
    else:
        moe = moe_mlp
    total_pages, _, page_size, _ = kv_pages.shape
    groups = kv_groups(cfg)  # static: a function of the config
    slots = kv_layer_slots(cfg)
    if total_pages % slots:
        raise ValueError(f"kv_pages has {total_pages} pages, not a multiple of {slots} layer "
                         "slots (expected kv_cache_shape's layout)")
    num_pages = total_pages // slots
    quantized = isinstance(kv_pages, QuantizedKV)
    kv_spec = kv_specs(quantized)

    def layer(spec: LayerSpec, carry: tuple[Any, ...],
              xs: tuple[Any, jax.Array, jax.Array | None]) -> tuple[tuple[Any, ...], None]:
        x, kv, shared, *aux = carry
        lp, i, inp = xs
        if aux:  # the stream entering layer i into its slot (the spare slot if not kept)
            slot = aux_slot[i]  # type: ignore[index]
            aux = [jax.lax.dynamic_update_index_in_dim(aux[0], x, slot, 0)]

        def attn(q: jax.Array, k: jax.Array, v: jax.Array, flat: KVPages,
                 spec: LayerSpec, sinks: jax.Array | None = None
                 ) -> tuple[jax.Array, KVPages]:
            def attend(q: jax.Array, k: jax.Array, v: jax.Array, flat: KVPages,
                       layer_md: AttentionMetadata, sinks: jax.Array | None
                       ) -> tuple[jax.Array, KVPages]:
                # Float pages: everything in the pages' dtype. Quantized: q, k, v as they are.
                dt = q.dtype if quantized else flat.dtype
                # The layer's own window, soft-cap and scale: static, one kernel per spec.
                out, flat = write_kv_and_attend(q.astype(dt), k.astype(dt), v.astype(dt), flat,
                                                layer_md, sm_scale=spec.query_scale,
                                                sliding_window=spec.sliding_window,
                                                soft_cap=spec.soft_cap, impl=attn_impl,
                                                sinks=sinks)
                return out.astype(q.dtype), flat

            if groups is None:
                base = i * num_pages
                layer_md = dataclasses.replace(md, block_tables=md.block_tables + base,
                                               slot_mapping=md.slot_mapping + base * page_size)
            else:
                g = jnp.asarray(groups.layer_groups, jnp.int32)[i]
                base = jnp.asarray(groups.layer_slots, jnp.int32)[i] * num_pages
                layer_md = dataclasses.replace(
                    md, block_tables=md.block_tables[g] + base,
                    slot_mapping=md.slot_mapping[g] + base * page_size)
            if mesh is None:
                return attend(q, k, v, flat, layer_md, sinks)
            heads = PS(None, MODEL_AXIS, None)  # [T, H, D] split by head
            # Sinks [Hq] split with the query heads; a model without them passes nothing.
            extra, extra_specs = ((), ()) if sinks is None else ((sinks,), (PS(MODEL_AXIS),))

            def sharded(q: jax.Array, k: jax.Array, v: jax.Array, flat: KVPages,
                        layer_md: AttentionMetadata, *sink: jax.Array
                        ) -> tuple[jax.Array, KVPages]:
                return attend(q, k, v, flat, layer_md, sink[0] if sink else None)

            return jax.shard_map(sharded, mesh=mesh,
                                 in_specs=(heads, heads, heads, kv_spec, PS(), *extra_specs),
                                 out_specs=(heads, kv_spec),
                                 # The attention's loops start from replicated zeros and
                                 # end per-shard; each shard is independent, nothing to check.
                                 check_vma=False)(q, k, v, flat, layer_md, *extra)

        x, kv, shared = decoder_layer(cfg, spec, lp, x, positions, attn, kv, inp, shared,
                                      moe)
        return (x, kv, shared, *aux), None

    x = embed(params, token_ids, cfg.embed_scale)
    # Gemma 4: per-layer inputs scanned beside the layers, K/V slots carried between them.
    inputs = per_layer_inputs(cfg, params, token_ids, x) if cfg.per_layer_input_size else None
    shared = init_shared_kv(cfg, token_ids.shape, x.dtype)
    if not aux_layers:
        (x, kv_pages, _), _ = scan_layers(layer, (x, kv_pages, shared), params.layers,
                                          cfg.layer_groups, inputs)
        return x, kv_pages
    # One slot per kept layer input plus a spare one the other layers write into: a write
    # at a traced index is a single in-place update of the carry, with no branch.
    inside = [i for i in aux_layers if i < cfg.num_layers]
    buf = jnp.zeros((len(inside) + 1, *x.shape), x.dtype)
    (x, kv_pages, _, buf), _ = scan_layers(layer, (x, kv_pages, shared, buf), params.layers,
                                           cfg.layer_groups, inputs)
    kept = [buf[k] for k in range(len(inside))]
    if len(inside) < len(aux_layers):  # num_layers itself: the last layer's output
        kept.append(x)
    return x, kv_pages, jnp.concatenate(kept, axis=-1)


def _aux_slots(aux_layers: tuple[int, ...], num_layers: int) -> jax.Array | None:
    """i32[num_layers]: the aux buffer slot layer i's input goes to (the spare last slot for
    a layer not kept), None without aux layers; refuses indices out of [0, num_layers] or
    not strictly increasing."""
    if any(not isinstance(i, int) or not 0 <= i <= num_layers for i in aux_layers) or any(
            a >= b for a, b in zip(aux_layers, aux_layers[1:])):
        raise ValueError(f"aux_layers={aux_layers!r} must be strictly increasing layer indices "
                         f"in [0, {num_layers}] (the model has {num_layers} layers)")
    if not aux_layers:
        return None
    inside = [i for i in aux_layers if i < num_layers]
    slot = np.full(num_layers, len(inside), np.int32)
    slot[inside] = np.arange(len(inside), dtype=np.int32)
    return jnp.asarray(slot)
