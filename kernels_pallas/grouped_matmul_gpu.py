"""Grouped matmul on NVIDIA GPUs: a Pallas Triton kernel over the tile visits of
grouped_matmul.py (the TPU kernel's metadata; here each program reads its visit itself).

Backend: Pallas' Triton backend (``jax.experimental.pallas.triton``), not Mosaic GPU (which
the attention uses): a grouped matmul is plain tiles of x and w with masks, Triton pipelines
its k-loop on Ampere and Hopper alike, and the kernel lowers without a GPU (jax.export on CPU
checks it). Triton blocks are powers of two, at least 16 on each matmul side.

Data flow::

    x [M, K] -> padded to whole m-tiles [M', K];  visits = tile_visits(group_sizes, M', tm)
    grid (M'/tm + G - 1, N / tn): program (v, n) is visit v's n-tile
      v >= num_visits: returns at once (the static grid's unused tail: no loads, no work)
      a matmul visit (group g < G): acc f32 [tm, tn] = sum over k-tiles of
          x[m_tile * tm : +tm, k : k + tk] @ w[g, k : k + tk, n * tn : +tn]
        (a loop of K / tk steps), then a masked store of rows [lo, store) only (zeros from hi on)
      a tail visit (g == G): stores zeros over its tile, reads nothing

Programs of one m-tile (one per group with rows in it) run concurrently: their stores are
row-disjoint masks, so no read-modify-write of the output is needed and none races. No row
meets another group's weights; every row of a visited tile is stored by exactly one visit
(grouped_matmul.py). Checked on CPU only (interpreter; Pallas -> Triton lowering through
jax.export); not run on a GPU yet.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from .grouped_matmul import (check_inputs, check_tiles, default_tm, largest_divisor,
                             max_visits, pad_rows, tile_visits)


def default_tiles(m: int, k: int, n: int) -> tuple[int, int, int]:
    """(tm, tk, tn): tm a power of two up to 64 rows (16 at least: Triton's dot), tk up to 64
    and tn up to 128, powers of two dividing K / N (a bf16 step: x 8 KiB + w 16 KiB per
    stage, a 32 KiB f32 accumulator in registers across 4 warps)."""
    tm = 1 << max(default_tm(m, 16, 64) - 1, 0).bit_length()
    return tm, largest_divisor(k, 64, 16, pow2=True), largest_divisor(n, 128, 16, pow2=True)


def _pow2(name: str, value: int) -> None:
    if value < 16 or value & (value - 1):
        raise ValueError(f"{name}={value} must be a power of two >= 16 (Triton blocks)")


def _kernel(num_ref, group_ref, m_tile_ref, lo_ref, hi_ref, store_ref, x_ref, w_ref, o_ref, *,
            num_groups: int, tm: int, tk: int, tn: int, num_k: int, precision: Any):
    v, n_i = pl.program_id(0), pl.program_id(1)
    live = v < num_ref[0]
    g, tile = group_ref[v], m_tile_ref[v]
    rows, cols = pl.ds(tile * tm, tm), pl.ds(n_i * tn, tn)

    @pl.when(live & (g < num_groups))
    def _matmul():
        def step(k_i: jax.Array, acc: jax.Array) -> jax.Array:
            ks = pl.ds(k_i * tk, tk)
            xk = pltriton.load(x_ref.at[rows, ks])
            wk = pltriton.load(w_ref.at[g, ks, cols])
            return acc + jnp.dot(xk, wk, preferred_element_type=jnp.float32,
                                 precision=precision)

        acc = jax.lax.fori_loop(0, num_k, step, jnp.zeros((tm, tn), jnp.float32))
        row = tile * tm + jax.lax.broadcasted_iota(jnp.int32, (tm, tn), 0)
        mine = (row >= lo_ref[v]) & (row < store_ref[v])
        # The last group's visit also zeroes its tile's rows past sum(group_sizes).
        value = jnp.where(row < hi_ref[v], acc, 0.0).astype(o_ref.dtype)
        pltriton.store(o_ref.at[rows, cols], value, mask=mine)

    @pl.when(live & (g >= num_groups))
    def _zeros():
        pltriton.store(o_ref.at[rows, cols], jnp.zeros((tm, tn), o_ref.dtype))


@functools.partial(jax.jit, static_argnames=("tiles", "num_warps", "num_stages", "interpret"))
def grouped_matmul_gpu(x: jax.Array, w: jax.Array, group_sizes: jax.Array,
                       tiles: tuple[int, int, int] | None = None, num_warps: int = 4,
                       num_stages: int = 3, interpret: bool = False) -> jax.Array:
    """[M, N] = the grouped matmul (grouped_matmul.py's contract). `tiles` (tm, tk, tn):
    default `default_tiles`. `interpret=True` runs on CPU."""
    check_inputs(x, w, group_sizes)
    m, k = x.shape
    num_groups, _, n = w.shape
    tm, tk, tn = tiles or default_tiles(m, k, n)
    check_tiles(k, n, tm, tk, tn, 16)
    for name, value in (("tm", tm), ("tk", tk), ("tn", tn)):
        _pow2(name, value)
    xp = pad_rows(x, tm)
    mp = xp.shape[0]
    visits = tile_visits(group_sizes, mp, tm)
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    out = pl.pallas_call(
        functools.partial(_kernel, num_groups=num_groups, tm=tm, tk=tk, tn=tn,
                          num_k=k // tk, precision=precision),
        out_shape=jax.ShapeDtypeStruct((mp, n), x.dtype),
        grid=(max_visits(mp, tm, num_groups), n // tn),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
    )(visits.num_visits.reshape(1), visits.group, visits.m_tile, visits.lo, visits.hi,
      visits.store, xp, w)
    return out[:m]


def gpu_tiles_fit(k: int, n: int) -> bool:
    """Whether `default_tiles` finds power-of-two tiles (>= 16) dividing K and N."""
    return k % 16 == 0 and n % 16 == 0
