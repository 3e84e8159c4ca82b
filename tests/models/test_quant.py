"""Quantized weights: the host quantizers, the XLA matmul, the CPU kernel and the GGUF blocks.

Oracles: numpy dequantization written here from the format's definition (W = q * s (+ z) per
group of input rows; int4 two rows per byte, the low nibble first; fp8 through ml_dtypes),
and the float weights a test quantizes or writes into a GGUF file (gguf-py quantizes and
dequantizes them with its own code). The engine-level checks are in test_quant_engine.py.
"""

from __future__ import annotations

import dataclasses
import functools

import gguf
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from support.cpu_isa import isa_params
from support.numerics import F32_UNIT_ROUNDOFF, matmul_atol, unit_roundoff

from jaxserve.config import EngineConfig
from jaxserve.kernels_pallas.dense_quant_cpu import (dense_quant_packed, dense_quant_reference,
                                                     pack_quant)
from jaxserve.models.gguf_loader import open_gguf
from jaxserve.models.hf_loader import host_params_from_hf
from jaxserve.models.linear import PackedWeight
from jaxserve.models.llama import LlamaParams
from jaxserve.models.families import config_from_hf
from jaxserve.models.quant import QuantizedWeight, WeightQuant, quantize_weight
from jaxserve.models.quantized_params import quantize_params

SCHEMES = ("int8", "fp8", "int4")


def numpy_dequantize(q: QuantizedWeight) -> np.ndarray:
    """The float weight [(L,) K, N] from the format's definition (module docstring)."""
    v = np.asarray(q.values)
    if q.scheme == "int4":
        lo, hi = v & 15, v >> 4
        v = np.stack([lo, hi], axis=-2).reshape(*v.shape[:-2], 2 * v.shape[-2], v.shape[-1])
    w = v.astype(np.float32)
    g = w.shape[-2] // q.scales.shape[-2]
    w = w * np.repeat(np.asarray(q.scales), g, axis=-2)
    if q.zeros is not None:
        w = w + np.repeat(np.asarray(q.zeros), g, axis=-2)
    return w


def dequant_atol(q: QuantizedWeight) -> np.ndarray:
    """Elementwise bound between two float32 evaluations of W = q * s (+ z): each rounds the
    product and the sum once (an FMA only once), at most u (|q| s + |z|) each, so two differ
    by at most 4u (|q| s + |z|), whichever order or fusion each uses."""
    mag = np.abs(numpy_dequantize(dataclasses.replace(q, zeros=None)))
    if q.zeros is not None:
        g = mag.shape[-2] // q.zeros.shape[-2]
        mag = mag + np.abs(np.repeat(np.asarray(q.zeros), g, axis=-2))
    return 4 * F32_UNIT_ROUNDOFF * mag


@pytest.mark.parametrize("scheme,group", [("int8", None), ("int8", 16), ("int4", 32),
                                          ("int4", None), ("fp8", None)])
def test_quantizers_round_to_nearest(scheme: str, group: int | None) -> None:
    """Every weight is within half a step of its stored value (fp8: half an e4m3 ulp)."""
    w = np.random.default_rng(0).normal(size=(2, 64, 40)).astype(np.float32)
    w[0, :, 3] = 0.0  # an all-zero column must not divide by zero
    q = quantize_weight(w, scheme, group)
    deq = numpy_dequantize(q)
    assert np.isfinite(deq).all() and np.all(deq[0, :, 3] == 0.0)
    g = q.group_size
    step = np.repeat(np.asarray(q.scales), g, axis=-2)
    if scheme == "fp8":  # 3 mantissa bits: relative half-ulp 2^-4; subnormals step s * 2^-9
        bound = np.maximum(np.abs(w) * 2.0 ** -4, step * 2.0 ** -10)
    else:
        bound = step / 2
    # Beyond round-to-nearest's bound, float32 roundings: before the rounding to a code,
    # fl(w / s) errs u |w| (int4: fl(w - z) first, then the division: 2u |w - z|); after it,
    # numpy_dequantize's fl(q s) and fl(q s + z) err u |q s| and u |deq| (|q s| <= |deq| + |z|
    # to first order). Each doubled for the second-order terms and summed:
    u = F32_UNIT_ROUNDOFF
    z = 0.0 if q.zeros is None else np.abs(np.repeat(np.asarray(q.zeros), g, axis=-2))
    roundings = 4 * u * (np.abs(w) + z) + 4 * u * (np.abs(deq) + z)
    assert np.all(np.abs(deq - w) <= bound + roundings)
    assert q.shape == w.shape and np.asarray(jnp.asarray(q.values)).shape == q.values.shape
    # The jnp dequantization (the XLA path's) agrees with the definition.
    got = np.asarray(jax.tree.map(jnp.asarray, q).dequantize())
    assert np.all(np.abs(got - deq) <= dequant_atol(q))


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_xla_matmul_is_x_at_dequantized(scheme: str, dtype: jnp.dtype) -> None:
    rng = np.random.default_rng(1)
    w = rng.normal(size=(64, 48)).astype(np.float32)
    for group in ((None, 32) if scheme == "int8" else (None,)):
        q = jax.tree.map(jnp.asarray, quantize_weight(w, scheme, group))
        x = rng.normal(size=(3, 5, 64)).astype(np.float32)
        y = np.asarray(jax.jit(QuantizedWeight.matmul)(q, jnp.asarray(x, dtype)), np.float32)
        want = np.asarray(jnp.asarray(x, dtype), np.float32) @ numpy_dequantize(q)
        # Two float32 orders (sides=2), each term also carrying the dequantization (q * s,
        # minus a zero point: 2 roundings); bfloat16 x: the weight rounded to bfloat16 for
        # the dot too, and the output rounded to bfloat16 (u_bf16 of |x| @ |w| more).
        xr = np.asarray(jnp.asarray(x, dtype), np.float32)
        tol = matmul_atol(xr, numpy_dequantize(q), sides=2, roundings=2, operand_dtype=dtype)
        if dtype != jnp.float32:
            tol = tol + unit_roundoff(dtype) * (np.abs(xr) @ np.abs(numpy_dequantize(q)))
        assert np.all(np.abs(y - want) <= tol), (scheme, group)


