"""The C++ CPU kernel (kernels_pallas/cpu.py) against the jnp reference, and its build.

Kernel cases: the cases the Pallas kernels are tested on (support.kernel_cases.CASES: pure
decode, pure prefill, mixed, lone q_len 1; page sizes 16/32/64; GQA 1/2/3/4/8; head dims
64/128; float32/bfloat16; sliding window, soft cap) plus float16, long contexts (4k keys,
small heads; a lone long decode whose key range the kernel cuts into parts), live
sequences with nothing to do (kv_len 0) and a head dim stored padded. The default tier runs
the interpreters' default subset of the cases and three of the long/odd batches, the rest run
with JAXSERVE_RUN_SLOW=1. Unowned pages, the trash
page and the unused tails of pages hold NaN, so a stray read shows; padding tokens must come
out as zeros. Tolerances against the float32-accumulating reference (support.numerics): the
float32 reordering bound of one attention call, elementwise (attention_atol: head_dim,
context length, the scores' and the output's magnitudes; 1e-4 - 2e-3 here), plus, for
float16 / bfloat16 outputs, one rounding of each side relative (rounding_rtol: 2^-10 / 2^-7).
Both sides read the same 16-bit inputs, widened exactly to float32.

The fused write_kv + attention call (the engine's per-layer call on CPU): pages bit-exact
against write_kv's contract (padding tokens into the trash page, negative and out-of-range
slots dropped, head dims zero-padded), output as the reference's.

Build: a fresh cache dir gets one library and no temporary files, and a second call reuses
it; with no compiler, one warning and the reference is used.
"""

from __future__ import annotations

import logging
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels_pallas import (AttentionMetadata, ragged_paged_attention,
                                     ragged_paged_attention_reference, select_impl, write_kv,
                                     write_kv_and_attend)
from jaxserve.kernels_pallas import cpu_build
from jaxserve.kernels_pallas.cpu import ragged_paged_attention_cpu, write_kv_and_attend_cpu
from support.kernel_cases import (CASE_IDS, CASES, INTERPRET_BY_DEFAULT, draw_specs,
                                  expected_pages_after_write, random_batch)
from support.numerics import assert_close, attention_atol, rounding_rtol
from support.tiers import split_tiers



def tolerance(batch, dtype: str, **opts) -> dict:
    """assert_allclose's atol / rtol for the kernel against the reference (module docstring)."""
    return {"atol": attention_atol(batch, **opts),
            "rtol": 0.0 if dtype == "float32" else rounding_rtol(dtype)}

pytestmark = pytest.mark.skipif(cpu_build.cpu_kernel_target() is None,
                                reason="the CPU kernel could not be built here (see the log)")


def check_case(specs: list[tuple[int, int]], *, hq: int, hkv: int, d: int, ps: int,
               dtype: str, window: int | None, cap: float | None, seed: int,
               extra_tokens: int = 0, extra_seqs: int = 0, isa: str | None = None) -> None:
    rng = np.random.default_rng(seed)
    batch = random_batch(rng, specs, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                         page_size=ps, dtype=jnp.dtype(dtype),
                         num_tokens=sum(n for _, n in specs) + extra_tokens,
                         num_seqs=len(specs) + extra_seqs)
    pages = write_kv(batch.kv_pages, batch.k_new, batch.v_new, batch.md.slot_mapping)
    opts = dict(sm_scale=d ** -0.5, sliding_window=window, soft_cap=cap)
    want = np.asarray(jnp.asarray(ragged_paged_attention_reference(batch.q, pages, batch.md,
                                                                   **opts), jnp.float32))
    got = ragged_paged_attention_cpu(batch.q, pages, batch.md, **opts, isa=isa)
    assert got.shape == batch.q.shape and got.dtype == batch.q.dtype
    got = np.asarray(jnp.asarray(got, jnp.float32))
    live = int(np.asarray(batch.md.cu_q_lens)[len(specs)])
    assert_close(got[:live], want[:live], **tolerance(batch, dtype, **opts),
                               err_msg=f"cpu kernel on {specs}")
    np.testing.assert_array_equal(got[live:], 0.0, err_msg="padding tokens must be zeros")


@pytest.mark.parametrize("case", split_tiers(CASES, CASE_IDS, INTERPRET_BY_DEFAULT,
                                             "more kernel cases on the CPU kernel"))
