"""Gemma's head_dim 256 through every attention implementation and every KV page dtype.

The other kernel tests run head dims 64 / 128 numerically (support.kernel_cases.CASES, the
quantized-page cases of test_kv_quant) and head_dim 256 only lowered (test_attention_kernels'
LOWERINGS, test_attention_lowering_grid, the export tests) or, numerically, only on the GPU
kernel's float32 / bfloat16 pages (test_attention_gpu_geometry / _hardening). Here each
implementation -- the jnp reference, the C++ CPU kernel through the FFI, the Pallas TPU and GPU
kernels interpreted on CPU (races detected) -- reads pages of head_dim 256 in each page dtype
the engine serves (float32, bfloat16, float16; int8 and float8_e4m3fn pages with their f32
row scales, read by a bfloat16 query), with a sliding window shorter than the contexts and a
soft-cap low enough to bend the scores, Gemma 3 1B's GQA (4 query heads on 1 KV head).

Oracle: per-sequence float64 numpy softmax attention, straight from the definition, over the
values the pages hold (the batch's float K / V; for 8-bit pages the dequantized rows read back
through the block table), with no pages, tiles or online softmax. Tolerance: what each
implementation rounds besides float32 arithmetic against an exact oracle
(support.numerics.kernel_attention_tolerance with sides=1; the reference and the CPU kernel
round nothing, the TPU kernel p to q's dtype, the GPU kernel its MMA operands to bfloat16),
plus one rounding of a 16-bit output. Unowned pages and slots are NaN (8-bit: NaN scales), so
a stray read fails.
"""

from __future__ import annotations

import dataclasses
import zlib

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels_pallas import dequantize, ragged_paged_attention_reference, write_kv
from jaxserve.kernels_pallas import cpu_build
from support.kernel_cases import expected_pages_after_write, quantized_pages, random_batch
from support.numerics import assert_close, kernel_attention_tolerance
from support.pallas_run import interpret_params, races_found, run_kernel
from support.tiers import grid

D, HQ, HKV, PAGE = 256, 4, 1, 32  # page_size 32: the smallest both Pallas kernels take for 8 bits
WINDOW, CAP = 24, 2.0
# Live (context, q_len): a decode and a chunk both past the window, a fresh prefill of two
# pages, a decode whose kv_len ends a page.
SPECS = [(45, 1), (20, 13), (0, 2 * PAGE), (PAGE - 1, 1)]
# page dtype -> (stored dtype, q / K / V dtype the step computes in)
PAGE_DTYPES = {"float32": (jnp.float32, jnp.float32), "bfloat16": (jnp.bfloat16, jnp.bfloat16),
               "float16": (jnp.float16, jnp.float16), "int8": (jnp.int8, jnp.bfloat16),
               "fp8": (jnp.float8_e4m3fn, jnp.bfloat16)}
IMPLS = ("reference", "cpu", "pallas_tpu", "pallas_gpu")


def seed_of(*parts: object) -> int:
    return zlib.crc32(repr(parts).encode())


