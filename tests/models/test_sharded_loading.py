"""Weights load straight into their tensor-parallel shardings, each device reading its slice.

In a subprocess with 8 virtual devices (`tests/support/workers/sharded_load_worker.py`; the device count is
fixed when jax starts): tiny models saved as HF safetensors, Orbax and GGUF (mixed quant types),
one with KV heads that TP 4 must replicate, loaded with `load_model(path, mesh=..., quant=none)` (float: the per-device reads) at TP 2 / 4.
Checked: every leaf equals the reference path (`place_params(load_model(path).params)`) exactly,
with the same sharding; each device holds exactly its share of the bytes; and every box asked of
a checkpoint tensor is exactly one device's slice of it (no tensor of a split leaf read whole,
each read once per device). In-process: the lazy views read exactly what a full read then a
slice would give, and GGUF dequantizes only the rows and quant blocks a box covers. And a TP 4
engine over a GGUF loaded onto its mesh (its quant blocks as stored) generates the TP 1
greedy tokens.
"""

from __future__ import annotations

import pathlib

import jax.numpy as jnp
import numpy as np
import pytest
from support.engine_fixtures import run_device_worker

from jaxserve.models import gguf_tensor
from jaxserve.models.gguf_loader import open_gguf, read_gguf
from jaxserve.models.host_arrays import LazyLeaf, RepeatedHeads

# The module's fixture runs a subprocess worker with its own 900 s limit; its first test
# (which builds the fixture) may take that long, and the limit lies past it so that the
# worker's TimeoutExpired, with its stderr, is what reports a hang.
pytestmark = pytest.mark.timeout(960)


@pytest.fixture(scope="module")
def worker() -> dict:
    return run_device_worker("sharded_load_worker.py")


@pytest.fixture(scope="module")
def rows(worker: dict) -> list[dict]:
    return worker["loads"]


CASES = [(m, f, tp) for m, fmts in (("llama_bias", ("hf", "orbax", "gguf")),
                                    ("qwen3_tied", ("hf", "orbax"))) for f in fmts for tp in (2, 4)]


def _row(rows: list[dict], model: str, fmt: str, tp: int) -> dict:
    return next(r for r in rows if (r["model"], r["format"], r["tp"]) == (model, fmt, tp))


@pytest.mark.parametrize("model,fmt,tp", CASES)
def test_equals_the_reference_path(rows: list[dict], model: str, fmt: str, tp: int) -> None:
    r = _row(rows, model, fmt, tp)
    assert r["same_tree"] and r["mismatched"] == []
    assert r["idempotent"]  # build_engine's place_params leaves loaded-onto-mesh params as they are


def test_engine_over_a_gguf_loaded_onto_its_mesh(worker: dict) -> None:
    """TP 4 (KV heads replicated) straight from a quantized GGUF: the TP 1 greedy tokens."""
    got = worker["engine_tp4"]
    assert len(got["tp1"]) == 8 and got["sharded_load"] == got["tp1"]
    assert got["quantized"] == ["wq", "wo", "w_down"]  # its blocks as stored (auto)