def test_fp8_activations_dot() -> None:
    """W8A8: x quantized per token to e4m3 (the oracle rounds it with ml_dtypes)."""
    rng = np.random.default_rng(2)
    w = rng.normal(size=(64, 32)).astype(np.float32)
    q = quantize_weight(w, "fp8", act_fp8=True)
    x = rng.normal(size=(4, 64)).astype(np.float32)
    y = np.asarray(jax.jit(QuantizedWeight.matmul)(jax.tree.map(jnp.asarray, q), x))
    sx = np.abs(x).max(-1, keepdims=True) / 448.0
    xq = (x / sx).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * sx
    want = xq @ numpy_dequantize(q)
    # Two orders of the same terms, each carrying x's and w's scale products (3 roundings).
    assert np.all(np.abs(y - want) <= matmul_atol(xq, numpy_dequantize(q), sides=2, roundings=3))
    # ... and stays near the float product (e4m3 activations: a few percent).
    assert np.abs(y - x @ w).max() <= 0.1 * np.abs(x @ w).max()


# (layers, K, N, group, rows): one panel and ragged panels; rows 1-6 run the direct register
# path, more rows the dequantized scratch panel; several layers read in place.
# Each on every instruction set this CPU has (support.cpu_isa): AVX-512's tile is 12 rows x 2
# panels (odd panel counts leave a one-panel group), AVX2's 6 rows x 1; K = 448 spans 3 of
# the chunk's k blocks (192); 257 rows, two row chunks (256).
KERNEL_CASES = [(1, 64, 16, None, 1), (3, 64, 40, 32, 6), (2, 96, 33, 32, 7),
                (1, 128, 50, 16, 40), (2, 64, 200, None, 100), (1, 64, 48, 32, 25),
                (1, 448, 40, 32, 30), (1, 32, 40, 32, 257)]


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("layers,k,n,group,m", KERNEL_CASES)
def test_cpu_kernel_against_numpy(scheme: str, layers: int, k: int, n: int,
                                  group: int | None, m: int, isa: str) -> None:
    rng = np.random.default_rng(k + n + m)
    g = group if group is not None else (32 if scheme == "int4" else None)
    q = quantize_weight(rng.normal(size=(layers, k, n)).astype(np.float32), scheme, g)
    w = numpy_dequantize(q)
    packed = jax.tree.map(jnp.asarray, pack_quant(np.asarray(q.values), q.scales, q.zeros,
                                                  scheme))
    x = rng.normal(size=(m, k)).astype(np.float32)
    kernel = jax.jit(functools.partial(dense_quant_packed, isa=isa), static_argnums=3)
    for layer in range(layers):
        want = x @ w[layer]
        for f in (kernel, dense_quant_reference):
            got = np.asarray(f(jnp.asarray(x), packed, jnp.int32(layer), n))
            # Two float32 orders, each term also carrying the dequantization (2 roundings).
            tol = matmul_atol(x, w[layer], sides=2, roundings=2)
            assert np.all(np.abs(got - want) <= tol), (f, layer)


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("scheme", SCHEMES)
def test_cpu_kernel_row_is_the_same_bits_in_any_row_count(scheme: str, isa: str) -> None:
    """Batch invariance: up to 6 rows run the direct register path, more the dequantized
    scratch panels; a row's output must be the same bits either way, or greedy decoding
    would change with the step's bucket (padding) or a speculative verification's rows."""
    rng = np.random.default_rng(5)
    k, n = 448, 40
    q = quantize_weight(rng.normal(size=(1, k, n)).astype(np.float32), scheme,
                        32 if scheme == "int4" else None)
    packed = jax.tree.map(jnp.asarray, pack_quant(np.asarray(q.values), q.scales, q.zeros,
                                                  scheme))
    x = rng.normal(size=(257, k)).astype(np.float32)
    kernel = jax.jit(functools.partial(dense_quant_packed, isa=isa), static_argnums=3)
    alone = {i: np.asarray(kernel(jnp.asarray(x[i:i + 1]), packed, jnp.int32(0), n))[0]
             for i in (0, 5, 6, 12, 256)}
    for m in (2, 6, 7, 13, 257):
        got = np.asarray(kernel(jnp.asarray(x[:m]), packed, jnp.int32(0), n))
        for i, want in alone.items():
            if i < m:
                assert np.array_equal(got[i], want), (m, i, np.abs(got[i] - want).max())


