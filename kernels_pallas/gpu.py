"""Ragged paged attention on NVIDIA GPUs (Hopper+): a Pallas Mosaic GPU kernel.

Backend: Mosaic GPU (``plgpu.kernel``), JAX's recommended GPU backend, not the deprecated
Triton backend. It can serve this op: TMA copies take dynamic page ids read from the block
table (the paged gather is one dense ``[page_size, D]`` TMA box per page and K/V), WGMMA runs
both matmuls from SMEM, and the kernel lowers without a GPU, so CI checks the device code
path too (tests/test_attention_kernels.py). Its limits shape the design: it needs sm_90+
(TMA, WGMMA; the selector falls back to the reference elsewhere); WGMMA tiles are 64 rows;
a register operand (p in ``p @ v``) must be 16-bit and the tf32 mode allows no operand
transpose (``q @ k^T`` needs one) -- so float32 pages are TMA'd as they are and rounded to
bfloat16 in SMEM before the matmuls (float32 inputs get bfloat16 matmul precision, float32
accumulation).
The GPU interpreter (CPU tests) runs everything here -- TMA, barriers, ring slots, masks,
SMEM fix-ups -- except two things it lacks: WGMMA with transposed or register operands
(interpreted runs do the two matmuls as dots on the loaded SMEM tiles) and register-layout
annotations (dropped when interpreted).

Data flow (see tiling.py)::

    q [T, Hq, D] -> q_tiles [Hkv, NT, 64, D]       (rows = tile_tokens x G query heads)
    grid (Hkv, NT), one warpgroup (128 threads) per (kv head, tile):
      TMA  q tile -> SMEM; then ring of ``num_stages`` KV slots: for KV block i, one TMA per
           page for K and one for V, from kv_pages[page, 2h | 2h+1] ([page_size, D] boxes),
           into slot i % num_stages; block i + num_stages is issued once block i is consumed
      WGMMA s = q k^T (f32 acc) -> mask (causal end, sliding window) -> online softmax in
           registers -> WGMMA acc += p v (p cast to the 16-bit dtype)
      out tile -> SMEM -> TMA -> out_tiles [Hkv, NT, 64, D] -> scatter to [T, Hq, D]

Raggedness: the tile plan gives each tile one sequence, its first query position and its KV
block range, so a CTA only streams the blocks it needs (decode tiles: the sequence's pages
once; the grid's empty tail tiles exit at once). Block-table rows are padded to whole blocks
with the trash page. Keys past the causal end of a block are masked to -inf-like logits and,
on the (one) partial block, V rows past it are zeroed in SMEM before ``p @ v``: 0 * NaN from
an unused slot would otherwise poison the accumulator.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .common import MASK_VALUE, AttentionMetadata, check_attention_inputs, pad_head_dim
from .tiling import (F_BLK_HI, F_BLK_LO, F_KV_HI, F_NQ, F_POS0, F_SEQ, NUM_FIELDS,
                     default_tile_tokens, gather_q_tiles, plan_tiles, row_to_token,
                     scatter_out_tiles)

_ROWS = 64          # WGMMA M: one warpgroup's tile height
_SWIZZLE = 128      # bytes; 64 bf16 columns per swizzle tile
_SMEM_BUDGET = 200 * 1024   # hard cap: of H100/H200's 227 KiB per block, room for barriers
# Default ring depth: what fits in 96 KiB, so two CTAs share an SM and one's softmax overlaps
# the other's copies (a single warpgroup per CTA cannot overlap with itself). Untuned guess.
_DEFAULT_SMEM = 96 * 1024


def _smem(shape: tuple[int, ...], dtype: jnp.dtype) -> Any:
    """SMEM buffer laid out for WGMMA / TMA: (8, 128 B) tiles with the 128 B swizzle."""
    cols = _SWIZZLE // jnp.dtype(dtype).itemsize
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, cols)),
                                                plgpu.SwizzleTransform(_SWIZZLE)))


def _kernel(info_ref, bt_ref, q_ref, kv_ref, o_ref,
            q_smem, k_smem, v_smem, q_bar, k_bars, v_bars, *staging,
            group: int, page_size: int, pages_per_block: int, pages_per_row: int,
            num_stages: int, sm_scale: float, sliding_window: int | None,
            soft_cap: float | None, interpreted: bool):
    block_kv = pages_per_block * page_size
    head_dim = q_smem.shape[-1]
    h = lax.axis_index("kv_head")
    tile = lax.axis_index("tile")

    def field(f):
        return info_ref[tile * NUM_FIELDS + f]

    seq, pos0, kv_hi = field(F_SEQ), field(F_POS0), field(F_KV_HI)
    blk_lo, blk_hi = field(F_BLK_LO), field(F_BLK_HI)
    num_blocks = blk_hi - blk_lo

    def issue(i):
        """Start the TMA copies of the tile's i-th KV block into slot i % num_stages."""
        slot = lax.rem(i, num_stages)
        base = seq * pages_per_row + (blk_lo + i) * pages_per_block
        for j in range(pages_per_block):
            page = bt_ref[base + j]
            rows = pl.ds(j * page_size, page_size)
            plgpu.copy_gmem_to_smem(kv_ref.at[page, 2 * h], k_smem.at[slot, rows],
                                    k_bars.at[slot])
            plgpu.copy_gmem_to_smem(kv_ref.at[page, 2 * h + 1], v_smem.at[slot, rows],
                                    v_bars.at[slot])

    @pl.when(field(F_NQ) > 0)
    def _live_tile():
        plgpu.copy_gmem_to_smem(q_ref.at[h, tile], q_smem, q_bar)
        for i in range(num_stages):
            pl.when(i < num_blocks)(functools.partial(issue, i))
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

        def body(i, carry):
            acc, m_i, l_i = carry
            slot = lax.rem(i, num_stages)
            first_key = (blk_lo + i) * block_kv
            plgpu.barrier_wait(k_bars.at[slot])
            if staging:                   # float32 pages: round K to the MMA dtype first
                k = staging[0]
                k[...] = k_smem.at[slot][...].astype(k.dtype)
                plgpu.commit_smem()       # make the generic-proxy stores visible to WGMMA
            else:
                k = k_smem.at[slot]
            s = matmul_qk(k) * sm_scale
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            # Index tiles are rebuilt per block, not hoisted: as loop constants they would pin
            # ~100 registers per thread next to acc, s and p.
            kpos = first_key + iota((_ROWS, block_kv), 1)
            qpos = pos0 + row_to_token(iota((_ROWS, block_kv), 0), group)   # row r: token r//G
            mask = (kpos <= qpos) & (kpos < kv_hi)
            if sliding_window is not None:
                mask = mask & (kpos > qpos - sliding_window)
            s = jnp.where(mask, s, MASK_VALUE)
            m_new = jnp.maximum(m_i, s.max(axis=1))
            alpha = jnp.exp(m_i - m_new)
            p = jnp.where(mask, jnp.exp(s - lax.broadcast_in_dim(m_new, s.shape, [0])), 0.0)
            l_i = l_i * alpha + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            plgpu.barrier_wait(v_bars.at[slot])

            def zero_v_tail(dst):
                v = v_smem.at[slot][...]
                key = first_key + iota((block_kv, head_dim), 0)
                dst[...] = jnp.where(key < kv_hi, v, 0.0).astype(dst.dtype)
                plgpu.commit_smem()

            if staging:
                v = staging[1]
                zero_v_tail(v)
            else:                         # only a tile's last block can reach past kv_hi
                v = v_smem.at[slot]
                pl.when(first_key + block_kv > kv_hi)(functools.partial(zero_v_tail, v))
            acc = matmul_pv(acc, p.astype(v.dtype), v)

            @pl.when(i + num_stages < num_blocks)
            def _refill():                # the slot's WGMMAs are done: reuse it
                issue(i + num_stages)
            return acc, m_new, l_i

        acc0 = with_layout(jnp.zeros((_ROWS, head_dim), jnp.float32), wgmma)
        m0 = with_layout(jnp.full((_ROWS,), MASK_VALUE, jnp.float32), wgmma.reduce(1))
        l0 = with_layout(jnp.zeros((_ROWS,), jnp.float32), wgmma.reduce(1))
        acc, _, l_i = lax.fori_loop(0, num_blocks, body, (acc0, m0, l0))
        l_i = jnp.where(l_i == 0.0, 1.0, l_i)
        q_smem[...] = (acc / lax.broadcast_in_dim(l_i, acc.shape, [0])).astype(q_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem, o_ref.at[h, tile])
        plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "sliding_window", "soft_cap", "interpret", "block_kv", "num_stages",
    "tile_tokens"))