def test_matches_reference_on_the_kernel_cases(case: tuple) -> None:
    kind, ps, hq, hkv, d, dtype, window, cap = case
    rng = np.random.default_rng(zlib.crc32(repr(("cpu", case)).encode()))
    specs = draw_specs(kind, rng, ps)
    check_case(specs, hq=hq, hkv=hkv, d=d, ps=ps, dtype=dtype, window=window, cap=cap,
               seed=int(rng.integers(1 << 30)), extra_tokens=int(rng.integers(0, 4)),
               extra_seqs=int(rng.integers(0, 3)))


# (specs, Hq, Hkv, D, page_size, dtype, sliding_window, soft_cap)
EXTRA = {
    "long-decode-split": ([(4095, 1)], 4, 1, 32, 16, "float32", None, None),
    "long-mixed": ([(4000, 96), (3000, 1), (17, 1)], 4, 2, 32, 16, "float32", None, None),
    "long-window-cap": ([(4090, 6), (2500, 1)], 4, 2, 32, 32, "bfloat16", 700, 20.0),
    "mixed-float16": ([(40, 1), (0, 33), (21, 12)], 8, 2, 64, 16, "float16", None, None),
    "mixed-g4-float16-window": ([(70, 1), (5, 30)], 8, 2, 64, 16, "float16", 9, 3.0),
    "empty-live-seq": ([(19, 1), (0, 0), (0, 18), (33, 1)], 4, 2, 64, 8, "float32", None,
                       None),
    "prefill-many-tiles": ([(0, 200), (31, 70)], 8, 8, 64, 16, "bfloat16", None, None),
}


# Default tier: a long split decode with window + cap in bf16, float16 with GQA 4 and a
# window, an empty live sequence; the rest with JAXSERVE_RUN_SLOW=1.
@pytest.mark.parametrize("name", split_tiers(
    list(EXTRA), list(EXTRA), {"long-window-cap", "mixed-g4-float16-window", "empty-live-seq"},
    "more long and odd batches on the CPU kernel"))
def test_matches_reference_on_long_and_odd_batches(name: str) -> None:
    specs, hq, hkv, d, ps, dtype, window, cap = EXTRA[name]
    check_case(specs, hq=hq, hkv=hkv, d=d, ps=ps, dtype=dtype, window=window, cap=cap,
               seed=zlib.crc32(name.encode()), extra_tokens=3, extra_seqs=2)


# Long prefill chunks: tiles taller than 8 rows run the register-blocked micro-kernels
# (csrc/tile_math.h: rows as lanes, 16 with AVX-512, 8 with AVX2), here with a chunk of 1,100
# tokens (52 tiles of 21 tokens x 3 heads), a short chunk, decode rows and a lone long decode
# whose key range is cut into parts (every 1,024 keys), on every instruction set this CPU runs (the library
# rebuilt with that ISA's flags: AVX-512 and AVX2 on an AVX-512 host). Heads: SmolLM2's (9 / 3,
# 64), and GQA 8 at head dim 80 (16 lanes of 8 tokens x 8 heads; 80 = 13 x 6 + 2 dims: every
# remainder path of PV) with a window and a cap, in bf16; MHA at head dim 128.
TALL = {
    "smollm-window-cap": ([(0, 1100), (517, 1), (60, 37), (900, 1)], 9, 3, 64, 16, "float32",
                          300, 30.0),
    "g8-d80-bf16-window-cap": ([(200, 700), (33, 1), (0, 19)], 8, 1, 80, 32, "bfloat16", 129,
                               5.0),
    "mha-d128": ([(0, 520), (2100, 1), (40, 9)], 4, 4, 128, 16, "float32", None, None),
}


@pytest.mark.parametrize("isa", [isa for isa, _ in cpu_build.attention_variants()])
@pytest.mark.parametrize("name", list(TALL))
def test_long_prefill_tiles_on_each_isa(name: str, isa: str) -> None:
    if isa not in cpu_build.dense_isas():
        pytest.skip(f"this CPU does not run {isa}")
    specs, hq, hkv, d, ps, dtype, window, cap = TALL[name]
    check_case(specs, hq=hq, hkv=hkv, d=d, ps=ps, dtype=dtype, window=window, cap=cap,
               seed=zlib.crc32(name.encode()), extra_tokens=2, extra_seqs=1, isa=isa)


