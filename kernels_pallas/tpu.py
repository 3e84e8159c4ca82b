"""Ragged paged attention on TPU: Pallas Mosaic TPU kernel with scalar-prefetched metadata.

Data flow (see tiling.py for the tile plan, tpu_plan.py for the trace-time decisions)::

    q [T, Hq, D] -> q_tiles [Hkv, NT, rows, D']             (XLA gather; D' = D up to 128s)
    grid (Hkv / hb, NT): head blocks "parallel" (megacore: one range per TensorCore),
                         tiles "arbitrary" (sequential: DMAs are chained across tiles)
      SMEM (scalar prefetch): tile info [NT * 8], live tile count, block tables [S * P']
      VMEM in : q block [hb, rows, D']   (BlockSpec, auto-pipelined)
      HBM     : kv_pages [num_pages, 2 * Hkv, page_size, D'] (memory_space=ANY, manual DMA)
      VMEM out: out block [hb, rows, D'] -> out_tiles -> scatter to [T, Hq, D]

Per grid step (kv-head block, tile): loop over the tile's KV blocks ``[blk_lo, blk_hi)``,
each ``pages_per_block`` pages read through the block table. Every page DMA copies one
contiguous ``[2 * hb, page_size, D']`` slab (K and V of hb heads) into a double buffer
``[2, 2 * hb, block_kv, D']``; pages wholly past the tile's causal end are not copied (the
last block of a short sequence reads only its live pages). While block b is computed, block
b + 1 -- or, on the tile's last block, the next tile's first block -- is already in flight.
The chain stops at head-block boundaries: each head block starts its own first copy, so the
head-block axis can be split between TensorCores (one exposed DMA latency per head block).
The double-buffer slot survives between grid steps in SMEM.

Math per head: s = q k^T (f32 on the MXU), optional soft-cap, causal + sliding-window mask
(full-tile boolean, select in f32), online softmax with running max/sum in VMEM scratch
(lane-replicated [rows, 128] so no unaligned lane slices are needed), acc += p v. On the block
that crosses the tile's causal end, V rows past it are zeroed in place first (full-tile mask,
select in f32): p is 0 there, but 0 * NaN from a stale buffer row or an unused page slot would
not be. Empty tiles (past the live count) skip all DMAs and write zeros.

Quantized pages (``QuantizedKV``, int8 / float8_e4m3fn): each page DMA is joined by one of its
scale slab ``scales[page, 2 * hb heads]`` ([2 * hb, page_size] f32) into a double buffer
``[2, pages_per_block, 2 * hb, page_size]`` (a leading page axis: every copy lands on whole
tiles), on the same semaphore. Per head, the block's K and V scales are joined along lanes
into ``[1, block_kv]`` rows; K and V are converted to q's dtype in VMEM (one block, never the
cache); s = (q k^T) * k_scale, and the weights, times the V scales, go into ``p @ v`` (the
denominator sums the unscaled weights). int8 / fp8 pages need page_size % 32 == 0 (sublane
packing). The scale rows' lane concatenation of page_size-wide pieces is the part of this
path Mosaic's layout passes (libtpu) never checked here.

Attention sinks (``sinks`` f32[Hq], gpt-oss): the wrapper lays them out per tile row,
lane-replicated like the running max (``[Hkv, rows, 128]``, a BlockSpec input fetched once per
head block), and each live tile starts its online softmax from them: running max = sink,
running sum = 1 (the sink's own e^0), no value. Without sinks that input does not exist.

Limits (tpu_plan.py): page_size must fill whole sublane tiles (16 rows for bf16 / f16, 8 for
f32); pages whose head dim is not a multiple of 128 are zero-padded by the wrapper, which
copies the whole page array per call (allocate pages with 128-lane head dims on TPU to avoid
it); when the block table and tile info outgrow the SMEM budget the call is split over
sequence ranges, and when even one sequence does not fit it falls back to the jnp reference
with one warning. Checked on CPU only: the interpreter (DMA/semaphore semantics, race
detector, two simulated cores) and the Pallas -> Mosaic lowering; Mosaic's own layout passes
run in libtpu and were not exercised.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .common import (MASK_VALUE, AttentionMetadata, KVPages, QuantizedKV, check_attention_inputs,
                     pad_head_dim, sink_rows)
from .reference import ragged_paged_attention_reference
from .tiling import (F_BLK_HI, F_BLK_LO, F_KV_HI, F_POS0, F_SEQ, NUM_FIELDS,
                     default_tile_tokens, gather_q_tiles, plan_tiles, row_to_token,
                     scatter_out_tiles, tile_rows)
from .tpu_plan import (LANES, check_page_alignment, default_kv_heads_per_block, lane_padded,
                       seqs_per_call, sublane_multiple, tpu_hardware)

log = logging.getLogger(__name__)


def _kernel(info_ref, num_tiles_ref, bt_ref,                  # scalar prefetch (SMEM)
            q_ref, kv_hbm, *refs,                             # q block, pages (+ scales), ...
            group: int, pages_per_block: int, pages_per_row: int, sm_scale: float,
            sliding_window: int | None, soft_cap: float | None, quantized: bool,
            has_sinks: bool):
    sc_hbm = sc_buf = sink_ref = None
    if quantized:       # scales (HBM) come after the pages
        sc_hbm, *refs = refs
    if has_sinks:       # then the sink rows [hb, rows, LANES] (VMEM block)
        sink_ref, *refs = refs
    if quantized:       # out block, scratch with the scales' double buffer
        o_ref, kv_buf, sc_buf, sems, m_ref, l_ref, acc_ref, slot_ref = refs
    else:
        o_ref, kv_buf, sems, m_ref, l_ref, acc_ref, slot_ref = refs
    hb, rows, head_dim = q_ref.shape
    block_kv = kv_buf.shape[2]
    page_size = block_kv // pages_per_block
    hblk, tile = pl.program_id(0), pl.program_id(1)
    num_tiles = num_tiles_ref[0]

    def field(t, f):
        return info_ref[t * NUM_FIELDS + f]

    def copies(t, blk, slot):
        """(live, copy) per page of KV block `blk` of tile `t`; a page is live when it holds
        a key below the tile's causal end. Page 0 of a visited block always is."""
        # Block-table rows are padded to whole blocks in the wrapper: no bounds check here.
        base = field(t, F_SEQ) * pages_per_row + blk * pages_per_block
        kv_hi = field(t, F_KV_HI)
        out = []
        for j in range(pages_per_block):
            live = (blk * pages_per_block + j) * page_size < kv_hi
            heads = (bt_ref[base + j], pl.ds(hblk * 2 * hb, 2 * hb))
            page = [pltpu.make_async_copy(kv_hbm.at[heads],
                                          kv_buf.at[slot, :, pl.ds(j * page_size, page_size)],
                                          sems.at[slot])]
            if quantized:    # the page's scale slab [2 * hb, page_size], same semaphore
                page.append(pltpu.make_async_copy(sc_hbm.at[heads], sc_buf.at[slot, j],
                                                  sems.at[slot]))
            out.append((live, page))
        return out

    def start(t, blk, slot):
        for j, (live, page) in enumerate(copies(t, blk, slot)):
            for c in page:
                if j == 0:
                    c.start()
                else:
                    pl.when(live)(c.start)

    def wait(t, blk, slot):
        for j, (live, page) in enumerate(copies(t, blk, slot)):
            for c in page:
                if j == 0:
                    c.wait()
                else:
                    pl.when(live)(c.wait)

    def scale_row(slot, row):
        """[1, block_kv] f32: the block's scales of K/V row `row`, page by page on lanes."""
        return jnp.concatenate([sc_buf[slot, j, pl.ds(row, 1), :]
                                for j in range(pages_per_block)], axis=1)

    @pl.when(tile >= num_tiles)
    def _empty_tile():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

    @pl.when(tile < num_tiles)
    def _live_tile():
        @pl.when(tile == 0)
        def _first():                      # later tiles of this head block: prefetched
            slot_ref[0] = 0
            start(tile, field(tile, F_BLK_LO), 0)

        if has_sinks:      # the softmax starts from the sink: its e^0 in the sum, no value
            m_ref[...] = sink_ref[...]
            l_ref[...] = jnp.ones(l_ref.shape, jnp.float32)
        else:
            m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
            l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
        pos0, kv_hi = field(tile, F_POS0), field(tile, F_KV_HI)
        blk_hi = field(tile, F_BLK_HI)
        # Row r of the tile is token r // group: its causal position. Masks are built at the
        # full tile shape (no (n, 1) broadcasts into selects, which Mosaic's layouts dislike).
        qpos = pos0 + row_to_token(lax.broadcasted_iota(jnp.int32, (rows, block_kv), 0), group)
        col = lax.broadcasted_iota(jnp.int32, (rows, block_kv), 1)
        vrow = lax.broadcasted_iota(jnp.int32, (block_kv, head_dim), 0)

        def body(blk, slot):
            nxt = 1 - slot

            @pl.when(blk + 1 < blk_hi)
            def _prefetch_same_tile():
                start(tile, blk + 1, nxt)

            @pl.when((blk + 1 >= blk_hi) & (tile + 1 < num_tiles))
            def _prefetch_next_tile():
                start(tile + 1, field(tile + 1, F_BLK_LO), nxt)

            wait(tile, blk, slot)

            @pl.when((blk + 1) * block_kv > kv_hi)
            def _zero_v_tail():            # only the block crossing the causal end
                v_ok = blk * block_kv + vrow < kv_hi
                for h in range(hb):
                    v = kv_buf[slot, 2 * h + 1]
                    kv_buf[slot, 2 * h + 1] = jnp.where(
                        v_ok, v.astype(jnp.float32), 0.0).astype(v.dtype)

            kpos = blk * block_kv + col
            mask = (kpos <= qpos) & (kpos < kv_hi)
            if sliding_window is not None:
                mask &= kpos > qpos - sliding_window
            for h in range(hb):
                q = q_ref[h]
                k = kv_buf[slot, 2 * h]
                v = kv_buf[slot, 2 * h + 1]
                if quantized:      # values to q's dtype in VMEM; scales applied below
                    k, v = k.astype(q.dtype), v.astype(q.dtype)
                s = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                    preferred_element_type=jnp.float32) * sm_scale
                if quantized:
                    s = s * scale_row(slot, 2 * h)
                if soft_cap is not None:
                    s = soft_cap * jnp.tanh(s / soft_cap)
                s = jnp.where(mask, s, MASK_VALUE)
                m_prev = jnp.max(m_ref[h], axis=1, keepdims=True)      # lanes are replicas
                l_prev = jnp.max(l_ref[h], axis=1, keepdims=True)
                m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
                p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
                alpha = jnp.exp(m_prev - m_new)
                l_ref[h] = jnp.broadcast_to(alpha * l_prev + jnp.sum(p, axis=1, keepdims=True),
                                            (rows, LANES))
                m_ref[h] = jnp.broadcast_to(m_new, (rows, LANES))
                if quantized:      # p x V scale; where(): stale scales past kv_hi may be NaN
                    p = jnp.where(mask, p * scale_row(slot, 2 * h + 1), 0.0)
                pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
                acc_ref[h] = alpha * acc_ref[h] + pv
            return nxt

        slot_ref[0] = lax.fori_loop(field(tile, F_BLK_LO), blk_hi, body, slot_ref[0])
        for h in range(hb):
            denom = jnp.max(l_ref[h], axis=1, keepdims=True)
            o_ref[h] = (acc_ref[h] / jnp.where(denom == 0.0, 1.0, denom)).astype(o_ref.dtype)


