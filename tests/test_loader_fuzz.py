"""Checkpoint loaders against corrupt input: every damaged file gives a clean error.

Valid tiny checkpoints are built here (safetensors with `write_safetensors`, GGUF with
`gguf.GGUFWriter` via test_gguf_loader's writer, an Orbax directory with `loading.convert`),
then damaged: truncated at random offsets, bytes flipped, header fields replaced by absurd or
wrongly typed values, files deleted or overwritten. The contract checked for every case:
  - the loader either returns, or raises a ValueError (CheckpointError / ConfigError) whose
    message names the damaged file (or the checkpoint directory);
  - a read that returns is right: the oracle is the undamaged file (safetensors: the declared
    bytes; Orbax: the original params) or `gguf.GGUFReader` (where the tensor data ends);
  - no allocation is sized by an unchecked header field: Python/numpy peak allocation during
    the call (tracemalloc) stays under a bound proportional to the file size; and no loop is
    driven by an unchecked count (a 2**63 count fails at once; a regression would hang here).
Hypothesis runs FUZZ_EXAMPLES examples per property (default 60, JAXSERVE_FUZZ_EXAMPLES=N for
a longer run).
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import struct
import tracemalloc
from typing import Callable

import gguf
import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_gguf_loader import Q, _tiny_weights, write_tiny_gguf

from jaxserve.models import hf_loader, loading
from jaxserve.models.config import ConfigError
from jaxserve.models.gguf_loader import read_gguf, read_gguf_metadata
from jaxserve.models.safetensors_io import CheckpointError, read_safetensors, write_safetensors

FUZZ_EXAMPLES = int(os.environ.get("JAXSERVE_FUZZ_EXAMPLES", "60"))
FUZZ = settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])
PEAK_SLACK = 32 << 20  # bytes beyond a small multiple of the file size


def outcome(fn: Callable[[pathlib.Path], object], path: pathlib.Path) -> object:
    """`fn(path)`'s result, or the clean error it raised (a ValueError naming `path`).

    Fails on any other exception type, on an error that names no file, and on a peak
    allocation out of proportion to the file (an unchecked size field would show here).
    """
    size = path.stat().st_size
    tracemalloc.start()
    try:
        return fn(path)
    except (CheckpointError, ConfigError) as e:
        assert str(path) in str(e), f"error does not name the file: {e}"
        return e
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak < 64 * size + PEAK_SLACK, f"peak allocation {peak} for a {size}-byte file"


# ------------------------------------------------------------------------------ safetensors
def _tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"a": rng.standard_normal((3, 5)).astype(np.float32),
            "b": rng.integers(-9, 9, (7,)).astype(np.int64),
            "c": rng.standard_normal((2, 2, 2)).astype(np.float16),
            "d": np.zeros((0, 4), np.float32)}


@pytest.fixture(scope="module")
def st_bytes(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("st") / "model.safetensors"
    write_safetensors(path, _tensors(), {"format": "pt"})
    return path.read_bytes()


def failed(result: object) -> bool:
    return isinstance(result, ValueError)


def _split(data: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), data[8 + n:]


def _with_header(path: pathlib.Path, header: object | bytes, body: bytes,
                 length: int | None = None) -> None:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + body)


def _check_read(header: dict, body: bytes, got: dict[str, np.ndarray]) -> None:
    """Oracle for a read that returned: each array is exactly its declared bytes."""
    for name, arr in got.items():
        begin, end = header[name]["data_offsets"]
        assert list(arr.shape) == header[name]["shape"]
        assert arr.tobytes() == body[begin:end]


def test_valid_file_reads_back(tmp_path: pathlib.Path, st_bytes: bytes) -> None:
    path = tmp_path / "ok.safetensors"
    path.write_bytes(st_bytes)
    got = outcome(read_safetensors, path)
    assert isinstance(got, dict) and set(got) == set(_tensors())
    for name, arr in _tensors().items():
        np.testing.assert_array_equal(got[name], arr)


@FUZZ
@given(cut=st.floats(0.0, 1.0, exclude_max=True))
def test_safetensors_truncated_anywhere(tmp_path: pathlib.Path, st_bytes: bytes,
                                        cut: float) -> None:
    path = tmp_path / "cut.safetensors"
    path.write_bytes(st_bytes[:int(cut * len(st_bytes))])
    # The last tensor ends at the end of the file, so every strict prefix is damaged.
    assert failed(outcome(read_safetensors, path))


@FUZZ
@given(flips=st.lists(st.tuples(st.floats(0.0, 1.0, exclude_max=True), st.integers(0, 255)),
                      min_size=1, max_size=4))
def test_safetensors_byte_flips(tmp_path: pathlib.Path, st_bytes: bytes,
                                flips: list[tuple[float, int]]) -> None:
    data = bytearray(st_bytes)
    (n,) = struct.unpack("<Q", data[:8])
    for where, value in flips:  # inside the length and the JSON header
        data[int(where * (8 + n))] = value
    path = tmp_path / "flip.safetensors"
    path.write_bytes(bytes(data))
    got = outcome(read_safetensors, path)
    if not failed(got):
        _check_read(*_split(bytes(data)), got)  # type: ignore[arg-type]


JSON_JUNK = st.recursive(
    st.none() | st.booleans() | st.text(max_size=8) | st.floats(allow_nan=False)
    | st.integers(-(2**70), 2**70) | st.sampled_from([2**63, 2**64, -1, 0, 1, 1e300]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner,
                                                                max_size=3),
    max_leaves=8)


@FUZZ
@given(field=st.sampled_from(["dtype", "shape", "data_offsets", None]), value=JSON_JUNK,
       victim=st.sampled_from(sorted(_tensors())))
def test_safetensors_header_fields_of_any_type(tmp_path: pathlib.Path, st_bytes: bytes,
                                               field: str | None, value: object,
                                               victim: str) -> None:
    header, body = _split(st_bytes)
    if field is None:
        header[victim] = value  # the whole entry
    else:
        header[victim][field] = value
    path = tmp_path / "junk.safetensors"
    _with_header(path, header, body)
    got = outcome(read_safetensors, path)
    if not failed(got):
        _check_read(header, body, got)  # type: ignore[arg-type]


def _entry(dtype: str = "F32", shape: object = (4,), offsets: object = (0, 16)) -> dict:
    return {"dtype": dtype, "shape": list(shape) if isinstance(shape, tuple) else shape,
            "data_offsets": list(offsets) if isinstance(offsets, tuple) else offsets}


ST_CASES: dict[str, tuple[object, bytes, int | None, str]] = {
    # name: (header, body, header length written (None: the true one), expected message)
    "length 2**63": ({}, b"", 2**63, "header length"),
    "length past the end": ({"x": _entry()}, bytes(16), 10_000, "header length"),
    "length over the format limit": ({}, b"", 100 * 1024 * 1024 + 1, "header length"),
    "length 0": ({}, bytes(16), 0, "not valid JSON"),
    "garbage JSON": (b"{\"x\": [1, 2", bytes(16), None, "not valid JSON"),
    "not UTF-8": (b"\xff\xfe{}", bytes(16), None, "not valid JSON"),
    "deeply nested": (b"[" * 100_000 + b"]" * 100_000, b"", None, "not valid JSON"),
    "integer past the digit limit": (b"{\"x\": 1" + b"0" * 5000 + b"}", b"", None, "JSON"),
    "header a list": ([1, 2], b"", None, "not a JSON object"),
    "entry a list": ({"x": [1]}, bytes(16), None, "malformed header entry"),
    "missing field": ({"x": {"dtype": "F32", "shape": [4]}}, bytes(16), None, "malformed"),
    "unknown dtype": ({"x": _entry(dtype="F12")}, bytes(16), None, "unknown dtype 'F12'"),
    "dtype a list": ({"x": _entry(dtype=["F32"])}, bytes(16), None, "unknown dtype"),
    "shape an int": ({"x": _entry(shape=4)}, bytes(16), None, "shape 4"),
    "shape of strings": ({"x": _entry(shape=["4"])}, bytes(16), None, "shape"),
    "shape of floats": ({"x": _entry(shape=[2.0, 2.0])}, bytes(16), None, "shape"),
    "negative shape": ({"x": _entry(shape=(-2, -2))}, bytes(16), None, "non-negative"),
    "shape product overflows int64": ({"x": _entry(shape=(2**32, 2**32, 4), offsets=(0, 0))},
                                      b"", None, "need"),
    "shape past 2**64": ({"x": _entry(shape=(2**64, 2**64))}, bytes(16), None, "need"),
    "shape disagrees with bytes": ({"x": _entry(shape=(5,))}, bytes(16), None, "need 20"),
    "offsets beyond the file": ({"x": _entry(offsets=(2**62, 2**62 + 16))}, bytes(16), None,
                                "truncated"),
    "offsets reversed": ({"x": _entry(shape=(0,), offsets=(16, 0))}, bytes(16), None,
                         "begin <= end"),
    "three offsets": ({"x": _entry(offsets=(0, 16, 32))}, bytes(32), None, "[begin, end]"),
    "negative offset": ({"x": _entry(offsets=(-16, 0))}, bytes(16), None, "non-negative"),
    "overlapping tensors": ({"x": _entry(), "y": _entry(offsets=(8, 24))}, bytes(24), None,
                            "overlap"),
}


@pytest.mark.parametrize("case", sorted(ST_CASES))
def test_safetensors_crafted(tmp_path: pathlib.Path, case: str) -> None:
    header, body, length, message = ST_CASES[case]
    path = tmp_path / "bad.safetensors"
    _with_header(path, header, body, length)
    got = outcome(read_safetensors, path)
    assert isinstance(got, CheckpointError) and message in str(got), got


def test_safetensors_too_short_for_a_length(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "x.safetensors"
    path.write_bytes(b"abc")
    with pytest.raises(CheckpointError, match="truncated"):
        read_safetensors(path)


# ------------------------------------------------------------------------- config.json, index
@pytest.fixture()
def hf_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    d = tmp_path / "hf"
    d.mkdir()
    cfg = {"model_type": "llama", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 96,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "eos_token_id": 2}
    (d / "config.json").write_text(json.dumps(cfg))
    return d


CONFIG_CASES: dict[str, tuple[str, bytes | Callable[[dict], None]]] = {
    # name: (file, raw bytes or an edit of the valid config)
    "garbage bytes": ("config.json", b"\x00\xffnot json"),
    "truncated": ("config.json", b"{\"model_type\": \"lla"),
    "a list": ("config.json", b"[1, 2]"),
    "deeply nested": ("config.json", b"{\"a\": " + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    "hidden_size a string": ("config.json", lambda c: c.update(hidden_size="64")),
    "hidden_size infinite": ("config.json", b"{\"model_type\": \"llama\", \"hidden_size\": 1e999}"),
    "vocab_size infinite": ("config.json", lambda c: c.update(vocab_size=float("inf"))),
    "vocab_size a list": ("config.json", lambda c: c.update(vocab_size=[96])),
    "layers negative": ("config.json", lambda c: c.update(num_hidden_layers=-2)),
    "heads zero": ("config.json", lambda c: c.update(num_attention_heads=0)),
    "architectures an int": ("config.json", lambda c: (c.pop("model_type"),
                                                        c.update(architectures=5))),
    "architectures a dict": ("config.json", lambda c: (c.pop("model_type"),
                                                        c.update(architectures={"a": 1}))),
    "eos a string": ("config.json", lambda c: c.update(eos_token_id="</s>")),
    "eos a list of dicts": ("config.json", lambda c: c.update(eos_token_id=[{}])),
    "rope_scaling a list": ("config.json", lambda c: c.update(rope_scaling=[1])),
    "rope_theta a string": ("config.json", lambda c: c.update(rope_theta="big")),
    "missing field": ("config.json", lambda c: c.pop("intermediate_size")),
    "generation_config garbage": ("generation_config.json", b"\xff"),
    "generation_config a list": ("generation_config.json", b"[]"),
    "generation_config eos a string": ("generation_config.json", b"{\"eos_token_id\": \"x\"}"),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_config_json_damaged(hf_dir: pathlib.Path, case: str) -> None:
    name, damage = CONFIG_CASES[case]
    path = hf_dir / name
    if callable(damage):
        cfg = json.loads(path.read_text())
        damage(cfg)
        path.write_text(json.dumps(cfg))
    else:
        path.write_bytes(damage)
    with pytest.raises((CheckpointError, ConfigError)) as e:
        hf_loader.read_hf_config(hf_dir)
    assert str(path) in str(e.value)


def test_config_json_missing(hf_dir: pathlib.Path) -> None:
    (hf_dir / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        hf_loader.read_hf_config(hf_dir)


@pytest.mark.parametrize("weight_map", [
    None, [1], {"x": 5}, {"x": "../outside.safetensors"}, {"x": "/etc/passwd"}, {"x": ""},
    {"x": ".."}, {"x": "sub/dir.safetensors"}])
def test_index_damaged(hf_dir: pathlib.Path, weight_map: object) -> None:
    index = hf_dir / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="weight_map") as e:
        hf_loader.read_hf_tensors(hf_dir)
    assert str(index) in str(e.value)


def test_index_shards_holding_the_same_tensor(hf_dir: pathlib.Path) -> None:
    for shard in ("a.safetensors", "b.safetensors"):
        write_safetensors(hf_dir / shard, {"x": np.zeros(4, np.float32)})
    (hf_dir / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"x": "a.safetensors", "y": "b.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"b\.safetensors: tensors also found.*'x'"):
        hf_loader.read_hf_tensors(hf_dir)


# ------------------------------------------------------------------------------------- GGUF
@pytest.fixture(scope="module")
def gguf_bytes(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path, _tiny_weights(np.random.default_rng(0)),
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
    assert len(ckpt.tensors) == len(_tiny_weights(np.random.default_rng(0)))  # type: ignore[attr-defined]


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
    from engine_fixtures import VOCAB, tiny_model
    from hf_models import save_tiny_tokenizer

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