@pytest.mark.parametrize("scheme", SCHEMES)
def test_cpu_kernel_fast_decode_path(scheme: str) -> None:
    """The default mode's few-row path (`QuantPanels.fast`: per-group sums, then the scale):
    within the float tolerance of numpy at 1..6 rows, and not the row-invariant path's bits
    (a row alone differs from the same row among 7+, which the dequantized panels run), so
    batch-invariant mode, which packs without it, has something to turn off."""
    rng = np.random.default_rng(9)
    k, n = 448, 40
    q = quantize_weight(rng.normal(size=(1, k, n)).astype(np.float32), scheme,
                        32 if scheme == "int4" else None)
    w = numpy_dequantize(q)[0]
    packed = jax.tree.map(jnp.asarray, pack_quant(np.asarray(q.values), q.scales, q.zeros,
                                                  scheme, fast=True))
    x = rng.normal(size=(13, k)).astype(np.float32)
    kernel = jax.jit(dense_quant_packed, static_argnums=3)
    for m in (1, 3, 6):
        got = np.asarray(kernel(jnp.asarray(x[:m]), packed, jnp.int32(0), n))
        assert np.all(np.abs(got - x[:m] @ w) <= matmul_atol(x[:m], w, sides=2, roundings=2))
    alone = np.stack([np.asarray(kernel(jnp.asarray(x[i:i + 1]), packed, jnp.int32(0), n))[0]
                      for i in range(13)])
    many = np.asarray(kernel(jnp.asarray(x), packed, jnp.int32(0), n))
    assert not np.array_equal(alone, many)


def test_cpu_kernel_checks_name_the_bad_input() -> None:
    q = quantize_weight(np.ones((64, 32), np.float32), "int4", 32)
    packed = pack_quant(np.asarray(q.values), q.scales, q.zeros, "int4")
    with pytest.raises(ValueError, match="x's last dim 48"):
        dense_quant_packed(jnp.ones((2, 48)), packed, None, 32)
    with pytest.raises(ValueError, match="out_features=40"):
        dense_quant_packed(jnp.ones((2, 64)), packed, None, 40)
    with pytest.raises(ValueError, match="zeros must be given exactly for int4"):
        pack_quant(np.asarray(q.values), q.scales, None, "int4")
    with pytest.raises(ValueError, match="takes int8 values"):
        pack_quant(np.zeros((64, 32), np.uint8), q.scales, None, "int8")
    with pytest.raises(ValueError, match="group size 24 must be even and divide"):
        quantize_weight(np.ones((64, 32), np.float32), "int8", 24)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_embedding_lookups_read_dequantized_columns(scheme: str) -> None:
    """A quantized tied embedding is stored as W = E^T; a lookup of ids is W[:, ids]^T, both
    unpacked (XLA path) and packed (CPU kernel path)."""
    rng = np.random.default_rng(3)
    q = quantize_weight(rng.normal(size=(64, 70)).astype(np.float32), scheme,
                        32 if scheme == "int4" else None)
    w = numpy_dequantize(q)
    ids = np.array([[0, 69, 15], [16, 33, 1]])
    qj = jax.tree.map(jnp.asarray, q)
    tol = dequant_atol(q).T[ids]
    assert np.all(np.abs(np.asarray(qj.columns(jnp.asarray(ids))) - w.T[ids]) <= tol)
    packed = PackedWeight(jax.tree.map(jnp.asarray, pack_quant(
        np.asarray(q.values), q.scales, q.zeros, scheme)), out_features=70)
    assert np.all(np.abs(np.asarray(packed.rows(jnp.asarray(ids))) - w.T[ids]) <= tol)