def ragged_paged_attention_gpu(q: jax.Array, kv_pages: jax.Array, md: AttentionMetadata, *,
                               sm_scale: float, sliding_window: int | None = None,
                               soft_cap: float | None = None, interpret: Any = False,
                               block_kv: int | None = None, num_stages: int | None = None,
                               tile_tokens: int | None = None) -> jax.Array:
    """out [T, Hq, Dq]. ``interpret``: True or a ``InterpretGPUParams`` runs on CPU."""
    (num_tokens, num_q_heads, q_head_dim, num_kv_heads, page_size, head_dim, group,
     num_seqs_max, max_pages) = check_attention_inputs(
        q, kv_pages, md, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    if group > _ROWS:
        raise ValueError(f"q shape {tuple(q.shape)}: {group} query heads per kv head exceed the "
                         f"{_ROWS}-row WGMMA tile")
    if head_dim % 64 or head_dim > 256:
        raise ValueError(f"kv_pages shape {tuple(kv_pages.shape)}: head_dim must be a multiple "
                         "of 64 up to 256 (allocate pages with padded_head_dim)")
    block_kv = block_kv or max(64, page_size)
    if block_kv % page_size or block_kv % 64 or block_kv > 256:
        raise ValueError(f"block_kv={block_kv} must be a multiple of page_size={page_size} and "
                         "of 64, at most 256")
    pages_per_block = block_kv // page_size
    # WGMMA needs 16-bit operands for p @ v: float32 pages are TMA'd as they are and rounded
    # to bfloat16 in SMEM (two extra [block_kv, D] buffers); q is rounded in the wrapper.
    dtype = kv_pages.dtype
    staged = jnp.dtype(dtype).itemsize == 4
    mma_dtype = jnp.bfloat16 if staged else dtype
    stage_bytes = 2 * block_kv * head_dim * jnp.dtype(dtype).itemsize
    fixed_bytes = (_ROWS + (2 * block_kv if staged else 0)) * head_dim * 2
    if num_stages is None:      # ring depth in [2, 4] fitting the default share (1 if must)
        num_stages = min(4, max(2, (_DEFAULT_SMEM - fixed_bytes) // stage_bytes),
                         (_SMEM_BUDGET - fixed_bytes) // stage_bytes)
    if num_stages < 1 or fixed_bytes + num_stages * stage_bytes > _SMEM_BUDGET:
        raise ValueError(f"num_stages={num_stages} x block_kv={block_kv} for kv_pages shape "
                         f"{tuple(kv_pages.shape)} {kv_pages.dtype} overflow shared memory")
    tile_tokens = tile_tokens or default_tile_tokens(num_tokens, num_seqs_max, _ROWS // group)
    if tile_tokens * group > _ROWS:
        raise ValueError(f"tile_tokens={tile_tokens} x {group} heads exceed {_ROWS} rows")
    plan = plan_tiles(md, num_tokens, tile_tokens=tile_tokens, block_kv=block_kv,
                      sliding_window=sliding_window)
    q_tiles = gather_q_tiles(pad_head_dim(q, head_dim), plan, num_kv_heads, _ROWS)
    q_tiles = q_tiles.astype(mma_dtype)
    pages_per_row = -(-max_pages // pages_per_block) * pages_per_block
    bt = jnp.pad(md.block_tables, ((0, 0), (0, pages_per_row - max_pages)))
    if interpret is True:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
        interpret = InterpretGPUParams()

    kernel = functools.partial(
        _kernel, group=group, page_size=page_size, pages_per_block=pages_per_block,
        pages_per_row=pages_per_row, num_stages=num_stages, sm_scale=sm_scale,
        sliding_window=sliding_window, soft_cap=soft_cap, interpreted=bool(interpret))
    out_tiles = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct(q_tiles.shape, mma_dtype),
        scratch_types=[
            _smem((_ROWS, head_dim), mma_dtype),     # q tile, then the output tile
            _smem((num_stages, block_kv, head_dim), dtype),
            _smem((num_stages, block_kv, head_dim), dtype),
            plgpu.Barrier(num_arrivals=1),
            plgpu.Barrier(num_arrivals=pages_per_block, num_barriers=num_stages),
            plgpu.Barrier(num_arrivals=pages_per_block, num_barriers=num_stages),
            *([_smem((block_kv, head_dim), mma_dtype)] * 2 if staged else []),
        ],
        grid=(num_kv_heads, plan.max_tiles),
        grid_names=("kv_head", "tile"),
        # Lane semantics pinned: the kernel is written per thread (layout casts, WGMMA
        # layouts), and the default changes to Warpgroup in jax 0.11.
        compiler_params=plgpu.CompilerParams(
            approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=interpret,
    )(plan.info.reshape(-1), bt.reshape(-1), q_tiles, kv_pages)
    return scatter_out_tiles(out_tiles, plan, num_q_heads, q.dtype)[..., :q_head_dim]
