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
from support.kernel_cases import expected_pages_after_write, random_batch


def draw_specs(kind: str, rng: np.random.Generator, ps: int) -> list[tuple[int, int]]:
    """Live (context_len, q_len) pairs of one kind; sizes kept small for the interpreters."""
    if kind == "decode":      # one kv_len exactly on a page boundary
        specs = [(int(rng.integers(0, 4 * ps)), 1) for _ in range(int(rng.integers(2, 5)))]
        return specs + [(int(rng.integers(1, 4)) * ps - 1, 1)]
    if kind == "prefill":     # one chunk exactly two pages long
        specs = [(0, int(rng.integers(1, 3 * ps))) for _ in range(int(rng.integers(1, 3)))]
        return specs + [(0, 2 * ps)]
    if kind == "mixed":       # chunk from mid-page to a page boundary + decodes + a prefill
        ctx = int(rng.integers(1, 3)) * ps + int(rng.integers(1, ps))
        chunk = (ctx, (ctx // ps + 2) * ps - ctx)
        decodes = [(int(rng.integers(0, 3 * ps)), 1) for _ in range(int(rng.integers(1, 4)))]
        specs = [chunk, *decodes, (0, int(rng.integers(1, ps + 5)))]
        return [specs[i] for i in rng.permutation(len(specs))]
    if kind == "q1":
        return [(int(rng.integers(0, 5 * ps)), 1)]
    raise ValueError(kind)


# (kind, page_size, Hq, Hkv, head_dim, dtype, sliding_window, soft_cap)
CASES = [
    ("decode", 16, 8, 8, 64, "float32", None, None),
    ("decode", 32, 8, 2, 128, "bfloat16", None, None),
    ("prefill", 16, 4, 2, 128, "float32", None, None),
    ("prefill", 64, 8, 1, 64, "bfloat16", None, None),
    ("mixed", 16, 8, 2, 64, "bfloat16", None, None),
    ("mixed", 32, 16, 2, 128, "float32", None, None),
    ("mixed", 64, 4, 4, 128, "bfloat16", None, None),
    ("mixed", 32, 4, 2, 64, "float32", None, None),
    ("q1", 64, 4, 2, 64, "float32", None, None),
    ("q1", 16, 8, 1, 128, "bfloat16", None, None),
    ("mixed", 16, 4, 2, 64, "float32", 19, 4.0),
    ("mixed", 32, 8, 2, 64, "bfloat16", 40, None),
    ("mixed", 16, 6, 2, 64, "float32", None, None),          # GQA 3: not a power of two
]
CASE_IDS = [f"{c[0]}-ps{c[1]}-g{c[2] // c[3]}-d{c[4]}-{c[5]}" + ("-win" if c[6] else "")
            + ("-cap" if c[7] else "") for c in CASES]

# The cases the interpreters run by default (each interpreted case costs 2-20 s on 2 CPU
# cores): together every kind, page size, GQA ratio (3 too), head dim, dtype, the sliding
# window and the soft cap. The other cases run interpreted with JAXSERVE_RUN_SLOW=1, and
# compiled on a device; the CPU kernel (test_attention_cpu) runs every case.
INTERPRET_BY_DEFAULT = {"decode-ps16-g1-d64-float32", "decode-ps32-g4-d128-bfloat16",
                        "prefill-ps64-g8-d64-bfloat16", "q1-ps16-g8-d128-bfloat16",
                        "mixed-ps16-g2-d64-float32-win-cap", "mixed-ps16-g3-d64-float32"}
assert INTERPRET_BY_DEFAULT <= set(CASE_IDS)
_SLOW_INTERPRETED = pytest.mark.slow(reason="more interpreted kernel cases")


def case_params() -> list:
    """(case, interpret): each case interpreted (slow unless in INTERPRET_BY_DEFAULT) and
    compiled on its device."""
    return [p for case, cid in zip(CASES, CASE_IDS) for p in (
        pytest.param(case, True, id=f"{cid}-interpret",
                     marks=() if cid in INTERPRET_BY_DEFAULT else _SLOW_INTERPRETED),
        pytest.param(case, False, id=f"{cid}-device", marks=pytest.mark.device))]


# Small blocks so even these short sequences cross several KV blocks and ring slots.
TUNING = {"pallas_tpu": dict(pages_per_block=2, tile_tokens=4),
          "pallas_gpu": dict(num_stages=2)}


def tolerance(impl: str, dtype: str, interpret: bool) -> float:
    if dtype == "bfloat16" or impl == "pallas_gpu":
        return 3e-2
    return 2e-5 if interpret else 1e-2


def interpret_params(impl: str):
    if impl == "pallas_tpu":
        from jax.experimental.pallas import tpu as pltpu
        return pltpu.InterpretParams(detect_races=True)
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    return InterpretGPUParams(detect_races=True)


def races_found(impl: str) -> bool:
    """The interpreters' race flags (private API: treated as 'no races' if it moved)."""
    try:
        if impl == "pallas_tpu":
            from jax._src.pallas.mosaic.interpret import interpret_pallas_call as m
            return bool(m.races is not None and m.races.races_found)
        from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as m
        return bool(m.get_races().races_found)
    except (ImportError, AttributeError, AssertionError):
        return False


def run_kernel(impl: str, *args, tuned: bool = True, **kwargs) -> jax.Array:
    if impl == "pallas_tpu":
        from jaxserve.kernels_pallas.tpu import ragged_paged_attention_tpu as fn
    else:
        from jaxserve.kernels_pallas.gpu import ragged_paged_attention_gpu as fn
    return fn(*args, **kwargs, **(TUNING[impl] if tuned else {}))


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
    tol = tolerance(impl, dtype, interpret)
    np.testing.assert_allclose(got[:live], want[:live], atol=tol, rtol=tol,
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
    np.testing.assert_allclose(np.asarray(got)[:4], np.asarray(want)[:4], atol=3e-2, rtol=3e-2)


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
    q = jax.ShapeDtypeStruct((8, 4, 80), jnp.bfloat16)
    pages = jax.ShapeDtypeStruct((5, 4, 16, 80), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"\(5, 4, 16, 80\): head_dim must be a multiple of 64"):
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
