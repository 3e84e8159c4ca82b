"""The multi-LoRA delta (kernels_pallas/lora.py's contract) by every implementation against
the definition: the C++ CPU kernel (lora_cpu.py; each instruction set this CPU runs, float32
and bfloat16 stacks), the masked XLA path, the grouped (Punica/SGMV) path through both Pallas
grouped matmuls run by their CPU interpreters, and the jnp reference itself.

Oracle: per row, (x[t] @ A[slot]) @ B[slot] in float64 numpy on the stacks' stored values
(bfloat16 values are exact in float64); slot-0 rows exactly zero (asserted bit for bit).
Tolerance (`_bound`): each implementation sums in float32 in its own order, so the shrink
u = x @ A (K terms) errs by at most gamma_K * |x| @ |A| and the expand (R terms; the masked
path adds the other slots' exact zeros, same bound) by gamma_R * (|u| + du) @ |B| plus the
shrink's error carried through |B| (support.numerics: Higham's gamma_n); a row given another
slot's adapter or a dropped row is off by O(|y|), far past it (`test_bound_catches_a_wrong_
adapter`). Where u and y are stored in bfloat16 (bfloat16 rows), their rounding joins it.

Cases: ragged mixes with slot-0 rows, every row slot 0, one slot for all rows (over the
kernel's 16-row jobs), every row its own slot, one row, T not a multiple of any tile, rank 8
/ 3 / 64 and widths that leave vector tails (the kernel's narrower vectors and scalar
columns), enough work for the kernel to use the thread pool (few uneven jobs: shrink then a
column-split expand; even or many jobs: a job an item, the next one claimed ahead), a slot
outside [0, S) (zero,
as the masked path); the bundled model's shapes in the slow tier. Plus: a layer of the
stack read inside a scan, bfloat16 rows, the fallback where the C++ library cannot be
built, the trace-time refusals naming the operand, the per-backend choice (`grouped_pays`)
and `lora_delta` lowered for TPU and CUDA from this host (jax.export).
"""

from __future__ import annotations

import functools
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support.cpu_isa import isa_params
from support.numerics import gamma
from support.tiers import slow

from jaxserve.kernels_pallas import cpu_build
from jaxserve.kernels_pallas.grouped_matmul_gpu import grouped_matmul_gpu
from jaxserve.kernels_pallas.grouped_matmul_tpu import grouped_matmul_tpu
from jaxserve.kernels_pallas.lora import (grouped_pays, lora_delta, lora_delta_grouped,
                                          lora_delta_masked, lora_delta_reference)
from jaxserve.kernels_pallas.lora_cpu import lora_delta_cpu

needs_kernel = pytest.mark.skipif(cpu_build.dense_kernel_target() is None,
                                  reason="the CPU kernels could not be built here (see the log)")

# id -> (T, in, R, out, S, slots or a seed for random ones in [0, S))
CASES = {
    "ragged": (37, 40, 16, 24, 5, 1),              # random mix incl. slot 0; T = 37
    "all-slot-0": (9, 40, 16, 24, 5, [0] * 9),     # nothing to do: all zeros
    "one-slot": (50, 40, 16, 24, 5, [3] * 50),     # 50 rows on one adapter: 4 jobs of <= 16
    "own-slot-each": (12, 40, 16, 24, 13, [5, 1, 12, 3, 7, 2, 9, 4, 11, 6, 10, 8]),
    "one-row": (1, 40, 16, 24, 5, [2]),
    "rank8-tails": (21, 13, 8, 100, 4, 2),         # K % 4 != 0; 64 + 16 + 16 + 4 columns
    "rank64": (20, 64, 64, 130, 4, 3),
    "rank3-scalar": (11, 24, 3, 7, 3, 4),          # R and out narrower than any vector
    "threaded": (70, 256, 16, 520, 6, 5),          # past the kernel's serial-work cut-off
    # A decode step's mix on the thread pool: 8 adapters x 4 rows, one job each, claimed a
    # job ahead; and many jobs (3 adapters x 100 rows) the same way.
    "threaded-decode": (32, 256, 16, 520, 9, [1 + t % 8 for t in range(32)]),
    "threaded-many": (300, 64, 16, 200, 4, [1 + t % 3 for t in range(300)]),
}
L_STACK = 3  # layers in every stack; the cases read layer 1


