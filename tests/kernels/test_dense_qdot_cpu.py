"""The integer-dot dense kernel (kernels_pallas/dense_qdot_cpu.py, csrc/dense_qdot_cpu.cc).

Oracles:
- the activation quantization: the jnp `quantize_rows` (the integers, the scales exactly; the
  float sums within their rounding), on rows with exact .5 ties, zeros and non-finite groups;
- the product: `dense_qdot_reference` (jnp, integer sums exact) within the float rounding of
  the scaling, derived below; and the float64 product x @ W within `error_bound` (the
  activations' rounding, d / 2 per element) — so a wrong nibble order, scale, zero term or
  +128 correction fails both;
- the packing: the stored integers read back equal the model-layout ones.
Every case runs on each ISA whose library has the scheme's integer dots (support.cpu_isa,
skipped with the reason where this CPU lacks it): int8 on AVX-512 VNNI, int4 also on AVX-512
without VNNI and AVX2 (vpmaddubsw). Shapes cross the tile edges (8 rows x 2 panels with
AVX-512, 2 rows with AVX2), the 256-row chunk, an odd panel count, a partial last panel, a
stack read by layer index, and weight groups of 16 (Q6_K), 32 (Q8_0 / Q4) and K (per column).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support.cpu_isa import isa_params
from support.numerics import F32_UNIT_ROUNDOFF, gamma

from jaxserve.kernels_pallas import cpu_build
from jaxserve.kernels_pallas import dense_qdot_cpu as dq
from jaxserve.models.quant import pack_int4

pytestmark = pytest.mark.skipif(cpu_build.dense_kernel_target() is None,
                                reason="the CPU kernels could not be built here (see the log)")

CASES = [  # (M, K, N, group)
    (1, 64, 48, 32), (2, 96, 40, 32), (5, 64, 16, 16), (8, 64, 48, 32), (9, 128, 72, 32),
    (13, 96, 24, 96), (37, 64, 80, 32), (260, 64, 40, 32), (3, 1024, 32, 32),
    (20, 1024, 40, 32),  # K in two of the multi-tile item's k blocks (512)
]


def qdot_isas(scheme: str) -> list:
    """isa_params() for the ISAs with `scheme`'s integer dots."""
    return [p for p in isa_params() if p.values[0] in dq.ISAS[scheme]]


def scheme_isa_params() -> list:
    """(scheme, isa) for every ISA with that scheme's integer dots, skipped where this CPU
    does not run it."""
    return [pytest.param(s, *p.values, marks=p.marks,
                         id=f"{s}-{p.values[0]}") for s in ("int8", "int4") for p in qdot_isas(s)]


