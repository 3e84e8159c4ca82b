"""GGUF blocks taken as they are (`models/gguf_quant.py`), K-quants included.

Oracle: gguf-py's own dequantization (`gguf.quants.dequantize`) of the same bytes. gguf-py
cannot quantize to K-quants, so the blocks are random bytes with their f16 fields (d, dmin)
set to finite values: every 4 / 6-bit quant and 6 / 8-bit sub-scale pattern occurs. Checked:
the QuantizedWeight dequantizes to gguf-py's floats bit for bit (its scale and zero products
are exact in f32), with llama.cpp's q/k row permutation undone as the float path undoes it;
under "auto" a field of exact types loads as stored and anything else (Q5_K, mixed types)
falls back to int8 groups of 32 with a log line.
"""

from __future__ import annotations

import logging
import mmap
import pathlib

import gguf
import numpy as np
import pytest
from support.numerics import F32_UNIT_ROUNDOFF, matmul_atol

from jaxserve.kernels_pallas.dense_quant_cpu import dense_quant_packed, pack_quant
from jaxserve.models import gguf_quant, quantized_params
from jaxserve.models.gguf_tensor import GGUFTensor, TensorInfo
from jaxserve.models.host_arrays import LazyLeaf
from jaxserve.models.quant import WeightQuant

Q = gguf.GGMLQuantizationType
# type -> (scheme, group size, byte offsets of its f16 fields)
EXACT = {Q.Q4_K: ("int4", 32, (0, 2)), Q.Q6_K: ("int8", 16, (208,)),
         Q.Q8_0: ("int8", 32, (0,)), Q.Q4_0: ("int4", 32, (0,)), Q.Q4_1: ("int4", 32, (0, 2))}
F16_FIELDS = {**{t: v[2] for t, v in EXACT.items()}, Q.Q5_K: (0, 2)}