def _attend(q: jax.Array, kv_pages: KVPages, md: AttentionMetadata, *, group: int,
            num_q_heads: int, hb: int, pages_per_block: int, tile_tokens: int,
            sm_scale: float, sliding_window: int | None, soft_cap: float | None,
            interpret: Any, vmem_limit_bytes: int | None,
            sinks: jax.Array | None = None) -> jax.Array:
    """One kernel call over md's sequences: out [T, Hq, D'] (q and pages lane-padded)."""
    num_tokens, head_dim = q.shape[0], q.shape[2]
    num_kv_heads, page_size = kv_pages.shape[1] // 2, kv_pages.shape[2]
    max_pages = md.block_tables.shape[1]
    block_kv = pages_per_block * page_size
    plan = plan_tiles(md, num_tokens, tile_tokens=tile_tokens, block_kv=block_kv,
                      sliding_window=sliding_window)
    rows = tile_rows(tile_tokens, group, sublane_multiple(q.dtype))
    q_tiles = gather_q_tiles(q, plan, num_kv_heads, rows)
    # Pad block-table rows to whole KV blocks (trash page), so the kernel never reads past them.
    pages_per_row = -(-max_pages // pages_per_block) * pages_per_block
    bt = jnp.pad(md.block_tables, ((0, 0), (0, pages_per_row - max_pages)))
    quantized = isinstance(kv_pages, QuantizedKV)
    kernel = functools.partial(_kernel, group=group, pages_per_block=pages_per_block,
                               pages_per_row=pages_per_row, sm_scale=sm_scale,
                               sliding_window=sliding_window, soft_cap=soft_cap,
                               quantized=quantized, has_sinks=sinks is not None)
    tile_spec = pl.BlockSpec((hb, None, rows, head_dim), lambda h, t, *_: (h, t, 0, 0))
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    pages = (kv_pages.pages, kv_pages.scales) if quantized else (kv_pages,)
    sink_inputs, sink_specs = (), []
    if sinks is not None:   # lane-replicated rows, one block per head block (never re-fetched)
        sink_inputs = (jnp.broadcast_to(sink_rows(sinks, num_kv_heads, rows)[..., None],
                                        (num_kv_heads, rows, LANES)),)
        sink_specs = [pl.BlockSpec((hb, rows, LANES), lambda h, t, *_: (h, 0, 0))]
    scale_scratch = [pltpu.VMEM((2, pages_per_block, 2 * hb, page_size), jnp.float32)
                     ] if quantized else []
    out_tiles = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(q_tiles.shape, q.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(num_kv_heads // hb, plan.max_tiles),
            in_specs=[tile_spec, *[hbm] * len(pages), *sink_specs],
            out_specs=tile_spec,
            scratch_shapes=[
                pltpu.VMEM((2, 2 * hb, block_kv, head_dim), kv_pages.dtype),
                *scale_scratch,
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.VMEM((hb, rows, LANES), jnp.float32),
                pltpu.VMEM((hb, rows, LANES), jnp.float32),
                pltpu.VMEM((hb, rows, head_dim), jnp.float32),
                pltpu.SMEM((1,), jnp.int32),
            ]),
        # Head blocks share nothing (each starts its own DMA chain): megacore chips may run
        # them on both TensorCores. Tiles stay sequential: tile t prefetches tile t + 1.
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                             vmem_limit_bytes=vmem_limit_bytes),
        interpret=interpret,
        name="ragged_paged_attention_tpu",
    )(plan.info.reshape(-1), plan.num_tiles.reshape(1), bt.reshape(-1), q_tiles, *pages,
      *sink_inputs)
    return scatter_out_tiles(out_tiles, plan, num_q_heads)


