"""The Pallas grouped matmuls (kernels_pallas/grouped_matmul*.py), both run by the CPU
interpreters, against the definition: each row times its own group's weights, in float64
numpy (an oracle independent of both the kernels and the jnp reference), rows past
sum(group_sizes) zero. The TPU interpreter fills uninitialised buffers with NaN, so a row
that no visit stores shows up. Plus the tile metadata's bound and the trace-time refusals,
and both kernels lowered for their platform (jax.export from this CPU host).

One (M, K, N, G) per kernel: every routing case reuses its compile (each case < 2 s).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels_pallas.grouped_matmul import (grouped_matmul_reference, max_visits,
                                                    tile_visits)
from jaxserve.kernels_pallas.grouped_matmul_gpu import grouped_matmul_gpu
from jaxserve.kernels_pallas.grouped_matmul_tpu import grouped_matmul_tpu
from jaxserve.models import moe_block

M, G = 40, 6  # 40 rows: not a multiple of the 16-row tiles below (the last one is padding)
# (name, group sizes): sum <= M; rows past the sum must come out zero.
ROUTINGS = [
    ("mixed-with-empty", [3, 0, 5, 1, 0, 7]),      # empty groups, one-row group, 24 rows past
    ("one-row-groups", [1, 1, 1, 1, 1, 1]),        # six boundaries inside one tile
    ("all-on-one", [0, 0, M, 0, 0, 0]),            # every row on one expert
    ("all-on-last", [0, 0, 0, 0, 0, M]),
    ("none", [0, 0, 0, 0, 0, 0]),                  # no rows at all: every tile zero
    ("across-tiles", [17, 0, 0, 15, 8, 0]),        # groups straddling tile boundaries
]
KERNELS = {
    # (kernel, K, N, tiles (tm, tk, tn)): tiles that leave K and N several blocks each
    "tpu": (grouped_matmul_tpu, 256, 256, (16, 128, 128)),
    "gpu": (grouped_matmul_gpu, 64, 32, (16, 16, 16)),
}


def oracle(x: np.ndarray, w: np.ndarray, sizes: list[int]) -> np.ndarray:
    out = np.zeros((x.shape[0], w.shape[2]))
    row = 0
    for g, size in enumerate(sizes):
        out[row:row + size] = x[row:row + size].astype(np.float64) @ w[g].astype(np.float64)
        row += size
    return out


@pytest.mark.parametrize("name,sizes", ROUTINGS, ids=[r[0] for r in ROUTINGS])
@pytest.mark.parametrize("backend", sorted(KERNELS))
def test_kernel_equals_definition(backend: str, name: str, sizes: list[int]) -> None:
    kernel, k, n, tiles = KERNELS[backend]
    rng = np.random.default_rng(len(name))
    x = rng.standard_normal((M, k)).astype(np.float32)
    w = rng.standard_normal((G, k, n)).astype(np.float32)
    got = np.asarray(kernel(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes, jnp.int32),
                            tiles=tiles, interpret=True))
    want = oracle(x, w, sizes)
    assert np.isfinite(got).all(), name  # every row stored (NaN-filled buffers on TPU)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3 * np.abs(want).max(initial=1))
    assert not got[sum(sizes):].any()  # rows past sum(sizes): exactly zero


@pytest.mark.parametrize("backend", sorted(KERNELS))
def test_bfloat16_and_default_tiles(backend: str) -> None:
    """bf16 rows and weights, f32 accumulation, the kernel's own tile choice (one tile of
    rows for a decode-sized M), against the jnp reference."""
    kernel, k, n, _ = KERNELS[backend]
    rng = np.random.default_rng(7)
    sizes = jnp.asarray([2, 0, 3, 0, 1, 2], jnp.int32)
    x = jnp.asarray(rng.standard_normal((8, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((G, k, n)) * 0.1, jnp.bfloat16)
    got = kernel(x, w, sizes, interpret=True)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32),
                               np.asarray(grouped_matmul_reference(x, w, sizes), np.float32),
                               rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("name,sizes", ROUTINGS, ids=[r[0] for r in ROUTINGS])
def test_visits_cover_each_row_once_within_bound(name: str, sizes: list[int]) -> None:
    """The metadata alone: visits <= num_m_tiles + G - 1; each row of [0, M') is stored by
    exactly one visit; a matmul visit's rows all belong to its group; empty groups and the
    padding entries past the count do nothing new."""
    tm, mp = 16, 48
    v = jax.tree.map(np.asarray, tile_visits(jnp.asarray(sizes, jnp.int32), mp, tm))
    count = int(v.num_visits)
    assert count <= max_visits(mp, tm, G) == len(v.group)
    ends = np.cumsum(sizes)
    stored = np.zeros(mp, int)
    for i in range(count):
        rows = np.arange(v.m_tile[i] * tm, (v.m_tile[i] + 1) * tm)
        if v.group[i] == G:  # tail: a whole tile past the sum
            assert rows[0] >= ends[-1]
            stored[rows] += 1
            continue
        g = v.group[i]
        assert sizes[g] > 0 and v.w_group[i] == g and v.x_tile[i] == v.m_tile[i]
        mine = rows[(rows >= v.lo[i]) & (rows < v.store[i])]
        assert ((mine < ends[g]) & (mine >= ends[g] - sizes[g]) | (mine >= ends[-1])).all()
        stored[mine] += 1
    assert (stored == 1).all(), stored
    # entries past the count repeat the last visit (a pipelined fetch of them is a no-op)
    if count:
        assert (v.m_tile[count:] == v.m_tile[count - 1]).all()


@pytest.mark.parametrize("backend", sorted(KERNELS))
def test_trace_time_refusals_name_the_value(backend: str) -> None:
    kernel, k, n, tiles = KERNELS[backend]
    x = jnp.zeros((M, k), jnp.float32)
    w = jnp.zeros((G, k, n), jnp.float32)
    sizes = jnp.zeros((G,), jnp.int32)
    cases = [
        ((x, w.astype(jnp.bfloat16), sizes), {}, "w dtype bfloat16"),
        ((x, jnp.zeros((G, k + 16, n)), sizes), {}, f"K={k + 16}"),
        ((x, w, jnp.zeros((G + 1,), jnp.int32)), {}, r"group_sizes shape \(7,\)"),
        ((x, w, sizes.astype(jnp.int64 if jax.config.x64_enabled else jnp.float32)), {},
         "group_sizes dtype"),
        ((x[0], w, sizes), {}, "x must be"),
        ((x, w, sizes), {"tiles": (tiles[0], tiles[1] * 3, tiles[2])}, f"tk={tiles[1] * 3}"),
        ((x, w, sizes), {"tiles": (tiles[0], tiles[1], n + 16)}, f"tn={n + 16}"),
        ((x, w, sizes), {"tiles": (12, tiles[1], tiles[2])}, "tm=12"),
    ]
    for args, kw, match in cases:
        with pytest.raises(ValueError, match=match):
            kernel(*args, interpret=True, **kw)


@pytest.mark.parametrize("backend,platform,call", [
    ("tpu", "tpu", "tpu_custom_call"), ("gpu", "cuda", "__gpu$xla.gpu.triton")])
def test_kernel_lowers_for_its_platform(backend: str, platform: str, call: str) -> None:
    """Qwen3-30B-A3B's gate projection (2048 -> 768, 128 experts) for a 64-token step's
    512 rows, exported from this CPU host through the Pallas -> Mosaic / Triton lowering."""
    kernel = KERNELS[backend][0]
    sds = jax.ShapeDtypeStruct
    exported = jax.export.export(
        jax.jit(kernel), platforms=[platform],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(call)])(
        sds((512, 2048), jnp.bfloat16), sds((128, 2048, 768), jnp.bfloat16),
        sds((128,), jnp.int32))
    calls = re.findall(r"custom_call @([\w$.]+)", exported.mlir_module())
    assert calls == [call]
    assert exported.out_avals[0].shape == (512, 768)


@pytest.mark.parametrize("backend", sorted(KERNELS))
def test_expert_mlp_through_the_kernel_equals_ragged_dot(backend: str) -> None:
    """A whole MoE expert block as `moe_block` runs it on TPU / CUDA (route, sort, gate / up /
    down through the kernel, un-sort, weight) against the same block through XLA's ragged
    dot: 12 tokens, top-2 of 6 experts, hidden 64, width 32, float32."""
    kernel = functools.partial(KERNELS[backend][0], interpret=True)
    rng = np.random.default_rng(3)
    n, hidden, width, k = 12, 64, 32, 2
    x = jnp.asarray(rng.standard_normal((n, hidden)), jnp.float32)
    w_gate, w_up = (jnp.asarray(rng.standard_normal((G, hidden, width)) * 0.2, jnp.float32)
                    for _ in range(2))
    w_down = jnp.asarray(rng.standard_normal((G, width, hidden)) * 0.2, jnp.float32)
    logits = rng.standard_normal((n, G))
    experts = jnp.asarray(np.argsort(-logits, axis=1)[:, :k], jnp.int32)
    weights = jnp.asarray(rng.random((n, k)), jnp.float32)

    def through(mlp):  # noqa: ANN001, ANN202
        return np.asarray(moe_block.expert_mlp(x, weights, experts, w_gate, w_up, w_down, mlp))

    want = through(moe_block.grouped_mlp_ragged)
    got = through(functools.partial(moe_block.grouped_mlp_with, kernel))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
