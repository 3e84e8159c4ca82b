"""Trace-time sizing of the Mosaic GPU kernel (gpu.py): the contract of what it runs, block and
ring sizes that fit shared memory, the split-KV factor, and the merge of split-KV partials.

Plain Python on static sizes (and one jnp merge), so each rule is unit-tested without a kernel
run; gpu.py only calls it, and the selector asks ``kernel_refusal`` before picking the kernel.

What the kernel refuses, and why (everything else in the 64..256 head-dim range runs):
  - pages whose head_dim is above 256 (a WGMMA's N) or not a multiple of 16 (of 32 for
    int8 / fp8 pages): the q tile, K / V blocks and staging block are swizzled SMEM WGMMA
    operands, and the swizzle (128, 64 or 32 bytes, the widest that divides a row) must
    divide a row: 32 bytes is 16 16-bit or 32 8-bit columns. Other head dims run through
    padding (``padded_head_dim``).
  - page_size not a multiple of 8 (the SMEM tile height every TMA box lands on) or above 256.
  - int8 / fp8 pages with page_size not a multiple of 32: each page's f32 scales are their
    own TMA, and a TMA lands on 128-byte aligned SMEM (32 floats).
  - more than 64 query heads per KV head: one kv head's tile is a 64-row WGMMA.
Shared memory never refuses a valid geometry: ``default_tuning`` shrinks the KV block (to 64
keys, read as slices of taller pages) and the ring (to one slot) until ``smem_bytes`` fits.
64 keys is the floor: a KV block is loaded into registers (the staging of float32 / 8-bit
pages, the V tail's zeroing) in WGMMA's register layout, whose tiles are 64 rows.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from .common import KernelGeometry, is_quantized_dtype

_ROWS = 64          # WGMMA M: one warpgroup's tile height
_SWIZZLE = 128      # bytes; 64 bf16 columns per swizzle tile
_SMEM_BUDGET = 200 * 1024   # of the 227 KiB per block Mosaic GPU allows: L1 keeps some
_SMEM_ALIGN = 1024  # Pallas Mosaic GPU rounds every scratch buffer up to this many bytes
_BARRIER_BYTES = 8
_REDUCTION_SCRATCH = 128 * 4 * 4   # plgpu.CompilerParams' default reduction_scratch_bytes
NUM_SMS = 132       # H100 / H200 SXM; split-KV aims at two waves of CTAs over them
_MAX_SPLITS = 16
_MIN_BLOCK_KV = 64  # the 64-row tiles of WGMMA's register layout (see the module docstring)
_MAX_BLOCK_KV = 256
# head_dim -> (block_kv, num_stages) for 16-bit pages. SMEM per CTA = stages * 2 * block_kv *
# D * 2 B + the q tile: D 64: 3 x 32 KiB + 8 KiB = 104 KiB; D 128: 2 x 32 + 16 = 80 KiB; both
# leave room for two CTAs per SM (one's softmax overlaps the other's copies: a single
# warpgroup per CTA cannot overlap with itself). D 256: 2 x 64 + 32 = 160 KiB, one CTA per SM.
# Untuned: chosen on paper (see the bandwidth arithmetic in gpu.py) until a device measures them.
_DEFAULTS = {64: (128, 3), 128: (64, 2), 256: (64, 2)}


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _SMEM_ALIGN) * _SMEM_ALIGN


def smem_bytes(head_dim: int, block_kv: int, num_stages: int, dtype: Any, *,
               quantized: bool = False, num_splits: int = 2) -> int:
    """Shared memory of one CTA as Mosaic GPU counts it, buffer by buffer as gpu.py allocates
    them (Pallas rounds each scratch buffer up to 1 KiB): the q / output tile (16-bit), the K
    and V rings of ``num_stages`` blocks in the page dtype, the split-KV lse row (with
    ``num_splits`` > 1; the planner counts it, as the split is chosen after the blocks), the
    quantized pages' K and V scale rings, one ``[block_kv, D]`` 16-bit staging block for
    float32 / 8-bit pages (K is converted into it for q k^T, then V for p v), Pallas' own
    cross-warp reduction scratch, and the barriers (one for q, one per slot for K and V)."""
    itemsize = jnp.dtype(dtype).itemsize
    ring = _aligned(num_stages * block_kv * head_dim * itemsize)
    total = _aligned(_ROWS * head_dim * 2) + 2 * ring + _aligned(_REDUCTION_SCRATCH)
    if num_splits > 1:
        total += _aligned(4 * _ROWS)
    if quantized:
        total += 2 * _aligned(num_stages * block_kv * 4)
    if itemsize != 2:
        total += _aligned(block_kv * head_dim * 2)
    return total + (1 + 2 * num_stages) * _BARRIER_BYTES


def _block_fits_pages(block_kv: int, page_size: int) -> bool:
    """A KV block is whole pages (one TMA each) or a slice of one page (one TMA of its rows)."""
    return (block_kv % _MIN_BLOCK_KV == 0 and block_kv <= _MAX_BLOCK_KV
            and (block_kv % page_size == 0 or page_size % block_kv == 0))


def check_geometry(geometry: KernelGeometry) -> None:
    """ValueError naming the value when the kernel cannot run `geometry` at all (the module
    docstring says why each limit is there); shared memory is ``default_tuning``'s part."""
    head_dim, page_size, group = geometry.head_dim, geometry.page_size, geometry.group
    multiple = 32 if is_quantized_dtype(geometry.kv_dtype) else 16
    if head_dim % multiple or not multiple <= head_dim <= 256:
        raise ValueError(f"head_dim must be a multiple of {multiple} up to 256 on the GPU kernel "
                         f"for {jnp.dtype(geometry.kv_dtype).name} pages, got "
                         f"head_dim={head_dim} (allocate pages with padded_head_dim)")
    if page_size % 8:
        raise ValueError(f"page_size={page_size}: the GPU kernel needs a multiple of 8 (the "
                         "SMEM tile height)")
    if not any(_block_fits_pages(b, page_size) for b in range(64, _MAX_BLOCK_KV + 1, 64)):
        raise ValueError(f"page_size={page_size}: no KV block of 64 to {_MAX_BLOCK_KV} keys "
                         "in steps of 64 is a multiple or a divisor of it")
    if is_quantized_dtype(geometry.kv_dtype) and page_size % 32:
        raise ValueError(f"page_size={page_size}: int8 / fp8 pages need a multiple of 32 on "
                         "the GPU kernel (each page's f32 scales land on 128-byte aligned SMEM); "
                         "use a page_size that is a multiple of 32")
    if group > _ROWS:
        raise ValueError(f"{group} query heads per kv head exceed the {_ROWS}-row WGMMA tile "
                         "of the GPU kernel")