def _split_by_sequences(attend: Any, md: AttentionMetadata, num_tokens: int,
                        seqs: int) -> jax.Array:
    """attend() over sequence ranges of `seqs` each (so each call's SMEM fits); a range's
    call sees only its block-table rows, and its output counts only for its own tokens."""
    num_seqs_max = md.block_tables.shape[0]
    live = jnp.clip(md.num_seqs[0], 0, num_seqs_max)
    tok = jnp.arange(num_tokens, dtype=jnp.int32)
    out = None
    for s0 in range(0, num_seqs_max, seqs):
        s1 = min(num_seqs_max, s0 + seqs)
        part = AttentionMetadata(
            slot_mapping=md.slot_mapping, block_tables=md.block_tables[s0:s1],
            kv_lens=md.kv_lens[s0:s1], cu_q_lens=md.cu_q_lens[s0:s1 + 1],
            num_seqs=jnp.clip(md.num_seqs - s0, 0, s1 - s0))
        got = attend(part)
        # cu_q_lens of the range starts at its first token, not 0: tokens before it would map
        # onto the range's first sequence, so only [first token, last live token) is kept.
        lo, hi = md.cu_q_lens[jnp.minimum(s0, live)], md.cu_q_lens[jnp.minimum(s1, live)]
        mine = ((tok >= lo) & (tok < hi))[:, None, None]
        out = jnp.where(mine, got, jnp.zeros((), got.dtype) if out is None else out)
    return out


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "sliding_window", "soft_cap", "interpret", "pages_per_block", "tile_tokens",
    "kv_heads_per_block", "vmem_limit_bytes", "smem_budget_bytes"))
