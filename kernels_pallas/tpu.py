"""Ragged paged attention on TPU: Pallas Mosaic TPU kernel with scalar-prefetched metadata.

Data flow (see tiling.py for the tile plan)::

    q [T, Hq, D] -> q_tiles [Hkv, NT, rows, D]              (XLA gather in the wrapper)
    grid (Hkv / hb, NT), both "arbitrary" (sequential: DMAs are chained across grid steps)
      SMEM (scalar prefetch): tile info [NT * 8], live tile count, block tables [S * P']
      VMEM in : q block [hb, rows, D]   (BlockSpec, auto-pipelined)
      HBM     : kv_pages [num_pages, 2 * Hkv, page_size, D] (memory_space=ANY, manual DMA)
      VMEM out: out block [hb, rows, D] -> out_tiles -> scatter to [T, Hq, D]

Per grid step (kv-head block, tile): loop over the tile's KV blocks ``[blk_lo, blk_hi)``,
each ``pages_per_block`` pages read through the block table. Every page DMA copies one
contiguous ``[2 * hb, page_size, D]`` slab (K and V of hb heads) into a double buffer
``[2, 2 * hb, block_kv, D]``; while block b is computed, block b + 1 -- or, on the tile's last
block, the *next tile's* first block -- is already in flight, so DMA latency is hidden across
tile boundaries too (this is why the grid runs sequentially; a "parallel" grid would split
the chain across TensorCores). The double-buffer slot survives between grid steps in SMEM.

Math per head: s = q k^T (f32 on the MXU), optional soft-cap, causal + sliding-window mask,
online softmax with running max/sum in VMEM scratch (lane-replicated [rows, 128] so no
unaligned lane slices are needed), acc += p v. V rows past the tile's causal end are zeroed
before the p v matmul: p is 0 there but 0 * NaN from an unused page slot would not be.
Empty tiles (past the live count) skip all DMAs and write zeros.

Limits: the block tables and tile info live in SMEM (scalar prefetch), so S x
max_pages_per_seq must fit there (tens of thousands of entries). Checked on CPU only: the
interpreter (DMA/semaphore semantics, race detector) and the Pallas -> Mosaic lowering;
Mosaic's own layout passes run in libtpu and were not exercised.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .common import MASK_VALUE, AttentionMetadata, check_attention_inputs, pad_head_dim
from .tiling import (F_BLK_HI, F_BLK_LO, F_KV_HI, F_POS0, F_SEQ, NUM_FIELDS,
                     default_tile_tokens, gather_q_tiles, plan_tiles, row_to_token,
                     scatter_out_tiles, tile_rows)

_LANES = 128


def _kernel(info_ref, num_tiles_ref, bt_ref,                  # scalar prefetch (SMEM)
            q_ref, kv_hbm, o_ref,                             # q block, pages (HBM), out block
            kv_buf, sems, m_ref, l_ref, acc_ref, slot_ref,    # scratch
            *, group: int, pages_per_block: int, pages_per_row: int, sm_scale: float,
            sliding_window: int | None, soft_cap: float | None):
    hb, rows, _ = q_ref.shape
    page_size = kv_buf.shape[2] // pages_per_block
    block_kv = kv_buf.shape[2]
    hblk, tile = pl.program_id(0), pl.program_id(1)
    num_hblk = pl.num_programs(0)
    num_tiles = num_tiles_ref[0]

    def field(t, f):
        return info_ref[t * NUM_FIELDS + f]

    def copies(h_blk, t, blk, slot):
        # Block-table rows are padded to whole blocks in the wrapper: no bounds check here.
        base = field(t, F_SEQ) * pages_per_row + blk * pages_per_block
        return [pltpu.make_async_copy(
            kv_hbm.at[bt_ref[base + j], pl.ds(h_blk * 2 * hb, 2 * hb)],
            kv_buf.at[slot, :, pl.ds(j * page_size, page_size)], sems.at[slot])
            for j in range(pages_per_block)]

    def start(h_blk, t, blk, slot):
        for c in copies(h_blk, t, blk, slot):
            c.start()

    @pl.when(tile >= num_tiles)
    def _empty_tile():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

    @pl.when(tile < num_tiles)
    def _live_tile():
        @pl.when((hblk == 0) & (tile == 0))
        def _first():                      # every later tile was prefetched by its predecessor
            slot_ref[0] = 0
            start(hblk, tile, field(tile, F_BLK_LO), 0)

        m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
        pos0, kv_hi = field(tile, F_POS0), field(tile, F_KV_HI)
        blk_hi = field(tile, F_BLK_HI)
        # Row r of the tile is token r // group: its causal position.
        qpos = pos0 + row_to_token(lax.broadcasted_iota(jnp.int32, (rows, block_kv), 0), group)
        col = lax.broadcasted_iota(jnp.int32, (rows, block_kv), 1)
        vrow = lax.broadcasted_iota(jnp.int32, (block_kv, 1), 0)

        def body(blk, slot):
            nxt = 1 - slot
            in_tile = blk + 1 < blk_hi
            wrap = tile + 1 >= num_tiles     # the next live tile starts the next head block
            n_tile = jnp.where(wrap, 0, tile + 1)
            n_hblk = jnp.where(wrap, hblk + 1, hblk)

            @pl.when(in_tile)
            def _prefetch_same_tile():
                start(hblk, tile, blk + 1, nxt)

            @pl.when(jnp.logical_not(in_tile) & (n_hblk < num_hblk))
            def _prefetch_next_tile():
                start(n_hblk, n_tile, field(n_tile, F_BLK_LO), nxt)

            for c in copies(hblk, tile, blk, slot):
                c.wait()
            kpos = blk * block_kv + col
            mask = (kpos <= qpos) & (kpos < kv_hi)
            if sliding_window is not None:
                mask &= kpos > qpos - sliding_window
            v_ok = blk * block_kv + vrow < kv_hi
            for h in range(hb):
                q = q_ref[h]
                k = kv_buf[slot, 2 * h]
                v = kv_buf[slot, 2 * h + 1]
                s = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                    preferred_element_type=jnp.float32) * sm_scale
                if soft_cap is not None:
                    s = soft_cap * jnp.tanh(s / soft_cap)
                s = jnp.where(mask, s, MASK_VALUE)
                m_prev = jnp.max(m_ref[h], axis=1, keepdims=True)      # lanes are replicas
                l_prev = jnp.max(l_ref[h], axis=1, keepdims=True)
                m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
                p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
                alpha = jnp.exp(m_prev - m_new)
                l_ref[h] = jnp.broadcast_to(alpha * l_prev + jnp.sum(p, axis=1, keepdims=True),
                                            (rows, _LANES))
                m_ref[h] = jnp.broadcast_to(m_new, (rows, _LANES))
                v = jnp.where(v_ok, v, jnp.zeros((), v.dtype))
                pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
                acc_ref[h] = alpha * acc_ref[h] + pv
            return nxt

        slot_ref[0] = lax.fori_loop(field(tile, F_BLK_LO), blk_hi, body, slot_ref[0])
        for h in range(hb):
            denom = jnp.max(l_ref[h], axis=1, keepdims=True)
            o_ref[h] = (acc_ref[h] / jnp.where(denom == 0.0, 1.0, denom)).astype(o_ref.dtype)


def _divisor_at_most(n: int, cap: int) -> int:
    return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "sliding_window", "soft_cap", "interpret", "pages_per_block", "tile_tokens",
    "kv_heads_per_block", "vmem_limit_bytes"))
def ragged_paged_attention_tpu(q: jax.Array, kv_pages: jax.Array, md: AttentionMetadata, *,
                               sm_scale: float, sliding_window: int | None = None,
                               soft_cap: float | None = None, interpret: Any = False,
                               pages_per_block: int | None = None,
                               tile_tokens: int | None = None,
                               kv_heads_per_block: int | None = None,
                               vmem_limit_bytes: int | None = None) -> jax.Array:
    """out [T, Hq, Dq]; tuning knobs default to sizes that suit v5e/v6e (untuned guesses)."""
    (num_tokens, num_q_heads, q_head_dim, num_kv_heads, page_size, head_dim, group,
     num_seqs_max, max_pages) = check_attention_inputs(
        q, kv_pages, md, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    pages_per_block = pages_per_block or max(1, min(max_pages, 256 // page_size))
    hb = kv_heads_per_block or _divisor_at_most(num_kv_heads, 8)
    if num_kv_heads % hb:
        raise ValueError(f"kv_heads_per_block={hb} must divide the {num_kv_heads} kv heads of "
                         f"kv_pages shape {tuple(kv_pages.shape)}")
    tile_tokens = tile_tokens or default_tile_tokens(num_tokens, num_seqs_max,
                                                     max(1, 128 // group))
    block_kv = pages_per_block * page_size
    plan = plan_tiles(md, num_tokens, tile_tokens=tile_tokens, block_kv=block_kv,
                      sliding_window=sliding_window)
    # Sublane tiling of the rows axis: 8 rows for 32-bit, 16 for 16-bit types.
    rows = tile_rows(tile_tokens, group, 8 * (4 // jnp.dtype(q.dtype).itemsize))
    q_tiles = gather_q_tiles(pad_head_dim(q, head_dim), plan, num_kv_heads, rows)
    n_tiles = plan.max_tiles
    # Pad block-table rows to whole KV blocks (trash page), so the kernel never reads past them.
    pages_per_row = -(-max_pages // pages_per_block) * pages_per_block
    bt = jnp.pad(md.block_tables, ((0, 0), (0, pages_per_row - max_pages)))

    if interpret is True:       # the TPU interpreter: real DMA/semaphore semantics, NaN scratch
        interpret = pltpu.InterpretParams()
    kernel = functools.partial(_kernel, group=group, pages_per_block=pages_per_block,
                               pages_per_row=pages_per_row, sm_scale=sm_scale,
                               sliding_window=sliding_window, soft_cap=soft_cap)
    tile_spec = pl.BlockSpec((hb, None, rows, head_dim), lambda h, t, *_: (h, t, 0, 0))
    out_tiles = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(q_tiles.shape, q.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(num_kv_heads // hb, n_tiles),
            in_specs=[tile_spec, pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=tile_spec,
            scratch_shapes=[
                pltpu.VMEM((2, 2 * hb, block_kv, head_dim), kv_pages.dtype),
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.VMEM((hb, rows, _LANES), jnp.float32),
                pltpu.VMEM((hb, rows, _LANES), jnp.float32),
                pltpu.VMEM((hb, rows, head_dim), jnp.float32),
                pltpu.SMEM((1,), jnp.int32),
            ]),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary"),
                                             vmem_limit_bytes=vmem_limit_bytes),
        interpret=interpret,
        name="ragged_paged_attention_tpu",
    )(plan.info.reshape(-1), plan.num_tiles.reshape(1), bt.reshape(-1), q_tiles, kv_pages)
    return scatter_out_tiles(out_tiles, plan, num_q_heads)[..., :q_head_dim]