def test_head_dim_stored_padded_and_selector_dispatch() -> None:
    """D=80 heads in D=128 pages: only the first 80 columns are read; impl='cpu' dispatches."""
    rng = np.random.default_rng(80)
    batch = random_batch(rng, [(21, 3), (40, 1)], num_q_heads=4, num_kv_heads=2, head_dim=80,
                         page_size=16, num_tokens=6, num_seqs=3)
    pages = jnp.pad(batch.kv_pages, ((0, 0), (0, 0), (0, 0), (0, 48)), constant_values=np.nan)
    pages = write_kv(pages, batch.k_new, batch.v_new, batch.md.slot_mapping)
    want = ragged_paged_attention_reference(batch.q, jnp.nan_to_num(pages), batch.md,
                                            sm_scale=80 ** -0.5)
    got = ragged_paged_attention(batch.q, pages, batch.md, sm_scale=80 ** -0.5, impl="cpu")
    assert got.shape == batch.q.shape
    assert_close(np.asarray(got)[:4], np.asarray(want)[:4],
                               **tolerance(batch, "float32", sm_scale=80 ** -0.5))
    assert select_impl("auto", "cpu") == "cpu" and select_impl("cpu") == "cpu"


@pytest.mark.parametrize("dtype,pad", [("float32", 0), ("bfloat16", 0), ("float32", 48)])
def test_fused_write_and_attend(dtype: str, pad: int) -> None:
    rng = np.random.default_rng(7 + pad)
    batch = random_batch(rng, [(37, 1), (0, 20), (50, 7), (16, 1)], num_q_heads=8,
                         num_kv_heads=2, head_dim=64 + pad, page_size=16,
                         dtype=jnp.dtype(dtype), num_tokens=33, num_seqs=6)
    d = 64
    q, k_new, v_new = batch.q[..., :d], batch.k_new[..., :d], batch.v_new[..., :d]
    # Padding tokens' slots: one negative, one past the last page (both dropped), one trash.
    slots = np.asarray(batch.md.slot_mapping).copy()
    slots[30:] = [-5, batch.kv_pages.shape[0] * 16 + 3, 2]
    md = AttentionMetadata(jnp.asarray(slots), batch.md.block_tables, batch.md.kv_lens,
                           batch.md.cu_q_lens, batch.md.num_seqs)
    want_pages = write_kv(batch.kv_pages, k_new, v_new, md.slot_mapping)
    want = ragged_paged_attention_reference(q, want_pages, md, sm_scale=0.125)
    out, pages = write_kv_and_attend(q, k_new, v_new, batch.kv_pages, md, sm_scale=0.125,
                                     impl="cpu")
    np.testing.assert_array_equal(np.asarray(jnp.asarray(pages, jnp.float32)),
                                  np.asarray(jnp.asarray(want_pages, jnp.float32)))
    if pad == 0:
        np.testing.assert_array_equal(np.asarray(jnp.asarray(pages, jnp.float32)),
                                      expected_pages_after_write(batch))
    assert_close(np.asarray(jnp.asarray(out, jnp.float32))[:29],
                               np.asarray(jnp.asarray(want, jnp.float32))[:29],
                               **tolerance(batch, dtype, sm_scale=0.125, head_dim=d))
    with pytest.raises(ValueError, match=rf"k_new must be \[T, 2, <= {64 + pad}\]"):
        jax.eval_shape(lambda *a: write_kv_and_attend_cpu(*a, sm_scale=1.0), q,
                       jnp.zeros((33, 3, d), dtype), v_new, batch.kv_pages, md)


def test_rejects_bad_shapes_naming_them() -> None:
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    md = AttentionMetadata(i32(8), i32(3, 4), i32(3), i32(4), i32(1))
    q = jax.ShapeDtypeStruct((8, 3, 64), jnp.float32)
    pages = jax.ShapeDtypeStruct((5, 4, 16, 64), jnp.float32)
    with pytest.raises(ValueError, match=r"q heads 3 .*\(8, 3, 64\)"):
        jax.eval_shape(lambda q, p, m: ragged_paged_attention_cpu(q, p, m, sm_scale=1.0),
                       q, pages, md)
    q = jax.ShapeDtypeStruct((8, 130, 64), jnp.float32)
    with pytest.raises(ValueError, match=r"at most 64 query heads per kv head, got 65"):
        jax.eval_shape(lambda q, p, m: ragged_paged_attention_cpu(q, p, m, sm_scale=1.0),
                       q, pages, md)


