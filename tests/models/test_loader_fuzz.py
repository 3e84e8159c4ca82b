"""Checkpoint loaders against corrupt input: every damaged file gives a clean error (safetensors,
config.json and the index here; GGUF and Orbax in test_loader_fuzz_gguf_orbax.py).

Valid tiny checkpoints are built here (safetensors with `write_safetensors`, GGUF with
`gguf.GGUFWriter` via support.gguf_files' writer, an Orbax directory with `loading.convert`),
then damaged: truncated at random offsets, bytes flipped, header fields replaced by absurd or
wrongly typed values, files deleted or overwritten. The contract checked for every case:
  - the loader either returns, or raises a ValueError (CheckpointError / ConfigError) whose
    message names the damaged file (or the checkpoint directory);
  - a read that returns is right: the oracle is the undamaged file (safetensors: the declared
    bytes; Orbax: the original params) or `gguf.GGUFReader` (where the tensor data ends);
  - no allocation is sized by an unchecked header field: Python/numpy peak allocation during
    the call (tracemalloc) stays under a bound proportional to the file size; and no loop is
    driven by an unchecked count (a 2**63 count fails at once; a regression would hang here).
Hypothesis runs FUZZ_EXAMPLES examples per property (support.tiers.fuzz_examples: 15 in the
default tier, 60 with JAXSERVE_RUN_SLOW=1, JAXSERVE_FUZZ_EXAMPLES=N for
a longer run).
"""

from __future__ import annotations

import json
import pathlib
import struct
from typing import Callable

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from support.loader_fuzz import FUZZ, failed, outcome

from jaxserve.models import hf_loader
from jaxserve.models.config import ConfigError
from jaxserve.models.safetensors_io import CheckpointError, read_safetensors, write_safetensors


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
