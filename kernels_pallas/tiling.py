"""Query tiling shared by the reference and both kernels: how raggedness becomes fixed shapes.

The flat token axis holds S sequences end to end. We cut every live sequence's queries into
*tiles* of at most ``tile_tokens`` consecutive tokens, so a tile never straddles two sequences
and every tile reads exactly one sequence's pages. With G = Hq / Hkv query heads per kv head,
a tile of one kv head is a ``[tile_tokens * G, D]`` matrix (row ``r`` = token ``r // G``, head
``r % G``): decode (1 token) and prefill (many tokens) become the same dense tile shape, and
GQA costs no K/V re-reads.

    q [T, Hq, D] --gather_q_tiles--> q_tiles [Hkv, NT, rows, D] --kernel--> out_tiles (same)
    out_tiles --scatter_out_tiles--> out [T, Hq, D]   (padding tokens -> 0)

NT is the static bound ``min(T, T // tile_tokens + S)`` (each sequence adds at most one partial
tile). Tiles past the live count come last and are marked empty (``n_q == 0``); the kernels
skip them. ``plan_tiles`` also precomputes the KV block range each tile needs (causal end,
sliding-window start), so kernels loop over exactly those blocks. The gathers are O(T * Hq * D),
small next to the K/V reads.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from .common import AttentionMetadata

# Columns of TilePlan.info (one row per tile).
F_SEQ = 0      # sequence index
F_POS0 = 1     # position (within the sequence) of the tile's first query token
F_NQ = 2       # number of valid query tokens in the tile (0 for empty tiles)
F_KV_HI = 3    # exclusive end of the keys the tile reads: F_POS0 + F_NQ
F_KV_LO = 4    # first key any row may see (sliding window), else 0
F_BLK_LO = 5   # first KV block (of block_kv tokens) to visit
F_BLK_HI = 6   # exclusive last KV block; F_BLK_LO == F_BLK_HI for empty tiles
F_TOK0 = 7     # flat token index of the tile's first query
NUM_FIELDS = 8


@dataclasses.dataclass(frozen=True)
class TilePlan:
    """Traced tile metadata plus the static sizes it was built for."""

    info: jax.Array        # i32[NT, NUM_FIELDS]
    num_tiles: jax.Array   # i32[] live tiles; they form the prefix info[:num_tiles]
    token_tile: jax.Array  # i32[T] tile holding each token's query (clamped for padding)
    token_row: jax.Array   # i32[T] token offset inside that tile
    token_valid: jax.Array  # bool[T] false for padding tokens
    tile_tokens: int
    block_kv: int

    @property
    def max_tiles(self) -> int:
        return self.info.shape[0]


def max_num_tiles(num_tokens: int, num_seqs: int, tile_tokens: int) -> int:
    """Static bound on the tile count: full tiles plus one partial tile per sequence."""
    return max(1, min(num_tokens, num_tokens // tile_tokens + num_seqs))


def default_tile_tokens(num_tokens: int, num_seqs: int, max_tokens: int) -> int:
    """Tokens per tile: the mean query length rounded up to a power of two, capped.

    Decode buckets (T == S) get 1-token tiles, so no work is spent on padding rows; prefill
    buckets get the cap (the kernel's preferred tile height).
    """
    mean = -(-num_tokens // max(num_seqs, 1))
    tile = 1
    while tile < mean and tile < max_tokens:
        tile *= 2
    return max(1, min(tile, max_tokens))


def plan_tiles(md: AttentionMetadata, num_tokens: int, *, tile_tokens: int, block_kv: int,
               sliding_window: int | None, seq_mask: jax.Array | None = None,
               max_tiles: int | None = None) -> TilePlan:
    """Cut the live sequences' queries into tiles; jit-friendly (static shapes only).

    `seq_mask` (bool[S]) restricts the plan to some sequences (the others' tokens come out
    as padding); `max_tiles` lowers the static tile bound when the caller knows better.
    """
    num_seqs_max = md.kv_lens.shape[0]
    n_tiles_max = max_tiles or max_num_tiles(num_tokens, num_seqs_max, tile_tokens)
    live = jnp.arange(num_seqs_max, dtype=jnp.int32) < md.num_seqs[0]
    starts = md.cu_q_lens[:-1]
    total_tokens = md.cu_q_lens[md.num_seqs[0]]
    # Padding sequences get empty, sorted query ranges at the live end of the token axis.
    ends = jnp.where(live, md.cu_q_lens[1:], total_tokens)
    starts = jnp.where(live, starts, total_tokens)
    q_lens = jnp.maximum(ends - starts, 0)
    if seq_mask is not None:
        q_lens = jnp.where(seq_mask, q_lens, 0)
    tiles_per_seq = -(-q_lens // tile_tokens)
    tile_end = jnp.cumsum(tiles_per_seq)
    tile_begin = tile_end - tiles_per_seq
    num_tiles = jnp.minimum(tile_end[-1], n_tiles_max)

    tile = jnp.arange(n_tiles_max, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(tile_end, tile, side="right").astype(jnp.int32),
                      num_seqs_max - 1)
    valid = tile < num_tiles
    local = tile - tile_begin[seq]
    n_q = jnp.where(valid, jnp.clip(q_lens[seq] - local * tile_tokens, 0, tile_tokens), 0)
    pos0 = md.kv_lens[seq] - q_lens[seq] + local * tile_tokens
    pos0 = jnp.where(valid, jnp.maximum(pos0, 0), 0)
    kv_hi = pos0 + n_q
    if sliding_window is None:
        kv_lo = jnp.zeros_like(kv_hi)
    else:
        kv_lo = jnp.maximum(pos0 - sliding_window + 1, 0)
    blk_lo = jnp.where(valid, kv_lo // block_kv, 0)
    blk_hi = jnp.where(valid, -(-kv_hi // block_kv), 0)
    tok0 = jnp.where(valid, starts[seq] + local * tile_tokens, 0)
    info = jnp.stack([seq, pos0, n_q, kv_hi, kv_lo, blk_lo, blk_hi, tok0], axis=1)

    tok = jnp.arange(num_tokens, dtype=jnp.int32)
    tok_seq = jnp.searchsorted(ends, tok, side="right").astype(jnp.int32)
    tok_valid = tok_seq < md.num_seqs[0]
    tok_seq = jnp.minimum(tok_seq, num_seqs_max - 1)
    if seq_mask is not None:
        tok_valid &= seq_mask[tok_seq]
    tok_local = jnp.maximum(tok - starts[tok_seq], 0)
    tok_tile = jnp.clip(tile_begin[tok_seq] + tok_local // tile_tokens, 0, n_tiles_max - 1)
    return TilePlan(info=info.astype(jnp.int32), num_tiles=num_tiles.astype(jnp.int32),
                    token_tile=tok_tile, token_row=tok_local % tile_tokens,
                    token_valid=tok_valid, tile_tokens=tile_tokens, block_kv=block_kv)


def tile_rows(tile_tokens: int, group: int, multiple: int = 1) -> int:
    """Rows of one kv head's tile (tokens x query heads per kv head), padded to `multiple`."""
    rows = tile_tokens * group
    return -(-rows // multiple) * multiple


def row_to_token(row: jax.Array, group: int) -> jax.Array:
    """Token ``r // group`` of tile row r inside a kernel, without a vector integer divide
    (TPU vector units have none): a shift for powers of two, else an exact float product."""
    if group & (group - 1) == 0:
        return lax.shift_right_logical(row, jnp.int32(group.bit_length() - 1))
    # Exact for rows < 2**20: (r + 0.5) / g stays at least 0.5 / g away from an integer.
    return ((row.astype(jnp.float32) + 0.5) * (1.0 / group)).astype(jnp.int32)


def gather_q_tiles(q: jax.Array, plan: TilePlan, num_kv_heads: int, rows: int) -> jax.Array:
    """q [T, Hq, D] -> [Hkv, NT, rows, D]; rows past the tile's tokens are zero."""
    num_tokens, num_q_heads, head_dim = q.shape
    group = num_q_heads // num_kv_heads
    b = plan.tile_tokens
    tok = plan.info[:, F_TOK0, None] + jnp.arange(b, dtype=jnp.int32)[None, :]   # [NT, b]
    ok = jnp.arange(b, dtype=jnp.int32)[None, :] < plan.info[:, F_NQ, None]
    tok = jnp.where(ok, jnp.minimum(tok, num_tokens - 1), 0)
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)[tok]   # [NT, b, Hkv, G, D]
    # Zero (not just ignore) the padding rows: padding tokens' q may hold anything.
    qg = jnp.where(ok[:, :, None, None, None], qg, jnp.zeros((), q.dtype))
    qg = qg.transpose(2, 0, 1, 3, 4).reshape(num_kv_heads, plan.max_tiles, b * group, head_dim)
    if rows > b * group:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, rows - b * group), (0, 0)))
    return qg


def scatter_out_tiles(out_tiles: jax.Array, plan: TilePlan, num_q_heads: int,
                      dtype: jnp.dtype | None = None) -> jax.Array:
    """[Hkv, NT, rows, D] -> out [T, Hq, D]; padding tokens get zeros."""
    num_kv_heads, _, _, head_dim = out_tiles.shape
    group = num_q_heads // num_kv_heads
    b = plan.tile_tokens
    tiles = out_tiles[:, :, : b * group].reshape(num_kv_heads, plan.max_tiles, b, group, head_dim)
    out = tiles[:, plan.token_tile, plan.token_row]          # [Hkv, T, G, D]
    out = out.transpose(1, 0, 2, 3).reshape(-1, num_q_heads, head_dim)
    out = jnp.where(plan.token_valid[:, None, None], out, jnp.zeros((), out.dtype))
    return out.astype(dtype or out.dtype)
