"""Ragged paged attention on NVIDIA GPUs (Hopper+): a Pallas Mosaic GPU kernel.

Backend: Mosaic GPU (``plgpu.kernel``), JAX's recommended GPU backend, not the deprecated
Triton backend. It can serve this op: TMA copies take dynamic page ids read from the block
table (the paged gather is one dense ``[page_size, D]`` TMA box per page and K/V), WGMMA runs
both matmuls from SMEM, and the kernel lowers without a GPU, so CI checks the device code
path too (tests/kernels/test_attention_kernels.py). Its limits shape the design: it needs sm_90+
(TMA, WGMMA; the selector falls back to the reference elsewhere); WGMMA tiles are 64 rows;
a register operand (p in ``p @ v``) must be 16-bit and the tf32 mode allows no operand
transpose (``q @ k^T`` needs one) -- so float32 pages are TMA'd as they are and rounded to
bfloat16 in SMEM before the matmuls (float32 inputs get bfloat16 matmul precision, float32
accumulation), through one ``[block_kv, D]`` staging block that holds K for ``q @ k^T`` and
then V for ``p @ v``. The kernel body is gpu_kernel.py; what it accepts and how its blocks
are sized to shared memory is gpu_plan.py (``check_geometry``, ``default_tuning``,
``smem_bytes``).
The GPU interpreter (CPU tests) runs everything here -- TMA, barriers, ring slots, masks,
SMEM fix-ups -- except two things it lacks: WGMMA with transposed or register operands
(interpreted runs do the two matmuls as dots on the loaded SMEM tiles) and register-layout
annotations (dropped when interpreted).

Data flow (see tiling.py)::

    q [T, Hq, D] -> q_tiles [Hkv, NT, 64, D]       (rows = tile_tokens x G query heads)
    grid (Hkv, NT[, NS]), one warpgroup (128 threads) per (kv head, tile[, KV split]):
      TMA  q tile -> SMEM; then ring of ``num_stages`` KV slots: for KV block i, one TMA per
           page for K and one for V, from kv_pages[page, 2h | 2h+1] ([page_size, D] boxes),
           or, for pages taller than the block, one of the block's rows of its page
           ([block_kv, D] at the block's offset), into slot i % num_stages; block
           i + num_stages is issued once block i is consumed (staged pages: once V is staged),
           with page ids read from the block table at the top of block i (before its waits
           and matmuls), so that load's latency hides behind block i's compute
      WGMMA s = q k^T (f32 acc) -> mask (boundary blocks only) -> online softmax in
           registers -> WGMMA acc += p v (p cast to the 16-bit dtype)
      out tile -> SMEM -> TMA -> out_tiles [Hkv, NT, 64, D] -> scatter to [T, Hq, D]
      split-KV (NS > 1): each split streams a contiguous chunk of the tile's blocks and also
           writes its rows' log-sum-exp; ``merge_splits`` (jnp) combines the NS partial softmax
           states before the scatter

Quantized pages (``QuantizedKV``, int8 / float8_e4m3fn): the values are TMA'd as they are and
converted to the 16-bit MMA dtype in SMEM (the staging of float32 pages; one block, never the
cache); each page's K and V scales ([page_size] f32) follow into ``[num_stages, block_kv]``
SMEM rows on the same barriers (page_size must be a multiple of 32: a TMA lands on 128-byte
aligned SMEM). s = (q k^T) * k_scale (the scales loaded as a WGMMA column vector), and the
weights times the V scales go into ``p @ v`` (the denominator sums the unscaled weights).

Raggedness: the tile plan gives each tile one sequence, its first query position and its KV
block range, so a CTA only streams the blocks it needs (decode tiles: the sequence's pages
once; the grid's empty tail tiles exit at once). Block-table rows are padded to whole blocks
with the trash page. Masking: the block loop runs in three parts -- window-boundary blocks
(masked), interior blocks (every key visible to every row: no iota, compare or select), the
causal-end blocks (masked) -- as jax's own Mosaic GPU attention splits its loop. Keys past
the causal end are masked to -inf-like logits and, on the (one) partial block, V rows past it
are zeroed in SMEM before ``p @ v``: 0 * NaN from an unused slot would otherwise poison the
accumulator.

Attention sinks (``sinks`` f32[Hq], gpt-oss): folded in at finalisation. The kernel then
writes each tile's rows' log-sum-exp beside the output (the split-KV outputs, with one split
when there is no split) and ``merge_splits`` adds each row's e^(sink - m) to the
denominator, as one more chunk with no value: the kernel body gains no inputs and no
registers. Without sinks nothing of this runs.

Split-KV (flash-decoding): NS = ``default_num_splits``: 1 when Hkv x NT (the bucket's tile
bound) fills two waves of CTAs over ``num_sms`` SMs (132 on H100/H200), else enough splits to
do so. A decode bucket of 8 sequences with 8 kv heads is 64 CTAs, under half the SMs: split
ceil(264 / 64) = 5 ways it is 320.

Expected HBM bandwidth (on paper; no device has run this kernel yet). Decode, Llama-3-8B
(Hkv 8, D 128, G 4, bf16 pages), 64 sequences at 2048 context, one layer: K+V bytes =
64 x 2048 x 8 x 128 x 2 (K, V) x 2 B = 537 MB; q, out and block tables add < 0.1 %. At
H200's 4.8 TB/s that is 112 us per layer (3.6 ms for 32 layers, 8.4 MB per sequence per
layer). Per CTA: 8 x 64 = 512 CTAs, two per SM (80 KiB SMEM each) -> 264 resident, 1.94
waves (97 % wave efficiency); each SM must pull 4.8 TB/s / 132 = 36 GB/s, i.e. one 32 KiB
block (64 keys x 128 x 2 x 2 B) every 0.89 us, while a block's compute is two 64x64x128
WGMMAs (2.1 MFLOP, 0.28 us at 989 TFLOP/s / 132) plus softmax on a 64 x 64 tile (~0.3 us for
128 threads), so the two CTAs of an SM can keep its copies busy: expect 70-85 % of 4.8 TB/s
(3.4-4.1 TB/s) at long contexts, less at short ones where the fixed per-CTA cost (q load,
output store, launch: a few us) is not amortised over the 1 MiB each CTA streams per 2048
keys. Bytes in flight needed (Little's law, ~1 us DRAM latency): ~4.8 MB, i.e. ~36 KiB per
SM; two CTAs with one 32 KiB block each in flight give 64 KiB. Only G = 4 of the 64 rows of
a decode tile are real queries, so the MMAs run 16x below their rate: fine while
memory-bound, wasteful if KV were ever resident in cache.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from .common import (AttentionMetadata, KVPages, QuantizedKV, check_attention_inputs,
                     kernel_geometry, pad_head_dim, sink_rows)
from .gpu_kernel import attention_kernel
from .gpu_plan import (_ROWS, _SWIZZLE, NUM_SMS, check_geometry, default_num_splits,
                       default_tuning, merge_splits)
from .tiling import default_tile_tokens, gather_q_tiles, plan_tiles, scatter_out_tiles


def _smem(shape: tuple[int, ...], dtype: jnp.dtype) -> Any:
    """SMEM buffer laid out for WGMMA / TMA: (8, swizzle) tiles with the widest swizzle (128,
    64 or 32 B) that divides a row: 128 B for 16-bit rows at head dims that are multiples of
    64, 64 B for 16-bit rows at 96 and 8-bit rows at 192, 32 B for 16-bit rows at 80
    (check_geometry refuses the head dims no swizzle divides)."""
    row_bytes = shape[-1] * jnp.dtype(dtype).itemsize
    swizzle = next(w for w in (_SWIZZLE, 64, 32) if row_bytes % w == 0)
    cols = swizzle // jnp.dtype(dtype).itemsize
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, cols)),
                                                plgpu.SwizzleTransform(swizzle)))


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "sliding_window", "soft_cap", "interpret", "block_kv", "num_stages",
    "tile_tokens", "num_splits", "num_sms"))
def ragged_paged_attention_gpu(q: jax.Array, kv_pages: KVPages, md: AttentionMetadata, *,
                               sm_scale: float, sliding_window: int | None = None,
                               soft_cap: float | None = None, interpret: Any = False,
                               block_kv: int | None = None, num_stages: int | None = None,
                               tile_tokens: int | None = None, num_splits: int | None = None,
                               num_sms: int = NUM_SMS, sinks: jax.Array | None = None
                               ) -> jax.Array:
    """out [T, Hq, Dq]. ``interpret``: True or a ``InterpretGPUParams`` runs on CPU;
    ``sinks``: f32[Hq] attention-sink logits or None.

    Tuning (static): ``block_kv`` keys per block, ``num_stages`` ring slots (defaults per head
    dim: ``default_tuning``), ``tile_tokens`` per query tile, ``num_splits`` split-KV factor
    (default from ``num_sms``: ``default_num_splits``)."""
    (num_tokens, num_q_heads, q_head_dim, num_kv_heads, page_size, head_dim, group,
     num_seqs_max, max_pages) = check_attention_inputs(
        q, kv_pages, md, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
        sinks=sinks)
    try:
        check_geometry(kernel_geometry(q, kv_pages))
    except ValueError as err:
        raise ValueError(f"q shape {tuple(q.shape)}, kv_pages shape {tuple(kv_pages.shape)}: "
                         f"{err}") from None
    quantized = isinstance(kv_pages, QuantizedKV)
    block_kv, num_stages = default_tuning(head_dim, page_size, kv_pages.dtype,
                                          block_kv=block_kv, num_stages=num_stages,
                                          quantized=quantized)
    # Whole pages per block, or (pages taller than the block) blocks per page.
    pages_per_block = max(1, block_kv // page_size)
    blocks_per_page = max(1, page_size // block_kv)
    # WGMMA needs 16-bit operands for p @ v: float32 and 8-bit pages are TMA'd as they are and
    # converted in SMEM (one extra [block_kv, D] buffer, for K then V); q is rounded in the
    # wrapper.
    dtype = kv_pages.dtype
    staged = jnp.dtype(dtype).itemsize != 2
    if quantized:       # the MMAs run in q's dtype where that is 16-bit, else bfloat16
        mma_dtype = q.dtype if jnp.dtype(q.dtype).itemsize == 2 else jnp.bfloat16
    else:
        mma_dtype = jnp.bfloat16 if staged else dtype
    tile_tokens = tile_tokens or default_tile_tokens(num_tokens, num_seqs_max, _ROWS // group)
    if tile_tokens * group > _ROWS:
        raise ValueError(f"tile_tokens={tile_tokens} x {group} heads exceed {_ROWS} rows")
    plan = plan_tiles(md, num_tokens, tile_tokens=tile_tokens, block_kv=block_kv,
                      sliding_window=sliding_window)
    q_tiles = gather_q_tiles(pad_head_dim(q, head_dim), plan, num_kv_heads, _ROWS)
    q_tiles = q_tiles.astype(mma_dtype)
    blocks_per_row = -(-max_pages // pages_per_block) * blocks_per_page
    pages_per_row = -(-max_pages // pages_per_block) * pages_per_block
    if num_splits is None:
        num_splits = default_num_splits(num_kv_heads * plan.max_tiles, blocks_per_row, num_sms)
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
    bt = jnp.pad(md.block_tables, ((0, 0), (0, pages_per_row - max_pages)))
    with_lse = num_splits > 1 or sinks is not None
    if interpret is True:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
        interpret = InterpretGPUParams()

    kernel = functools.partial(
        attention_kernel, group=group, block_kv=block_kv, page_size=page_size,
        pages_per_row=pages_per_row, num_stages=num_stages, num_splits=num_splits,
        sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
        interpreted=bool(interpret), quantized=quantized, with_lse=with_lse)
    pages = (kv_pages.pages, kv_pages.scales) if quantized else (kv_pages,)
    tiles_shape = (num_kv_heads, plan.max_tiles)
    arrivals = pages_per_block * (2 if quantized else 1)
    if with_lse:
        out_type = (jax.ShapeDtypeStruct((*tiles_shape, num_splits, _ROWS, head_dim), mma_dtype),
                    jax.ShapeDtypeStruct((*tiles_shape, num_splits, _ROWS), jnp.float32))
    else:
        out_type = jax.ShapeDtypeStruct(q_tiles.shape, mma_dtype)
    result = plgpu.kernel(
        kernel,
        out_type=out_type,
        scratch_types=[
            _smem((_ROWS, head_dim), mma_dtype),     # q tile, then the output tile
            _smem((num_stages, block_kv, head_dim), dtype),
            _smem((num_stages, block_kv, head_dim), dtype),
            plgpu.Barrier(num_arrivals=1),
            # One arrival per TMA: a page's K (V) rows, and with quantized pages their scales.
            plgpu.Barrier(num_arrivals=arrivals, num_barriers=num_stages),
            plgpu.Barrier(num_arrivals=arrivals, num_barriers=num_stages),
            *([plgpu.SMEM((_ROWS,), jnp.float32)] if with_lse else []),
            *([plgpu.SMEM((num_stages, block_kv), jnp.float32)] * 2 if quantized else []),
            *([_smem((block_kv, head_dim), mma_dtype)] if staged else []),
        ],
        grid=(*tiles_shape, num_splits) if num_splits > 1 else tiles_shape,
        grid_names=("kv_head", "tile", "split") if num_splits > 1 else ("kv_head", "tile"),
        # Lane semantics pinned: the kernel is written per thread (layout casts, WGMMA
        # layouts), and the default changes to Warpgroup in jax 0.11.
        compiler_params=plgpu.CompilerParams(
            approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=interpret,
    )(plan.info.reshape(-1), bt.reshape(-1), q_tiles, *pages)
    if with_lse:
        rows = None if sinks is None else sink_rows(sinks, num_kv_heads, _ROWS)
        out_tiles = merge_splits(*result, rows)
    else:
        out_tiles = result
    return scatter_out_tiles(out_tiles, plan, num_q_heads, q.dtype)[..., :q_head_dim]
