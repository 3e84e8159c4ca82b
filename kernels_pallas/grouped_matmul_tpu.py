"""Grouped matmul on TPU: a Pallas Mosaic TPU kernel over the tile visits of grouped_matmul.py
(Megablox's scheme: metadata in SMEM by scalar prefetch, one grid step per visited tile).

Data flow::

    x [M, K] -> padded to whole m-tiles [M', K];  visits = tile_visits(group_sizes, M', tm)
    grid (N / tn, visits, K / tk), the visit axis a dynamic bound (only real visits run):
      SMEM (scalar prefetch): the visit arrays group, m_tile, x_tile, w_group, lo,
                              hi, store (i32[M'/tm + G - 1] each)
      VMEM in : x block [tm, tk] at (x_tile[v], k), w block [tk, tn] at (w_group[v], k, n)
      VMEM out: out block [tm, tn] at (m_tile[v], n); f32 accumulator [tm, tn] scratch
    step (n, v, k): acc (= 0 at k == 0) += x @ w on the MXU in f32; at the last k, rows
      [lo, hi) of the out block take acc, [hi, store) zeros, the others keep what the
      block holds.

Why it is right: the visits of one m-tile are consecutive, so its out block stays in VMEM
across them (Pallas writes a block back when its index changes) and each row is stored by
exactly one of them; no row meets another group's weights (the row mask). A tail visit (a
tile wholly past sum(group_sizes), `group == G`) skips the matmul and stores zeros; its x /
w indices repeat the previous visit's at the last k, so the pipeline fetches nothing for it.
Work: one (tm, K) x (K, N) matmul per matmul visit, so at most (num_m_tiles + G - 1) tiles,
and at decode (a few rows, k experts each) the distinct experts' weights once per n-tile.

Checked on CPU only (interpreter: NaN-filled uninitialised buffers, so a row the masks miss
shows; and the Pallas -> Mosaic lowering through jax.export); not run on a TPU yet.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .grouped_matmul import (check_inputs, check_tiles, default_tm, largest_divisor,
                             pad_rows, tile_visits)


def default_tiles(m: int, k: int, n: int, dtype: Any) -> tuple[int, int, int]:
    """(tm, tk, tn): tm up to 128 rows (whole sublane tiles), tk up to 2048 and tn up to 512
    lanes (multiples of 128 dividing K / N; the full extent where none does). A bf16 step at
    the maxima holds x 0.5 MiB + w 2 MiB, double-buffered, plus a 0.25 MiB accumulator: well
    inside the default scoped VMEM."""
    sub = sublanes(dtype)
    return (default_tm(m, sub), largest_divisor(k, 2048, 128),
            largest_divisor(n, 512, 128))


def sublanes(dtype: Any) -> int:
    return 8 if jnp.dtype(dtype).itemsize == 4 else 16


def _kernel(group_ref, m_tile_ref, x_tile_ref, w_group_ref, lo_ref, hi_ref, store_ref,
            x_ref, w_ref, o_ref, acc_ref, *, num_groups: int, tm: int):
    del x_tile_ref, w_group_ref  # used by the index maps only
    v, k = pl.program_id(1), pl.program_id(2)
    matmul = group_ref[v] < num_groups

    @pl.when(matmul & (k == 0))
    def _zero():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(matmul)
    def _accumulate():
        acc_ref[...] += jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32)

    @pl.when(k == pl.num_programs(2) - 1)
    def _store():
        row = m_tile_ref[v] * tm + jax.lax.broadcasted_iota(jnp.int32, acc_ref.shape, 0)
        mine = (row >= lo_ref[v]) & (row < store_ref[v])
        # Rows past the group's end (the last group's, past sum(sizes)) and a tail visit's
        # whole tile store zeros.
        value = jnp.where(matmul & (row < hi_ref[v]), acc_ref[...], 0.0).astype(o_ref.dtype)
        o_ref[...] = jnp.where(mine | ~matmul, value, o_ref[...])


@functools.partial(jax.jit, static_argnames=("tiles", "interpret"))
def grouped_matmul_tpu(x: jax.Array, w: jax.Array, group_sizes: jax.Array,
                       tiles: tuple[int, int, int] | None = None,
                       interpret: Any = False) -> jax.Array:
    """[M, N] = the grouped matmul (grouped_matmul.py's contract). `tiles` (tm, tk, tn):
    default `default_tiles`. `interpret`: True or a pltpu.InterpretParams runs on CPU."""
    check_inputs(x, w, group_sizes)
    m, k = x.shape
    num_groups, _, n = w.shape
    tm, tk, tn = tiles or default_tiles(m, k, n, x.dtype)
    check_tiles(k, n, tm, tk, tn, sublanes(x.dtype))
    if tk != k and tk % 128:
        raise ValueError(f"tk={tk} must be a multiple of 128 or K={k} (TPU lanes)")
    if tn != n and tn % 128:
        raise ValueError(f"tn={tn} must be a multiple of 128 or N={n} (TPU lanes)")
    xp = pad_rows(x, tm)
    mp = xp.shape[0]
    visits = tile_visits(group_sizes, mp, tm)
    last_k = k // tk - 1

    def x_map(n_i, v, k_i, group, m_tile, x_tile, w_group, *_):
        # A tail visit keeps the previous visit's block (its last k): nothing is fetched.
        return x_tile[v], jnp.where(group[v] < num_groups, k_i, last_k)

    def w_map(n_i, v, k_i, group, m_tile, x_tile, w_group, *_):
        return w_group[v], jnp.where(group[v] < num_groups, k_i, last_k), n_i

    def o_map(n_i, v, k_i, group, m_tile, *_):
        return m_tile[v], n_i

    if interpret is True:
        interpret = pltpu.InterpretParams()
    out = pl.pallas_call(
        functools.partial(_kernel, num_groups=num_groups, tm=tm),
        out_shape=jax.ShapeDtypeStruct((mp, n), x.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=7,
            in_specs=[pl.BlockSpec((tm, tk), x_map),
                      pl.BlockSpec((None, tk, tn), w_map)],
            out_specs=pl.BlockSpec((tm, tn), o_map),
            grid=(n // tn, visits.num_visits, k // tk),
            scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)]),
        # n-tiles are independent (megacore may split them); visits chain through the
        # resident out block, k through the accumulator.
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        interpret=interpret,
        cost_estimate=pl.CostEstimate(flops=2 * m * k * n, transcendentals=0,
                                      bytes_accessed=(x.size + w.size) * x.dtype.itemsize
                                      + m * n * x.dtype.itemsize),
    )(visits.group, visits.m_tile, visits.x_tile, visits.w_group, visits.lo, visits.hi,
      visits.store, xp, w)
    return out[:m]
