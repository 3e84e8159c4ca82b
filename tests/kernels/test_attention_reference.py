"""The jnp reference and write_kv against an independent oracle, plus the shared contract.

Oracle: per-sequence float64 numpy softmax attention over the dense, unpaged K/V the batch
generator kept (no pages, no tiles, no online softmax). Batches are random and seeded; every
page slot no live sequence owns is NaN, so a stray read turns the output NaN. Tolerances
(support.numerics): the reference's own float32 error against the exact oracle, elementwise
(attention_atol with sides=1: head_dim, context length, the scores' and the output's
magnitudes; ~5e-5 - 3e-4 here); bfloat16 inputs add the output's one rounding to bfloat16,
2^-8 relative (the oracle reads the same bfloat16 values, widened exactly).
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels_pallas import (AttentionMetadata, ragged_paged_attention,
                                     ragged_paged_attention_reference, select_impl, write_kv)
from support.kernel_cases import expected_pages_after_write, random_batch
from support.numerics import assert_close, attention_atol, rounding_rtol
from support.tiers import grid



def tolerance(batch, dtype, **opts) -> dict:
    """atol / rtol of the reference against the float64 oracle (module docstring)."""
    return {"atol": attention_atol(batch, sides=1, **opts),
            "rtol": 0.0 if jnp.dtype(dtype) == jnp.float32 else rounding_rtol(dtype, 1)}


def oracle(batch, sm_scale: float, sliding_window: int | None = None,
           soft_cap: float | None = None) -> list[np.ndarray]:
    """[q_len, Hq, D] float64 per live sequence, straight from the definition."""
    outs = []
    for (ctx, n), q, k, v in zip(batch.specs, batch.seq_q, batch.seq_k, batch.seq_v):
        group = q.shape[1] // k.shape[1]
        k = np.repeat(k.astype(np.float64), group, axis=1)
        v = np.repeat(v.astype(np.float64), group, axis=1)
        s = np.einsum("qhd,khd->hqk", q.astype(np.float64), k[:, :, : q.shape[2]]) * sm_scale
        if soft_cap is not None:
            s = soft_cap * np.tanh(s / soft_cap)
        qpos = ctx + np.arange(n)[:, None]
        kpos = np.arange(ctx + n)[None, :]
        allowed = kpos <= qpos
        if sliding_window is not None:
            allowed &= kpos > qpos - sliding_window
        s = np.where(allowed[None], s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        outs.append(np.einsum("hqk,khd->qhd", p, v[:, :, : q.shape[2]]))
    return outs


def check_against_oracle(out: jax.Array, batch, expected: list[np.ndarray], tol: dict) -> None:
    out = np.asarray(jnp.asarray(out, jnp.float32))
    cu = np.asarray(batch.md.cu_q_lens)
    for s, exp in enumerate(expected):   # tol["atol"]: [live tokens, Hq, D], sequence order
        assert_close(out[cu[s]:cu[s + 1]], exp, atol=tol["atol"][cu[s]:cu[s + 1]],
                                   rtol=tol["rtol"], err_msg=f"sequence {s} of {batch.specs}")
    # Padding tokens: zeros, in particular never NaN.
    np.testing.assert_array_equal(out[cu[len(expected)]:], 0.0)


def seed_of(*parts: object) -> int:
    """Stable across processes (unlike hash() of a str)."""
    return zlib.crc32(repr(parts).encode())


def make(seed: int, specs, *, hq: int = 4, hkv: int = 2, d: int = 64, ps: int = 16,
         dtype=jnp.float32, pad_tokens: int = 3, pad_seqs: int = 2):
    rng = np.random.default_rng(seed)
    return random_batch(rng, specs, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                        page_size=ps, dtype=dtype,
                        num_tokens=sum(n for _, n in specs) + pad_tokens,
                        num_seqs=len(specs) + pad_seqs)


CASES = {
    # name: (specs [(context, q_len)], Hq, Hkv, D, page_size)
    "decode": ([(5, 1), (31, 1), (32, 1), (0, 1), (63, 1)], 8, 8, 64, 16),
    "prefill": ([(0, 17), (0, 32), (0, 5)], 8, 2, 128, 16),
    "mixed_mid_page_chunks": ([(7, 9), (40, 1), (13, 51), (64, 1)], 16, 2, 64, 32),
    "q_len_1_single": ([(100, 1)], 8, 1, 128, 64),
    "kv_len_page_multiple": ([(48, 16), (0, 64), (127, 1)], 4, 4, 64, 64),
}


# Default tier: each case in one dtype, alternating (f32 and bf16 both covered); the other
# dtype with JAXSERVE_RUN_SLOW=1.
@pytest.mark.parametrize("name,dtype", grid(
    [[(n, n) for n in sorted(CASES)], [("f32", jnp.float32), ("bf16", jnp.bfloat16)]],
    {f"{n}-{('f32', 'bf16')[i % 2]}" for i, n in enumerate(sorted(CASES))},
    "each case in the other dtype"))
def test_reference_matches_oracle(name: str, dtype) -> None:
    specs, hq, hkv, d, ps = CASES[name]
    batch = make(seed_of(name, jnp.dtype(dtype).name), specs, hq=hq, hkv=hkv, d=d, ps=ps,
                 dtype=dtype)
    pages = write_kv(batch.kv_pages, batch.k_new, batch.v_new, batch.md.slot_mapping)
    scale = d ** -0.5
    out = ragged_paged_attention_reference(batch.q, pages, batch.md, sm_scale=scale)
    assert out.shape == batch.q.shape and out.dtype == batch.q.dtype
    check_against_oracle(out, batch, oracle(batch, scale),
                         tolerance(batch, dtype, sm_scale=scale))


@pytest.mark.parametrize("window,cap", [(5, None), (None, 3.0), (17, 8.0)])
def test_reference_sliding_window_and_soft_cap(window, cap) -> None:
    batch = make(11, [(30, 6), (3, 1), (0, 20)], hq=8, hkv=4, d=64, ps=16)
    pages = write_kv(batch.kv_pages, batch.k_new, batch.v_new, batch.md.slot_mapping)
    out = ragged_paged_attention_reference(batch.q, pages, batch.md, sm_scale=0.3,
                                           sliding_window=window, soft_cap=cap)
    check_against_oracle(out, batch, oracle(batch, 0.3, window, cap),
                         tolerance(batch, jnp.float32, sm_scale=0.3,
                                   sliding_window=window, soft_cap=cap))


@pytest.mark.parametrize("tile_tokens", [1, 4, 64])
def test_reference_tile_size_does_not_matter(tile_tokens: int) -> None:
    batch = make(5, [(9, 13), (0, 1), (16, 16)], hq=4, hkv=2, d=64, ps=16)
    pages = write_kv(batch.kv_pages, batch.k_new, batch.v_new, batch.md.slot_mapping)
    out = ragged_paged_attention_reference(batch.q, pages, batch.md, sm_scale=0.125,
                                           tile_tokens=tile_tokens)
    check_against_oracle(out, batch, oracle(batch, 0.125),
                         tolerance(batch, jnp.float32, sm_scale=0.125))


def test_head_dim_through_padding() -> None:
    """D=80 heads in D=128 pages: K/V and q zero-padded, output sliced back to 80."""
    batch = make(3, [(20, 3), (5, 1)], hq=4, hkv=2, d=80, ps=16)
    pages = jnp.pad(batch.kv_pages, ((0, 0), (0, 0), (0, 0), (0, 48)))
    pages = write_kv(pages, batch.k_new, batch.v_new, batch.md.slot_mapping)
    out = ragged_paged_attention(batch.q, pages, batch.md, sm_scale=80 ** -0.5, impl="reference")
    assert out.shape == batch.q.shape
    check_against_oracle(out, batch, oracle(batch, 80 ** -0.5),
                         tolerance(batch, jnp.float32, sm_scale=80 ** -0.5))


def test_no_live_sequences_gives_zeros() -> None:
    batch = make(4, [(3, 2)], hq=4, hkv=2, d=64, ps=16)
    md = AttentionMetadata(batch.md.slot_mapping, batch.md.block_tables, batch.md.kv_lens * 0,
                           batch.md.cu_q_lens * 0, jnp.zeros((1,), jnp.int32))
    pages = jnp.nan_to_num(batch.kv_pages)
    out = ragged_paged_attention_reference(jnp.nan_to_num(batch.q), pages, md, sm_scale=1.0)
    np.testing.assert_array_equal(np.asarray(out), 0.0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_write_kv_exact_and_foreign_pages_untouched(dtype) -> None:
    batch = make(7, [(13, 5), (0, 16), (31, 1)], hq=4, hkv=2, d=64, ps=16, dtype=dtype)
    before = np.array(jnp.asarray(batch.kv_pages, jnp.float32))
    expected = expected_pages_after_write(batch)     # before the pages are donated
    out = jax.jit(write_kv, donate_argnums=0)(batch.kv_pages, batch.k_new, batch.v_new,
                                               batch.md.slot_mapping)
    assert out.dtype == dtype
    got = np.asarray(jnp.asarray(out, jnp.float32))
    assert batch.kv_pages.is_deleted()               # donated: XLA wrote in place
    np.testing.assert_array_equal(got, expected)                             # bit-exact
    foreign = np.setdiff1d(np.arange(1, got.shape[0]), batch.owned_pages)
    assert foreign.size > 0
    np.testing.assert_array_equal(got[foreign], before[foreign])             # still all NaN


def test_write_kv_drops_out_of_range_slots() -> None:
    pages = jnp.zeros((3, 4, 16, 64), jnp.float32)
    k = jnp.ones((3, 2, 64), jnp.float32)
    out = write_kv(pages, k, k, jnp.array([-1, 3 * 16, 17], jnp.int32))
    assert float(out.sum()) == 4 * 64         # only slot 17 (page 1, offset 1) was written


def _md(t: int = 8, s: int = 3, p: int = 4, **over) -> AttentionMetadata:
    f = dict(slot_mapping=jnp.zeros(t, jnp.int32), block_tables=jnp.zeros((s, p), jnp.int32),
             kv_lens=jnp.zeros(s, jnp.int32), cu_q_lens=jnp.zeros(s + 1, jnp.int32),
             num_seqs=jnp.zeros(1, jnp.int32))
    f.update(over)
    return AttentionMetadata(**f)


@pytest.mark.parametrize("q_shape,q_dtype,pages_shape,pages_dtype,md,match", [
    ((8, 4, 64), jnp.float32, (5, 4, 16, 64), jnp.float32, _md(t=7), r"slot_mapping.*\(8,\)"),
    ((8, 4, 64), jnp.float32, (5, 4, 16, 64), jnp.bfloat16, _md(), "q dtype float32 differs"),
    ((8, 3, 64), jnp.float32, (5, 4, 16, 64), jnp.float32, _md(), r"q heads 3 .*\(8, 3, 64\)"),
    ((8, 4, 64), jnp.float32, (5, 3, 16, 64), jnp.float32, _md(), r"kv_pages must be .*\(5, 3"),
    ((8, 4, 128), jnp.float32, (5, 4, 16, 64), jnp.float32, _md(), "head_dim 128"),
    ((8, 4, 64), jnp.int32, (5, 4, 16, 64), jnp.int32, _md(), "q dtype must be"),
    ((8, 4, 64), jnp.float32, (5, 4, 16, 64), jnp.float32,
     _md(kv_lens=jnp.zeros(3, jnp.float32)), "kv_lens must be int32"),
    ((8, 4, 64), jnp.float32, (5, 4, 16, 64), jnp.float32,
     _md(cu_q_lens=jnp.zeros(3, jnp.int32)), r"cu_q_lens.*\(4,\)"),
    ((8, 4, 64), jnp.float32, (5, 4, 16, 64), jnp.float32,
     _md(block_tables=jnp.zeros(3, jnp.int32)), "block_tables must be"),
])
def test_input_checks_name_the_culprit(q_shape, q_dtype, pages_shape, pages_dtype, md,
                                       match) -> None:
    q = jax.ShapeDtypeStruct(q_shape, q_dtype)
    pages = jax.ShapeDtypeStruct(pages_shape, pages_dtype)
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(lambda q, p, m: ragged_paged_attention_reference(q, p, m, sm_scale=1.0),
                       q, pages, md)


def test_option_checks() -> None:
    q, pages = jnp.zeros((8, 4, 64)), jnp.zeros((5, 4, 16, 64))
    with pytest.raises(ValueError, match="sliding_window"):
        ragged_paged_attention_reference(q, pages, _md(), sm_scale=1.0, sliding_window=0)
    with pytest.raises(ValueError, match="soft_cap"):
        ragged_paged_attention_reference(q, pages, _md(), sm_scale=1.0, soft_cap=-1.0)
    with pytest.raises(ValueError, match=r"k_new .*\(8, 3, 64\)"):
        write_kv(pages, jnp.zeros((8, 3, 64)), jnp.zeros((8, 3, 64)), jnp.zeros(8, jnp.int32))


def test_select_impl() -> None:
    # CPU: the C++ kernel where it builds (tests/kernels/test_attention_cpu.py), else the reference.
    assert select_impl("auto", "cpu") in ("cpu", "reference")
    assert select_impl("auto", "tpu") == "pallas_tpu"
    assert select_impl("auto", "gpu") == "pallas_gpu"
    assert select_impl("pallas_gpu", "cpu") == "pallas_gpu"     # explicit names win
    assert select_impl("auto") in ("reference", "cpu", "pallas_tpu", "pallas_gpu")
    with pytest.raises(ValueError, match="unknown attention impl 'triton'"):
        select_impl("triton")
