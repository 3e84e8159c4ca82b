"""Every kernel geometry a model can ask for, lowered for TPU and CUDA (issue #29 item 5).

The grid: head_dim {64, 80, 96, 128, 192, 256} x page dtype {float32, bfloat16, float16,
int8, float8_e4m3fn} x page_size {16, 32, 64, 128} x platform {tpu, cuda} = 240 cases, each
exported with ``jax.export`` (Pallas -> Mosaic TPU / Mosaic GPU, every trace-time check and,
for CUDA, Mosaic GPU's own shared-memory check, without a device). Each case either lowers
to the platform's kernel call or is refused by the kernel's contract with a ValueError naming
the value; which cases are refused, and why, is written out in ``expected_refusal``, so a new
refusal anywhere (or a refusal that stops holding) fails here. The contract the selector asks
(``kernel_refusal``) must agree with what lowering does. The GPU kernel takes head dims in
multiples of 16 (32 for 8-bit pages) at narrower swizzles; 8-bit pages at head_dim 80 are
refused and lower padded (``padded_head_dim``: 128, as the engine allocates them). Then
'auto': it falls back to the jnp reference with one warning per distinct reason where the
kernel cannot run, and a kernel named explicitly is an error giving the reason.

Default tier (``_default_ids``): the cheap refusals and 14 exports covering each head dim,
dtype and page size per platform; the rest with JAXSERVE_RUN_SLOW=1.
"""

from __future__ import annotations

import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels_pallas import (AttentionMetadata, KernelGeometry, QuantizedKV, gpu_plan,
                                     padded_head_dim, ragged_paged_attention,
                                     ragged_paged_attention_reference, selector, tpu_plan,
                                     write_kv)
from support.kernel_cases import quantized_pages, random_batch
from support.tiers import grid

SDS = jax.ShapeDtypeStruct
PLATFORMS = ("tpu", "cuda")
HEAD_DIMS = (64, 80, 96, 128, 192, 256)
DTYPES = ("float32", "bfloat16", "float16", "int8", "float8_e4m3fn")
PAGE_SIZES = (16, 32, 64, 128)
QUANTIZED = ("int8", "float8_e4m3fn")
KERNEL = {"tpu": "pallas_tpu", "cuda": "pallas_gpu"}
KERNEL_CALL = {"tpu": "tpu_custom_call", "cuda": "mosaic_gpu_v2"}
REFUSAL = {"tpu": tpu_plan.kernel_refusal, "cuda": gpu_plan.kernel_refusal}
HQ, HKV = 8, 2                        # GQA 4
TOKENS, SEQS, MAX_LEN = 64, 8, 512    # a mixed step: prefill chunks and decodes


def expected_refusal(platform: str, d: int, dtype: str, ps: int) -> str | None:
    """The regex the refusal must match, None where the kernel must lower. Why each holds
    is in the kernel's plan module (tpu_plan.check_page_alignment, gpu_plan's docstring)."""
    if platform == "cuda" and dtype in QUANTIZED and d % 32:   # 8-bit rows: no swizzle of
        return rf"head_dim={d}\b"             # 32 B or more divides 80 bytes (checked first:
                                              # padded, the case may still be refused)
    if dtype in QUANTIZED and ps == 16:       # TPU: 32-row sublane tiles of 8-bit values;
        return r"page_size[= ]16\b"           # GPU: 128-byte aligned scale copies
    return None