def _slots(case: str) -> np.ndarray:
    t, _, _, _, s, spec = CASES[case]
    if isinstance(spec, list):
        return np.asarray(spec, np.int32)
    return np.random.default_rng(spec).integers(0, s, t).astype(np.int32)


def _operands(case: str, dtype: str, seed: int = 0) -> tuple[np.ndarray, ...]:
    """x f32[T, in], a [L, S, in, R] and b [L, S, R, out] in `dtype` (as numpy float64 of
    the stored values, and as the arrays), slots."""
    t, k, r, n, s, _ = CASES[case]
    rng = np.random.default_rng(seed + len(case))
    x = rng.standard_normal((t, k)).astype(np.float32)
    a = np.asarray(jnp.asarray(rng.standard_normal((L_STACK, s, k, r)) * 0.5, dtype))
    b = np.asarray(jnp.asarray(rng.standard_normal((L_STACK, s, r, n)) * 0.5, dtype))
    return x, a, b, _slots(case)


def _bound(x: np.ndarray, a: np.ndarray, b: np.ndarray, slots: np.ndarray, layer: int,
           rounding: float = 0.0, operands: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """(y, bound): the float64 definition and the float32 evaluation's elementwise bound;
    `rounding`: the relative rounding of u and of y where they are stored narrower
    (bfloat16 rows: 2 ** -8); `operands`: that of x and of u where they are rounded before
    their products (the CPU kernel's bfloat16 dot path: 2 ** -8)."""
    x = x.astype(np.float64)
    al, bl = a[layer].astype(np.float64), b[layer].astype(np.float64)
    k, r = al.shape[1:]
    y, bound = np.zeros((x.shape[0], bl.shape[2])), np.zeros((x.shape[0], bl.shape[2]))
    for t, s in enumerate(slots):
        if not 0 < s < al.shape[0]:
            continue
        u = x[t] @ al[s]
        du = (gamma(k) + operands * (1 + gamma(k))) * (np.abs(x[t]) @ np.abs(al[s]))
        du += rounding * (np.abs(u) + du)
        du += operands * (np.abs(u) + du)
        y[t] = u @ bl[s]
        bound[t] = du @ np.abs(bl[s]) + gamma(r) * ((np.abs(u) + du) @ np.abs(bl[s]))
        bound[t] += rounding * (np.abs(y[t]) + bound[t])
    return y, bound


def _assert_close(got: jax.Array, x: np.ndarray, a: np.ndarray, b: np.ndarray,
                  slots: np.ndarray, layer: int = 1, rounding: float = 0.0,
                  operands: float = 0.0) -> None:
    got = np.asarray(got, np.float64)
    want, bound = _bound(x, a, b, slots, layer, rounding, operands)
    assert got.shape == want.shape
    err = np.abs(got - want)
    worst = float((err / np.maximum(bound, 1e-30)).max()) if err.size else 0.0
    assert (err <= bound + 1e-30).all(), f"max err / bound {worst:.3g}"
    off = ~((slots > 0) & (slots < a.shape[1]))
    assert (got[off] == 0).all() and not np.signbit(got[off]).any()  # exactly +0


def _run(fn, x, a, b, slots, layer: int = 1) -> jax.Array:  # noqa: ANN001
    return jax.jit(fn)(jnp.asarray(x), jnp.asarray(a), jnp.asarray(b), jnp.asarray(slots),
                       jnp.int32(layer))


def _dot_rounding(isa: str, dtype: str, rank: int) -> float:
    """x's and u's rounding where the kernel takes its bfloat16 dot path (bfloat16 stacks,
    rank a multiple of 16, the avx512_vnni build on a CPU with AVX512_BF16: lora_bf16_dot.h);
    0 elsewhere (every product exact in float32)."""
    dot = dtype == "bfloat16" and rank % 16 == 0 and isa == "avx512_vnni" \
        and cpu_build.cpu_has_avx512_bf16()
    return 2.0 ** -8 if dot else 0.0


@needs_kernel
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("case", sorted(CASES))
def test_cpu_kernel_equals_definition(case: str, isa: str, dtype: str) -> None:
    x, a, b, slots = _operands(case, dtype)
    got = _run(functools.partial(lora_delta_cpu, isa=isa), x, a, b, slots)
    assert got.dtype == jnp.float32
    _assert_close(got, x, a, b, slots, operands=_dot_rounding(isa, dtype, a.shape[3]))


@needs_kernel
@slow(reason="the bundled model's shapes (512 rows, 576 -> 1536, 9 slots): the default "
      "tier's cases cover the same code paths on small shapes")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_kernel_on_the_bundled_model_shapes(dtype: str) -> None:
    rng = np.random.default_rng(17)
    x = rng.standard_normal((512, 576)).astype(np.float32)
    a = np.asarray(jnp.asarray(rng.standard_normal((2, 9, 576, 16)) * 0.05, dtype))
    b = np.asarray(jnp.asarray(rng.standard_normal((2, 9, 16, 1536)) * 0.05, dtype))
    slots = rng.integers(0, 9, 512).astype(np.int32)
    slots[:200] = 4  # one long group beside the ragged rest
    _assert_close(_run(lora_delta_cpu, x, a, b, slots), x, a, b, slots,
                  operands=_dot_rounding(cpu_build.dense_isas()[0], dtype, 16))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_masked_and_reference_equal_definition(case: str, dtype: str) -> None:
    x, a, b, slots = _operands(case, dtype)
    _assert_close(_run(lora_delta_masked, x, a, b, slots), x, a, b, slots)
    _assert_close(_run(lora_delta_reference, x, a, b, slots), x, a, b, slots)


# The grouped path through each Pallas kernel's interpreter. The GPU kernel's power-of-two
# tiles need in, R and out multiples of 16 (lora.py sends other shapes to the masked path):
# the Triton cases widen the toy shapes' in / out to 64 / 32.
_GROUPED = {"tpu": functools.partial(grouped_matmul_tpu, interpret=True),
            "gpu": functools.partial(grouped_matmul_gpu, interpret=True)}
_GROUPED_CASES = ["ragged", "all-slot-0", "one-slot", "own-slot-each", "one-row"]


def _grouped_operands(backend: str, case: str, dtype: str) -> tuple[np.ndarray, ...]:
    x, a, b, slots = _operands(case, dtype)
    if backend == "gpu":
        rng = np.random.default_rng(9)
        t, _, r, _, s, _ = CASES[case]
        x = rng.standard_normal((t, 64)).astype(np.float32)
        a = np.asarray(jnp.asarray(rng.standard_normal((L_STACK, s, 64, r)) * 0.5, dtype))
        b = np.asarray(jnp.asarray(rng.standard_normal((L_STACK, s, r, 32)) * 0.5, dtype))
    return x, a, b, slots


@pytest.mark.parametrize("backend,case,dtype", [
    pytest.param(be, case, dt, id=f"{be}-{case}-{dt}",
                 marks=() if (case, dt) == ("ragged", "float32") else
                 slow(reason="the Pallas interpreters take seconds a case; ragged f32 "
                      "runs by default"))
    for be in sorted(_GROUPED) for case in _GROUPED_CASES for dt in ("float32", "bfloat16")])
def test_grouped_path_equals_definition(backend: str, case: str, dtype: str) -> None:
    """float32: rows and stacks; bfloat16: both (the kernels' bf16 inputs, f32 accumulation,
    u and y stored in bfloat16: their rounding joins the bound)."""
    x, a, b, slots = _grouped_operands(backend, case, dtype)
    x = np.asarray(jnp.asarray(x, dtype))
    matmul = _GROUPED[backend]
    got = _run(lambda *z: lora_delta_grouped(*z, matmul=matmul), x, a, b, slots)
    assert got.dtype == jnp.dtype(dtype)
    _assert_close(got, x.astype(np.float32), a, b, slots,
                  rounding=2.0 ** -8 if dtype == "bfloat16" else 0.0)


@needs_kernel
def test_slot_outside_the_stack_is_zero_on_every_path() -> None:
    """Not the contract (slots lie in [0, S)), but what each path does with one: zero, as
    the masked path (no slot matches it); never another slot's adapter or a bad read."""
    x, a, b, _ = _grouped_operands("gpu", "ragged", "float32")
    slots = np.asarray([1, 7, -1, 2] * 9 + [4], np.int32)  # S = 5
    for fn in (lora_delta_cpu, lora_delta_masked,
               lambda *z: lora_delta_grouped(*z, matmul=_GROUPED["gpu"])):
        _assert_close(_run(fn, x, a, b, slots), x, a, b, slots)


@needs_kernel
def test_lora_delta_on_cpu_is_the_kernel_inside_a_scan_and_keeps_x_dtype() -> None:
    """As the model calls it: the whole stacks and the layer index from a scan over layers;
    on CPU `lora_delta` lowers to the C++ kernel. bfloat16 rows come back bfloat16."""
    x, a, b, slots = _operands("ragged", "bfloat16")
    args = tuple(map(jnp.asarray, (x, a, b, slots)))

    def step(xs, a, b, s):  # noqa: ANN001, ANN202
        return jax.lax.scan(lambda c, l: (c, lora_delta(xs, a, b, s, l)), None,
                            jnp.arange(L_STACK, dtype=jnp.int32))[1]

    assert cpu_build.LORA_TARGETS["bfloat16"] in jax.jit(step).lower(*args).as_text()
    ys = jax.jit(step)(*args)
    for layer in range(L_STACK):
        _assert_close(ys[layer], x, a, b, slots, layer,
                      operands=_dot_rounding(cpu_build.dense_isas()[0], "bfloat16", 16))
    y16 = lora_delta(args[0].astype(jnp.bfloat16), *args[1:], jnp.int32(1))
    assert y16.dtype == jnp.bfloat16 and y16.shape == (37, 24)
    want = lora_delta_reference(args[0].astype(jnp.bfloat16), *args[1:], jnp.int32(1))
    np.testing.assert_allclose(np.asarray(y16, np.float32), np.asarray(want, np.float32),
                               rtol=2 ** -7, atol=2 ** -7 * float(np.abs(want).max()))


def test_no_compiler_falls_back_to_the_masked_path(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setenv(cpu_build.CACHE_ENV, str(tmp_path))  # nothing cached here
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    cpu_build.load_kernels.cache_clear()
    try:
        x, a, b, slots = (jnp.asarray(v) for v in _operands("ragged", "float32"))
        with caplog.at_level(logging.WARNING, logger=cpu_build.__name__):
            text = jax.jit(lora_delta_cpu).lower(x, a, b, slots, jnp.int32(1)).as_text()
            assert "custom_call" not in text
            got = lora_delta_cpu(x, a, b, slots, jnp.int32(1))
        np.testing.assert_array_equal(np.asarray(got), np.asarray(
            lora_delta_masked(x, a, b, slots, jnp.int32(1))))
        assert any("/nonexistent/c++" in r.getMessage() for r in caplog.records)
    finally:
        cpu_build.load_kernels.cache_clear()


def test_trace_time_refusals_name_the_operand() -> None:
    x, a, b, s = (jnp.zeros((4, 8)), jnp.zeros((2, 3, 8, 4)), jnp.zeros((2, 3, 4, 6)),
                  jnp.zeros((4,), jnp.int32))
    l = jnp.int32(0)
    cases = [((x[0], a, b, s, l), "x must be"),
             ((x, a[0], b, s, l), "a must be"),
             ((jnp.zeros((4, 9)), a, b, s, l), "x has 9 input features"),
             ((x, a, jnp.zeros((2, 3, 5, 6)), s, l), r"b \(2, 3, 5, 6\)"),
             ((x, a, b, s[:3], l), "slots must be int32"),
             ((x, a, b, s.astype(jnp.float32), l), "slots must be int32"),
             ((x, a, b, s, jnp.zeros((1,), jnp.int32)), "layer must be an int32 scalar")]
    impls = [lora_delta, lora_delta_cpu, lora_delta_masked,
             lambda *z: lora_delta_grouped(*z, matmul=_GROUPED["gpu"])]
    for args, match in cases:
        for fn in impls:
            with pytest.raises(ValueError, match=match):
                jax.jit(fn)(*args)


_BUNDLED = (32, 9, 16, 576, 1536)         # T, S, R, in, out: 32 decode rows, 8 adapters
_LARGE = (512, 65, 64, 4096, 14336)       # an 8B model's gate, 64 adapters of rank 64
_RANK8 = (8192, 65, 8, 4096, 14336)       # grouped pays, but R = 8 is under Triton's dot
_CALLS = {"tpu": "tpu_custom_call", "cuda": "__gpu$xla.gpu.triton"}
_KERNELS = {"tpu": grouped_matmul_tpu, "cuda": grouped_matmul_gpu}


def _export(fn, platform: str, shape: tuple[int, ...]) -> jax.export.Exported:  # noqa: ANN001
    t, s, r, k, n = shape
    sds = jax.ShapeDtypeStruct
    return jax.export.export(
        jax.jit(fn), platforms=[platform],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(_CALLS[platform])])(
        sds((t, k), jnp.bfloat16), sds((2, s, k, r), jnp.bfloat16),
        sds((2, s, r, n), jnp.bfloat16), sds((t,), jnp.int32), sds((), jnp.int32))


@pytest.mark.parametrize("platform", sorted(_CALLS))
@pytest.mark.parametrize("shape,grouped", [
    (_BUNDLED, {"tpu": False, "cuda": False}), (_LARGE, {"tpu": True, "cuda": True}),
    (_RANK8, {"tpu": True, "cuda": False})], ids=["bundled", "large", "rank8-long-prefill"])
def test_lora_delta_lowers_for_accelerators(platform: str, shape: tuple[int, ...],
                                            grouped: dict[str, bool]) -> None:
    """`lora_delta` exported for TPU / CUDA from this host: the bundled model's shapes take
    the masked path (two dots, no kernel), a large adapter stack the grouped one (the two
    Pallas calls, shrink and expand), as `grouped_pays` estimates; rank 8 the masked path
    on CUDA whatever the estimate (the Triton kernel's tiles are 16 at least)."""
    t, s, r, k, n = shape
    assert grouped_pays(platform, t, s, r, k, n, 2) is (shape != _BUNDLED)
    grouped = grouped[platform]
    exported = _export(lora_delta, platform, shape)
    text = exported.mlir_module()
    calls = re.findall(r"custom_call @([\w$.]+)", text)
    assert calls == ([_CALLS[platform]] * 2 if grouped else [])
    assert len(re.findall(r"stablehlo\.dot_general", text)) == (0 if grouped else 2)
    assert exported.out_avals[0].shape == (t, n)
    assert exported.out_avals[0].dtype == jnp.bfloat16


@pytest.mark.parametrize("platform", sorted(_CALLS))
def test_grouped_path_lowers_at_the_bundled_shapes(platform: str) -> None:
    """The grouped path forced at the bundled model's shapes (in = 576: no 128-multiple k
    tile, so the TPU kernel's block is the whole width; R = 16 one tile) lowers through
    Mosaic / Triton too, should the estimate pick it."""
    mm = _KERNELS[platform]
    exported = _export(lambda *z: lora_delta_grouped(*z, matmul=mm), platform, _BUNDLED)
    assert re.findall(r"custom_call @([\w$.]+)", exported.mlir_module()) == \
        [_CALLS[platform]] * 2


def test_bound_catches_a_wrong_adapter() -> None:
    """The tolerance can fail: one row given its neighbour slot's adapter is outside it."""
    x, a, b, slots = _operands("ragged", "float32")
    wrong = slots.copy()
    wrong[np.flatnonzero(slots == 2)[0]] = 3
    got = np.asarray(_run(lora_delta_reference, x, a, b, wrong))
    with pytest.raises(AssertionError, match="max err / bound"):
        _assert_close(got, x, a, b, slots)
