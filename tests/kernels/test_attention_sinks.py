"""Attention sinks (gpt-oss) in every ragged paged attention implementation.

Oracle: a dense numpy softmax per live sequence whose denominator has one extra logit per
query head (the sink) with no value -- transformers' eager gpt-oss attention written out
(concatenate the sink column, softmax, drop it). Every implementation runs on the same seeded
ragged batches (NaN in unowned pages and unused slots, padding tokens and sequences): the jnp
reference and the C++ CPU kernel compiled (decode rows, tall prefill tiles, a long decode whose
key range the kernel splits over threads and merges), the TPU and GPU Pallas kernels in their
interpreters (GPU: with and without split-KV), each with and without a sliding window; sinks
large and small against the logits so both the sink-dominated and the key-dominated rows
show. Also: None leaves every implementation as it was, a wrongly shaped sinks array is a
ValueError naming it, and the kernels with sinks export for TPU and CUDA from this host.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels_pallas import (AttentionMetadata, ragged_paged_attention,
                                     ragged_paged_attention_reference, write_kv,
                                     write_kv_and_attend)
from jaxserve.kernels_pallas import cpu_build
from support.kernel_cases import random_batch
from support.pallas_run import interpret_params, races_found, run_kernel

_SLOW = pytest.mark.slow(reason="more attention-sink cases (the default tier keeps one each)")

SDS = jax.ShapeDtypeStruct
HQ, HKV, D = 8, 2, 64
SCALE = D ** -0.5
# Mixed prefill chunks (one starting mid-page), decodes, a chunk taller than the CPU kernel's
# direct rows; padding tokens and a padding sequence.
SPECS = [(0, 7), (13, 1), (30, 9), (5, 1)]


def dense_with_sinks(batch, sinks: np.ndarray, window: int | None) -> np.ndarray:
    """f32[live tokens, Hq, D]: softmax over [keys..., sink] per row, the sink's weight
    dropped (transformers' eager gpt-oss attention)."""
    outs = []
    for (ctx, n), q, k, v in zip(batch.specs, batch.seq_q, batch.seq_k, batch.seq_v):
        g = q.shape[1] // k.shape[1]
        k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
        s = np.einsum("thd,shd->hts", q, k).astype(np.float64) * SCALE
        qpos, kpos = ctx + np.arange(n), np.arange(ctx + n)
        mask = kpos[None, :] <= qpos[:, None]
        if window is not None:
            mask &= kpos[None, :] > qpos[:, None] - window
        s = np.where(mask[None], s, -np.inf)
        col = np.broadcast_to(sinks.astype(np.float64)[:, None, None], (q.shape[1], n, 1))
        full = np.concatenate([s, col], axis=-1)
        p = np.exp(full - full.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        outs.append(np.einsum("hts,shd->thd", p[..., :-1], v))
    return np.concatenate(outs).astype(np.float32)


def case(seed: int, specs=SPECS, dtype=jnp.float32, extra_tokens: int = 3):
    rng = np.random.default_rng(seed)
    batch = random_batch(rng, specs, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D,
                         page_size=16, dtype=dtype,
                         num_tokens=sum(n for _, n in specs) + extra_tokens,
                         num_seqs=len(specs) + 1)
    # Sinks from well below to well above the logits' range (|s| ~ 1 here).
    sinks = np.array([-3.0, -1.0, 0.0, 0.5, 1.0, 2.0, 4.0, 8.0], np.float32)[rng.permutation(HQ)]
    pages = write_kv(batch.kv_pages, batch.k_new, batch.v_new, batch.md.slot_mapping)
    return batch, jnp.asarray(sinks), pages


def check(got: jax.Array, batch, sinks: jax.Array, window: int | None, tol: float) -> None:
    want = dense_with_sinks(batch, np.asarray(sinks), window)
    got = np.asarray(jnp.asarray(got, jnp.float32))
    live = want.shape[0]
    np.testing.assert_allclose(got[:live], want, atol=tol, rtol=tol)
    np.testing.assert_array_equal(got[live:], 0.0, err_msg="padding tokens must be zeros")


@pytest.mark.parametrize("window", [pytest.param(None, marks=_SLOW), 5])
def test_reference_with_sinks_matches_the_dense_oracle(window: int | None) -> None:
    batch, sinks, pages = case(1)
    got = ragged_paged_attention_reference(batch.q, pages, batch.md, sm_scale=SCALE,
                                           sliding_window=window, sinks=sinks)
    check(got, batch, sinks, window, 2e-5)
    # The oracle can fail: without the sinks the same call is far off.
    plain = ragged_paged_attention_reference(batch.q, pages, batch.md, sm_scale=SCALE,
                                             sliding_window=window)
    with pytest.raises(AssertionError):
        check(plain, batch, sinks, window, 2e-5)


needs_cpu_kernel = pytest.mark.skipif(cpu_build.cpu_kernel_target() is None,
                                      reason="the CPU kernel could not be built here")


@needs_cpu_kernel
@pytest.mark.parametrize("specs,window", [
    (SPECS, 5), pytest.param(SPECS, None, marks=_SLOW), ([(3000, 1)], None),
    pytest.param([(3000, 1)], 100, marks=_SLOW)],
    ids=["mixed-window", "mixed", "long-decode-split", "long-decode-split-window"])
def test_cpu_kernel_with_sinks(specs: list, window: int | None) -> None:
    """Compiled: decode rows, tall tiles, and a lone long decode whose key range the kernel
    splits over threads (the sink folds in after the merge); also through the fused write."""
    batch, sinks, pages = case(2, specs)
    got = ragged_paged_attention(batch.q, pages, batch.md, sm_scale=SCALE,
                                 sliding_window=window, impl="cpu", sinks=sinks)
    check(got, batch, sinks, window, 1e-4)
    fused, fused_pages = write_kv_and_attend(batch.q, batch.k_new, batch.v_new, batch.kv_pages,
                                             batch.md, sm_scale=SCALE, sliding_window=window,
                                             impl="cpu", sinks=sinks)
    check(fused, batch, sinks, window, 1e-4)
    np.testing.assert_array_equal(np.asarray(fused_pages)[batch.owned_pages],
                                  np.asarray(pages)[batch.owned_pages])


@pytest.mark.parametrize("impl", ["reference", pytest.param("cpu", marks=_SLOW)])
def test_no_sinks_is_unchanged_and_bad_sinks_are_refused(impl: str) -> None:
    if impl == "cpu" and cpu_build.cpu_kernel_target() is None:
        pytest.skip("the CPU kernel could not be built here")
    batch, _, pages = case(3)
    a = ragged_paged_attention(batch.q, pages, batch.md, sm_scale=SCALE, impl=impl)
    b = ragged_paged_attention(batch.q, pages, batch.md, sm_scale=SCALE, impl=impl, sinks=None)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for bad in (jnp.zeros((HQ + 1,), jnp.float32), jnp.zeros((HQ,), jnp.bfloat16)):
        with pytest.raises(ValueError, match="sinks must be float32"):
            ragged_paged_attention(batch.q, pages, batch.md, sm_scale=SCALE, impl=impl,
                                   sinks=bad)


@pytest.mark.parametrize("impl,window,extra", [
    pytest.param("pallas_tpu", None, {}, marks=_SLOW), ("pallas_tpu", 5, {}),
    pytest.param("pallas_gpu", None, {}, marks=_SLOW), ("pallas_gpu", 5, {"num_splits": 3})])
def test_pallas_kernels_with_sinks_interpreted(impl: str, window: int | None,
                                               extra: dict) -> None:
    """Each Pallas kernel in its interpreter (races detected), small blocks so sequences
    cross several KV blocks; the GPU kernel also under split-KV, where the sinks join the
    merge of the splits. GPU tolerance: it rounds q, K, V and p to bfloat16 for WGMMA."""
    batch, sinks, pages = case(4)
    got = run_kernel(impl, batch.q, pages, batch.md, sm_scale=SCALE, sliding_window=window,
                     sinks=sinks, interpret=interpret_params(impl), **extra)
    check(got, batch, sinks, window, 2e-5 if impl == "pallas_tpu" else 3e-2)
    assert not races_found(impl)


@pytest.mark.parametrize("platform,impl", [("tpu", "pallas_tpu"), ("cuda", "pallas_gpu")])
def test_kernels_with_sinks_export(platform: str, impl: str) -> None:
    """jax.export (Pallas -> Mosaic lowering, every trace-time check) of the kernel with
    sinks and a window for each accelerator, from this CPU host."""
    i32 = lambda *s: SDS(s, jnp.int32)  # noqa: E731
    tokens, seqs, pages_per_seq, ps, d = 32, 4, 8, 16, 128
    md = AttentionMetadata(i32(tokens), i32(seqs, pages_per_seq), i32(seqs), i32(seqs + 1),
                           i32(1))
    fn = jax.jit(lambda q, kv, md, sinks: ragged_paged_attention(
        q, kv, md, sm_scale=d ** -0.5, sliding_window=128, impl=impl, sinks=sinks))
    exported = jax.export.export(fn, platforms=[platform])(
        SDS((tokens, HQ, d), jnp.bfloat16),
        SDS((1 + seqs * pages_per_seq, 2 * HKV, ps, d), jnp.bfloat16), md,
        SDS((HQ,), jnp.float32))
    text = exported.mlir_module()
    assert {"tpu": "tpu_custom_call", "cuda": "mosaic_gpu"}[platform] in text
