"""Trace-time decisions of the TPU kernel: alignment, lane padding, SMEM budget, head blocks.

Everything here is plain Python on static sizes, so each rule is unit-tested without a
kernel run, and `tpu.py` only calls it.

- Sublane packing: a VMEM tile is 8 sublanes of 32-bit words; narrower types pack 2 (16-bit)
  or 4 (8-bit) rows per word, so the kernel's per-page DMA into ``[.., block_kv, D]`` lands on
  whole tiles only when ``page_size`` is a multiple of 8 / 16 / 32 rows for 32 / 16 / 8-bit.
- Lanes: the last axis is 128 lanes wide; head dims are padded up to a multiple of 128.
- SMEM: the scalar-prefetched block table and tile info live in the core's scalar memory
  (jax's ``tpu_info``: 16 KiB per core on v2/v3, 1 MiB from v4 through v7). Mosaic pads
  SMEM arrays and keeps some for itself, so, as vLLM's TPU backend does, we plan against
  half the capacity by default. Calls that do not fit are split over sequence ranges.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .common import KernelGeometry
from .tiling import NUM_FIELDS, max_num_tiles

LANES = 128
SUBLANES = 8
# SMEM per TensorCore from v4 on (jax/_src/pallas/mosaic/tpu_info.py); v2/v3 have 16 KiB.
DEFAULT_SMEM_CAPACITY = 1 << 20


def sublane_multiple(dtype: jnp.dtype) -> int:
    """Rows of one native VMEM tile for `dtype`: 8 (32-bit), 16 (16-bit), 32 (8-bit)."""
    return SUBLANES * max(1, 4 // jnp.dtype(dtype).itemsize)


def check_page_alignment(page_size: int, dtype: jnp.dtype,
                         kv_shape: tuple[int, ...] | None = None) -> None:
    """ValueError unless page_size fills whole sublane tiles of the page dtype: each page is
    one DMA into rows ``[j * page_size, (j + 1) * page_size)`` of a KV block, and Mosaic's
    DMAs land on whole (sublane, lane) tiles, so a 16-row page of 8-bit values (32-row tiles)
    has nowhere to go."""
    need = sublane_multiple(dtype)
    if page_size % need:
        shape = "" if kv_shape is None else f" (kv_pages shape {tuple(kv_shape)})"
        raise ValueError(
            f"page_size {page_size}{shape} is not a multiple of "
            f"{need}: the TPU kernel needs whole {need}-row sublane tiles for "
            f"{jnp.dtype(dtype).name} pages; use a page_size that is a multiple of {need}")


def kernel_refusal(geometry: KernelGeometry) -> str | None:
    """Why the TPU kernel cannot run `geometry` (None when it can): only a page_size short
    of whole sublane tiles. Head dims are lane-padded by the wrapper, any GQA ratio fits a
    tile, and a step whose block tables outgrow SMEM is split (or, bucket by bucket, falls
    back to the reference inside the kernel's wrapper)."""
    try:
        check_page_alignment(geometry.page_size, geometry.kv_dtype)
    except ValueError as err:
        return str(err)
    return None


def lane_padded(head_dim: int) -> int:
    """Head dim rounded up to whole 128-lane vregs (the pages the TPU kernel reads)."""
    return -(-head_dim // LANES) * LANES


def tpu_hardware() -> tuple[int, int]:
    """(SMEM bytes per core, TensorCores per device) of this host's TPU; off-TPU (export,
    interpret mode) the v4-v7 values (1 MiB, 1 core)."""
    if jax.default_backend() != "tpu":
        return DEFAULT_SMEM_CAPACITY, 1
    try:
        from jax.experimental.pallas import tpu as pltpu
        info = pltpu.get_tpu_info()
        return int(info.smem_capacity_bytes), int(getattr(info, "num_cores", 1) or 1)
    except Exception:  # noqa: BLE001 - an unknown chip: keep the common values
        return DEFAULT_SMEM_CAPACITY, 1


def default_kv_heads_per_block(num_kv_heads: int, num_cores: int, cap: int = 8) -> int:
    """Largest divisor of Hkv up to `cap`, but small enough to leave one head block per
    TensorCore: the head-block grid axis is `parallel`, and megacore chips (v4, v5p) split
    only that axis between their two cores."""
    if num_cores > 1 and num_kv_heads >= num_cores:
        cap = min(cap, num_kv_heads // num_cores)
    return max(d for d in range(1, min(num_kv_heads, cap) + 1) if num_kv_heads % d == 0)


def smem_bytes(num_seqs: int, pages_per_row: int, num_tiles: int) -> int:
    """Bytes of the kernel's SMEM operands: tile info, live tile count, block table, slot."""
    return 4 * (num_tiles * NUM_FIELDS + 1 + num_seqs * pages_per_row + 1)


def seqs_per_call(num_tokens: int, num_seqs: int, pages_per_row: int, tile_tokens: int,
                  budget: int) -> int | None:
    """Most sequences one kernel call may take so its SMEM operands fit `budget` bytes:
    `num_seqs` when all fit, fewer to split the call over sequence ranges, None when not even
    one sequence fits (the tile info alone, which grows with the step's tokens, is too big)."""
    def fits(s: int) -> bool:
        return smem_bytes(s, pages_per_row, max_num_tiles(num_tokens, s, tile_tokens)) <= budget

    if fits(num_seqs):
        return num_seqs
    if not fits(1):
        return None
    lo, hi = 1, num_seqs       # fits(lo) and not fits(hi): bisect (bytes grow with s)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
