"""Quantized KV pages (int8 / float8_e4m3fn + per-row f32 scales): write_kv and every reader.

Oracles:
  - write_kv's round trip against the float rows it was given: each stored row, dequantized,
    is within the quantizer's own error bound (int8: half a step, max|row| / 254; fp8: half an
    ulp of e4m3, 2^-4 relative, or the subnormal spacing 2^-9 x scale), live slots only; the
    slots it must not touch keep their bits.
  - every attention implementation on a QuantizedKV against the jnp reference run on the
    *dequantized* float32 pages (``dequantize``: values x scales, a plain float page array, the
    float path the other tests check against a float64 oracle). Both compute the same
    products, so the tolerance is float32 rounding (reference, CPU kernel, TPU interpreted),
    or the GPU kernel's bfloat16 operand rounding (3e-2, as for its float pages).
Batches come from kernel_cases (random ragged steps; unused slots NaN, which quantizes to NaN
scales, so a stray read of a quantized page still turns an output NaN).
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels_pallas import cpu_build
from jaxserve.kernels_pallas import (QuantizedKV, dequantize, init_kv_pages,
                                     ragged_paged_attention_reference, write_kv)
from support.kernel_cases import quantized_pages, random_batch
from support.numerics import (F32_UNIT_ROUNDOFF, assert_close, kernel_attention_tolerance,
                              rounding_rtol)
from support.pallas_run import interpret_params, races_found, run_kernel
from support.tiers import grid

QDTYPES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}


def seed_of(*parts: object) -> int:
    return zlib.crc32(repr(parts).encode())


def quantized_batch(kind: str, seed: int, **kw):
    """A random step whose context pages are quantized, and its write_kv'd QuantizedKV."""
    rng = np.random.default_rng(seed)
    specs = {"mixed": [(21, 3), (0, 17), (40, 1), (5, 1)], "decode": [(30, 1), (63, 1), (1, 1)],
             "prefill": [(0, 33), (0, 9)]}[kind]
    opts = dict(num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16) | kw
    batch = random_batch(rng, specs, num_tokens=sum(n for _, n in specs) + 2,
                         num_seqs=len(specs) + 1, **opts)
    return batch


def written(batch, qdtype) -> QuantizedKV:
    kv = quantized_pages(batch.kv_pages, qdtype)
    return write_kv(kv, batch.k_new, batch.v_new, batch.md.slot_mapping)


def live_rows(batch) -> int:
    return int(np.asarray(batch.md.cu_q_lens)[len(batch.specs)])


# The bound's magnitudes (|q| |k| and p |v| sums) are computed from the float K / V the pages
# were written from; the dequantized values differ by <= 2^-4 relative (e4m3) or <= amax/254
# (int8) elementwise, under 10% of those sums on these unit-normal rows: SLACK.
SLACK = 1.1


def tolerance(impl: str, batch, q_dtype: str, **opts) -> dict:  # noqa: ANN001 - a RaggedBatch
    """assert_allclose's atol / rtol for `impl` on 8-bit pages against the float32 reference
    on the dequantized pages (support.numerics.kernel_attention_tolerance; the reference's
    output stays float32: one rounding of a 16-bit output)."""
    return kernel_attention_tolerance(impl, batch, q_dtype, roundings=1, slack=SLACK, **opts)


