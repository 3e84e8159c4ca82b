"""GGUF and Orbax loaders against corrupt input: every damaged file gives a clean error.

The contract is test_loader_fuzz's (see its docstring), the `outcome` oracle and the example
budget support.loader_fuzz's: a clean error naming the file, a right result when the read
succeeds, and no allocation or loop sized by an unchecked header field. The valid GGUF comes
from support.gguf_files' writer, the Orbax directory from `loading.convert`.
"""

from __future__ import annotations

import pathlib
import shutil
import struct

import gguf
import jax
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from support.gguf_files import Q, tiny_weights, write_tiny_gguf
from support.loader_fuzz import FUZZ, failed, outcome

from jaxserve.models import hf_loader, loading
from jaxserve.models.gguf_loader import read_gguf, read_gguf_metadata
from jaxserve.models.safetensors_io import CheckpointError


# ------------------------------------------------------------------------------------- GGUF
@pytest.fixture(scope="module")
def gguf_bytes(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path, tiny_weights(np.random.default_rng(0)),
                    types={"model.embed_tokens.weight": Q.Q8_0,
                           "model.layers.0.mlp.up_proj.weight": Q.Q4_1})
    return path.read_bytes()


@pytest.fixture(scope="module")
def gguf_layout(gguf_bytes: bytes, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Independent oracle (gguf's own reader): where the header ends and the tensor data ends."""
    path = tmp_path_factory.mktemp("gguf-oracle") / "tiny.gguf"
    path.write_bytes(gguf_bytes)
    reader = gguf.GGUFReader(path)
    ends = [int(t.data_offset) + int(t.n_bytes) for t in reader.tensors]
    return {"data_end": max(ends), "data_start": min(int(t.data_offset) for t in reader.tensors),
            "tensors": {t.name: (int(t.data_offset), int(t.n_bytes)) for t in reader.tensors}}


def test_gguf_valid_reads(tmp_path: pathlib.Path, gguf_bytes: bytes) -> None:
    path = tmp_path / "ok.gguf"
    path.write_bytes(gguf_bytes)
    ckpt = outcome(read_gguf, path)
    assert not failed(ckpt)
    assert len(ckpt.tensors) == len(tiny_weights(np.random.default_rng(0)))  # type: ignore[attr-defined]


@FUZZ
@given(cut=st.floats(0.0, 1.0, exclude_max=True))
def test_gguf_truncated_anywhere(tmp_path: pathlib.Path, gguf_bytes: bytes, gguf_layout: dict,
                                 cut: float) -> None:
    path = tmp_path / "cut.gguf"
    size = int(cut * len(gguf_bytes))
    path.write_bytes(gguf_bytes[:size])
    got = outcome(read_gguf, path)
    assert failed(got) == (size < gguf_layout["data_end"])  # only trailing padding may go


@FUZZ
@given(flips=st.lists(st.tuples(st.floats(0.0, 1.0, exclude_max=True), st.integers(0, 255)),
                      min_size=1, max_size=4))
def test_gguf_header_byte_flips(tmp_path: pathlib.Path, gguf_bytes: bytes, gguf_layout: dict,
                                flips: list[tuple[float, int]]) -> None:
    data = bytearray(gguf_bytes)
    for where, value in flips:  # inside magic, counts, metadata and the tensor table
        data[int(where * gguf_layout["data_start"])] = value
    path = tmp_path / "flip.gguf"
    path.write_bytes(bytes(data))
    outcome(read_gguf, path)
    outcome(read_gguf_metadata, path)


def _s(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def _kv(key: str, vtype: int, value: bytes) -> bytes:
    return _s(key) + struct.pack("<I", vtype) + value


def _gguf(n_tensors: int, n_kv: int, body: bytes, version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv) + body


_ARCH = _kv("general.architecture", 8, _s("llama"))
GGUF_CASES: dict[str, tuple[bytes, str]] = {
    "bad magic": (b"GGML" + bytes(100), "not a GGUF file"),
    "version 1": (_gguf(0, 0, b"", version=1), "version 1"),
    "version 2**31": (_gguf(0, 0, b"", version=2**31), "version"),
    "metadata count 2**63": (_gguf(0, 2**63, bytes(10_000)), "metadata count"),
    "tensor count 2**63": (_gguf(2**63, 0, bytes(10_000)), "tensor count"),
    "tensor count past the metadata": (_gguf(300, 2, _ARCH + _kv("pad", 8, _s("x" * 9600))
                                             + bytes(100)), "tensor count"),
    "key length 2**63": (_gguf(0, 1, struct.pack("<Q", 2**63) + bytes(100)), "needs"),
    "string value past the end": (_gguf(0, 1, _kv("a", 8, struct.pack("<Q", 10**6) + b"x")),
                                  "needs"),
    "key not UTF-8": (_gguf(0, 1, struct.pack("<Q", 2) + b"\xff\xfe" + bytes(20)), "UTF-8"),
    "unknown value type": (_gguf(0, 1, _kv("a", 99, bytes(16))), "unknown value type 99"),
    "unknown element type": (_gguf(0, 1, _kv("a", 9, struct.pack("<IQ", 77, 1) + bytes(8))),
                             "unknown array element type 77"),
    "u8 array of 2**62": (_gguf(0, 1, _kv("a", 9, struct.pack("<IQ", 0, 2**62))), "needs"),
    "string array of 2**62": (_gguf(0, 1, _kv("a", 9, struct.pack("<IQ", 8, 2**62))),
                              "length of metadata 'a'"),
    "array array of 2**62": (_gguf(0, 1, _kv("a", 9, struct.pack("<IQ", 9, 2**62))),
                             "length of metadata 'a'"),
    "arrays nested 10000 deep": (_gguf(0, 1, _kv("a", 9, struct.pack("<IQ", 9, 1) * 10_000)),
                                 "deeper than"),
    "rank 0": (_gguf(1, 0, _s("t") + struct.pack("<I", 0) + bytes(40)), "invalid rank 0"),
    "rank 2**31": (_gguf(1, 0, _s("t") + struct.pack("<I", 2**31) + bytes(40)), "invalid rank"),
    "dims past the end": (_gguf(1, 0, _s("t") + struct.pack("<IQ", 4, 1) + bytes(20)),
                          "dims of 't'"),
    "alignment 0": (_gguf(0, 1, _kv("general.alignment", 4, struct.pack("<I", 0))),
                    "general.alignment"),
    "alignment 2**63": (_gguf(0, 1, _kv("general.alignment", 10, struct.pack("<Q", 2**63))),
                        "general.alignment"),
    "alignment not a power of two": (_gguf(0, 1, _kv("general.alignment", 4,
                                                     struct.pack("<I", 24))), "alignment"),
    "alignment a bool": (_gguf(0, 1, _kv("general.alignment", 7, b"\x01")), "alignment"),
    "per-layer list of lists": (_gguf(0, 2, _ARCH + _kv(
        "llama.embedding_length", 9, struct.pack("<IQ", 9, 2) + struct.pack("<IQ", 4, 0) * 2)),
        "must be an integer"),
}


@pytest.mark.parametrize("case", sorted(GGUF_CASES))
def test_gguf_crafted(tmp_path: pathlib.Path, case: str) -> None:
    data, message = GGUF_CASES[case]
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    got = outcome(read_gguf, path)
    assert failed(got) and message in str(got), got


def _tensor_offset_field(data: bytes, name: str, n_dims: int) -> int:
    """Byte position of a tensor-table entry's data offset (after name, rank, dims, type)."""
    at = data.index(_s(name))
    return at + len(_s(name)) + 4 + 8 * n_dims + 4


@pytest.mark.parametrize("offset, message", [(0, "overlap"), (2**62, "truncated")])
def test_gguf_tensor_offset_damaged(tmp_path: pathlib.Path, gguf_bytes: bytes,
                                    offset: int, message: str) -> None:
    data = bytearray(gguf_bytes)
    at = _tensor_offset_field(gguf_bytes, "blk.1.ffn_down.weight", 2)
    data[at:at + 8] = struct.pack("<Q", offset)  # onto the first tensor's data / far away
    path = tmp_path / "offset.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=message) as e:
        read_gguf(path)
    assert str(path) in str(e.value)


@pytest.mark.parametrize("dims", [(2**63, 2**63), (0, 64), (2**32, 2**32)])
def test_gguf_tensor_dims_damaged(tmp_path: pathlib.Path, gguf_bytes: bytes,
                                  dims: tuple[int, int]) -> None:
    data = bytearray(gguf_bytes)
    at = _tensor_offset_field(gguf_bytes, "blk.0.ffn_gate.weight", 2) - 4 - 16
    data[at:at + 16] = struct.pack("<2Q", *dims)
    path = tmp_path / "dims.gguf"
    path.write_bytes(bytes(data))
    got = outcome(read_gguf, path)
    assert failed(got) and "blk.0.ffn_gate.weight" in str(got), got


def test_gguf_unknown_tensor_type(tmp_path: pathlib.Path, gguf_bytes: bytes) -> None:
    data = bytearray(gguf_bytes)
    at = _tensor_offset_field(gguf_bytes, "output_norm.weight", 1) - 4
    data[at:at + 4] = struct.pack("<I", 200)
    path = tmp_path / "type.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="unknown GGML type id 200"):
        read_gguf(path)


# ------------------------------------------------------------------------------------ Orbax
@pytest.fixture(scope="module")
def orbax_ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, list]:
    from support.engine_fixtures import VOCAB, tiny_model
    from support.hf_models import save_tiny_tokenizer

    root = tmp_path_factory.mktemp("orbax")
    model = tiny_model()
    hf_loader.save_hf_dir(root / "hf", model.config, model.params)
    save_tiny_tokenizer(root / "hf", VOCAB)
    dst = loading.convert(root / "hf", root / "orbax", fmt="orbax")
    return dst, [np.asarray(x) for x in jax.tree.leaves(model.params)]


def _orbax_files() -> list[str]:
    """The files a jaxserve Orbax checkpoint of the tiny model holds (read at collection)."""
    return ["config.json", "generation_config.json", "jaxserve.json", "tokenizer.json",
            "tokenizer_config.json", "params/_CHECKPOINT_METADATA", "params/state/_METADATA",
            "params/state/_sharding", "params/state/manifest.ocdbt",
            "params/state/array_metadatas/process_0", "params/state/ocdbt.process_0/d/*",
            "params/state/ocdbt.process_0/manifest.ocdbt", "params/state/d/*"]


def _damage(path: pathlib.Path, how: str) -> None:
    if how == "delete":
        path.unlink()
    elif how == "truncate":
        path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])
    else:
        path.write_bytes(np.random.default_rng(0).bytes(max(1, path.stat().st_size)))


