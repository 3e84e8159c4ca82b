"""The C++ dense kernel over packed weights (kernels_pallas/dense_cpu.py) against numpy.

Oracle: x @ W in float64 numpy on the unpacked weight. Every case runs on each instruction
set this CPU has (support.cpu_isa: AVX-512 and AVX2 on an AVX-512 host; the AVX-512 case is
skipped, with the reason, elsewhere). Cases cover the kernels' edges: row counts around both
register tiles (6 rows for AVX2; 12 rows x 2 panels for AVX-512) and the row chunk (256), odd
panel counts (the AVX-512 tile's last group has one panel), a column count that leaves the
last 16-column panel partly empty, K over several of the chunk's k blocks (192), a single partial panel, a stack of layers read by index
(inside a scan, as the engine reads it) and a lone weight, leading batch dims. Tolerance:
float32 accumulation over K terms (support.numerics.matmul_atol). Also: the runtime ISA check
against /proc/cpuinfo, and the isa override's checks.
Also: pack / unpack round trip, the input checks, and that the model with packed params
gives the unpacked model's logits (test_model_parity checks packed against transformers).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support.cpu_isa import cpuinfo_flags, isa_params
from support.numerics import logits_atol, matmul_atol

from jaxserve.kernels_pallas import cpu_build
from jaxserve.kernels_pallas.dense_cpu import (PANEL, dense_packed, dense_packed_reference,
                                               pack_panels, unpack_panels)
from jaxserve.models import decoder, linear, llama
from jaxserve.models.packing import pack_params

pytestmark = pytest.mark.skipif(cpu_build.dense_kernel_target() is None,
                                reason="the CPU kernels could not be built here (see the log)")

CASES = [  # (M, K, N)
    (1, 64, 48), (5, 64, 48), (6, 64, 48), (7, 64, 48), (13, 40, 24), (256, 32, 16),
    (257, 32, 40), (200, 72, 96), (3, 24, 8), (2, 576, 192), (12, 48, 32), (25, 40, 80),
    (30, 400, 48),  # K in 3 blocks of the multi-tile chunk (192, 192, 16)
]


def _close(got: np.ndarray, want: np.ndarray, x: np.ndarray, w: np.ndarray) -> None:
    """The kernel's float32 x @ w against the float64 product: elementwise within
    gamma_K * (|x| @ |w|) (support.numerics.matmul_atol, one side: the oracle is exact to
    float32's scale), whatever the kernel's blocking, SIMD width or FMA use. The float64
    oracle errs by gamma_K at u = 2^-53 itself, at most 2^-29 of that bound."""
    err, bound = np.abs(got - want), matmul_atol(x, w) * (1 + 2.0 ** -29)
    worst = float((err / np.maximum(bound, np.finfo(np.float64).tiny)).max())
    assert (err <= bound).all(), f"max err / bound {worst:.3g}"


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("m,k,n", CASES)
def test_stacked_weight_by_layer_matches_numpy(m: int, k: int, n: int, isa: str) -> None:
    rng = np.random.default_rng(m * 1000 + k + n)
    w = rng.standard_normal((3, k, n)).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    panels = jnp.asarray(pack_panels(w))

    def body(carry: None, layer: jax.Array) -> tuple[None, jax.Array]:
        return carry, dense_packed(jnp.asarray(x), panels, layer, n, isa=isa)

    _, got = jax.jit(lambda: jax.lax.scan(body, None, jnp.arange(3, dtype=jnp.int32)))()
    for layer in range(3):
        _close(np.asarray(got[layer]), x.astype(np.float64) @ w[layer].astype(np.float64),
               x, w[layer])


@pytest.mark.parametrize("isa", isa_params())
def test_lone_weight_and_leading_dims(isa: str) -> None:
    rng = np.random.default_rng(7)
    w = rng.standard_normal((40, 200)).astype(np.float32)
    x = rng.standard_normal((2, 9, 40)).astype(np.float32)
    got = jax.jit(lambda x, p: dense_packed(x, p, None, 200, isa=isa))(
        jnp.asarray(x), jnp.asarray(pack_panels(w)))
    assert got.shape == (2, 9, 200)
    _close(np.asarray(got), x.astype(np.float64) @ w.astype(np.float64), x, w)
    ref = dense_packed_reference(jnp.asarray(x), jnp.asarray(pack_panels(w)), None, 200)
    _close(np.asarray(ref), x.astype(np.float64) @ w.astype(np.float64), x, w)


def test_no_rows() -> None:
    p = jnp.asarray(pack_panels(np.ones((8, 16), np.float32)))
    assert dense_packed(jnp.zeros((0, 8)), p, None, 16).shape == (0, 16)


def test_pack_round_trip_and_layout() -> None:
    w = np.arange(2 * 5 * 21, dtype=np.float32).reshape(2, 5, 21)
    p = pack_panels(w)
    assert p.shape == (2, 2, 5, PANEL)
    assert p[1, 1, 3, 4] == w[1, 3, 20] and np.all(p[:, 1, :, 5:] == 0)
    np.testing.assert_array_equal(np.asarray(unpack_panels(jnp.asarray(p), 21)), w)


def test_runtime_isa_check_matches_cpuinfo() -> None:
    """The variants registered are those /proc/cpuinfo says this CPU runs, best first, and the
    plain target runs the first."""
    flags = cpuinfo_flags()
    if not flags or "native" in dict(cpu_build.dense_variants()):
        pytest.skip("no x86 /proc/cpuinfo flags here to check the runtime choice against")
    avx512 = {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx2", "fma"}
    want = [isa for isa, need in (("avx512_vnni", avx512 | {"avx512_vnni"}),
                                  ("avx512", avx512),
                                  ("avx2", {"avx2", "fma", "f16c"})) if need <= flags]
    assert list(cpu_build.dense_isas()) == want
    assert cpu_build.dense_kernel_target() == cpu_build.DENSE_TARGET
    assert cpu_build.dense_kernel_target(want[-1]) == f"{cpu_build.DENSE_TARGET}_{want[-1]}"


def test_isa_override_is_checked() -> None:
    p = jnp.asarray(pack_panels(np.ones((8, 32), np.float32)))
    with pytest.raises(ValueError, match="isa='sse2' must be one of"):
        dense_packed(jnp.ones((2, 8)), p, None, 32, isa="sse2")
    missing = [isa for isa, _ in cpu_build.dense_variants() if isa not in cpu_build.dense_isas()]
    for isa in missing:  # an AVX2-only host asked for AVX-512
        with pytest.raises(ValueError, match=f"isa='{isa}': this CPU runs only"):
            dense_packed(jnp.ones((2, 8)), p, None, 32, isa=isa)


def test_an_avx2_only_host_refuses_and_skips_avx512(monkeypatch) -> None:
    """What an AVX2-only host sees (its runtime check registering avx2 alone), here on any
    x86 host: the plain target is the AVX2 one, asking for AVX-512 is a ValueError, and the
    AVX-512 test parameters are skipped with the reason."""
    if "avx512" not in dict(cpu_build.dense_variants()):
        pytest.skip("not an x86-64 build: no AVX-512 variant to refuse")
    monkeypatch.setattr(cpu_build, "load_kernels", lambda: ("avx2",))
    assert cpu_build.dense_kernel_target() == cpu_build.DENSE_TARGET
    assert cpu_build.dense_kernel_target("avx2") == f"{cpu_build.DENSE_TARGET}_avx2"
    with pytest.raises(ValueError, match=r"isa='avx512': this CPU runs only \['avx2'\]"):
        cpu_build.dense_kernel_target("avx512")
    skips = {p.values[0]: p.marks[0] for p in isa_params()}  # one skipif mark each
    assert skips["avx2"].args[0] is False
    assert skips["avx512"].args[0] is True
    assert "does not run the avx512" in skips["avx512"].kwargs["reason"]


def test_bad_inputs_name_the_problem() -> None:
    p = jnp.asarray(pack_panels(np.ones((8, 32), np.float32)))
    with pytest.raises(ValueError, match="last dim 9 != the panels' K 8"):
        dense_packed(jnp.ones((2, 9)), p, None, 32)
    with pytest.raises(ValueError, match="out_features=40 does not fit 2 panels"):
        dense_packed(jnp.ones((2, 8)), p, None, 40)
    with pytest.raises(ValueError, match="float32 only"):
        dense_packed(jnp.ones((2, 8), jnp.bfloat16), p, None, 32)
    with pytest.raises(ValueError, match="panels must be"):
        dense_packed(jnp.ones((2, 8)), jnp.ones((8, 32)), None, 32)


@pytest.mark.parametrize("tied", [False, True])
def test_packed_model_matches_unpacked(tied: bool) -> None:
    from support.engine_fixtures import tiny_model_config

    cfg = tiny_model_config(tie_word_embeddings=tied, attention_bias=True, qk_norm=True,
                            hidden_size=48, head_dim=12)
    params = llama.init_random_params(cfg, jax.random.key(3), jnp.float32, scale=0.3)
    packed = pack_params(params)
    assert isinstance(packed.layers.wq, linear.PackedWeight)
    assert isinstance(packed.lm_head if not tied else packed.embed, linear.PackedWeight)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (3, 11)),
                         jnp.int32)
    lengths = jnp.asarray([11, 4, 7], jnp.int32)
    want = np.asarray(decoder.forward_jit(params, tokens, lengths, cfg=cfg))
    got = np.asarray(decoder.forward_jit(packed, tokens, lengths, cfg=cfg))
    # The whole model in two summation orders (XLA's dots against the packed kernel's):
    # support.numerics.logits_atol, from the weights.
    assert np.max(np.abs(got - want)) <= logits_atol(cfg, params, tokens.shape[1])
