"""Trace-time sizing of the Mosaic GPU kernel (gpu.py): block and ring sizes that fit shared
memory, the split-KV factor, and the merge of split-KV partial results.

Plain Python on static sizes (and one jnp merge), so each rule is unit-tested without a kernel
run; gpu.py only calls it.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

_ROWS = 64          # WGMMA M: one warpgroup's tile height
_SWIZZLE = 128      # bytes; 64 bf16 columns per swizzle tile
_SMEM_BUDGET = 200 * 1024   # hard cap: of H100/H200's 227 KiB per block, room for barriers
NUM_SMS = 132       # H100 / H200 SXM; split-KV aims at two waves of CTAs over them
_MAX_SPLITS = 16
# head_dim -> (block_kv, num_stages) for 16-bit pages. SMEM per CTA = stages * 2 * block_kv *
# D * 2 B + the q tile: D 64: 3 x 32 KiB + 8 KiB = 104 KiB; D 128: 2 x 32 + 16 = 80 KiB; both
# leave room for two CTAs per SM (one's softmax overlaps the other's copies: a single
# warpgroup per CTA cannot overlap with itself). D 256: 2 x 64 + 32 = 160 KiB, one CTA per SM.
# Untuned: chosen on paper (see the bandwidth arithmetic in gpu.py) until a device measures them.
_DEFAULTS = {64: (128, 3), 128: (64, 2), 256: (64, 2)}


def default_tuning(head_dim: int, page_size: int, dtype: Any, *, block_kv: int | None = None,
                   num_stages: int | None = None, quantized: bool = False) -> tuple[int, int]:
    """(block_kv, num_stages): the per-head-dim defaults (see ``_DEFAULTS``) for what is not
    given, block_kv raised to the page size, the ring shrunk (to 1 at worst) until it fits
    shared memory. Raises ValueError naming the bad value when nothing fits."""
    default_block, default_stages = _DEFAULTS[min(k for k in _DEFAULTS if k >= head_dim)]
    block_kv = block_kv or max(default_block, page_size)
    if page_size % 8 or page_size > 256:
        raise ValueError(f"page_size={page_size}: the GPU kernel needs a multiple of 8 (the "
                         "SMEM tile height) up to 256")
    if block_kv % page_size or block_kv % 64 or block_kv > 256:
        raise ValueError(f"block_kv={block_kv} must be a multiple of page_size={page_size} and "
                         "of 64, at most 256")
    if quantized and page_size % 32:
        raise ValueError(f"page_size={page_size}: int8 / fp8 pages need a multiple of 32 on "
                         "the GPU kernel (each page's f32 scales land on 128-byte aligned SMEM)")
    staged = jnp.dtype(dtype).itemsize != 2
    stage_bytes = 2 * block_kv * (head_dim * jnp.dtype(dtype).itemsize + (4 if quantized else 0))
    fixed_bytes = (_ROWS + (2 * block_kv if staged else 0)) * head_dim * 2 + 4 * _ROWS
    if num_stages is None:
        num_stages = max(1, min(default_stages, (_SMEM_BUDGET - fixed_bytes) // stage_bytes))
    if num_stages < 1 or fixed_bytes + num_stages * stage_bytes > _SMEM_BUDGET:
        raise ValueError(f"num_stages={num_stages} x block_kv={block_kv} for head_dim "
                         f"{head_dim} {jnp.dtype(dtype).name} pages overflow shared memory "
                         f"({fixed_bytes + num_stages * stage_bytes} > {_SMEM_BUDGET} bytes)")
    return block_kv, num_stages


def default_num_splits(num_ctas: int, max_blocks: int, num_sms: int = NUM_SMS) -> int:
    """Split-KV factor: 1 when the (kv head, tile) programs fill two waves of ``num_sms``
    (two CTAs per SM), else enough splits to get there, at most one per KV block and
    ``_MAX_SPLITS``. Static: ``num_ctas`` counts the bucket's tile bound, not live tiles."""
    if num_ctas >= 2 * num_sms:
        return 1
    return max(1, min(-(-2 * num_sms // num_ctas), max_blocks, _MAX_SPLITS))


def merge_splits(out: jax.Array, lse: jax.Array) -> jax.Array:
    """[Hkv, NT, NS, rows, D] partial outputs (each normalised over its chunk of keys) and
    their log-sum-exps [Hkv, NT, NS, rows] -> [Hkv, NT, rows, D] float32: the softmax over the
    union of chunks. Empty chunks carry lse = MASK_VALUE, so their weight is 0."""
    m = lse.max(axis=2, keepdims=True)
    w = jnp.exp(lse - m)
    acc = jnp.sum(w[..., None] * out.astype(jnp.float32), axis=2)
    return acc / jnp.sum(w, axis=2)[..., None]


