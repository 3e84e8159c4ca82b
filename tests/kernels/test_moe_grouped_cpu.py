"""The C++ grouped expert MLP over packed expert panels (kernels_pallas/moe_grouped_cpu.py)
against numpy.

Oracle: each group's SwiGLU MLP silu(x @ Wg[e]) * (x @ Wu[e]) @ Wd[e] in float64 numpy on the
unpacked weights (bfloat16 panels: on their bfloat16 values, exact in float64), rows past
sum(sizes) zero. Every case runs on each instruction set this CPU has (support.cpu_isa) and
with float32 and bfloat16 panels. Cases: empty groups, one-token groups (a decode step), all
rows on one expert, every group empty, M from 1 to 300 (one expert over the 256-row chunk),
hidden / intermediate sizes that leave panels partly empty or an odd panel count (the
AVX-512 down tile's last group has one panel), K over several 192-row k blocks, padding rows
past the groups, a layer of a stack read by index inside a scan. Tolerance: the float32
error bound of the two products and the SwiGLU between them (`_bound`), far below a wrong
expert's or row's error. Also: the jnp reference against the same oracle, pack round trip,
the input checks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support.cpu_isa import isa_params
from support.numerics import F32_UNIT_ROUNDOFF, gamma

from jaxserve.kernels_pallas import cpu_build
from jaxserve.kernels_pallas.moe_grouped_cpu import (PANEL, grouped_mlp_packed,
                                                     grouped_mlp_packed_reference,
                                                     pack_expert_panels, unpack_expert_panels)

pytestmark = pytest.mark.skipif(cpu_build.dense_kernel_target() is None,
                                reason="the CPU kernels could not be built here (see the log)")

CASES = [  # (sizes, padding rows, hidden, intermediate)
    ((3, 0, 1, 7, 2), 3, 40, 24),  # empty groups, odd sizes, padding rows
    ((0, 0, 13, 0, 0), 0, 40, 24),  # every row on one expert
    ((1, 1, 0, 0, 0), 2, 64, 48),  # one-token groups: a decode step of top-2
    ((0, 0, 0, 0, 0), 4, 32, 16),  # nothing routed: all zeros
    ((0, 0, 0, 1, 0), 0, 48, 32),  # M = 1
    ((0, 300, 0, 0, 0), 0, 40, 20),  # over the 256-row chunk; a partly empty panel
    ((20, 0, 17, 0, 9), 1, 400, 200),  # K in several 192-row blocks, both products
    ((61, 70, 50, 79, 40), 0, 24, 40),  # M = 300 spread over every expert
]


def _weights(rng: np.random.Generator, layers: int, e: int, h: int, i: int, dtype: str
             ) -> list[np.ndarray]:
    ws = [0.3 * rng.standard_normal((layers, e, h, i)), 0.3 * rng.standard_normal(
        (layers, e, h, i)), 0.3 * rng.standard_normal((layers, e, i, h))]
    # The values the panels hold (bfloat16 rounds them), so the oracle sees the same weights.
    return [np.asarray(w.astype(jnp.dtype(dtype)).astype(np.float64)) for w in ws]


def _oracle(x: np.ndarray, sizes: tuple[int, ...], wg: np.ndarray, wu: np.ndarray,
            wd: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(y, bound): float64 result and the float32 evaluation's elementwise error bound."""
    x = x.astype(np.float64)
    y, bound = np.zeros_like(x), np.zeros_like(x)
    h_dim, i_dim = wg.shape[1], wg.shape[2]
    r = 0
    for e, n in enumerate(sizes):
        xe = x[r:r + n]
        g, u = xe @ wg[e], xe @ wu[e]
        dg, du = (gamma(h_dim) * (np.abs(xe) @ np.abs(w[e])) for w in (wg, wu))
        sig = 1 / (1 + np.exp(-g))
        h = g * sig * u
        # |d silu / dg| <= 1.1; 8 roundings of silu * up (exp, add, divide, multiply)
        dh = 1.1 * dg * np.abs(u) + np.abs(g * sig) * du + dg * du + \
            8 * F32_UNIT_ROUNDOFF * np.abs(h)
        y[r:r + n] = h @ wd[e]
        bound[r:r + n] = dh @ np.abs(wd[e]) + gamma(i_dim) * ((np.abs(h) + dh) @ np.abs(wd[e]))
        r += n
    return y, bound


def _assert_close(got: np.ndarray, want: np.ndarray, bound: np.ndarray) -> None:
    err = np.abs(np.asarray(got, np.float64) - want)
    worst = float((err / np.maximum(bound, 1e-30)).max()) if err.size else 0.0
    assert (err <= bound + 1e-30).all(), f"max err / bound {worst:.3g}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("sizes,pad,hidden,inter", CASES)