def _leaf_bytes(c: dict, tp: int) -> tuple[int, int]:
    """(bytes every device holds, bytes split over tp) of the placed f32 params."""
    L, H, I, V = c["num_layers"], c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    q, kv = c["num_heads"] * c["head_dim"], c["num_kv_heads"] * c["head_dim"]
    kv *= max(1, tp // c["num_kv_heads"])  # placed with replicated KV heads
    whole = 2 * L * H + H + (2 * L * c["head_dim"] if c["qk_norm"] else 0)
    split = L * (H * q + 2 * H * kv + q * H + 3 * H * I)
    split += L * (q + 2 * kv) if c["attention_bias"] else 0
    vocab = V * H * (1 if c["tie_word_embeddings"] else 2)
    if V % tp:
        whole += vocab
    else:
        split += vocab
    return 4 * whole, 4 * split


@pytest.mark.parametrize("model,fmt,tp", CASES)
def test_each_device_holds_its_share(rows: list[dict], model: str, fmt: str, tp: int) -> None:
    r = _row(rows, model, fmt, tp)
    whole, split = _leaf_bytes(r["config"], tp)
    assert r["total_bytes"] == whole + split
    assert r["device_bytes"] == [whole + split // tp] * tp


def _expected_read(name: str, full: list[int], c: dict, tp: int) -> tuple[list[int], int]:
    """The shape of one device's box of HF tensor `name`, and how many devices read it."""
    rep = max(1, tp // c["num_kv_heads"])
    if name.endswith(("norm.weight",)):
        return full, 1  # replicated: read once for all devices
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return ([full[0] // tp, full[1]], tp) if c["vocab_size"] % tp == 0 else (full, 1)
    if ".o_proj." in name or ".down_proj." in name:  # rows of [in, out] = HF columns
        return [full[0], full[1] // tp], tp
    share = rep if (".k_proj." in name or ".v_proj." in name) else 1
    return [full[0] * share // tp, *full[1:]], tp  # outputs = HF rows (one head when rep > 1)


@pytest.mark.parametrize("model,fmt,tp", [c for c in CASES if c[1] != "orbax"])
def test_host_tensors_read_per_device_slices_only(rows: list[dict], model: str, fmt: str,
                                                  tp: int) -> None:
    r = _row(rows, model, fmt, tp)
    reads: dict[str, list[list[int]]] = {}
    fulls: dict[str, list[int]] = {}
    for name, shape, full in r["reads"]:
        reads.setdefault(name, []).append(shape)
        fulls[name] = full
    c = r["config"]
    n_layer_tensors = 9 + (3 if c["attention_bias"] else 0) + (2 if c["qk_norm"] else 0)
    assert len(reads) == c["num_layers"] * n_layer_tensors + 2 + (
        0 if c["tie_word_embeddings"] else 1)
    for name, shapes in reads.items():
        box, count = _expected_read(name, fulls[name], c, tp)
        assert shapes == [box] * count, (name, fulls[name])


# ------------------------------------------------------------------ the lazy views, in-process
def test_repeated_heads_reads_only_the_heads_a_box_covers() -> None:
    heads, d, rep = 3, 4, 4
    base = np.random.default_rng(0).normal(size=(2, 5, heads * d)).astype(np.float32)
    ref = np.repeat(base.reshape(2, 5, heads, d), rep, axis=2).reshape(2, 5, -1)
    asked: list[tuple[slice, ...]] = []

    class Src:
        shape, dtype = base.shape, base.dtype

        def __getitem__(self, box: tuple[slice, ...]) -> np.ndarray:
            asked.append(box)
            return base[box]

    view = RepeatedHeads(Src(), heads, rep)
    assert view.shape == ref.shape
    width = heads * d * rep
    for lo, hi in [(0, width), (0, d), (d, 2 * d), (5, 11), (3 * d * rep - 1, 3 * d * rep + 2),
                   (width - d, width), (7, 7)]:
        box = (slice(0, 2), slice(1, 4), slice(lo, hi))
        np.testing.assert_array_equal(view[box], ref[box])
        if hi - lo == d and lo % d == 0:  # one device's repeated head: one original head read
            assert asked[-1][-1].stop - asked[-1][-1].start == d
    # jax arrays as the base (params already on a device) slice the same way.
    np.testing.assert_array_equal(np.asarray(RepeatedHeads(jnp.asarray(base), heads, rep)[
        (slice(0, 2), slice(0, 5), slice(d, 3 * d))]), ref[:, :, d:3 * d])


def test_lazy_leaf_stacks_transposes_and_casts_only_the_box() -> None:
    rng = np.random.default_rng(1)
    layers = [rng.normal(size=(6, 10)).astype(np.float32) for _ in range(3)]  # HF [out, in]
    leaf = LazyLeaf("w", layers, (3, 10, 6), np.dtype(jnp.bfloat16), transpose=True,
                    stacked=True)
    ref = np.stack([w.T for w in layers]).astype(jnp.bfloat16)
    for box in [(slice(0, 3), slice(0, 10), slice(0, 6)), (slice(1, 3), slice(2, 7), slice(3, 6)),
                (slice(0, 1), slice(0, 10), slice(0, 0))]:
        got = leaf[box]
        assert got.dtype == jnp.bfloat16 and got.flags.c_contiguous
        np.testing.assert_array_equal(got, ref[box])
    np.testing.assert_array_equal(leaf[...], ref)
    with pytest.raises(ValueError, match="step"):
        leaf[(slice(0, 3, 2),)]


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    from support.engine_fixtures import tiny_model
    from support.workers.sharded_load_worker import MODELS, save_gguf

    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    save_gguf(path, tiny_model(**MODELS["llama_bias"]))
    return path


def test_gguf_boxes_equal_a_full_dequantization(gguf_file: pathlib.Path) -> None:
    full = read_gguf(gguf_file).tensors
    lazy = open_gguf(gguf_file).tensors
    rng = np.random.default_rng(2)
    types = set()
    for name, t in lazy.items():
        types.add(t.type_name)
        for _ in range(4):
            box = tuple(slice(int(a), int(b)) for a, b in
                        (np.sort(rng.integers(0, n + 1, 2)) for n in t.shape))
            np.testing.assert_array_equal(t[box], full[name][box], err_msg=f"{name} {box}")
    assert {"Q8_0", "Q4_0", "F16", "F32"} <= types


def test_gguf_dequantizes_only_the_covered_rows_and_blocks(gguf_file: pathlib.Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    t = open_gguf(gguf_file).tensors["model.layers.0.self_attn.o_proj.weight"]  # Q8_0 [64, 64]
    assert t.type_name == "Q8_0" and t.shape == (64, 64)
    seen: list[tuple[int, ...]] = []
    real = gguf_tensor.quants.dequantize

    def spy(raw: np.ndarray, qtype: object) -> np.ndarray:
        seen.append(raw.shape)
        return real(raw, qtype)

    monkeypatch.setattr(gguf_tensor.quants, "dequantize", spy)
    t[(slice(0, 64), slice(16, 32))]  # one TP 4 device's columns: inside block 0 (of 32)
    t[(slice(8, 24), slice(32, 64))]  # some rows of block 1
    q8_block_bytes = 34  # 32 int8 + an f16 scale
    assert seen == [(64, q8_block_bytes), (16, q8_block_bytes)]
    q = open_gguf(gguf_file).tensors["model.layers.0.self_attn.q_proj.weight"]
    seen.clear()
    q[(slice(8, 16), slice(0, 64))]  # head 1 of 8 (rows permuted by llama.cpp within a head)
    assert seen == [(8, 2 * q8_block_bytes)]
