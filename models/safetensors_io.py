"""Read and write `.safetensors` files with numpy, without executing anything from the file.

Data flow: file -> 8-byte little-endian header length -> JSON header {name: {dtype, shape,
data_offsets}} -> numpy views over a read-only memmap (bfloat16 via ml_dtypes). Every
inconsistency (truncated file, bad header, offsets out of range, size mismatch, unknown dtype)
raises `CheckpointError` naming the file and the tensor, instead of whatever numpy would throw.
Sharded checkpoints (`model.safetensors.index.json`) are resolved in `hf_loader`.
"""

from __future__ import annotations

import json
import pathlib
import struct
from typing import Iterator, Mapping

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
    path = pathlib.Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file (no header length)")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                raise CheckpointError(
                    f"{path}: header length {n} exceeds the file size {size} "
                    "(truncated or not a safetensors file)")
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e}") from e
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object")
    header.pop("__metadata__", None)
    data_start = 8 + n
    data_len = size - data_start
    mm = np.memmap(path, dtype=np.uint8, mode="r", offset=data_start, shape=(data_len,)) \
        if data_len > 0 else np.zeros((0,), np.uint8)
    for name, info in header.items():
        yield name, _view(path, mm, name, info, data_len)


def _view(path: pathlib.Path, mm: np.ndarray, name: str, info: object,
          data_len: int) -> np.ndarray:
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry {info!r}")
    dtype = _DTYPES.get(info["dtype"])
    if dtype is None:
        raise CheckpointError(
            f"{path}: tensor {name!r} has unknown dtype {info['dtype']!r}; "
            f"known: {', '.join(_DTYPES)}")
    shape = tuple(int(s) for s in info["shape"])
    begin, end = (int(o) for o in info["data_offsets"])
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if end > data_len:
        raise CheckpointError(
            f"{path}: tensor {name!r} ends at byte {end} of the data section but the file holds "
            f"only {data_len} bytes: the file is truncated")
    if end - begin != expected or begin < 0:
        raise CheckpointError(
            f"{path}: tensor {name!r} spans {end - begin} bytes but dtype {info['dtype']} and "
            f"shape {list(shape)} need {expected}")
    return mm[begin:end].view(dtype).reshape(shape)


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