# ------------------------------------------------------------------------------ GGUF blocks
def _gguf_params(tmp_path, qtype: gguf.GGMLQuantizationType | None = None,  # noqa: ANN202
                 types: dict[str, gguf.GGMLQuantizationType] | None = None):
    """The tiny GGUF's lazy params: every 2-D tensor stored as `qtype`, or as `types` says."""
    from support.gguf_files import tiny_weights, write_tiny_gguf

    weights = tiny_weights(np.random.default_rng(4))
    if qtype is not None:
        types = {name: qtype for name, w in weights.items() if w.ndim == 2}
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, weights, types=types)
    ckpt = open_gguf(path)
    cfg = config_from_hf(ckpt.hf_config)
    return host_params_from_hf(cfg, ckpt.tensors, jnp.float32)


@pytest.mark.parametrize("qtype,scheme", [("Q8_0", "int8"), ("Q4_0", "int4"),
                                          ("Q4_1", "int4")])
def test_gguf_blocks_load_as_they_are(tmp_path, qtype: str, scheme: str) -> None:
    """Under "auto" every dense weight stored as Q8_0 / Q4_0 / Q4_1 becomes that scheme with
    groups of 32, and dequantizes to exactly what gguf-py dequantizes the file to (including
    the llama q/k rows llama.cpp permuted)."""
    host = _gguf_params(tmp_path, getattr(gguf.GGMLQuantizationType, qtype))
    params: LlamaParams = quantize_params(host, WeightQuant())
    for name in ("wq", "wk", "wo", "w_down"):
        q = getattr(params.layers, name)
        assert isinstance(q, QuantizedWeight) and q.scheme == scheme and q.group_size == 32
        float_leaf = np.asarray(getattr(host.layers, name)[...])
        # gguf-py evaluates the same d * q (+ m) in float32: dequant_atol.
        assert np.all(np.abs(numpy_dequantize(q) - float_leaf) <= dequant_atol(q)), name
    for name in ("lm_head", "embed"):  # both stored transposed, [hidden, vocab]
        q = getattr(params, name)
        assert isinstance(q, QuantizedWeight) and q.scheme == scheme
        leaf = np.asarray(getattr(host, name)[...])
        want = leaf if name == "lm_head" else leaf.T
        assert np.all(np.abs(numpy_dequantize(q) - want) <= dequant_atol(q)), name
    # "none" keeps everything float; an explicit scheme leaves the lm_head and embedding be.
    assert quantize_params(host, WeightQuant("none")) is host
    explicit = quantize_params(host, WeightQuant(scheme))
    assert isinstance(explicit.layers.wq, QuantizedWeight)
    assert not isinstance(explicit.lm_head, QuantizedWeight)


def test_gguf_mixed_types_fall_back_to_int8(tmp_path, caplog) -> None:
    """Layers stored in different quant types share no scheme: dequantized and quantized to
    int8 in groups of 32, with a log line; float-stored fields stay float under auto."""
    from support.gguf_files import TINY

    types = {f"model.layers.{i}.mlp.down_proj.weight":
             (gguf.GGMLQuantizationType.Q8_0 if i == 0 else gguf.GGMLQuantizationType.Q4_1)
             for i in range(TINY["layers"])}
    host = _gguf_params(tmp_path, types=types)
    with caplog.at_level("INFO"):
        params = quantize_params(host, WeightQuant())
    down = params.layers.w_down
    assert isinstance(down, QuantizedWeight) and down.scheme == "int8" and down.group_size == 32
    assert "Q4_1/Q8_0" in caplog.text
    assert not isinstance(params.layers.wq, QuantizedWeight)  # stored F32


def test_options_are_checked_where_they_are_given() -> None:
    with pytest.raises(ValueError, match="quantization='int3'"):
        EngineConfig(quantization="int3")
    with pytest.raises(ValueError, match="quantization_group_size=33"):
        EngineConfig(quantization="int4", quantization_group_size=33)
    with pytest.raises(ValueError, match="fp8_activations='on' needs quantization='fp8'"):
        EngineConfig(quantization="int8", fp8_activations="on")
    with pytest.raises(ValueError, match="per-column weight scales"):
        WeightQuant("fp8", 32, act_fp8=True)
    from jaxserve.cli.flags import add_engine_flags, engine_config_from_args
    import argparse

    p = argparse.ArgumentParser()
    add_engine_flags(p)
    cfg = engine_config_from_args(p.parse_args(
        ["--quantization", "int4", "--quantization-group-size", "64", "--quantize-lm-head"]))
    assert (cfg.quantization, cfg.quantization_group_size, cfg.quantize_lm_head) == (
        "int4", 64, True)
