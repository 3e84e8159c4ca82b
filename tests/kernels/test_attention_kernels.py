"""Both Pallas kernels against the jnp reference on randomized ragged batches.

Every case draws a fresh seeded batch of its kind -- pure decode, pure prefill, mixed
(chunks starting mid-page and ending exactly on a page boundary, kv_len a multiple of the
page size), a lone q_len-1 sequence -- over page sizes 16/32/64, GQA ratios 1/2/4/8, head
dims 64/128 and float32/bfloat16. Pages nobody owns, the trash page and the unused tails of
owned pages hold NaN, so any stray read shows. write_kv's result is checked bit-exactly
before the kernel reads it.

``interpret=True`` runs on CPU in each backend's interpreter (TPU: DMA semaphores simulated,
scratch NaN-filled; GPU: TMA, barriers and SMEM simulated), with race detection on. The same
cases run compiled when a matching device is present (``device`` marker).

Tolerances (abs = rel), against the float32-accumulating reference:
  float32 TPU interpreted 2e-5; float32 TPU on device 1e-2 (the MXU may take bf16 passes);
  float32 GPU 3e-2 (the kernel rounds K, V, q and p to bfloat16 for WGMMA, by design);
  bfloat16 3e-2 (outputs and p are bfloat16: spacing 7.8e-3 near 1).
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels_pallas import ragged_paged_attention_reference, write_kv
from support.kernel_cases import (CASE_IDS, CASES, INTERPRET_BY_DEFAULT, draw_specs,
                                  expected_pages_after_write, random_batch)
from support.numerics import assert_close, kernel_attention_tolerance
from support.pallas_run import interpret_params, races_found, run_kernel


_SLOW_INTERPRETED = pytest.mark.slow(reason="more interpreted kernel cases")


def case_params() -> list:
    """(case, interpret): each case interpreted (slow unless in INTERPRET_BY_DEFAULT) and
    compiled on its device."""
    return [p for case, cid in zip(CASES, CASE_IDS) for p in (
        pytest.param(case, True, id=f"{cid}-interpret",
                     marks=() if cid in INTERPRET_BY_DEFAULT else _SLOW_INTERPRETED),
        pytest.param(case, False, id=f"{cid}-device", marks=pytest.mark.device))]


def tolerance(impl: str, batch, dtype: str, interpret: bool, **opts) -> dict:  # noqa: ANN001
    """atol / rtol of `impl` against the reference (both outputs in q's dtype): what each
    kernel rounds besides float32 arithmetic, support.numerics.kernel_attention_tolerance."""
    return kernel_attention_tolerance(impl, batch, dtype, interpret=interpret, roundings=2,
                                      **opts)


def skip_unless_platform(impl: str, interpret: bool) -> None:
    want = "tpu" if impl == "pallas_tpu" else "gpu"
    if not interpret and jax.default_backend() != want:
        pytest.skip(f"{impl} compiled needs a {want.upper()}; this is {jax.default_backend()}")


@pytest.mark.parametrize("case,interpret", case_params())
@pytest.mark.parametrize("impl", ["pallas_tpu", "pallas_gpu"])
def test_kernel_matches_reference(impl: str, case: tuple, interpret: bool) -> None:
    skip_unless_platform(impl, interpret)
    kind, ps, hq, hkv, d, dtype, window, cap = case
    rng = np.random.default_rng(zlib.crc32(repr(case).encode()))
    specs = draw_specs(kind, rng, ps)
    batch = random_batch(rng, specs, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                         page_size=ps, dtype=jnp.dtype(dtype),
                         num_tokens=sum(n for _, n in specs) + int(rng.integers(0, 4)),
                         num_seqs=len(specs) + int(rng.integers(0, 3)))
    expected_pages = expected_pages_after_write(batch)
    pages = write_kv(batch.kv_pages, batch.k_new, batch.v_new, batch.md.slot_mapping)
    np.testing.assert_array_equal(np.asarray(jnp.asarray(pages, jnp.float32)), expected_pages)

    opts = dict(sm_scale=d ** -0.5, sliding_window=window, soft_cap=cap)
    want = np.asarray(ragged_paged_attention_reference(batch.q, pages, batch.md, **opts),
                      np.float32)
    got = run_kernel(impl, batch.q, pages, batch.md,
                     interpret=interpret_params(impl) if interpret else False, **opts)
    assert got.shape == batch.q.shape and got.dtype == batch.q.dtype
    got = np.asarray(jnp.asarray(got, jnp.float32))
    if interpret:
        assert not races_found(impl), "the interpreter reported a data race"
    live = int(np.asarray(batch.md.cu_q_lens)[len(specs)])
    assert_close(got[:live], want[:live],
                               **tolerance(impl, batch, dtype, interpret, **opts),
                               err_msg=f"{impl} on {specs}")
    assert np.isfinite(got).all(), "padding rows must be finite (zeros) too"


@pytest.mark.parametrize("impl", ["pallas_tpu", "pallas_gpu"])
def test_kernel_head_dim_through_padding(impl: str) -> None:
    """D=80 heads stored in D=128 pages (padded_head_dim): the wrapper pads q, slices out."""
    rng = np.random.default_rng(80)
    batch = random_batch(rng, [(21, 3), (40, 1)], num_q_heads=4, num_kv_heads=2, head_dim=80,
                         page_size=16, num_tokens=6, num_seqs=3)
    pages = jnp.pad(batch.kv_pages, ((0, 0), (0, 0), (0, 0), (0, 48)))
    pages = write_kv(pages, batch.k_new, batch.v_new, batch.md.slot_mapping)
    want = ragged_paged_attention_reference(batch.q, pages, batch.md, sm_scale=80 ** -0.5)
    got = run_kernel(impl, batch.q, pages, batch.md, sm_scale=80 ** -0.5,
                     interpret=interpret_params(impl))
    assert got.shape == batch.q.shape
    assert_close(np.asarray(got)[:4], np.asarray(want)[:4],
                               **tolerance(impl, batch, "float32", True, sm_scale=80 ** -0.5))


@pytest.mark.parametrize("impl", ["pallas_tpu", "pallas_gpu"])
def test_kernel_rejects_bad_shapes(impl: str) -> None:
    q = jax.ShapeDtypeStruct((8, 3, 64), jnp.bfloat16)
    pages = jax.ShapeDtypeStruct((5, 4, 16, 64), jnp.bfloat16)
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    from jaxserve.kernels_pallas import AttentionMetadata
    md = AttentionMetadata(i32(8), i32(3, 4), i32(3), i32(4), i32(1))
    with pytest.raises(ValueError, match=r"q heads 3 .*\(8, 3, 64\)"):
        jax.eval_shape(lambda q, p, m: run_kernel(impl, q, p, m, sm_scale=1.0), q, pages, md)


def test_gpu_kernel_rejects_unsupported_head_dim() -> None:
    from jaxserve.kernels_pallas import AttentionMetadata
    from jaxserve.kernels_pallas.gpu import ragged_paged_attention_gpu
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    md = AttentionMetadata(i32(8), i32(3, 4), i32(3), i32(4), i32(1))
    q = jax.ShapeDtypeStruct((8, 4, 72), jnp.bfloat16)   # 144-byte rows: no swizzle divides
    pages = jax.ShapeDtypeStruct((5, 4, 16, 72), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"\(5, 4, 16, 72\): head_dim must be a multiple of 16"):
        jax.eval_shape(lambda q, p, m: ragged_paged_attention_gpu(q, p, m, sm_scale=1.0),
                       q, pages, md)


def _abstract_inputs(t: int, s: int, hq: int, hkv: int, d: int, ps: int, dtype: str):
    from jaxserve.kernels_pallas import AttentionMetadata
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    md = AttentionMetadata(i32(t), i32(s, 4096 // ps), i32(s), i32(s + 1), i32(1))
    return (jax.ShapeDtypeStruct((t, hq, d), jnp.dtype(dtype)),
            jax.ShapeDtypeStruct((1 + s * 4096 // ps, 2 * hkv, ps, d), jnp.dtype(dtype)), md)


# (T, S, Hq, Hkv, D, page_size, dtype, sliding_window, soft_cap): the device paths of both
# kernels -- WGMMA, register layouts, Mosaic TPU ops -- lowered without a device.
LOWERINGS = [
    (64, 64, 32, 8, 128, 16, "bfloat16", None, None),
    (512, 4, 32, 8, 128, 64, "bfloat16", 128, 30.0),
    (48, 8, 12, 4, 64, 32, "float32", None, None),
    (32, 8, 8, 8, 256, 16, "float16", None, 5.0),
]


@pytest.mark.parametrize("case", LOWERINGS, ids=[f"lower{i}" for i in range(len(LOWERINGS))])
@pytest.mark.parametrize("impl", ["pallas_tpu", "pallas_gpu"])
def test_kernel_lowers_for_its_device(impl: str, case: tuple) -> None:
    """Pallas -> Mosaic (TPU) / Mosaic GPU lowering runs on any host and catches unsupported
    ops, layouts and shared-memory overflow; only the device compiler stays unchecked."""
    *shape, window, cap = case
    platform = "tpu" if impl == "pallas_tpu" else "cuda"
    fn = jax.jit(lambda q, p, m: run_kernel(impl, q, p, m, tuned=False, sm_scale=0.1,
                                            sliding_window=window, soft_cap=cap))
    text = fn.trace(*_abstract_inputs(*shape)).lower(lowering_platforms=(platform,)).as_text()
    assert ("tpu_custom_call" if impl == "pallas_tpu" else "mosaic_gpu") in text