def dense_rows(pages: np.ndarray, batch) -> tuple[list[np.ndarray], list[np.ndarray]]:  # noqa: ANN001
    """Each live sequence's K / V [kv_len, Hkv, D] read back from float pages through its
    block table (the oracle's input for 8-bit pages: exactly the rows a reader dequantizes)."""
    tables, ks, vs = np.asarray(batch.md.block_tables), [], []
    for s, (ctx, n) in enumerate(batch.specs):
        pos = np.arange(ctx + n)
        rows = pages[tables[s, pos // PAGE], :, pos % PAGE]       # [kv_len, 2 Hkv, D]
        ks.append(rows[:, 0::2])
        vs.append(rows[:, 1::2])
    return ks, vs


def oracle(batch, sm_scale: float) -> list[np.ndarray]:  # noqa: ANN001
    """[q_len, Hq, D] float64 per live sequence (module docstring)."""
    outs = []
    for (ctx, n), q, k, v in zip(batch.specs, batch.seq_q, batch.seq_k, batch.seq_v):
        group = q.shape[1] // k.shape[1]
        k = np.repeat(k.astype(np.float64), group, axis=1)
        v = np.repeat(v.astype(np.float64), group, axis=1)
        s = np.einsum("qhd,khd->hqk", q.astype(np.float64), k) * sm_scale
        s = CAP * np.tanh(s / CAP)
        qpos, kpos = ctx + np.arange(n)[:, None], np.arange(ctx + n)[None, :]
        s = np.where(((kpos <= qpos) & (kpos > qpos - WINDOW))[None], s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        outs.append(np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), v))
    return outs


def attend(impl: str, q, kv, md, **opts):  # noqa: ANN001, ANN201
    if impl == "reference":
        return ragged_paged_attention_reference(q, kv, md, **opts)
    if impl == "cpu":
        if cpu_build.cpu_kernel_target() is None:
            pytest.skip("the CPU kernel could not be built here (see the log)")
        from jaxserve.kernels_pallas.cpu import ragged_paged_attention_cpu
        return ragged_paged_attention_cpu(q, kv, md, **opts)
    return run_kernel(impl, q, kv, md, interpret=interpret_params(impl), **opts)


# Default tier: the reference and the CPU kernel (cheap) in every page dtype, each Pallas
# kernel interpreted (2-20 s a case on 2 cores) in the page dtypes the existing kernel tests
# never read at head_dim 256: TPU float32, float16 and int8; GPU float16 and fp8 (its float32
# / bfloat16 head-256 pages are test_attention_gpu_geometry's). The rest with
# JAXSERVE_RUN_SLOW=1.
@pytest.mark.parametrize("impl,page_dtype", grid(
    [[(i, i) for i in IMPLS], [(d, d) for d in PAGE_DTYPES]],
    {f"{i}-{d}" for i in ("reference", "cpu") for d in PAGE_DTYPES}
    | {"pallas_tpu-float32", "pallas_tpu-float16", "pallas_tpu-int8", "pallas_gpu-float16",
       "pallas_gpu-fp8"},
    "the Pallas kernels' other head-256 page dtypes, interpreted"))
def test_head_dim_256_matches_float64_oracle(impl: str, page_dtype: str) -> None:
    stored, dtype = PAGE_DTYPES[page_dtype]
    rng = np.random.default_rng(seed_of("d256", impl, page_dtype))
    batch = random_batch(rng, SPECS, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D,
                         page_size=PAGE, dtype=jnp.dtype(dtype),
                         num_tokens=sum(n for _, n in SPECS) + 3, num_seqs=len(SPECS) + 2)
    if stored in (jnp.int8, jnp.float8_e4m3fn):
        kv = write_kv(quantized_pages(batch.kv_pages, stored), batch.k_new, batch.v_new,
                      batch.md.slot_mapping)
        ks, vs = dense_rows(np.asarray(dequantize(kv)), batch)
        # What the pages hold, for the oracle and the bound's magnitudes alike.
        batch = dataclasses.replace(batch, seq_k=tuple(ks), seq_v=tuple(vs))
    else:
        kv = write_kv(batch.kv_pages, batch.k_new, batch.v_new, batch.md.slot_mapping)
        np.testing.assert_array_equal(np.asarray(jnp.asarray(kv, jnp.float32)),
                                      expected_pages_after_write(batch))
    opts = dict(sm_scale=D ** -0.5, sliding_window=WINDOW, soft_cap=CAP)
    got = attend(impl, batch.q, kv, batch.md, **opts)
    assert got.shape == batch.q.shape and got.dtype == batch.q.dtype
    if impl.startswith("pallas"):
        assert not races_found(impl), "the interpreter reported a data race"
    got = np.asarray(jnp.asarray(got, jnp.float32))
    tol = kernel_attention_tolerance("cpu" if impl == "reference" else impl, batch,
                                     jnp.dtype(dtype).name, roundings=1, sides=1, **opts)
    cu = np.asarray(batch.md.cu_q_lens)
    for s, want in enumerate(oracle(batch, D ** -0.5)):
        assert_close(got[cu[s]:cu[s + 1]], want, atol=tol["atol"][cu[s]:cu[s + 1]],
                     rtol=tol["rtol"], err_msg=f"{impl} {page_dtype}: sequence {s} {SPECS[s]}")
    assert np.isfinite(got).all(), "padding rows must be finite too"