def make_weight(rng: np.random.Generator, scheme: str, layers: int, k: int, n: int,
                group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Random model-layout values, scales and zeros of a [layers, k, n] weight."""
    scales = rng.uniform(0.002, 0.03, (layers, k // group, n)).astype(np.float32)
    if scheme == "int8":
        return rng.integers(-127, 128, (layers, k, n)).astype(np.int8), scales, None
    q = rng.integers(0, 16, (layers, k, n)).astype(np.uint8)
    zeros = (rng.standard_normal((layers, k // group, n)) * 0.05).astype(np.float32)
    return pack_int4(q), scales, zeros


def float_weight(values: np.ndarray, scales: np.ndarray, zeros: np.ndarray | None,
                 scheme: str) -> np.ndarray:
    """The weights as float64 [L, K, N] (the model layout's meaning)."""
    q = dq.unpack_int4_rows(values) if scheme == "int4" else values
    g = q.shape[-2] // scales.shape[-2]
    w = q.astype(np.float64) * np.repeat(scales, g, axis=-2)
    return w if zeros is None else w + np.repeat(zeros, g, axis=-2)


def dequant_atol(values: np.ndarray, scales: np.ndarray, zeros: np.ndarray | None,
                 scheme: str) -> np.ndarray:
    """q * s (+ z) in float32: a rounding of the product and one of the sum, each at most u
    of |q s| + |z|."""
    q = dq.unpack_int4_rows(values) if scheme == "int4" else values
    g = q.shape[-2] // scales.shape[-2]
    mag = np.abs(q.astype(np.float64) * np.repeat(scales, g, axis=-2))
    if zeros is not None:
        mag = mag + np.abs(np.repeat(zeros, g, axis=-2))
    return 2 * F32_UNIT_ROUNDOFF * mag + 1e-30


def scaling_bound(x: np.ndarray, w: dq.QdotPanels, layer: int, n: int) -> np.ndarray:
    """|kernel - reference| bound: both sum the same exact integer dots I_a, each times d_a
    and the group scale (and int4's z * sum x), in different orders: per term two roundings
    (the products) and the sum of 2 * K / A + 1 terms, so gamma of that count plus 3 times
    the sum of the terms' magnitudes, plus int4's float sums of x (gamma_A each, in
    different orders on the two sides)."""
    q, d, _, xs = (np.asarray(a, np.float64) for a in dq.quantize_rows(jnp.asarray(x),
                                                                        w.act_group))
    values = np.asarray(dq.weight_values(w, jnp.asarray(layer)), np.float64)  # [P, K, 16]
    scales = np.asarray(w.scales[layer] if w.scales.ndim == 4 else w.scales, np.float64)
    m, k = x.shape
    a, na, g = w.act_group, k // w.act_group, k // scales.shape[-2]
    dots = np.einsum("mak,pakc->mapc", q.reshape(m, na, a), values.reshape(-1, na, a, 16))
    s = np.repeat(scales, g // a, axis=-2)
    terms = np.einsum("mapc,pac,ma->mpc", np.abs(dots), np.abs(s), np.abs(d))
    bound = gamma(2 * na + 3) * terms
    if w.zeros is not None:
        zeros = np.asarray(w.zeros[layer] if w.zeros.ndim == 4 else w.zeros, np.float64)
        z = np.abs(np.repeat(zeros, g // a, axis=-2))
        xabs = np.abs(x.astype(np.float64)).reshape(m, na, a).sum(-1)
        bound += (gamma(2 * na + 3) + 2 * gamma(a)) * np.einsum("pac,ma->mpc", z, xabs)
    return bound.reshape(m, -1)[:, :n] + np.finfo(np.float32).tiny


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_pack_round_trip(scheme: str) -> None:
    rng = np.random.default_rng(1)
    values, scales, zeros = make_weight(rng, scheme, 2, 64, 40, 32)
    w = dq.pack_qdot(values, scales, zeros, scheme)
    assert w.values.shape == (2, 3, 64 // dq.STEP[scheme], dq.LINE) and w.act_group == 32
    q = dq.unpack_int4_rows(values) if scheme == "int4" else values
    for layer in range(2):
        got = np.asarray(dq.weight_values(w, jnp.asarray(layer)))  # [P, K, 16]
        got = np.moveaxis(got, 0, 1).reshape(64, -1)[:, :40]
        np.testing.assert_array_equal(got, q[layer].astype(np.float32))
        deq = np.moveaxis(np.asarray(dq.dequantized(w, jnp.asarray(layer))), 0, 1)
        err = np.abs(deq.reshape(64, -1)[:, :40] - float_weight(values, scales, zeros,
                                                                  scheme)[layer])
        assert (err <= dequant_atol(values, scales, zeros, scheme)[layer]).all()


def test_act_group_rules() -> None:
    assert [dq.act_group_for(g) for g in (16, 32, 64, 576, 24, 6)] == [16, 32, 32, 32, 24, None]
    assert [dq.act_group_for(g, 8) for g in (16, 32, 576, 6)] == [8, 8, 8, None]
    assert "at most 16" in dq.qdot_scheme_supported("int4", 12, "avx512_vnni", 16)
    assert dq.qdot_scheme_supported("fp8", 32, "avx512_vnni") is not None
    assert "avx512_vnni" in dq.qdot_scheme_supported("int8", 32, "avx2")
    assert dq.qdot_scheme_supported("int4", 32, "avx2") is None
    assert dq.qdot_scheme_supported("int4", 24, "avx512_vnni") is None
    assert "groups of 12" in dq.qdot_scheme_supported("int4", 12, "avx512_vnni")
    with pytest.raises(ValueError, match="groups of 6"):
        dq.pack_qdot(np.zeros((12, 16), np.int8), np.ones((2, 16), np.float32), None, "int8")
    with pytest.raises(ValueError, match="zeros must be given exactly for int4"):
        dq.pack_qdot(np.zeros((32, 16), np.uint8), np.ones((1, 16), np.float32), None, "int4")


@pytest.mark.parametrize("isa", qdot_isas("int4"))
def test_activation_quantization_matches_jnp(isa: str) -> None:
    """The kernel's step 1 equals quantize_rows: exact ties (x * 127 / max|x| = k + 0.5 round
    to even), an all-zero group, an inf and a NaN group (scale NaN, so y is NaN)."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((6, 96)).astype(np.float32)
    # amax 63.5: 127 / 63.5 = 2 exactly, so these hit x * inv = k + 0.5 and round to even
    x[2, :32] = 0.0
    x[2, :5] = [63.5, 0.25, 0.75, 1.25, -0.75]
    x[3, 32:64] = 0.0
    x[4, 64:] = np.inf
    x[5, 0] = np.nan
    want = dq.quantize_rows(jnp.asarray(x), 32)
    got = dq.quantize_rows_kernel(jnp.asarray(x), 32, isa=isa)
    for name, a, b in zip(("q", "d", "qsum"), got[:3], want[:3]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
    np.testing.assert_allclose(np.asarray(got[3])[:4], np.asarray(want[3])[:4],
                               rtol=gamma(32), atol=gamma(32) * 32 * np.abs(x[:4]).max())
    np.testing.assert_array_equal(np.asarray(got[0])[2, :5], [127, 0, 2, 2, -2])
    assert np.isnan(np.asarray(got[1])[4, 2]) and np.isnan(np.asarray(got[1])[5, 0])


@pytest.mark.parametrize("scheme,isa", scheme_isa_params())
@pytest.mark.parametrize("m,k,n,group", CASES)
def test_kernel_matches_reference_and_float64(scheme: str, isa: str, m: int, k: int, n: int,
                                              group: int) -> None:
    check_product(scheme, isa, m, k, n, group, 32)


@pytest.mark.parametrize("scheme,isa", scheme_isa_params())
@pytest.mark.parametrize("max_group", [8, 16])
def test_smaller_activation_groups(scheme: str, isa: str, max_group: int) -> None:
    """int8_activation_group_size 8 and 16 under weight groups of 32 and of K."""
    check_product(scheme, isa, 9, 128, 72, 32, max_group)
    check_product(scheme, isa, 3, 64, 40, 64, max_group)


def check_product(scheme: str, isa: str, m: int, k: int, n: int, group: int,
                  max_group: int) -> None:
    """The kernel over a 3-layer stack read by index in a scan, against the reference and
    float64."""
    rng = np.random.default_rng(m * 7919 + k * 31 + n + group + max_group)
    values, scales, zeros = make_weight(rng, scheme, 3, k, n, group)
    w = jax.tree.map(jnp.asarray, dq.pack_qdot(values, scales, zeros, scheme, max_group))
    assert w.act_group == min(group, max_group)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[0, : min(k, 8)] *= 40.0  # an outlier group: its scale is large, the others' are not
    wf = float_weight(values, scales, zeros, scheme)

    def body(carry: None, layer: jax.Array) -> tuple[None, jax.Array]:
        return None, dq.dense_qdot_packed(jnp.asarray(x), w, layer, n, isa=isa)

    got = np.asarray(jax.jit(lambda: jax.lax.scan(body, None, jnp.arange(3))[1])())
    for layer in range(3):
        ref = np.asarray(dq.dense_qdot_reference(jnp.asarray(x), w, jnp.asarray(layer), n))
        err = np.abs(got[layer].astype(np.float64) - ref)
        bound = scaling_bound(x, w, layer, n) * 2  # both sides round: one bound each
        assert (err <= bound).all(), f"kernel vs reference: {(err / bound).max():.3g}"
        exact = x.astype(np.float64) @ wf[layer]
        qbound = dq.error_bound(x, wf[layer], w.act_group) + bound
        assert (np.abs(got[layer] - exact) <= qbound).all(), \
            f"vs float64: {(np.abs(got[layer] - exact) / qbound).max():.3g} of the bound"


@pytest.mark.parametrize("scheme,isa", scheme_isa_params())
def test_a_row_does_not_depend_on_its_batch(scheme: str, isa: str) -> None:
    """Each row is quantized and summed alone: its result is bitwise the same in a batch of
    1, 7 or 300 rows (greedy decoding gives the same tokens whatever the neighbours)."""
    rng = np.random.default_rng(3)
    values, scales, zeros = make_weight(rng, scheme, 1, 128, 72, 32)
    w = jax.tree.map(jnp.asarray, dq.pack_qdot(values[0], scales[0],
                                               None if zeros is None else zeros[0], scheme))
    x = jnp.asarray(rng.standard_normal((300, 128)).astype(np.float32))
    f = jax.jit(lambda x: dq.dense_qdot_packed(x, w, None, 72, isa=isa))
    full = np.asarray(f(x))
    for rows in ([0], [5, 6, 7, 8, 9, 10, 11], [299]):
        np.testing.assert_array_equal(np.asarray(f(x[np.asarray(rows)])), full[rows])


@pytest.mark.parametrize("isa", qdot_isas("int4"))
def test_non_finite_rows_stay_their_own(isa: str) -> None:
    """A NaN or inf in a row makes that row NaN (as a float dot would make it non-finite) and
    leaves the other rows as they were."""
    rng = np.random.default_rng(4)
    values, scales, zeros = make_weight(rng, "int4", 1, 64, 32, 32)
    w = jax.tree.map(jnp.asarray, dq.pack_qdot(values[0], scales[0], zeros[0], "int4"))
    x = rng.standard_normal((4, 64)).astype(np.float32)
    clean = np.asarray(dq.dense_qdot_packed(jnp.asarray(x), w, None, 32, isa=isa))
    x[1, 3], x[2, 40] = np.nan, np.inf
    y = np.asarray(dq.dense_qdot_packed(jnp.asarray(x), w, None, 32, isa=isa))
    assert np.isnan(y[1]).all() and np.isnan(y[2]).all()
    np.testing.assert_array_equal(y[[0, 3]], clean[[0, 3]])


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_columns_are_the_dequantized_weight(scheme: str) -> None:
    """qdot_columns (a tied embedding's lookup) reads W[:, ids] as stored."""
    rng = np.random.default_rng(5)
    values, scales, zeros = make_weight(rng, scheme, 1, 64, 40, 32)
    w = jax.tree.map(jnp.asarray, dq.pack_qdot(values[0], scales[0],
                                               None if zeros is None else zeros[0], scheme))
    ids = jnp.asarray([[0, 17], [39, 16]])
    got = np.asarray(dq.qdot_columns(w, ids))
    want = float_weight(values, scales, zeros, scheme)[0].T[np.asarray(ids)]
    atol = dequant_atol(values, scales, zeros, scheme)[0].T[np.asarray(ids)]
    assert (np.abs(got - want) <= atol).all()


def test_bad_inputs_name_the_problem() -> None:
    rng = np.random.default_rng(6)
    values, scales, _ = make_weight(rng, "int8", 1, 64, 32, 32)
    w = dq.pack_qdot(values[0], scales[0], None, "int8")
    with pytest.raises(ValueError, match="x's last dim 32 != the weight's in_features 64"):
        dq.dense_qdot_packed(jnp.ones((2, 32)), w, None, 32)
    with pytest.raises(ValueError, match="out_features=40 does not fit 2 panels"):
        dq.dense_qdot_packed(jnp.ones((2, 64)), w, None, 40)
    with pytest.raises(ValueError, match="x must be float32"):
        dq.dense_qdot_packed(jnp.ones((2, 64), jnp.bfloat16), w, None, 32)
    assert dq.dense_qdot_packed(jnp.ones((0, 64)), w, None, 32).shape == (0, 32)


@pytest.mark.parametrize("scheme,isa", scheme_isa_params())
def test_extreme_products_do_not_saturate(scheme: str, isa: str) -> None:
    """Every weight at its largest magnitude (int4 15, int8 -127) and every activation at
    +-127 after quantization: the largest sums the integer paths can meet (int4 without VNNI
    keeps 16 products of 15 x 127 per s16 lane over a group of 32: 30,480), exactly."""
    k, n = 64, 32
    if scheme == "int4":
        values, zeros = pack_int4(np.full((k, n), 15, np.uint8)), np.zeros((k // 32, n), np.float32)
    else:
        values, zeros = np.full((k, n), -127, np.int8), None
    scales = np.ones((k // 32, n), np.float32)
    w = jax.tree.map(jnp.asarray, dq.pack_qdot(values, scales, zeros, scheme))
    x = np.ones((3, k), np.float32)
    x[1] = -1.0
    x[2, ::2] = -1.0
    y = np.asarray(dq.dense_qdot_packed(jnp.asarray(x), w, None, n, isa=isa))
    wf = float_weight(values[None], scales[None], None if zeros is None else zeros[None],
                      scheme)[0]
    np.testing.assert_allclose(y, x.astype(np.float64) @ wf, rtol=4 * F32_UNIT_ROUNDOFF)
