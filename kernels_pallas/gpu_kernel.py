"""The Mosaic GPU kernel's body: one warpgroup per (kv head, query tile[, KV split]).

gpu.py's docstring gives the data flow and the design; gpu.py allocates the shared memory
(its sizes: gpu_plan.smem_bytes) and launches this body over the grid. Per program: the q tile
by TMA, then a ring of ``num_stages`` K/V slots refilled by TMA from the block table's pages
(whole pages per block, or a block-sized slice of a taller page), two WGMMAs per block with an
online softmax between them, masks only on boundary blocks, float32 / 8-bit pages converted to
the 16-bit MMA dtype in one staging block (K, then V), and the output tile (with its
log-sum-exp under split-KV) back by TMA.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .common import MASK_VALUE
from .gpu_plan import _ROWS
from .tiling import F_BLK_HI, F_BLK_LO, F_KV_HI, F_NQ, F_POS0, F_SEQ, NUM_FIELDS, row_to_token


def attention_kernel(info_ref, bt_ref, q_ref, kv_ref, *refs,
                     group: int, block_kv: int, page_size: int, pages_per_row: int,
                     num_stages: int, num_splits: int, sm_scale: float,
                     sliding_window: int | None, soft_cap: float | None, interpreted: bool,
                     quantized: bool, with_lse: bool = False):
    """One (kv head, tile[, split]) program; `refs`: (scales,) out(, lse), then the scratch
    gpu.py allocates, in its order. The log-sum-exp output exists under split-KV and with
    attention sinks (`with_lse`: gpu.py folds the sinks in where it merges)."""
    with_lse = with_lse or num_splits > 1
    sc_ref = ksc_smem = vsc_smem = None
    if quantized:                         # the scales [P, 2 * Hkv, page_size] come as input 5
        sc_ref, *refs = refs
    o_ref, *refs = refs
    if with_lse:
        lse_ref, q_smem, k_smem, v_smem, q_bar, k_bars, v_bars, lse_smem, *staging = refs
    else:
        q_smem, k_smem, v_smem, q_bar, k_bars, v_bars, *staging = refs
    if quantized:                         # [num_stages, block_kv] f32 K / V scales
        ksc_smem, vsc_smem, *staging = staging
    # A block is whole pages (one TMA per page) or, for pages taller than the block, a slice
    # of one page (one TMA of its block_kv rows, starting at the block's offset in the page).
    rows = min(block_kv, page_size)
    pages_per_block = max(1, block_kv // page_size)
    blocks_per_page = max(1, page_size // block_kv)
    head_dim = q_smem.shape[-1]
    h = lax.axis_index("kv_head")
    tile = lax.axis_index("tile")
    split = lax.axis_index("split") if num_splits > 1 else 0

    def field(f):
        return info_ref[tile * NUM_FIELDS + f]

    seq, pos0, kv_hi = field(F_SEQ), field(F_POS0), field(F_KV_HI)
    # This program's share of the tile's KV blocks: [lo, lo + num_blocks) (split-KV cuts the
    # tile's range into num_splits near-equal chunks; a chunk may be empty).
    blk_lo, blk_hi = field(F_BLK_LO), field(F_BLK_HI)
    chunk = lax.div(blk_hi - blk_lo + num_splits - 1, num_splits)
    lo = jnp.minimum(blk_lo + split * chunk, blk_hi)
    num_blocks = jnp.minimum(lo + chunk, blk_hi) - lo
    # Only boundary blocks are masked: blocks ending at or before the tile's first query
    # (pos0) are fully visible to every row (causal), and with a window so are blocks
    # starting past kv_hi - 1 - window. Masked: [0, mid_lo) and [mid_hi, num_blocks).
    mid_hi = jnp.clip(lax.div(pos0 + 1, block_kv) - lo, 0, num_blocks)
    if sliding_window is None:
        mid_lo = jnp.int32(0)
    else:
        first_free = lax.div(jnp.maximum(kv_hi - sliding_window, 0) + block_kv - 1, block_kv)
        mid_lo = jnp.clip(first_free - lo, 0, num_blocks)
        mid_hi = jnp.maximum(mid_hi, mid_lo)
    last_entry = bt_ref.shape[0] - 1

    def page_ids(i):
        """Block i's (page id, first row in it) per copy; ids clamped in range (those of a
        block past the end go unused)."""
        if blocks_per_page == 1:
            base = seq * pages_per_row + (lo + i) * pages_per_block
            return [(bt_ref[jnp.minimum(base + j, last_entry)], None)
                    for j in range(pages_per_block)]
        entry = seq * pages_per_row + lax.div(lo + i, blocks_per_page)
        return [(bt_ref[jnp.minimum(entry, last_entry)],
                 lax.rem(lo + i, blocks_per_page) * block_kv)]

    def page_rows(ref, page, row, row0):
        """[rows(, D)] of K/V row `row` of `page`: all of it, or the block's rows from row0."""
        return ref.at[page, row] if row0 is None else ref.at[page, row, pl.ds(row0, rows)]

    def issue(i, pages):
        """Start the TMA copies of the tile's i-th KV block into slot i % num_stages."""
        slot = lax.rem(i, num_stages)
        for j, (page, row0) in enumerate(pages):
            dst = pl.ds(j * rows, rows)
            for kv, (smem, bars) in enumerate(((k_smem, k_bars), (v_smem, v_bars))):
                plgpu.copy_gmem_to_smem(page_rows(kv_ref, page, 2 * h + kv, row0),
                                        smem.at[slot, dst], bars.at[slot])
            if quantized:                 # the rows' scales, on the same barriers
                for kv, (smem, bars) in enumerate(((ksc_smem, k_bars), (vsc_smem, v_bars))):
                    plgpu.copy_gmem_to_smem(page_rows(sc_ref, page, 2 * h + kv, row0),
                                            smem.at[slot, dst], bars.at[slot])

    @pl.when(field(F_NQ) > 0)
    def _live_tile():
        plgpu.copy_gmem_to_smem(q_ref.at[h, tile], q_smem, q_bar)
        for i in range(num_stages):
            pl.when(i < num_blocks)(lambda i=i: issue(i, page_ids(i)))
        plgpu.barrier_wait(q_bar)

        # Register layouts: WGMMA's fragment layout for tiles, its row-reduction for vectors.
        # The GPU interpreter has no rules for layout annotations, so they are dropped there.
        wgmma = plgpu.Layout.WGMMA

        def iota(shape, dim):
            if interpreted:
                return lax.broadcasted_iota(jnp.int32, shape, dim)
            return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=wgmma)

        def with_layout(x, layout):
            return x if interpreted else plgpu.layout_cast(x, layout)

        def to_mma(x, dtype):
            """Staged values in the MMA dtype. float8_e4m3fn goes through float16 (exact for
            every e4m3 value): Hopper converts fp8 to f16 only."""
            if x.dtype == jnp.float8_e4m3fn and jnp.dtype(dtype) != jnp.float16:
                x = x.astype(jnp.float16)
            return x.astype(dtype)

        def key_scales(ref, shape):
            """A block's [block_kv] scales broadcast over the score tile's rows."""
            if interpreted:
                row = ref[...]
            else:
                row = plgpu.load(ref, (), layout=wgmma.reduce(0), optimized=False)
            return lax.broadcast_in_dim(row, shape, [1])

        # The interpreter's WGMMA only takes untransposed SMEM operands, so interpreted runs
        # do both matmuls on loaded values; everything else (TMA, barriers, masks) is shared.
        def matmul_qk(k):
            if interpreted:
                return lax.dot_general(q_smem[...], k[...], (((1,), (1,)), ((), ())),
                                       preferred_element_type=jnp.float32)

            def scoped(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(k, (1, 0)))
                return acc_ref[...]
            return pl.run_scoped(scoped, plgpu.ACC((_ROWS, block_kv), jnp.float32))

        def matmul_pv(acc, p, v):
            if interpreted:
                return acc + jnp.dot(p, v[...], preferred_element_type=jnp.float32)

            def accumulate(acc_ref):      # p from registers, V from SMEM, into acc in place
                plgpu.wgmma(acc_ref, p, v)
            return pl.run_state(accumulate)(plgpu.ACC.init(acc))

        def body(i, carry, *, masked: bool):
            acc, m_i, l_i = carry
            slot = lax.rem(i, num_stages)
            first_key = (lo + i) * block_kv
            # The refill's page ids are read now, before this block's waits and matmuls, so
            # their global-memory latency hides behind the compute instead of delaying the
            # next TMA issue.
            refill_pages = page_ids(i + num_stages)
            plgpu.barrier_wait(k_bars.at[slot])
            if staging:                   # f32 / 8-bit pages: K to the MMA dtype first
                k, = staging
                k[...] = to_mma(k_smem.at[slot][...], k.dtype)
                plgpu.commit_smem()       # make the generic-proxy stores visible to WGMMA
            else:
                k = k_smem.at[slot]
            s = matmul_qk(k) * sm_scale
            if quantized:                 # (q . k_q) * k_scale per key
                s = s * key_scales(ksc_smem.at[slot], s.shape)
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            mask = None
            if masked:
                # Index tiles are rebuilt per block, not hoisted: as loop constants they
                # would pin ~100 registers per thread next to acc, s and p.
                kpos = first_key + iota((_ROWS, block_kv), 1)
                qpos = pos0 + row_to_token(iota((_ROWS, block_kv), 0), group)   # r: token r//G
                mask = (kpos <= qpos) & (kpos < kv_hi)
                if sliding_window is not None:
                    mask = mask & (kpos > qpos - sliding_window)
                s = jnp.where(mask, s, MASK_VALUE)
            m_new = jnp.maximum(m_i, s.max(axis=1))
            alpha = jnp.exp(m_i - m_new)
            p = jnp.exp(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
            if masked:
                p = jnp.where(mask, p, 0.0)
            l_i = l_i * alpha + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            plgpu.barrier_wait(v_bars.at[slot])
            if quantized:                 # weights x v_scale (l_i summed them unscaled)
                p = p * key_scales(vsc_smem.at[slot], p.shape)
                if masked:                # stale scales past kv_hi: 0 * NaN must not reach acc
                    p = jnp.where(mask, p, 0.0)

            def stage_v(dst, zero_tail):
                v = to_mma(v_smem.at[slot][...], dst.dtype)
                if zero_tail:
                    key = first_key + iota((block_kv, head_dim), 0)
                    v = jnp.where(key < kv_hi, v, jnp.zeros((), v.dtype))
                dst[...] = v
                plgpu.commit_smem()

            def refill():
                pl.when(i + num_stages < num_blocks)(
                    lambda: issue(i + num_stages, refill_pages))

            if staging:
                # V goes to the same staging block as K: q k^T has finished reading it (its
                # result is in registers). The slot is then free: its refill overlaps p v.
                v, = staging
                stage_v(v, masked)
                refill()
            else:                         # only a tile's last block can reach past kv_hi
                v = v_smem.at[slot]
                if masked:
                    pl.when(first_key + block_kv > kv_hi)(functools.partial(stage_v, v, True))
            acc = matmul_pv(acc, p.astype(v.dtype), v)
            if not staging:               # the slot's WGMMAs are done: reuse it
                refill()
            return acc, m_new, l_i

        carry = (with_layout(jnp.zeros((_ROWS, head_dim), jnp.float32), wgmma),
                 with_layout(jnp.full((_ROWS,), MASK_VALUE, jnp.float32), wgmma.reduce(1)),
                 with_layout(jnp.zeros((_ROWS,), jnp.float32), wgmma.reduce(1)))
        masked_body = functools.partial(body, masked=True)
        carry = lax.fori_loop(0, mid_lo, masked_body, carry)          # window boundary
        carry = lax.fori_loop(mid_lo, mid_hi, functools.partial(body, masked=False), carry)
        acc, m_i, l_i = lax.fori_loop(mid_hi, num_blocks, masked_body, carry)   # causal end
        empty = l_i == 0.0
        l_i = jnp.where(empty, 1.0, l_i)
        q_smem[...] = (acc / lax.broadcast_in_dim(l_i, acc.shape, [0])).astype(q_smem.dtype)
        if with_lse:                      # log-sum-exp of the chunk, for the merge
            lse_smem[...] = jnp.where(empty, MASK_VALUE, m_i + jnp.log(l_i))
        plgpu.commit_smem()
        if with_lse:
            plgpu.copy_smem_to_gmem(q_smem, o_ref.at[h, tile, split])
            plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[h, tile, split])
        else:
            plgpu.copy_smem_to_gmem(q_smem, o_ref.at[h, tile])
        plgpu.wait_smem_to_gmem(0)