def default_tuning(head_dim: int, page_size: int, dtype: Any, *, block_kv: int | None = None,
                   num_stages: int | None = None, quantized: bool = False) -> tuple[int, int]:
    """(block_kv, num_stages): the per-head-dim defaults (see ``_DEFAULTS``) for what is not
    given, block_kv raised to the page size (at most 256). Where that does not fit shared
    memory, the ring shrinks to two slots, then the block by 64 keys (down to 64; blocks
    below the page size read slices of it), then one slot is tried with each block, so every
    geometry ``check_geometry`` accepts runs. Raises ValueError naming the bad value when a
    given size cannot work."""
    check_geometry(KernelGeometry(head_dim, page_size, dtype))
    default_block, default_stages = _DEFAULTS[min(k for k in _DEFAULTS if k >= head_dim)]
    if block_kv is not None:
        if not _block_fits_pages(block_kv, page_size):
            raise ValueError(f"block_kv={block_kv} must be a multiple of 64 up to "
                             f"{_MAX_BLOCK_KV}, and a multiple or a divisor of "
                             f"page_size={page_size}")
        blocks = [block_kv]
    else:
        fitting = [b for b in range(_MAX_BLOCK_KV, 0, -64) if _block_fits_pages(b, page_size)]
        # The smallest fitting block of at least the default and the page, then smaller ones.
        start = min((b for b in fitting if b >= max(default_block, page_size)),
                    default=fitting[0])
        blocks = [b for b in fitting if b <= start]
    if num_stages is not None and (not isinstance(num_stages, int) or num_stages < 1):
        raise ValueError(f"num_stages={num_stages!r} must be a positive int")
    if num_stages is not None:
        order = [(b, num_stages) for b in blocks]
    else:   # a ring of two hides a block's copy behind the previous one's compute: a smaller
        # block with two slots before one slot of a bigger block
        order = [(b, n) for b in blocks for n in range(default_stages, 1, -1)]
        order += [(b, 1) for b in blocks]
    for block, n in order:
        need = smem_bytes(head_dim, block, n, dtype, quantized=quantized)
        if need <= _SMEM_BUDGET:
            return block, n
    raise ValueError(f"num_stages={n} x block_kv={block} for head_dim {head_dim} "
                     f"{jnp.dtype(dtype).name} pages overflow shared memory ({need} > "
                     f"{_SMEM_BUDGET} bytes)")


def kernel_refusal(geometry: KernelGeometry) -> str | None:
    """Why the GPU kernel cannot run `geometry` (None when it can): what the selector asks
    before 'auto' picks the kernel."""
    try:
        default_tuning(geometry.head_dim, geometry.page_size, geometry.kv_dtype,
                       quantized=is_quantized_dtype(geometry.kv_dtype))
        check_geometry(geometry)
    except ValueError as err:
        return str(err)
    return None


def default_num_splits(num_ctas: int, max_blocks: int, num_sms: int = NUM_SMS) -> int:
    """Split-KV factor: 1 when the (kv head, tile) programs fill two waves of ``num_sms``
    (two CTAs per SM), else enough splits to get there, at most one per KV block and
    ``_MAX_SPLITS``. Static: ``num_ctas`` counts the bucket's tile bound, not live tiles."""
    if num_ctas >= 2 * num_sms:
        return 1
    return max(1, min(-(-2 * num_sms // num_ctas), max_blocks, _MAX_SPLITS))


def merge_splits(out: jax.Array, lse: jax.Array, sinks: jax.Array | None = None) -> jax.Array:
    """[Hkv, NT, NS, rows, D] partial outputs (each normalised over its chunk of keys) and
    their log-sum-exps [Hkv, NT, NS, rows] -> [Hkv, NT, rows, D] float32: the softmax over the
    union of chunks. Empty chunks carry lse = MASK_VALUE, so their weight is 0. sinks
    [Hkv, rows] (attention sinks, common.sink_rows): one more chunk of log-sum-exp = sink and
    no value, i.e. e^(sink - m) joins the denominator only."""
    m = lse.max(axis=2, keepdims=True)
    if sinks is not None:
        m = jnp.maximum(m, sinks[:, None, None, :])
    w = jnp.exp(lse - m)
    acc = jnp.sum(w[..., None] * out.astype(jnp.float32), axis=2)
    denom = jnp.sum(w, axis=2)
    if sinks is not None:
        denom = denom + jnp.exp(sinks[:, None, :] - m[:, :, 0])
    return acc / denom[..., None]