def test_build_into_a_fresh_cache_dir_once(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(cpu_build.CACHE_ENV, str(tmp_path))
    path = cpu_build.build_library()
    assert path.parent == tmp_path and path.suffix == ".so"
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]   # no temporary left
    mtime = path.stat().st_mtime_ns
    assert cpu_build.build_library() == path and path.stat().st_mtime_ns == mtime


def test_no_compiler_falls_back_to_the_reference_with_one_warning(tmp_path, monkeypatch,
                                                                   caplog) -> None:
    monkeypatch.setenv(cpu_build.CACHE_ENV, str(tmp_path))       # nothing cached here
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    cpu_build.load_kernels.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=cpu_build.__name__):
            assert select_impl("auto", "cpu") == "reference"
            assert select_impl("cpu") == "reference"
            rng = np.random.default_rng(3)
            batch = random_batch(rng, [(5, 2), (9, 1)], num_q_heads=6, num_kv_heads=3,
                                 head_dim=16, page_size=8, num_tokens=4, num_seqs=3)
            pages = write_kv(batch.kv_pages, batch.k_new, batch.v_new, batch.md.slot_mapping)
            got = ragged_paged_attention(batch.q, pages, batch.md, sm_scale=0.25, impl="cpu")
            want = ragged_paged_attention_reference(batch.q, pages, batch.md, sm_scale=0.25)
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
            got, got_pages = write_kv_and_attend(batch.q, batch.k_new, batch.v_new,
                                                 batch.kv_pages, batch.md, sm_scale=0.25,
                                                 impl="cpu")
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
            np.testing.assert_array_equal(np.asarray(got_pages), np.asarray(pages))
            # The dense kernels share the build: none registered, the wrappers' reference.
            assert cpu_build.dense_kernel_target() is None and cpu_build.dense_isas() == ()
            assert cpu_build.dense_kernel_target("avx2") is None
        # cpu_build's records only: an engine of an earlier module whose compile guard is still
        # registered logs "XLA compile after warmup" for this test's eager ops.
        warnings = [r for r in caplog.records
                    if r.levelno == logging.WARNING and r.name == cpu_build.__name__]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
        msg = warnings[0].getMessage()
        assert "using the jnp reference" in msg and "/nonexistent/c++" in msg
        assert list(tmp_path.iterdir()) == []
    finally:
        cpu_build.load_kernels.cache_clear()


@pytest.mark.slow(reason="an 8-device subprocess: the TP engine tests run this kernel under "
                  "tensor parallelism in the default tier")
@pytest.mark.timeout(960)  # past the worker's own 900 s subprocess limit
def test_under_tensor_parallelism_on_8_virtual_devices() -> None:
    """The kernel inside shard_map on 8 devices equals the unsharded reference; an engine at
    TP 4 (one KV head per device) running it gives TP 1 reference's greedy tokens exactly and
    its logprobs within the float32 reordering bound of the model's chain of sums
    (support.numerics.model_logprob_atol, from the weights, computed in the worker; a fixed
    1e-5 relative bound, measured on one AVX2 host, failed on AVX-512 at 5.1e-5)."""
    from support.engine_fixtures import run_device_worker
    res = run_device_worker("cpu_attention_tp_worker.py")
    assert res["built"]
    assert res["shard_map_err_over_bound"] <= 1  # attention_atol, in the worker
    base = res["tp1_reference"]["outputs"]
    for key in ("tp4_cpu",):
        got = res[key]
        assert got["impl"] == "cpu" and got["compiles_after_warmup"] == 0
        for rid, want in base.items():
            assert got["outputs"][rid]["tokens"] == want["tokens"], (key, rid)
            for lp_got, lp_want in zip(got["outputs"][rid]["logprobs"], want["logprobs"]):
                assert lp_got.keys() == lp_want.keys(), (key, rid)
                ref = np.array(list(lp_want.values()))
                diff = np.array([lp_got[k] for k in lp_want]) - ref
                tol = res["tp1_reference"]["logprob_atol"]
                assert np.abs(diff).max() <= tol, (key, rid, np.abs(diff).max(), tol)
