"""The Mosaic GPU kernel on the geometries its planner used to refuse (issue #29 item 5).

The planner (kernels_pallas/gpu_plan.py) fits shared memory by shrinking the ring, then the
KV block down to 64 keys, reading blocks as slices of taller pages, with one staging block
for K then V on float32 / 8-bit pages. Here: ``smem_bytes`` is exactly what Mosaic GPU
allocates (the lowering's own count, read through its test hook), and the newly reachable
configurations -- float32 at head_dim 256 (one ring slot), blocks that are slices of 128-key
pages, with 16-bit, float32 and int8 pages, head dims 80 / 96 unpadded (narrower swizzles)
-- run in the GPU interpreter (races detected)
against the jnp reference, whose unused pages hold NaN (support.kernel_cases). The full
lowering grid is tests/kernels/test_attention_lowering_grid.py.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels_pallas import (AttentionMetadata, QuantizedKV, dequantize, gpu, gpu_plan,
                                     ragged_paged_attention_reference, write_kv)
from support.gpu_kernel_checks import MODES, check_against_reference, mode, written
from support.kernel_cases import quantized_pages, random_batch
from support.numerics import assert_close, kernel_attention_tolerance
from support.pallas_run import races_found

SDS = jax.ShapeDtypeStruct


def _abstract(d: int, ps: int, dtype: str, hq: int = 8, hkv: int = 2):
    i32 = lambda *s: SDS(s, jnp.int32)  # noqa: E731
    md = AttentionMetadata(i32(64), i32(8, 16), i32(8), i32(9), i32(1))
    shape = (129, 2 * hkv, ps, d)
    if dtype in ("int8", "float8_e4m3fn"):
        return SDS((64, hq, d), jnp.bfloat16), QuantizedKV(
            SDS(shape, jnp.dtype(dtype)), SDS(shape[:3], jnp.float32)), md
    return SDS((64, hq, d), jnp.dtype(dtype)), SDS(shape, jnp.dtype(dtype)), md


# (head_dim, page_size, dtype, num_splits): staged and unstaged pages, slices, split-KV.
SMEM_CASES = [(256, 32, "float32", 1), (256, 128, "float32", 2), (128, 16, "bfloat16", 1),
              (192, 64, "int8", 3), (64, 16, "bfloat16", 2), (256, 128, "float8_e4m3fn", 1)]


@pytest.mark.parametrize("d,ps,dtype,splits", SMEM_CASES,
                         ids=[f"d{c[0]}-ps{c[1]}-{c[2]}-s{c[3]}" for c in SMEM_CASES])
def test_smem_bytes_is_what_mosaic_gpu_allocates(monkeypatch: pytest.MonkeyPatch, d: int,
                                                 ps: int, dtype: str, splits: int) -> None:
    """Lowered for CUDA with Mosaic GPU's shared-memory bound set to 1 byte, the kernel fails
    with the lowering's own byte count, which must equal the planner's."""
    from jax.experimental.mosaic.gpu import core as mgpu_core
    if not hasattr(mgpu_core, "_SMEM_SIZE_BOUND"):
        pytest.skip("this jax's Mosaic GPU has no shared-memory bound hook")
    monkeypatch.setattr(mgpu_core, "_SMEM_SIZE_BOUND", 1)
    quantized = dtype in ("int8", "float8_e4m3fn")
    block_kv, stages = gpu_plan.default_tuning(d, ps, jnp.dtype(dtype), quantized=quantized)
    want = gpu_plan.smem_bytes(d, block_kv, stages, jnp.dtype(dtype), quantized=quantized,
                               num_splits=splits)
    assert want <= gpu_plan._SMEM_BUDGET
    fn = jax.jit(lambda q, p, m: gpu.ragged_paged_attention_gpu(q, p, m, sm_scale=0.1,
                                                                num_splits=splits))
    with pytest.raises(ValueError, match="exceeds available shared memory") as err:
        jax.export.export(fn, platforms=["cuda"])(*_abstract(d, ps, dtype))
    assert int(re.search(r"smem_bytes=(\d+)", str(err.value))[1]) == want


# --------------------------------------------------------------------------- interpreted
# Contexts over several 128-key pages, a prefill chunk crossing a page, decodes.
SLICE_SPECS = [(300, 1), (100, 40), (0, 1), (250, 2)]
_SLOW = pytest.mark.slow(reason="more interpreted GPU geometries (suite time)")


@MODES
def test_float32_head_dim_256_the_issue_case(interpret: bool) -> None:
    """The issue's case (float32 pages, head_dim 256, page_size 32) at the planner's default
    (64-key blocks of two pages, one ring slot, one staging block for K then V)."""
    assert gpu.default_tuning(256, 32, jnp.float32) == (64, 1)
    rng = np.random.default_rng(29)
    batch = random_batch(rng, [(90, 1), (20, 13), (0, 1)], num_q_heads=4, num_kv_heads=2,
                         head_dim=256, page_size=32, num_tokens=16, num_seqs=4)
    check_against_reference(batch, written(batch), interpret=interpret)


@pytest.mark.parametrize("dtype,tuning", [
    ("float32", {}),                                              # default: (64, 2)
    pytest.param("bfloat16", dict(block_kv=64, num_stages=3, num_splits=2), marks=_SLOW),
])
@MODES
def test_blocks_are_slices_of_taller_pages(dtype: str, tuning: dict, interpret: bool) -> None:
    """64-key blocks read as halves of 128-key pages (one TMA of the block's rows at its
    offset in the page), the ring wrapping, with a sliding window (masked blocks at both
    ends of a tile's range)."""
    if not tuning:
        assert gpu.default_tuning(128, 128, jnp.float32) == (64, 2)
    rng = np.random.default_rng(128)
    batch = random_batch(rng, SLICE_SPECS, num_q_heads=8, num_kv_heads=2, head_dim=128,
                         page_size=128, dtype=jnp.dtype(dtype), num_tokens=48, num_seqs=5)
    check_against_reference(batch, written(batch), window=150, interpret=interpret, **tuning)


@pytest.mark.parametrize("qname,d,ps,tuning", [
    ("int8", 64, 128, dict(block_kv=64)),           # the scales read as slices too
    pytest.param("float8_e4m3fn", 192, 32, {}, marks=_SLOW),     # 64-byte swizzled rows
])
@MODES
def test_8bit_pages_sliced_and_at_head_dim_192(qname: str, d: int, ps: int, tuning: dict,
                                               interpret: bool) -> None:
    """8-bit pages with their f32 scales on newly allowed geometries, against the float32
    reference on the dequantized pages (tolerance as in test_kv_quant: the kernel's bfloat16
    MMA operands, magnitudes from the float rows the pages were quantized from)."""
    rng = np.random.default_rng(8 + d)
    batch = random_batch(rng, [(200, 1), (100, 40)], num_q_heads=4, num_kv_heads=2,
                         head_dim=d, page_size=ps, num_tokens=48, num_seqs=3)
    kv = write_kv(quantized_pages(batch.kv_pages, jnp.dtype(qname)), batch.k_new,
                  batch.v_new, batch.md.slot_mapping)
    opts = dict(sm_scale=d ** -0.5)
    got = gpu.ragged_paged_attention_gpu(batch.q, kv, batch.md, interpret=mode(interpret),
                                         **opts, **tuning)
    assert not (interpret and races_found("pallas_gpu")), "the interpreter reported a data race"
    want = ragged_paged_attention_reference(batch.q, dequantize(kv), batch.md, **opts)
    live = int(np.asarray(batch.md.cu_q_lens)[len(batch.specs)])
    got = np.asarray(got, np.float32)
    assert_close(got[:live], np.asarray(want)[:live],
                 **kernel_attention_tolerance("pallas_gpu", batch, "float32", roundings=1,
                                              slack=1.1, **opts))
    assert np.isfinite(got).all() and not got[live:].any()


@pytest.mark.parametrize("d,dtype", [pytest.param(80, "bfloat16", marks=_SLOW),  # 32-byte
                                     pytest.param(96, "float32", marks=_SLOW)])  # 64-byte
@MODES
def test_head_dims_that_are_not_multiples_of_64(d: int, dtype: str, interpret: bool) -> None:
    """Pages of head_dim 80 / 96 as they are (no padding to 128): narrower swizzles."""
    rng = np.random.default_rng(d)
    batch = random_batch(rng, [(70, 1), (17, 12), (0, 1)], num_q_heads=8, num_kv_heads=2,
                         head_dim=d, page_size=16, dtype=jnp.dtype(dtype), num_tokens=16,
                         num_seqs=4)
    check_against_reference(batch, written(batch), interpret=interpret, cap=20.0)