def abstract_step(d: int, dtype: str, ps: int) -> tuple:
    """(q, kv_pages, md) as ShapeDtypeStructs; q in bfloat16 over 8-bit pages."""
    i32 = lambda *s: SDS(s, jnp.int32)  # noqa: E731
    md = AttentionMetadata(i32(TOKENS), i32(SEQS, MAX_LEN // ps), i32(SEQS), i32(SEQS + 1),
                           i32(1))
    shape = (1 + SEQS * MAX_LEN // ps, 2 * HKV, ps, d)
    if dtype in QUANTIZED:
        kv = QuantizedKV(SDS(shape, jnp.dtype(dtype)), SDS(shape[:3], jnp.float32))
        return SDS((TOKENS, HQ, d), jnp.bfloat16), kv, md
    return SDS((TOKENS, HQ, d), jnp.dtype(dtype)), SDS(shape, jnp.dtype(dtype)), md


def export(platform: str, q: SDS, kv: object, md: AttentionMetadata) -> jax.export.Exported:
    d = q.shape[-1]
    fn = jax.jit(lambda q, kv, md: ragged_paged_attention(
        q, kv, md, sm_scale=d ** -0.5, sliding_window=200, soft_cap=30.0, impl=KERNEL[platform]))
    return jax.export.export(fn, platforms=[platform])(q, kv, md)


def _default_ids() -> set[str]:
    """Every refusal of 8-bit pages of 16 tokens (raised before lowering: instant), and per
    platform each head dim, page dtype and page size at least once, the issue's cases among
    them (float32 at head_dim 256: 64-key blocks of two pages, then slices of 128-key pages),
    8-bit rows at 192 (64-byte swizzle), 16-bit rows at 80 (32-byte) and 96 (64-byte)."""
    ids = {f"{p}-d{d}-{t}-ps16" for p in PLATFORMS for d in HEAD_DIMS for t in QUANTIZED}
    return ids | {
        "cuda-d256-float32-ps32", "cuda-d256-float32-ps128", "cuda-d192-int8-ps32",
        "cuda-d80-bfloat16-ps64", "cuda-d96-float16-ps16", "cuda-d128-float8_e4m3fn-ps128",
        "cuda-d64-float32-ps16", "cuda-d80-int8-ps64",       # refused as pages, lowers padded
        "tpu-d80-float32-ps32", "tpu-d96-bfloat16-ps64", "tpu-d192-float16-ps128",
        "tpu-d64-int8-ps32", "tpu-d256-float8_e4m3fn-ps64", "tpu-d128-bfloat16-ps16"}


GRID = grid([[(p, p) for p in PLATFORMS], [(f"d{d}", d) for d in HEAD_DIMS],
             [(t, t) for t in DTYPES], [(f"ps{ps}", ps) for ps in PAGE_SIZES]],
            _default_ids(), "the rest of the 240-case lowering grid")


@pytest.mark.parametrize("platform,d,dtype,ps", GRID)
def test_kernel_lowers_or_is_refused_by_its_contract(platform: str, d: int, dtype: str,
                                                     ps: int) -> None:
    want = expected_refusal(platform, d, dtype, ps)
    reason = REFUSAL[platform](KernelGeometry(d, ps, jnp.dtype(dtype), HQ // HKV))
    assert (reason is None) == (want is None), reason
    if want is not None:
        assert re.search(want, reason), reason
        with pytest.raises(ValueError, match=want):
            export(platform, *abstract_step(d, dtype, ps))
        if "head_dim" not in want:
            return
        # What the engine allocates for this kernel: the model's head dim under padded pages.
        q, kv, md = abstract_step(padded_head_dim(d), dtype, ps)
        q = SDS((*q.shape[:2], d), q.dtype)
        rest = expected_refusal(platform, padded_head_dim(d), dtype, ps)
        if rest is not None:
            with pytest.raises(ValueError, match=rest):
                export(platform, q, kv, md)
            return
        exported = export(platform, q, kv, md)
    else:
        exported = export(platform, *abstract_step(d, dtype, ps))
    calls = re.findall(r"custom_call @(\w+)", exported.mlir_module())
    assert KERNEL_CALL[platform] in calls, calls


# --------------------------------------------------------------------------- 'auto'
@pytest.fixture
def fresh_warnings():
    """select_impl's one-warning-per-reason cache, emptied around the test."""
    selector._warn_fallback.cache_clear()
    yield
    selector._warn_fallback.cache_clear()


def _fallbacks(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "cannot run this geometry" in r.getMessage()]


def test_auto_falls_back_once_per_reason(fresh_warnings, caplog) -> None:
    int8_16 = KernelGeometry(128, 16, jnp.dtype(jnp.int8), 4)
    with caplog.at_level(logging.WARNING, logger=selector.__name__):
        for _ in range(3):      # e.g. every layer, every engine of a pool: one warning
            assert selector.select_impl("auto", "cuda", geometry=int8_16) == "reference"
        assert selector.select_impl("auto", "tpu", geometry=int8_16) == "reference"
        assert selector.select_impl("auto", "cuda",
                                    geometry=KernelGeometry(80, 32, jnp.int8)) == "reference"
        # What the kernels run: no fallback, no warning.
        assert selector.select_impl("auto", "cuda",
                                    geometry=KernelGeometry(256, 32, jnp.float32)) == "pallas_gpu"
        assert selector.select_impl("auto", "tpu",
                                    geometry=KernelGeometry(80, 16, jnp.bfloat16)) == "pallas_tpu"
    got = _fallbacks(caplog)
    assert len(got) == 3, got
    assert "pallas_gpu" in got[0] and "page_size=16" in got[0]
    assert "pallas_tpu" in got[1] and "page_size 16" in got[1]
    assert "pallas_gpu" in got[2] and "head_dim=80" in got[2]


def test_a_named_kernel_is_refused_with_the_reason() -> None:
    geometry = KernelGeometry(128, 16, jnp.dtype(jnp.float8_e4m3fn), 4)
    for name, platform in (("pallas_gpu", "cuda"), ("pallas_tpu", "tpu")):
        with pytest.raises(ValueError, match=rf"'{name}'.*page_size[= ]16"):
            selector.select_impl(name, platform, geometry=geometry)
    with pytest.raises(ValueError, match=r"'pallas_gpu'.*query heads per kv head"):
        selector.select_impl("pallas_gpu", "cuda",
                             geometry=KernelGeometry(128, 16, jnp.bfloat16, 128))


def test_auto_attention_call_falls_back_to_the_reference(monkeypatch, fresh_warnings,
                                                          caplog) -> None:
    """On a (faked) Hopper host, ragged_paged_attention(impl='auto') over int8 pages of 16
    tokens runs the reference, warning once for both calls, with the reference's result."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(selector, "_gpu_kernel_supported", lambda: True)
    monkeypatch.setattr(selector, "_ptxas_unsafe", lambda: False)
    rng = np.random.default_rng(16)
    batch = random_batch(rng, [(20, 1), (3, 5)], num_q_heads=4, num_kv_heads=2, head_dim=64,
                         page_size=16)
    kv = write_kv(quantized_pages(batch.kv_pages, jnp.int8), batch.k_new, batch.v_new,
                  batch.md.slot_mapping)
    with caplog.at_level(logging.WARNING, logger=selector.__name__):
        outs = [ragged_paged_attention(batch.q, kv, batch.md, sm_scale=0.125, impl="auto")
                for _ in range(2)]
    want = ragged_paged_attention_reference(batch.q, kv, batch.md, sm_scale=0.125)
    live = sum(n for _, n in batch.specs)
    for got in outs:
        np.testing.assert_array_equal(np.asarray(got)[:live], np.asarray(want)[:live])
    got = _fallbacks(caplog)
    assert len(got) == 1 and "page_size=16" in got[0], got


@pytest.mark.parametrize("q_shape,pages_shape,match", [
    ((8, 4, 64), (5, 4, 16), r"kv_pages must be \[num_pages"),
    ((8, 64), (5, 4, 16, 64), r"q must be \[T, Hq, D\]"),
])
def test_auto_with_malformed_shapes_names_them(q_shape, pages_shape, match) -> None:
    """'auto' reads the geometry off the inputs; shapes that have none still get the
    implementation's own error naming them, not an IndexError."""
    i32 = lambda *s: SDS(s, jnp.int32)  # noqa: E731
    md = AttentionMetadata(i32(8), i32(3, 4), i32(3), i32(4), i32(1))
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(lambda q, p, m: ragged_paged_attention(q, p, m, sm_scale=1.0),
                       SDS(q_shape, jnp.float32), SDS(pages_shape, jnp.float32), md)