@pytest.mark.parametrize("qname", sorted(QDTYPES))
def test_write_kv_round_trip_within_the_quantizer_bound(qname: str) -> None:
    qdtype = QDTYPES[qname]
    batch = quantized_batch("mixed", seed_of("write", qname))
    before = quantized_pages(batch.kv_pages, qdtype)
    after = write_kv(before, batch.k_new, batch.v_new, batch.md.slot_mapping)
    assert isinstance(after, QuantizedKV) and after.pages.dtype == qdtype
    assert after.scales.dtype == jnp.float32 and after.scales.shape == after.shape[:3]
    deq = np.asarray(dequantize(after))
    scales = np.asarray(after.scales)
    slots = np.asarray(batch.md.slot_mapping)[:live_rows(batch)]
    k = np.asarray(batch.k_new, np.float32)
    v = np.asarray(batch.v_new, np.float32)
    ps = after.shape[2]
    for t, slot in enumerate(slots):
        page, off = divmod(int(slot), ps)
        for x, rows in ((k[t], slice(0, None, 2)), (v[t], slice(1, None, 2))):
            got, s = deq[page, rows, off], scales[page, rows, off]       # [Hkv, D], [Hkv]
            amax = np.abs(x).max(-1)
            # One division each side, or a reciprocal and a product: 3 roundings at most.
            assert_close(s, amax / (127.0 if qname == "int8" else 448.0),
                                       rtol=rounding_rtol("float32", 3))
            # Round to nearest against the stored scale s: half a step (int8: s / 2; e4m3:
            # half an ulp, 2^-4 relative, or s 2^-10 among the subnormals), plus float32
            # roundings: x / s (or x * (1 / s)) before the rounding, 2u |x| at most, and
            # q * s after it, u |got|; doubled for second-order terms.
            if qname == "int8":
                half_step = s[:, None] / 2
            else:
                half_step = np.maximum(np.abs(x) * 2.0 ** -4, s[:, None] * 2.0 ** -10)
            bound = half_step + 2 * F32_UNIT_ROUNDOFF * (2 * np.abs(x) + np.abs(got))
            assert (np.abs(got - x) <= bound).all(), (t, np.abs(got - x).max())
    # Slots nobody wrote keep their bits (values and scales).
    written_pages = {int(s) // ps for s in np.asarray(batch.md.slot_mapping)}
    untouched = [p for p in range(after.shape[0]) if p not in written_pages]
    np.testing.assert_array_equal(np.asarray(after.pages)[untouched].view(np.uint8),
                                  np.asarray(before.pages)[untouched].view(np.uint8))
    np.testing.assert_array_equal(np.asarray(after.scales)[untouched],
                                  np.asarray(before.scales)[untouched])


def test_zero_rows_get_zero_scales_and_values() -> None:
    kv = init_kv_pages(3, 16, 2, 64, jnp.int8)
    assert isinstance(kv, QuantizedKV)
    zeros = jnp.zeros((2, 2, 64), jnp.float32)
    out = write_kv(kv, zeros, zeros, jnp.asarray([17, 18], jnp.int32))
    assert not np.asarray(out.pages).any() and not np.asarray(out.scales).any()
    assert np.isfinite(np.asarray(dequantize(out))).all()


def test_write_kv_checks_name_the_bad_value() -> None:
    kv = init_kv_pages(3, 16, 2, 64, jnp.int8)
    bad = QuantizedKV(kv.pages, kv.scales[:, :, :8])
    x = jnp.zeros((2, 2, 64), jnp.float32)
    with pytest.raises(ValueError, match=r"scales must be float32\[3, 4, 16\]"):
        write_kv(bad, x, x, jnp.zeros(2, jnp.int32))
    with pytest.raises(ValueError, match="k_new dtype must be float32/bfloat16/float16"):
        write_kv(kv, x.astype(jnp.int32), x, jnp.zeros(2, jnp.int32))
    with pytest.raises(ValueError, match="come as a QuantizedKV"):
        write_kv(kv.pages, x, x, jnp.zeros(2, jnp.int32))


# Default tier: each kind with one 8-bit format (both formats covered); the other format
# with JAXSERVE_RUN_SLOW=1.
@pytest.mark.parametrize("kind,dtype,qname", grid(
    [[("mixed-float32", ("mixed", "float32")), ("decode-bfloat16", ("decode", "bfloat16")),
      ("prefill-float32", ("prefill", "float32"))], [(q, q) for q in sorted(QDTYPES)]],
    {"mixed-float32-int8", "decode-bfloat16-fp8", "prefill-float32-fp8"},
    "each kind with the other 8-bit format", flatten=True))
def test_reference_matches_reference_on_dequantized_pages(qname: str, kind: str,
                                                          dtype: str) -> None:
    batch = quantized_batch(kind, seed_of("ref", qname, kind), dtype=jnp.dtype(dtype))
    kv = written(batch, QDTYPES[qname])
    opts = dict(sm_scale=0.125, sliding_window=None, soft_cap=None)
    got = ragged_paged_attention_reference(batch.q, kv, batch.md, **opts)
    assert got.dtype == batch.q.dtype and got.shape == batch.q.shape
    want = ragged_paged_attention_reference(batch.q.astype(jnp.float32), dequantize(kv),
                                            batch.md, **opts)
    n = live_rows(batch)
    tol = tolerance("cpu", batch, dtype, **opts)  # the reference is float32 throughout too
    assert_close(np.asarray(got, np.float32)[:n], np.asarray(want)[:n], **tol)
    assert np.isfinite(np.asarray(got, np.float32)).all()
    # And the dequantized pages are close to the float ones: the quantization is not a no-op,
    # nor garbage (int8: ~1e-2 relative on unit-normal K/V; fp8: ~6e-2).
    exact = ragged_paged_attention_reference(
        batch.q.astype(jnp.float32), write_kv(batch.kv_pages.astype(jnp.float32),
                                              batch.k_new.astype(jnp.float32),
                                              batch.v_new.astype(jnp.float32),
                                              batch.md.slot_mapping), batch.md, **opts)
    err = np.abs(np.asarray(want)[:n] - np.asarray(exact)[:n]).max()
    assert 0 < err < (0.05 if qname == "int8" else 0.2), err


# --------------------------------------------------------------------------- CPU kernel
def _cpu_kernel_or_skip() -> None:
    from jaxserve.kernels_pallas import cpu_build
    if cpu_build.cpu_kernel_target() is None:
        pytest.skip("the CPU kernel could not be built here (see the log)")


# (kind, q dtype, Hq, Hkv, D, page_size, window, cap); "long": one 3000-key decode whose key
# range the kernel splits over threads, next to a prefill.
CPU_CASES = [("mixed", "float32", 4, 2, 64, 16, None, None),
             ("decode", "bfloat16", 8, 2, 64, 16, None, None),
             ("prefill", "float32", 8, 1, 128, 32, None, None),
             ("mixed", "float32", 6, 2, 64, 16, 19, 4.0),
             ("long", "float32", 4, 1, 32, 16, None, None)]


def cpu_batch(case: tuple, seed: int):
    kind, dtype, hq, hkv, d, ps, _, _ = case
    opts = dict(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=ps,
                dtype=jnp.dtype(dtype))
    if kind != "long":
        return quantized_batch(kind, seed, **opts)
    return random_batch(np.random.default_rng(seed), [(3000, 1), (0, 40)], num_tokens=43,
                        num_seqs=3, **opts)


CPU_CASE_IDS = [f"{c[0]}-{c[1]}-g{c[2] // c[3]}" + ("-win-cap" if c[6] else "")
                for c in CPU_CASES]


# Default tier: each case with one 8-bit format, alternating; the other with
# JAXSERVE_RUN_SLOW=1.
@pytest.mark.parametrize("case,qname", grid(
    [list(zip(CPU_CASE_IDS, CPU_CASES)), [(q, q) for q in sorted(QDTYPES)]],
    {f"{i}-{sorted(QDTYPES)[n % 2]}" for n, i in enumerate(CPU_CASE_IDS)},
    "each CPU-kernel case with the other 8-bit format"))
def test_cpu_kernel_matches_reference_on_dequantized_pages(qname: str, case: tuple) -> None:
    _cpu_kernel_or_skip()
    from jaxserve.kernels_pallas.cpu import ragged_paged_attention_cpu
    batch = cpu_batch(case, seed_of("cpu", qname, case))
    kv = written(batch, QDTYPES[qname])
    opts = dict(sm_scale=case[4] ** -0.5, sliding_window=case[6], soft_cap=case[7])
    got = ragged_paged_attention_cpu(batch.q, kv, batch.md, **opts)
    assert got.dtype == batch.q.dtype
    want = ragged_paged_attention_reference(batch.q.astype(jnp.float32), dequantize(kv),
                                            batch.md, **opts)
    n = live_rows(batch)
    got = np.asarray(got, np.float32)
    assert_close(got[:n], np.asarray(want)[:n],
                               **tolerance("cpu", batch, case[1], **opts))
    np.testing.assert_array_equal(got[n:], 0.0, err_msg="padding tokens must be zeros")


# Tall tiles (csrc/tile_math.h: K scales on the scores, V scales on the weights) on every
# instruction set this CPU runs: a 600-token chunk with a window and a cap beside decode rows
# and a short chunk (SmolLM2's heads: 9 / 3, head dim 64).
@pytest.mark.parametrize("isa", [isa for isa, _ in cpu_build.attention_variants()])
@pytest.mark.parametrize("qname", sorted(QDTYPES))
def test_cpu_tall_tiles_on_quantized_pages_on_each_isa(qname: str, isa: str) -> None:
    _cpu_kernel_or_skip()
    if isa not in cpu_build.dense_isas():
        pytest.skip(f"this CPU does not run {isa}")
    from jaxserve.kernels_pallas.cpu import ragged_paged_attention_cpu
    batch = random_batch(np.random.default_rng(seed_of("tall", qname, isa)),
                         [(40, 600), (700, 1), (0, 13)], num_q_heads=9, num_kv_heads=3,
                         head_dim=64, page_size=16, dtype=jnp.dtype("float32"),
                         num_tokens=616, num_seqs=4)
    kv = written(batch, QDTYPES[qname])
    opts = dict(sm_scale=0.125, sliding_window=250, soft_cap=25.0)
    got = ragged_paged_attention_cpu(batch.q, kv, batch.md, **opts, isa=isa)
    want = ragged_paged_attention_reference(batch.q, dequantize(kv), batch.md, **opts)
    n = live_rows(batch)
    got = np.asarray(got, np.float32)
    assert_close(got[:n], np.asarray(want)[:n], **tolerance("cpu", batch, "float32", **opts))
    np.testing.assert_array_equal(got[n:], 0.0, err_msg="padding tokens must be zeros")


@pytest.mark.parametrize("qname", sorted(QDTYPES))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_fused_write_and_attend_stores_what_write_kv_stores(qname: str, dtype: str) -> None:
    """The kernel's own quantizing write: the same values and scales, bit for bit, as
    write_kv's (live slots, dropped slots, a head dim stored padded), then the same output."""
    _cpu_kernel_or_skip()
    from jaxserve.kernels_pallas import AttentionMetadata, write_kv_and_attend
    rng = np.random.default_rng(seed_of("fused", qname, dtype))
    batch = random_batch(rng, [(37, 1), (0, 20), (50, 7), (16, 1)], num_q_heads=8,
                         num_kv_heads=2, head_dim=80, page_size=16, dtype=jnp.dtype(dtype),
                         num_tokens=33, num_seqs=6, fill_nan=False)
    d = 64       # rows of 64 into pages of head dim 80: zero-padded
    q, k_new, v_new = batch.q[..., :d], batch.k_new[..., :d], batch.v_new[..., :d]
    slots = np.asarray(batch.md.slot_mapping).copy()
    slots[30:] = [-5, batch.kv_pages.shape[0] * 16 + 3, 2]        # dropped, dropped, trash
    md = AttentionMetadata(jnp.asarray(slots), batch.md.block_tables, batch.md.kv_lens,
                           batch.md.cu_q_lens, batch.md.num_seqs)
    kv = quantized_pages(batch.kv_pages, QDTYPES[qname])
    want_kv = write_kv(kv, k_new, v_new, md.slot_mapping)
    out, got_kv = write_kv_and_attend(q, k_new, v_new, kv, md, sm_scale=0.125, impl="cpu")
    assert isinstance(got_kv, QuantizedKV)
    np.testing.assert_array_equal(np.asarray(got_kv.pages).view(np.uint8),
                                  np.asarray(want_kv.pages).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(got_kv.scales), np.asarray(want_kv.scales))
    want = ragged_paged_attention_reference(q.astype(jnp.float32), dequantize(want_kv), md,
                                            sm_scale=0.125)
    assert_close(np.asarray(out, np.float32)[:29], np.asarray(want)[:29],
                               **tolerance("cpu", batch, dtype, sm_scale=0.125, head_dim=d))


# --------------------------------------------------------------------------- Pallas kernels
# (kind, q dtype, Hq, Hkv, D, page_size, window, cap): page_size 32, the smallest both kernels
# take for 8-bit pages (TPU sublane packing; GPU 128-byte aligned scale copies).
PALLAS_CASES = [("mixed", "float32", 4, 2, 64, 32, None, None),
                ("decode", "bfloat16", 8, 2, 128, 32, 40, None)]


# Default tier: both kernels on both cases, each (kernel, case) with one 8-bit format so that
# each kernel reads int8 and fp8 pages; the other format with JAXSERVE_RUN_SLOW=1.
@pytest.mark.parametrize("impl,case,qname", grid(
    [[(i, i) for i in ("pallas_tpu", "pallas_gpu")],
     [(f"{c[0]}-{c[1]}-d{c[4]}", c) for c in PALLAS_CASES], [(q, q) for q in sorted(QDTYPES)]],
    {"pallas_tpu-mixed-float32-d64-int8", "pallas_tpu-decode-bfloat16-d128-fp8",
     "pallas_gpu-mixed-float32-d64-fp8", "pallas_gpu-decode-bfloat16-d128-int8"},
    "each interpreted kernel case with the other 8-bit format"))
def test_pallas_kernel_interpreted_matches_reference_on_dequantized_pages(
        impl: str, case: tuple, qname: str) -> None:
    batch = cpu_batch(case, seed_of(impl, qname, case))
    kv = written(batch, QDTYPES[qname])
    opts = dict(sm_scale=case[4] ** -0.5, sliding_window=case[6], soft_cap=case[7])
    got = run_kernel(impl, batch.q, kv, batch.md, interpret=interpret_params(impl), **opts)
    assert not races_found(impl), "the interpreter reported a data race"
    assert got.shape == batch.q.shape and got.dtype == batch.q.dtype
    want = ragged_paged_attention_reference(batch.q.astype(jnp.float32), dequantize(kv),
                                            batch.md, **opts)
    n = live_rows(batch)
    # TPU interpreted: K/V converted to q's dtype (exact for int8 / e4m3 in bfloat16 too), p
    # to q's dtype; GPU: its bfloat16 MMA operands, as for float pages (kernel_attention_
    # tolerance).
    got = np.asarray(got, np.float32)
    assert_close(got[:n], np.asarray(want)[:n],
                               **tolerance(impl, batch, case[1], **opts))
    assert np.isfinite(got).all()


@pytest.mark.parametrize("impl", ["pallas_tpu", "pallas_gpu"])
def test_pallas_kernels_refuse_8bit_pages_of_16_tokens(impl: str) -> None:
    batch = cpu_batch(("decode", "float32", 4, 2, 64, 16, None, None), 3)
    kv = written(batch, jnp.int8)
    with pytest.raises(ValueError, match="page_size.* 16.*32|page_size=16"):
        jax.eval_shape(lambda q, p, m: run_kernel(impl, q, p, m, sm_scale=0.1), batch.q, kv,
                       batch.md)