def random_blocks(rng: np.random.Generator, qtype: Q, rows: int, cols: int) -> np.ndarray:
    """u8 [rows, row bytes] of `qtype` blocks: random bytes, finite f16 fields."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for at in F16_FIELDS[qtype]:
        d = (rng.standard_normal((rows, cols // block)) * 0.01).astype(np.float16)
        raw[..., at:at + 2] = d.view(np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, -1)


class Tensors:
    """GGUFTensors over raw blocks written to files (kept mapped for the test)."""

    def __init__(self, tmp: pathlib.Path) -> None:
        self.tmp, self.files, self.n = tmp, [], 0

    def make(self, raw: np.ndarray, qtype: Q, shape: tuple[int, int],
             heads: int | None = None) -> GGUFTensor:
        self.n += 1
        path = self.tmp / f"t{self.n}.bin"
        path.write_bytes(raw.tobytes())
        f = open(path, "rb")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.files.append((f, buf))
        return GGUFTensor(buf, TensorInfo(f"blk.{self.n}.w", shape, int(qtype), 0), 0, str(path),
                          permute_heads=heads)


@pytest.fixture()
def tensors(tmp_path):
    t = Tensors(tmp_path)
    yield t
    for f, _ in t.files:
        f.close()


@pytest.mark.parametrize("qtype", sorted(EXACT, key=lambda q: q.name), ids=lambda q: q.name)
def test_blocks_dequantize_to_gguf_py_exactly(tensors, qtype) -> None:
    rng = np.random.default_rng(int(qtype))
    out_f, in_f = 16, 512
    raw = random_blocks(rng, qtype, out_f, in_f)
    t = tensors.make(raw, qtype, (out_f, in_f))
    w = gguf_quant.quantized_blocks(t)
    scheme, group, _ = EXACT[qtype]
    assert gguf_quant.block_scheme(t) == scheme and gguf_quant.block_group(t) == group
    assert w.scheme == scheme and w.group_size == group and w.shape == (in_f, out_f)
    ref = gguf.quants.dequantize(raw, qtype).reshape(out_f, in_f)
    np.testing.assert_array_equal(np.asarray(w.dequantize()).T, ref)
    if qtype == Q.Q6_K:  # values q - 32 of 6-bit q: the whole range occurs
        assert int(w.values.min()) == -32 and int(w.values.max()) == 31


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_permuted_rows_follow_the_float_path(tensors, qtype) -> None:
    """A llama q projection (4 heads of 4 rows, stored interleaved): the blocks' rows are
    taken in the order the float path reads them."""
    raw = random_blocks(np.random.default_rng(7), qtype, 16, 256)
    t = tensors.make(raw, qtype, (16, 256), heads=4)
    got = np.asarray(gguf_quant.quantized_blocks(t).dequantize()).T
    np.testing.assert_array_equal(got, t[...])
    assert not np.array_equal(got, gguf.quants.dequantize(raw, qtype).reshape(16, 256))


def _leaf(tensors: Tensors, types: list[Q], out_f: int = 32, in_f: int = 256) -> LazyLeaf:
    """A stacked [L, in, out] field over one GGUF tensor per layer."""
    rng = np.random.default_rng(len(types))
    parts = [tensors.make(random_blocks(rng, q, out_f, in_f), q, (out_f, in_f)) for q in types]
    return LazyLeaf("layers.w_up", parts, (len(parts), in_f, out_f), np.float32, True, True)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_auto_loads_k_quants_as_stored(tensors, qtype) -> None:
    leaf = _leaf(tensors, [qtype, qtype])
    w = quantized_params.quantize_leaf(leaf, WeightQuant(), "layers.w_up")
    scheme, group, _ = EXACT[qtype]
    assert w.scheme == scheme and w.group_size == group and w.values.shape[0] == 2
    for i, part in enumerate(leaf.parts):
        np.testing.assert_array_equal(np.asarray(w.dequantize()[i]).T, part[...])
    # The same scheme asked explicitly at the stored group size (or none) is still exact.
    same = quantized_params.quantize_leaf(leaf, WeightQuant(scheme, group), "layers.w_up")
    np.testing.assert_array_equal(np.asarray(same.values), np.asarray(w.values))


def test_types_without_an_exact_mapping_fall_back_with_a_log_line(tensors, caplog) -> None:
    for types, named in (([Q.Q5_K, Q.Q5_K], "Q5_K"), ([Q.Q4_K, Q.Q6_K], "Q4_K/Q6_K")):
        leaf = _leaf(tensors, types)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=quantized_params.__name__):
            w = quantized_params.quantize_leaf(leaf, WeightQuant(), "layers.w_up")
        assert w.scheme == "int8" and w.group_size == quantized_params.FALLBACK_GROUP
        assert f"stored as {named}, which maps onto no jaxserve scheme" in caplog.text
        # int8 groups of 32 of the dequantized floats: within half a step of each group, plus
        # float32 roundings: the stored step fl(max / 127) is within u step of this float64
        # one; fl(w / s) before the rounding to a code errs u |w|, fl(q s) after it u |deq|
        # (each doubled for second-order terms).
        u = F32_UNIT_ROUNDOFF
        for i, part in enumerate(leaf.parts):
            ref = part[...].T.reshape(-1, 32, part.shape[0]).astype(np.float64)
            step = np.abs(ref).max(axis=1, keepdims=True) / 127
            deq = np.asarray(w.dequantize()[i], np.float64).reshape(ref.shape)
            bound = step * (0.5 + u) + 2 * u * (np.abs(ref) + np.abs(deq))
            assert (np.abs(deq - ref) <= bound).all()


def test_an_explicit_other_group_size_requantizes_with_a_log_line(tensors, caplog) -> None:
    leaf = _leaf(tensors, [Q.Q6_K, Q.Q6_K])
    with caplog.at_level(logging.INFO, logger=quantized_params.__name__):
        w = quantized_params.quantize_leaf(leaf, WeightQuant("int8", 32), "layers.w_up")
    assert w.group_size == 32 and "stored as Q6_K; dequantized and quantized to int8" in caplog.text
    none = quantized_params.quantize_leaf(leaf, WeightQuant("none"), "layers.w_up")
    assert none is None  # "none": the float views stay


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_cpu_dense_kernel_takes_the_k_quant_layouts(tensors, qtype) -> None:
    """int4 groups of 32 and int8 groups of 16 through the C++ kernel (or its jnp reference
    where it is not built): x @ the dequantized weight, in f64 (both row-count paths)."""
    w = gguf_quant.quantized_blocks(tensors.make(
        random_blocks(np.random.default_rng(3), qtype, 40, 512), qtype, (40, 512)))
    panels = pack_quant(w.values, w.scales, w.zeros, w.scheme)
    x = np.random.default_rng(4).standard_normal((9, 512)).astype(np.float32)
    for rows in (3, 9):  # past 6 rows the kernel dequantizes panels to scratch
        got = np.asarray(dense_quant_packed(x[:rows], panels, None, 40))
        ref = x[:rows].astype(np.float64) @ np.asarray(w.dequantize(), np.float64)
        # float32 against float64: gamma_(K+3) (|x| @ |w|) (matmul_atol: each term also
        # carries the kernel's dequantization, d * sc * q - dmin * m: 3 roundings).
        wd = np.asarray(w.dequantize(), np.float64)
        assert np.all(np.abs(got - ref) <= matmul_atol(x[:rows], wd, roundings=3))
