"""Pure-jnp ragged paged attention: the numerical reference and the engine's CPU attention.

Data flow: ``plan_tiles`` cuts the live sequences' queries into tiles of ``tile_tokens``
tokens that never straddle sequences; ``gather_q_tiles`` packs each tile as
``[Hkv, rows = tile_tokens * G, D]``. For each tile we gather the owning sequence's pages
through its block-table row into dense ``K, V [Hkv, max_kv, D]`` (max_kv = max_pages_per_seq
* page_size), compute masked softmax attention in float32 and scatter rows back to
``[T, Hq, D]``.

Cost: per tile, ``Hkv * max_kv * D`` gathered K/V elements and ``rows * Hkv * max_kv``
float32 logits, so a call moves ``O(NT * Hkv * max_kv * D)`` bytes and does
``O(NT * tile_tokens * Hq * max_kv * D)`` flops, NT <= T / tile_tokens + S.
Decode (tile_tokens = 1) is then exactly "each sequence reads its pages once"; prefill pays
``T * max_kv`` logits like any dense attention. Tiles run through ``lax.map`` in batches sized
to keep the gathered K/V and the logits near ``_BATCH_BYTES``, so memory stays bounded
whatever the bucket. Keys past a tile's causal end are masked and their V rows zeroed, so
NaN/garbage in unused or trash pages cannot leak into live rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .common import (MASK_VALUE, AttentionMetadata, check_attention_inputs, pad_head_dim)
from .tiling import (F_KV_HI, F_KV_LO, F_POS0, F_SEQ, default_tile_tokens, gather_q_tiles,
                     plan_tiles, scatter_out_tiles, tile_rows)

# Working-set target per lax.map batch (gathered K/V plus f32 logits), bytes.
_BATCH_BYTES = 64 << 20
# Reference tiles stay small: a long prefill chunk becomes many tiles, bounding logits memory.
_MAX_TILE_TOKENS = 64


def _tile_attention(q_tile: jax.Array, info: jax.Array, kv_pages: jax.Array,
                    block_tables: jax.Array, *, group: int, sm_scale: float,
                    sliding_window: int | None, soft_cap: float | None) -> jax.Array:
    """One tile: q_tile [Hkv, rows, D] against its sequence's pages -> [Hkv, rows, D] f32."""
    num_kv_heads, rows, head_dim = q_tile.shape
    pages = kv_pages[block_tables[info[F_SEQ]]]                  # [P, 2Hkv, ps, D]
    kv = pages.transpose(1, 0, 2, 3).reshape(2 * num_kv_heads, -1, head_dim)
    k, v = kv[0::2], kv[1::2]                                     # [Hkv, max_kv, D]
    max_kv = k.shape[1]
    kpos = jnp.arange(max_kv, dtype=jnp.int32)
    qpos = info[F_POS0] + jnp.arange(rows, dtype=jnp.int32) // group
    mask = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] < info[F_KV_HI])
    if sliding_window is not None:
        mask &= kpos[None, :] >= jnp.maximum(info[F_KV_LO], qpos[:, None] - sliding_window + 1)
    # Zero V beyond the causal end: p == 0 there, but 0 * NaN would still poison the sum.
    v = jnp.where((kpos < info[F_KV_HI])[None, :, None], v, jnp.zeros((), v.dtype))
    # HIGHEST: on GPU/TPU the default f32 matmul precision is TF32/bf16; the reference must
    # stay exact wherever it runs (on CPU this costs nothing).
    s = jnp.einsum("hrd,hkd->hrk", q_tile, k, preferred_element_type=jnp.float32,
                   precision=jax.lax.Precision.HIGHEST) * sm_scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    s = jnp.where(mask[None], s, MASK_VALUE)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(mask[None], jnp.exp(s - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    # p stays float32 (the reference should be the most exact implementation).
    out = jnp.einsum("hrk,hkd->hrd", p, v.astype(jnp.float32),
                     precision=jax.lax.Precision.HIGHEST)
    return out / jnp.where(denom == 0.0, 1.0, denom)


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap",
                                             "tile_tokens"))
def ragged_paged_attention_reference(q: jax.Array, kv_pages: jax.Array, md: AttentionMetadata,
                                     *, sm_scale: float, sliding_window: int | None = None,
                                     soft_cap: float | None = None,
                                     tile_tokens: int | None = None) -> jax.Array:
    """out [T, Hq, Dq] of causal ragged paged attention (see module docstring)."""
    check_attention_inputs(q, kv_pages, md, sm_scale=sm_scale, sliding_window=sliding_window,
                           soft_cap=soft_cap)
    num_tokens, num_q_heads, q_head_dim = q.shape
    _, two_hkv, page_size, head_dim = kv_pages.shape
    num_kv_heads = two_hkv // 2
    group = num_q_heads // num_kv_heads
    num_seqs_max, max_pages = md.block_tables.shape
    if tile_tokens is None:
        tile_tokens = default_tile_tokens(num_tokens, num_seqs_max, _MAX_TILE_TOKENS)
    plan = plan_tiles(md, num_tokens, tile_tokens=tile_tokens, block_kv=page_size,
                      sliding_window=sliding_window)
    rows = tile_rows(tile_tokens, group)
    q_tiles = gather_q_tiles(pad_head_dim(q, head_dim), plan, num_kv_heads, rows)
    q_tiles = q_tiles.transpose(1, 0, 2, 3)                      # [NT, Hkv, rows, D]

    max_kv = max_pages * page_size
    itemsize = jnp.dtype(kv_pages.dtype).itemsize
    # Gathered K/V plus ~3 float32 [Hkv, rows, max_kv] temporaries (logits, mask, p).
    per_tile = (2 * num_kv_heads * max_kv * head_dim * itemsize
                + 3 * num_kv_heads * rows * max_kv * 4)
    batch = max(1, min(plan.max_tiles, _BATCH_BYTES // max(per_tile, 1)))
    fn = functools.partial(_tile_attention, kv_pages=kv_pages, block_tables=md.block_tables,
                           group=group, sm_scale=sm_scale, sliding_window=sliding_window,
                           soft_cap=soft_cap)
    out_tiles = jax.lax.map(lambda args: fn(*args), (q_tiles, plan.info), batch_size=batch)
    out_tiles = out_tiles.astype(q.dtype).transpose(1, 0, 2, 3)  # [Hkv, NT, rows, D]
    out = scatter_out_tiles(out_tiles, plan, num_q_heads)
    return out[..., :q_head_dim]
