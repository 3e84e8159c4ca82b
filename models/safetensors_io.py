"""Read and write `.safetensors` files with numpy, without executing anything from the file.

Data flow: file -> 8-byte little-endian header length -> JSON header {name: {dtype, shape,
data_offsets}} -> numpy views over a read-only memmap (bfloat16 via ml_dtypes). Every
inconsistency (truncated file, bad header, offsets out of range or overlapping, size mismatch,
unknown dtype, wrongly typed fields) is found before any tensor is yielded and raises
`CheckpointError` naming the file and the tensor, instead of whatever numpy would throw.
Nothing is allocated from a header field before it is checked against the file size.
Sharded checkpoints (`model.safetensors.index.json`) are resolved in `hf_loader`.
"""

from __future__ import annotations

import json
import math
import pathlib
import struct
from typing import Iterator, Mapping, NamedTuple

import ml_dtypes
import numpy as np


class CheckpointError(ValueError):
    """A checkpoint file that cannot be read; the message names the file and the tensor."""


_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in _DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024  # the format's own limit


def read_safetensors(path: str | pathlib.Path) -> dict[str, np.ndarray]:
    """All tensors of one file as read-only numpy arrays (memory-mapped, no copy)."""
    return dict(iter_safetensors(path))


def iter_safetensors(path: str | pathlib.Path) -> Iterator[tuple[str, np.ndarray]]:
    """(name, array) for every tensor; the whole header is checked before the first is yielded."""
    path = pathlib.Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file (no header length)")
            (n,) = struct.unpack("<Q", head)
            # Checked against the file before anything is allocated from it.
            if n > _MAX_HEADER or 8 + n > size:
                raise CheckpointError(
                    f"{path}: header length {n} exceeds the file size {size} "
                    "(truncated or not a safetensors file)")
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e}") from e
    try:
        header = json.loads(raw)
    # ValueError: not UTF-8, not JSON, or an integer literal past Python's digit limit;
    # RecursionError: arrays nested deeper than the parser's stack.
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{path}: header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object")
    header.pop("__metadata__", None)
    data_start = 8 + n
    data_len = size - data_start
    entries = {name: _entry(path, name, info, data_len) for name, info in header.items()}
    _check_disjoint(path, entries)
    mm = np.memmap(path, dtype=np.uint8, mode="r", offset=data_start, shape=(data_len,)) \
        if data_len > 0 else np.zeros((0,), np.uint8)
    for name, e in entries.items():
        yield name, mm[e.begin:e.end].view(e.dtype).reshape(e.shape)


class _Entry(NamedTuple):
    """One checked header entry: where its bytes lie in the data section and how to view them."""

    dtype: np.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def _ints(value: object, what: str, name: str, path: pathlib.Path) -> list[int]:
    """A JSON list of non-negative integers (no bools, floats or strings), else CheckpointError."""
    if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise CheckpointError(f"{path}: tensor {name!r} has {what} {_short(value)}; expected a list "
                              "of non-negative integers")
    return value


def _entry(path: pathlib.Path, name: str, info: object, data_len: int) -> _Entry:
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry {_short(info)}")
    dtype = _DTYPES.get(info["dtype"]) if isinstance(info["dtype"], str) else None
    if dtype is None:
        raise CheckpointError(
            f"{path}: tensor {name!r} has unknown dtype {_short(info['dtype'])}; "
            f"known: {', '.join(_DTYPES)}")
    shape = tuple(_ints(info["shape"], "shape", name, path))
    offsets = _ints(info["data_offsets"], "data_offsets", name, path)
    if len(offsets) != 2 or offsets[0] > offsets[1]:
        raise CheckpointError(f"{path}: tensor {name!r} has data_offsets {_short(offsets)}; expected "
                              "[begin, end] with begin <= end")
    begin, end = offsets
    if end > data_len:
        raise CheckpointError(
            f"{path}: tensor {name!r} ends at byte {end} of the data section but the file holds "
            f"only {data_len} bytes: the file is truncated")
    expected = math.prod(shape) * dtype.itemsize  # python ints: no overflow on absurd shapes
    if end - begin != expected:
        raise CheckpointError(
            f"{path}: tensor {name!r} spans {end - begin} bytes but dtype {info['dtype']} and "
            f"shape {list(shape)} need {expected}")
    return _Entry(dtype, shape, begin, end)


def _short(value: object, limit: int = 120) -> str:
    """repr for an error message, cut short: a corrupt header may hold megabytes in one field."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _check_disjoint(path: pathlib.Path, entries: Mapping[str, _Entry]) -> None:
    """No two tensors share bytes (the format lays them out one after another)."""
    spans = sorted((e.begin, e.end, name) for name, e in entries.items() if e.end > e.begin)
    for (_, end0, name0), (begin1, _, name1) in zip(spans, spans[1:]):
        if begin1 < end0:
            raise CheckpointError(f"{path}: tensors {name0!r} and {name1!r} overlap in the data "
                                  f"section (byte {begin1} < {end0})")


def write_safetensors(path: str | pathlib.Path, tensors: Mapping[str, np.ndarray],
                      metadata: Mapping[str, str] | None = None) -> None:
    """Write tensors (C-contiguous copies) in the standard layout, sorted by name."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    arrays: list[np.ndarray] = []
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        if a.dtype not in _NAMES:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {a.dtype}")
        header[name] = {"dtype": _NAMES[a.dtype], "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        arrays.append(a)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # align the data section to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for a in arrays:
            f.write(a.tobytes())
