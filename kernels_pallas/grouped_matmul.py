"""Grouped matmul (the experts of a mixture-of-experts MLP): contract, tile metadata, jnp
reference. The kernels are grouped_matmul_tpu.py (Mosaic TPU) and grouped_matmul_gpu.py
(Triton); both read the tile metadata built here.

    grouped_matmul(x [M, K], w [G, K, N], group_sizes i32[G]) -> [M, N] in x's dtype

Rows of x are sorted by group: rows [offsets[g], offsets[g + 1]) (offsets = 0 then the
cumulative group sizes) meet w[g] only, with float32 accumulation; rows at or past
sum(group_sizes) come out zero. `group_sizes` is data (a routing result), never a shape:
the compiled call is one per (M, K, N, G) whatever the routing. Sizes summing past M are
cut at M.

Tile metadata (`tile_visits`, jnp, computed on the device inside the step: no host round
trip). M is cut into m-tiles of `tm` rows. Each non-empty group visits the m-tiles its rows
touch, in order; a tile holding a group boundary is therefore visited once per group that
has rows in it (each visit stores only its own group's rows), and an empty group visits
nothing. After the groups come the "tail" tiles wholly past sum(group_sizes): visited once
each to write zeros, with no matmul. Visits of one m-tile are consecutive (groups are
sorted), which lets the TPU kernel keep the output tile in VMEM across them. Rows past the
end inside the last group's last tile are zeroed by that group's visit: its store mask runs
to the tile's end. Every row of a visited tile is stored by exactly one visit.

    visits = sum over non-empty groups of the m-tiles they touch + tail tiles
          <= num_m_tiles + G - 1   (each of the < G boundaries inside a tile adds one)

so a grid of that static length is enough; the TPU kernel runs a grid of exactly `visits`
steps (a dynamic grid bound), the GPU kernel a static grid whose programs past `visits`
return at once. Visit arrays, each i32[num_m_tiles + G - 1] (entries past `visits` repeat
the last real one, so a pipelined fetch of them is a no-op):

    group   the visit's group; G for a tail visit (nothing to multiply)
    m_tile  the output tile it writes
    x_tile  the x tile / w group it reads: the m_tile and group of a matmul visit, the last
    w_group matmul visit's for a tail visit (so a tail visit fetches nothing new)
    lo, hi  the group's rows [lo, hi) (global row ids): they take the matmul
    store   the visit stores rows [lo, store): hi, or the tile's end for the last group with
            rows (its rows past hi are past sum(group_sizes): stored as zeros)
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class TileVisits(NamedTuple):
    """The visit list of a grouped matmul over m-tiles (all device arrays)."""
    num_visits: jax.Array  # i32[]: visits that do anything (<= num_m_tiles + G - 1)
    group: jax.Array       # i32[V]: group of the visit, G on a tail (zero-writing) visit
    m_tile: jax.Array      # i32[V]: output m-tile
    x_tile: jax.Array      # i32[V]: x m-tile read (the last matmul visit's on a tail visit)
    w_group: jax.Array     # i32[V]: w group read (likewise; in [0, G))
    lo: jax.Array          # i32[V]: the group's first row (the first the visit stores)
    hi: jax.Array          # i32[V]: past the group's last row
    store: jax.Array       # i32[V]: past the last row the visit stores (zeros from hi on)


def check_inputs(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> None:
    """Trace-time contract of both kernels: ValueError naming the bad value."""
    if x.ndim != 2:
        raise ValueError(f"x must be [M, K], got shape {x.shape}")
    if w.ndim != 3:
        raise ValueError(f"w must be [G, K, N], got shape {w.shape}")
    if w.shape[1] != x.shape[1]:
        raise ValueError(f"w shape {w.shape}: K={w.shape[1]} != x's K={x.shape[1]}")
    if group_sizes.shape != (w.shape[0],):
        raise ValueError(f"group_sizes shape {group_sizes.shape} must be (G,) = "
                         f"({w.shape[0]},) from w")
    if group_sizes.dtype != jnp.int32:
        raise ValueError(f"group_sizes dtype {group_sizes.dtype} must be int32")
    if x.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
        raise ValueError(f"x dtype {x.dtype} must be bfloat16, float16 or float32")
    if w.dtype != x.dtype:
        raise ValueError(f"w dtype {w.dtype} must equal x dtype {x.dtype}")


def check_tiles(k: int, n: int, tm: int, tk: int, tn: int, sublanes: int) -> None:
    """tk / tn must divide K / N and tm be a positive multiple of `sublanes`."""
    if tm <= 0 or tm % sublanes:
        raise ValueError(f"tm={tm} must be a positive multiple of {sublanes}")
    if tk <= 0 or k % tk:
        raise ValueError(f"tk={tk} must divide K={k}")
    if tn <= 0 or n % tn:
        raise ValueError(f"tn={tn} must divide N={n}")


def max_visits(m: int, tm: int, num_groups: int) -> int:
    """The static bound on visits: num_m_tiles + G - 1."""
    return -(-m // tm) + num_groups - 1


def tile_visits(group_sizes: jax.Array, m: int, tm: int) -> TileVisits:
    """The visit list for `m` rows (a multiple of `tm`) in tiles of `tm` (module docstring)."""
    num_groups = group_sizes.shape[0]
    tiles_m = m // tm
    bound = max_visits(m, tm, num_groups)
    ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), m)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    total = ends[-1]
    nonempty = ends > starts
    first = starts // tm
    count = jnp.where(nonempty, (ends - 1) // tm - first + 1, 0)
    matmul_visits = jnp.sum(count)
    tail_first = -(-total // tm)
    num_visits = matmul_visits + tiles_m - tail_first
    # Visit j < matmul_visits belongs to the group whose cumulative count passes j.
    j = jnp.arange(bound, dtype=jnp.int32)
    cum = jnp.cumsum(count)
    g = jnp.minimum(jnp.searchsorted(cum, j, side="right"), num_groups - 1).astype(jnp.int32)
    is_mm = j < matmul_visits
    mm_tile = first[g] + j - (cum[g] - count[g])
    # The last group with rows stores to the end of its last tile (zeros past `total`).
    last_group = jnp.max(jnp.where(nonempty, jnp.arange(num_groups), 0)).astype(jnp.int32)
    store_g = jnp.where(g == last_group, (mm_tile + 1) * tm, ends[g])
    last = jnp.maximum(matmul_visits - 1, 0)  # the last matmul visit (0 when there is none)
    last_tile = jnp.where(matmul_visits > 0, mm_tile[last], 0)
    last_w = jnp.where(matmul_visits > 0, g[last], 0)
    tail_tile = tail_first + j - matmul_visits
    m_tile = jnp.where(is_mm, mm_tile, tail_tile)
    # Entries past num_visits repeat the last real visit (a no-op if fetched).
    real_last = jnp.maximum(num_visits - 1, 0)
    pad = j >= num_visits

    def settle(a: jax.Array) -> jax.Array:
        return jnp.where(pad, a[real_last], a).astype(jnp.int32)

    group = settle(jnp.where(is_mm, g, num_groups))
    m_tile = settle(m_tile)
    x_tile = settle(jnp.where(is_mm, mm_tile, last_tile))
    w_group = settle(jnp.where(is_mm, g, last_w))
    lo = settle(jnp.where(is_mm, starts[g], 0))
    hi = settle(jnp.where(is_mm, ends[g], 0))
    store = settle(jnp.where(is_mm, store_g, 0))
    return TileVisits(num_visits.astype(jnp.int32), group, m_tile, x_tile, w_group, lo, hi,
                      store)


def pad_rows(x: jax.Array, tm: int) -> jax.Array:
    """x with zero rows appended up to a multiple of tm (the kernels see whole tiles)."""
    pad = -x.shape[0] % tm
    return x if pad == 0 else jnp.pad(x, ((0, pad), (0, 0)))


def default_tm(m: int, sublanes: int, cap: int = 128) -> int:
    """The m-tile: `cap` rows, or fewer for a short M (a decode step of a few tokens),
    rounded up to whole sublane tiles."""
    return min(cap, -(-m // sublanes) * sublanes)


def largest_divisor(n: int, cap: int, multiple: int, pow2: bool = False) -> int:
    """The largest t <= cap dividing n that is a multiple of `multiple` (a power of two when
    `pow2`); n itself when none is (a full-extent block)."""
    for t in range(min(cap, n), 0, -1):
        if n % t == 0 and t % multiple == 0 and (not pow2 or t & (t - 1) == 0):
            return t
    return n


def grouped_matmul_reference(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """The contract by its definition: each row's group from the cumulative sizes, that
    group's weights gathered per row (M copies of a weight matrix: tests only)."""
    check_inputs(x, w, group_sizes)
    ends = jnp.cumsum(group_sizes)
    row = jnp.arange(x.shape[0])
    group = jnp.searchsorted(ends, row, side="right")
    valid = row < ends[-1]
    wg = w[jnp.minimum(group, w.shape[0] - 1)].astype(jnp.float32)
    y = jnp.einsum("mk,mkn->mn", x.astype(jnp.float32), wg,
                   precision=jax.lax.Precision.HIGHEST)
    return jnp.where(valid[:, None], y, 0.0).astype(x.dtype)