# Damage that must be refused (the rest may load, and then must load the original weights).
ORBAX_MUST_FAIL = {"config.json", "tokenizer.json", "params/state/_METADATA",
                   "params/state/ocdbt.process_0/d/*"}


@pytest.mark.parametrize("how", ["delete", "truncate", "garbage"])
@pytest.mark.parametrize("name", _orbax_files())
def test_orbax_damaged_file(tmp_path: pathlib.Path, orbax_ckpt: tuple[pathlib.Path, list],
                            name: str, how: str) -> None:
    src, original = orbax_ckpt
    ckpt = tmp_path / "ckpt"
    shutil.copytree(src, ckpt)
    (victim,) = ckpt.glob(name)
    _damage(victim, how)
    try:
        model = loading.load_model(ckpt)
    except (ValueError, FileNotFoundError) as e:  # tokenizer errors: ValueError/FileNotFound
        assert str(ckpt) in str(e), f"error does not name the checkpoint: {e}"
        return
    assert name not in ORBAX_MUST_FAIL, f"{how} {name} loaded"
    for got, want in zip(jax.tree.leaves(model.params), original, strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)


def test_orbax_missing_params_dir(tmp_path: pathlib.Path,
                                  orbax_ckpt: tuple[pathlib.Path, list]) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(orbax_ckpt[0], ckpt)
    shutil.rmtree(ckpt / "params")
    with pytest.raises(CheckpointError, match="no Orbax params directory"):
        loading.load_model(ckpt)