def ragged_paged_attention_tpu(q: jax.Array, kv_pages: KVPages, md: AttentionMetadata, *,
                               sm_scale: float, sliding_window: int | None = None,
                               soft_cap: float | None = None, interpret: Any = False,
                               pages_per_block: int | None = None,
                               tile_tokens: int | None = None,
                               kv_heads_per_block: int | None = None,
                               vmem_limit_bytes: int | None = None,
                               smem_budget_bytes: int | None = None,
                               sinks: jax.Array | None = None) -> jax.Array:
    """out [T, Hq, Dq]; tuning knobs default to sizes that suit v5e/v6e (untuned guesses);
    sinks: f32[Hq] attention-sink logits or None.

    `smem_budget_bytes` bounds the SMEM operands of one kernel call (default: half of this
    TPU's SMEM, or of 1 MiB off-TPU); larger steps are split over sequence ranges."""
    (num_tokens, num_q_heads, q_head_dim, num_kv_heads, page_size, head_dim, group,
     num_seqs_max, max_pages) = check_attention_inputs(
        q, kv_pages, md, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
        sinks=sinks)
    check_page_alignment(page_size, kv_pages.dtype, kv_pages.shape)
    smem_capacity, num_cores = tpu_hardware()
    budget = smem_budget_bytes or smem_capacity // 2
    pages_per_block = pages_per_block or max(1, min(max_pages, 256 // page_size))
    hb = kv_heads_per_block or default_kv_heads_per_block(num_kv_heads, num_cores)
    if num_kv_heads % hb:
        raise ValueError(f"kv_heads_per_block={hb} must divide the {num_kv_heads} kv heads of "
                         f"kv_pages shape {tuple(kv_pages.shape)}")
    tile_tokens = tile_tokens or default_tile_tokens(num_tokens, num_seqs_max,
                                                     max(1, 128 // group))
    pages_per_row = -(-max_pages // pages_per_block) * pages_per_block
    seqs = seqs_per_call(num_tokens, num_seqs_max, pages_per_row, tile_tokens, budget)
    opts = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                sinks=sinks)
    if seqs is None:
        log.warning("TPU attention falls back to the jnp reference: the tile info of %d "
                    "tokens (tile_tokens=%d) plus one block-table row of %d pages exceeds "
                    "the %d-byte SMEM budget (smem_budget_bytes)", num_tokens, tile_tokens,
                    pages_per_row, budget)
        return ragged_paged_attention_reference(q, kv_pages, md, **opts)

    lanes = lane_padded(head_dim)
    if lanes != head_dim:   # a copy of every page, each call: allocate 128-lane pages instead
        log.warning("TPU attention pads kv_pages %s to head_dim %d (a copy of the whole array "
                    "per call); allocate pages with padded_head_dim(D, 128) on TPU",
                    tuple(kv_pages.shape), lanes)
        kv_pages = (QuantizedKV(pad_head_dim(kv_pages.pages, lanes), kv_pages.scales)
                    if isinstance(kv_pages, QuantizedKV) else pad_head_dim(kv_pages, lanes))
    q = pad_head_dim(q, lanes)
    if interpret is True:       # the TPU interpreter: real DMA/semaphore semantics, NaN scratch
        interpret = pltpu.InterpretParams()
    attend = functools.partial(
        _attend, q, kv_pages, group=group, num_q_heads=num_q_heads, hb=hb,
        pages_per_block=pages_per_block, tile_tokens=tile_tokens, interpret=interpret,
        vmem_limit_bytes=vmem_limit_bytes, **opts)
    if seqs >= num_seqs_max:
        out = attend(md)
    else:
        log.info("TPU attention: block tables of %d sequences x %d pages exceed the %d-byte "
                 "SMEM budget; %d calls of %d sequences", num_seqs_max, pages_per_row, budget,
                 -(-num_seqs_max // seqs), seqs)
        out = _split_by_sequences(attend, md, num_tokens, seqs)
    return out[..., :q_head_dim]