def test_kernel_matches_numpy(sizes: tuple[int, ...], pad: int, hidden: int, inter: int,
                              isa: str, dtype: str) -> None:
    rng = np.random.default_rng(sum(sizes) * 7 + hidden + inter + pad)
    m = sum(sizes) + pad
    x = rng.standard_normal((m, hidden)).astype(np.float32)
    wg, wu, wd = _weights(rng, 2, len(sizes), hidden, inter, dtype)
    gate, up, down = (jnp.asarray(pack_expert_panels(w, dtype)) for w in (wg, wu, wd))
    s = jnp.asarray(sizes, jnp.int32)
    got = jax.jit(lambda x, s, g, u, d: grouped_mlp_packed(
        x, s, g, u, d, jnp.int32(1), inter, isa=isa))(jnp.asarray(x), s, gate, up, down)
    want, bound = _oracle(x, sizes, wg[1], wu[1], wd[1])
    assert got.shape == (m, hidden) and got.dtype == jnp.float32
    _assert_close(got, want, bound)
    assert not np.asarray(got[sum(sizes):]).any()  # padding rows are zero


@pytest.mark.parametrize("isa", isa_params())
def test_layer_of_a_stack_inside_a_scan_and_activation_dtype(isa: str) -> None:
    """As the engine reads it: a scan over the layers hands the kernel the whole stack and
    the layer index; bfloat16 rows come back bfloat16 (float32 inside)."""
    rng = np.random.default_rng(5)
    sizes, hidden, inter = (2, 0, 5), 32, 48
    x = rng.standard_normal((8, hidden)).astype(np.float32)
    ws = _weights(rng, 3, 3, hidden, inter, "float32")
    panels = [jnp.asarray(pack_expert_panels(w)) for w in ws]
    s = jnp.asarray(sizes, jnp.int32)

    def body(carry: None, layer: jax.Array) -> tuple[None, jax.Array]:
        return None, grouped_mlp_packed(jnp.asarray(x), s, *panels, layer, inter, isa=isa)

    _, ys = jax.jit(lambda: jax.lax.scan(body, None, jnp.arange(3, dtype=jnp.int32)))()
    for layer in range(3):
        want, bound = _oracle(x, sizes, *(w[layer] for w in ws))
        _assert_close(ys[layer], want, bound)
    y16 = grouped_mlp_packed(jnp.asarray(x, jnp.bfloat16), s, *panels, jnp.int32(0), inter,
                             isa=isa)
    assert y16.dtype == jnp.bfloat16


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reference_matches_numpy(dtype: str) -> None:
    """The jnp fallback (where the C++ library cannot be built) against the same oracle."""
    rng = np.random.default_rng(11)
    sizes, hidden, inter = (3, 0, 4, 1), 40, 24
    x = rng.standard_normal((10, hidden)).astype(np.float32)
    ws = _weights(rng, 1, 4, hidden, inter, dtype)
    panels = [jnp.asarray(pack_expert_panels(w, dtype)) for w in ws]
    got = grouped_mlp_packed_reference(jnp.asarray(x), jnp.asarray(sizes, jnp.int32), *panels,
                                       jnp.int32(0), inter)
    want, bound = _oracle(x, sizes, *(w[0] for w in ws))
    _assert_close(got, want, 4 * bound)  # XLA's dots may sum in another order: two sides
    assert not np.asarray(got[8:]).any()


def test_pack_round_trip_and_layout() -> None:
    w = np.arange(2 * 3 * 5 * 20, dtype=np.float32).reshape(2, 3, 5, 20)
    p = pack_expert_panels(w)
    assert p.shape == (2, 3, 2, 5, PANEL) and p.dtype == np.float32
    assert p[1, 2, 1, 4, 3] == w[1, 2, 4, 19] and not p[..., 1, :, 4:].any()
    np.testing.assert_array_equal(np.asarray(unpack_expert_panels(jnp.asarray(p), 20)), w)
    b = pack_expert_panels(w, "bfloat16")
    assert b.dtype == jnp.bfloat16 and b.shape == p.shape
    with pytest.raises(ValueError, match="dtype='float16' must be one of"):
        pack_expert_panels(w, "float16")


def test_bad_inputs_name_the_problem() -> None:
    rng = np.random.default_rng(0)
    ws = _weights(rng, 1, 2, 32, 16, "float32")
    g, u, d = (jnp.asarray(pack_expert_panels(w)[0]) for w in ws)
    x, s = jnp.zeros((4, 32), jnp.float32), jnp.asarray([2, 2], jnp.int32)
    with pytest.raises(ValueError, match="hidden 24 != the gate panels' K 32"):
        grouped_mlp_packed(jnp.zeros((4, 24)), s, g, u, d, None, 16)
    with pytest.raises(ValueError, match="intermediate=40 does not fit 1 panels"):
        grouped_mlp_packed(x, s, g, u, d, None, 40)
    with pytest.raises(ValueError, match=r"sizes must be int32\[2\]"):
        grouped_mlp_packed(x, jnp.asarray([1, 2, 1], jnp.int32), g, u, d, None, 16)
    with pytest.raises(ValueError, match="up panels"):
        grouped_mlp_packed(x, s, g, u[:1], d, None, 16)
    with pytest.raises(ValueError, match="down panels must be"):
        grouped_mlp_packed(x, s, g, u, g, None, 16)
    with pytest.raises(ValueError, match="share one dtype"):
        grouped_mlp_packed(x, s, g, u, d.astype(jnp.bfloat16), None, 16)
    with pytest.raises(ValueError, match="isa='sse2' must be one of"):
        grouped_mlp_packed(x, s, g, u, d, None, 16, isa="sse2")
