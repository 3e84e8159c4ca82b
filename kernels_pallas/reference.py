"""Pure-jnp ragged paged attention: the numerical reference and the engine's CPU attention.

Data flow: ``plan_tiles`` cuts the live sequences' queries into tiles of ``tile_tokens``
tokens that never straddle sequences; ``gather_q_tiles`` packs each tile as
``[Hkv, rows = tile_tokens * G, D]``. Then one loop over KV blocks of ``block_pages`` pages,
for every tile at once: gather the block's pages of each tile's sequence through its
block-table row, compute masked float32 logits and fold them into a float32 online softmax
(running max, denominator, accumulator). Rows go back to ``[T, Hq, D]`` at the end.

Cost: the loop runs from the smallest first block to the largest last block any tile needs
(a traced bound, so no recompile), so a step reads ``NT * Hkv * max(kv_len) * D`` K/V
elements: proportional to the longest *live* context of the step, not to the block table's
width (max_model_len). Logits memory per iteration is ``NT * Hkv * rows * block`` float32.
Keys outside a tile's causal / window range are masked and their V rows zeroed, so NaN or
garbage in unused or trash pages cannot leak into live rows.

Quantized pages (``QuantizedKV``): the block's values are gathered as stored (int8 / fp8) with
their scales; logits are ``(q . k_q) * k_scale`` per key and the softmax weights are multiplied
by the key's V scale before ``p @ v_q`` (the denominator sums the unscaled weights), so no
dequantized copy of the pages is made.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .common import (MASK_VALUE, AttentionMetadata, KVPages, QuantizedKV,
                     check_attention_inputs, pad_head_dim, sink_rows)
from .tiling import (F_KV_HI, F_KV_LO, F_NQ, F_POS0, F_SEQ, gather_q_tiles, max_num_tiles,
                     plan_tiles, scatter_out_tiles, tile_rows)

# Keys per loop iteration: big enough to amortise the loop, small enough for cache.
_BLOCK_TOKENS = 128
# Reference tiles stay small: a long prefill chunk becomes many tiles, bounding logits memory.
_MAX_TILE_TOKENS = 64


def _blocked_attention(q_tiles: jax.Array, info: jax.Array, kv_pages: KVPages,
                       block_tables: jax.Array, *, group: int, block_pages: int, sm_scale: float,
                       sliding_window: int | None, soft_cap: float | None,
                       sinks: jax.Array | None = None) -> jax.Array:
    """q_tiles [NT, Hkv, rows, D] -> [NT, Hkv, rows, D] f32, online softmax over KV blocks.
    sinks f32[Hkv, rows] (common.sink_rows) or None: each row's softmax starts from its sink
    (running max = sink, running sum = 1, no value)."""
    num_tiles, num_kv_heads, rows, head_dim = q_tiles.shape
    page_size = kv_pages.shape[2]
    block = block_pages * page_size
    max_pages = block_tables.shape[1]
    # Pad the block table so every block's page slice is in range (extra entries: page 0).
    n_blocks_max = -(-max_pages // block_pages)
    tables = jnp.pad(block_tables, ((0, 0), (0, n_blocks_max * block_pages - max_pages)))
    tile_tables = tables[info[:, F_SEQ]]                                  # [NT, n_blk * bp]
    qpos = info[:, F_POS0, None] + jnp.arange(rows, dtype=jnp.int32)[None, :] // group
    kv_hi, kv_lo = info[:, F_KV_HI], info[:, F_KV_LO]
    live = kv_hi > 0
    first = jnp.min(jnp.where(live, kv_lo // block, n_blocks_max))
    last = jnp.max(jnp.where(live, -(-kv_hi // block), 0))
    qf = q_tiles.astype(jnp.float32)
    quantized = isinstance(kv_pages, QuantizedKV)
    values = kv_pages.pages if quantized else kv_pages
    flat = values.reshape(-1, page_size, head_dim)  # [num_pages * 2Hkv, ps, D], free
    flat_scales = kv_pages.scales.reshape(-1, page_size) if quantized else None
    heads = jnp.arange(num_kv_heads, dtype=jnp.int32)

    def body(j: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]
             ) -> tuple[jax.Array, jax.Array, jax.Array]:
        m, l, acc = carry
        ids = jax.lax.dynamic_slice_in_dim(tile_tables, j * block_pages, block_pages, axis=1)
        # Gather K and V straight into [NT, Hkv, pages, ps, D] (rows 2h / 2h+1 of each page):
        # the dots read them as they land, with no transpose or strided-slice copies.
        rows_k = ids[:, None, :] * (2 * num_kv_heads) + 2 * heads[None, :, None]
        k = flat[rows_k].reshape(num_tiles, num_kv_heads, block, head_dim).astype(jnp.float32)
        v = flat[rows_k + 1].reshape(num_tiles, num_kv_heads, block, head_dim).astype(jnp.float32)
        kpos = j * block + jnp.arange(block, dtype=jnp.int32)
        ok_k = (kpos[None, :] < kv_hi[:, None]) & (kpos[None, :] >= kv_lo[:, None])  # [NT, blk]
        mask = ok_k[:, None, :] & (kpos[None, None, :] <= qpos[:, :, None])          # [NT,r,blk]
        if sliding_window is not None:
            mask &= kpos[None, None, :] > qpos[:, :, None] - sliding_window
        # Zero V outside the range: p == 0 there, but 0 * NaN would still poison the sum.
        v = jnp.where(ok_k[:, None, :, None], v, 0.0)
        s = jnp.einsum("thrd,thkd->thrk", qf, k) * sm_scale
        if quantized:       # per-key scales [NT, Hkv, 1, blk]; V's zeroed outside the range
            k_scale = flat_scales[rows_k].reshape(num_tiles, num_kv_heads, 1, block)
            v_scale = flat_scales[rows_k + 1].reshape(num_tiles, num_kv_heads, 1, block)
            v_scale = jnp.where(ok_k[:, None, None, :], v_scale, 0.0)
            s = s * k_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        s = jnp.where(mask[:, None], s, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
        p = jnp.where(mask[:, None], jnp.exp(s - m_new), 0.0)
        corr = jnp.exp(m - m_new)
        l = l * corr + jnp.sum(p, axis=-1, keepdims=True)
        pv = p * v_scale if quantized else p
        acc = acc * corr + jnp.einsum("thrk,thkd->thrd", pv, v)
        return m_new, l, acc

    shape = (num_tiles, num_kv_heads, rows, 1)
    if sinks is None:
        m0, l0 = jnp.full(shape, MASK_VALUE, jnp.float32), jnp.zeros(shape, jnp.float32)
    else:
        m0, l0 = jnp.broadcast_to(sinks[None, :, :, None], shape), jnp.ones(shape, jnp.float32)
    init = (m0, l0,
            jnp.zeros((num_tiles, num_kv_heads, rows, head_dim), jnp.float32))
    _, l, acc = jax.lax.fori_loop(first, last, body, init)
    return acc / jnp.where(l == 0.0, 1.0, l)


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap",
                                             "tile_tokens", "uniform_tiles"))
def ragged_paged_attention_reference(q: jax.Array, kv_pages: KVPages, md: AttentionMetadata,
                                     *, sm_scale: float, sliding_window: int | None = None,
                                     soft_cap: float | None = None,
                                     tile_tokens: int | None = None,
                                     sinks: jax.Array | None = None,
                                     uniform_tiles: bool = False) -> jax.Array:
    """out [T, Hq, Dq] of causal ragged paged attention (see module docstring); sinks
    f32[Hq] or None (common.py: attention sinks). `uniform_tiles` (the 'reference_invariant'
    impl, batch-invariant mode): decodes too go through the prefill pass's tiles, so a token
    is attended by the same einsum shapes whether it is decoded, verified, prefilled or
    recomputed after a preemption (at one step shape: the tile height is the bucket's)."""
    (num_tokens, num_q_heads, q_head_dim, num_kv_heads, page_size, head_dim, group,
     num_seqs_max, max_pages) = check_attention_inputs(
        q, kv_pages, md, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
        sinks=sinks)
    block_pages = max(1, min(max_pages, _BLOCK_TOKENS // page_size))
    q = pad_head_dim(q, head_dim)
    attend = functools.partial(_blocked_attention, kv_pages=kv_pages,
                               block_tables=md.block_tables, group=group,
                               block_pages=block_pages, sm_scale=sm_scale,
                               sliding_window=sliding_window, soft_cap=soft_cap)
    # Rows of a tile are (token, query head of the group) with the head fastest, so one
    # [Hkv, rows] sink table serves every tile of a given height.
    rows_of = (lambda rows: None) if sinks is None else (
        lambda rows: sink_rows(sinks, num_kv_heads, rows))
    starts, ends = md.cu_q_lens[:-1], md.cu_q_lens[1:]
    live = jnp.arange(num_seqs_max) < md.num_seqs[0]
    is_decode = live & (ends - starts == 1) & (not uniform_tiles)

    # Decode sequences: one 1-token tile each (rows = G), all in one vectorised pass whose KV
    # loop stops at the longest decode context.
    plan_d = plan_tiles(md, num_tokens, tile_tokens=1, block_kv=page_size,
                        sliding_window=sliding_window, seq_mask=is_decode,
                        max_tiles=min(num_tokens, num_seqs_max))
    rows_d = tile_rows(1, group)
    q_d = gather_q_tiles(q, plan_d, num_kv_heads, rows_d).transpose(1, 0, 2, 3)
    out_d = attend(q_d, plan_d.info, sinks=rows_of(rows_d))
    out_d = out_d.astype(q.dtype).transpose(1, 0, 2, 3)
    out = scatter_out_tiles(out_d, plan_d, num_q_heads)

    # Prefill chunks: tiles of `tile_tokens`, one at a time (lax.map), each looping over its
    # own KV blocks only; empty tiles are skipped, so padding costs nothing.
    if tile_tokens is None:
        tile_tokens = min(_MAX_TILE_TOKENS, num_tokens)
    n_prefill_max = min(num_seqs_max, num_tokens if uniform_tiles else num_tokens // 2)
    if n_prefill_max > 0:
        plan_p = plan_tiles(md, num_tokens, tile_tokens=tile_tokens, block_kv=page_size,
                            sliding_window=sliding_window, seq_mask=live & ~is_decode,
                            max_tiles=max_num_tiles(num_tokens, n_prefill_max, tile_tokens))
        rows_p = tile_rows(tile_tokens, group)
        q_p = gather_q_tiles(q, plan_p, num_kv_heads, rows_p).transpose(1, 0, 2, 3)

        def one_tile(args: tuple[jax.Array, jax.Array]) -> jax.Array:
            q_tile, info = args
            return jax.lax.cond(
                info[F_NQ] > 0,
                lambda: attend(q_tile[None], info[None], sinks=rows_of(rows_p))[0],
                lambda: jnp.zeros(q_tile.shape, jnp.float32))

        def prefill_pass() -> jax.Array:
            out_p = jax.lax.map(one_tile, (q_p, plan_p.info))
            out_p = out_p.astype(q.dtype).transpose(1, 0, 2, 3)
            return scatter_out_tiles(out_p, plan_p, num_q_heads)

        # A pure decode step skips the (sequential) prefill pass altogether.
        out = out + jax.lax.cond(plan_p.num_tiles > 0, prefill_pass,
                                 lambda: jnp.zeros(out.shape, out.dtype))
    return out[..., :q_head_dim]
