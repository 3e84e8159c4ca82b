"""GGUF file format: header, metadata key/values and tensor table, read from a mapped file.

`parse_header` walks magic, version, metadata key/values and the tensor table and finds where
the tensor data starts; every read is bounds-checked, so a truncated or foreign file gives a
`CheckpointError` saying where and what. `read_gguf_metadata` is the plain python metadata
(the tokenizer reads its vocab/merges from here); `gguf_loader` maps header and tensors onto
an HF-shaped model. No jax here.
"""

from __future__ import annotations

import mmap
import os
import struct
from typing import NamedTuple

import numpy as np

from .gguf_tensor import TensorInfo
from .safetensors_io import CheckpointError

__all__ = ["GGUFHeader", "close_gguf", "map_gguf", "parse_header", "read_gguf_metadata"]

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)  # v1 used 32-bit counts; llama.cpp itself dropped it
DEFAULT_ALIGNMENT = 32  # GGUF spec default when general.alignment is absent

# Metadata value type id -> (struct format, numpy dtype) for the fixed-size types.
_SCALAR_TYPES = {0: ("<B", "<u1"), 1: ("<b", "<i1"), 2: ("<H", "<u2"), 3: ("<h", "<i2"),
                 4: ("<I", "<u4"), 5: ("<i", "<i4"), 6: ("<f", "<f4"), 7: ("<?", "<u1"),
                 10: ("<Q", "<u8"), 11: ("<q", "<i8"), 12: ("<d", "<f8")}
_STRING, _ARRAY, _BOOL = 8, 9, 7
# Fewest bytes one entry can occupy: a count read from the file is checked against the bytes
# left before it drives a loop (a corrupt count of 2**63 fails at once, not after a long walk).
_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, a one-byte value
_MIN_TENSOR_BYTES = 8 + 4 + 8 + 4 + 8  # name length, rank, one dim, type, offset
_MIN_ARRAY_BYTES = 4 + 8  # element type, length (an empty nested array)
_MAX_ARRAY_DEPTH = 8  # arrays of arrays: real files nest at most one level


class GGUFHeader(NamedTuple):
    """What `parse_header` found: metadata, tensor table, offset of the first tensor's data."""

    metadata: dict[str, object]
    tensors: tuple[TensorInfo, ...]
    data_start: int


class _Cursor:
    """Bounds-checked little-endian reads from the mapped file; errors say where and what."""

    def __init__(self, buf: mmap.mmap | bytes, path: str) -> None:
        self.buf, self.path, self.pos, self.size = buf, path, 0, len(buf)

    def need(self, n: int, what: str) -> int:
        if n < 0 or self.pos + n > self.size:
            raise CheckpointError(f"{self.path}: truncated or corrupt GGUF: {what} needs {n} "
                                  f"bytes at offset {self.pos} but the file has {self.size} bytes")
        start = self.pos
        self.pos += n
        return start

    def count(self, n: int, min_bytes: int, what: str) -> int:
        """`n` entries of at least `min_bytes` each must fit in what is left of the file."""
        if n * min_bytes > self.size - self.pos:
            raise CheckpointError(f"{self.path}: corrupt GGUF: {what} is {n} but only "
                                  f"{self.size - self.pos} bytes follow at offset {self.pos}")
        return n

    def scalar(self, vtype: int, what: str) -> object:
        fmt, _ = _SCALAR_TYPES[vtype]
        (value,) = struct.unpack_from(fmt, self.buf, self.need(struct.calcsize(fmt), what))
        return bool(value) if vtype == _BOOL else value

    def string(self, what: str) -> str:
        n = self.scalar(10, f"length of {what}")
        start = self.need(int(n), what)  # type: ignore[call-overload]
        try:
            return self.buf[start:self.pos].decode("utf-8")
        except UnicodeDecodeError as e:
            raise CheckpointError(f"{self.path}: {what} at offset {start} is not UTF-8 ({e})") from None

    def value(self, vtype: int, what: str, depth: int = 0) -> object:
        if vtype in _SCALAR_TYPES:
            return self.scalar(vtype, what)
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            etype = int(self.scalar(4, f"element type of {what}"))  # type: ignore[call-overload]
            count = int(self.scalar(10, f"length of {what}"))  # type: ignore[call-overload]
            if etype in _SCALAR_TYPES:
                _, dtype = _SCALAR_TYPES[etype]
                start = self.need(count * np.dtype(dtype).itemsize, what)
                arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=start)
                return (arr != 0).tolist() if etype == _BOOL else arr.tolist()
            if etype == _STRING:  # each string needs its 8-byte length
                self.count(count, 8, f"length of {what}")
                return [self.string(f"{what}[{i}]") for i in range(count)]
            if etype == _ARRAY:
                if depth >= _MAX_ARRAY_DEPTH:
                    raise CheckpointError(f"{self.path}: {what} nests arrays deeper than "
                                          f"{_MAX_ARRAY_DEPTH} levels")
                self.count(count, _MIN_ARRAY_BYTES, f"length of {what}")
                return [self.value(_ARRAY, f"{what}[{i}]", depth + 1) for i in range(count)]
            raise CheckpointError(f"{self.path}: {what} has unknown array element type {etype}")
        raise CheckpointError(f"{self.path}: {what} has unknown value type {vtype}")


def parse_header(buf: mmap.mmap | bytes, path: str) -> GGUFHeader:
    cur = _Cursor(buf, path)
    if len(buf) < 4 or buf[:4] != GGUF_MAGIC:
        raise CheckpointError(
            f"{path}: not a GGUF file (magic {bytes(buf[:4])!r}, expected {GGUF_MAGIC!r})")
    cur.pos = 4
    version = cur.scalar(4, "version")
    if version not in SUPPORTED_VERSIONS:
        raise CheckpointError(f"{path}: GGUF version {version} is not supported "
                              f"(supported: {SUPPORTED_VERSIONS}; big-endian files are not)")
    n_tensors = int(cur.scalar(10, "tensor count"))  # type: ignore[call-overload]
    n_kv = int(cur.scalar(10, "metadata count"))  # type: ignore[call-overload]
    cur.count(n_kv, _MIN_KV_BYTES, "metadata count")
    cur.count(n_tensors, _MIN_TENSOR_BYTES, "tensor count")
    metadata: dict[str, object] = {}
    for i in range(n_kv):
        key = cur.string(f"metadata key #{i}")
        vtype = int(cur.scalar(4, f"type of metadata {key!r}"))  # type: ignore[call-overload]
        metadata[key] = cur.value(vtype, f"metadata {key!r}")
    tensors = []
    cur.count(n_tensors, _MIN_TENSOR_BYTES, "tensor count")  # what the metadata left
    for i in range(n_tensors):
        name = cur.string(f"name of tensor #{i}")
        n_dims = int(cur.scalar(4, f"rank of tensor {name!r}"))  # type: ignore[call-overload]
        if not 1 <= n_dims <= 4:  # GGML_MAX_DIMS
            raise CheckpointError(f"{path}: tensor {name!r} has invalid rank {n_dims}")
        dims = struct.unpack_from(f"<{n_dims}Q", buf, cur.need(8 * n_dims, f"dims of {name!r}"))
        ggml_type = int(cur.scalar(4, f"type of tensor {name!r}"))  # type: ignore[call-overload]
        offset = int(cur.scalar(10, f"offset of tensor {name!r}"))  # type: ignore[call-overload]
        tensors.append(TensorInfo(name, tuple(int(d) for d in reversed(dims)), ggml_type, offset))
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if (not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0
            or alignment & (alignment - 1) or alignment > len(buf)):
        raise CheckpointError(f"{path}: metadata 'general.alignment'={alignment!r} is invalid "
                              "(a power of two no larger than the file)")
    data_start = -(-cur.pos // alignment) * alignment
    return GGUFHeader(metadata, tuple(tensors), data_start)


def map_gguf(path: str | os.PathLike) -> tuple[str, mmap.mmap]:
    spath = os.fspath(path)
    try:
        size = os.path.getsize(spath)
        if size == 0:
            raise CheckpointError(f"{spath}: not a GGUF file (it is empty)")
        with open(spath, "rb") as f:
            return spath, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise CheckpointError(f"{spath}: cannot open GGUF file ({e.strerror or e})") from None


def close_gguf(buf: mmap.mmap) -> None:
    try:
        buf.close()
    except BufferError:  # a frame in a propagating traceback still holds a view; GC frees it
        pass


def read_gguf_metadata(path: str | os.PathLike) -> dict[str, object]:
    """All metadata key/values of a GGUF file as plain python values (no tensor data is read)."""
    spath, buf = map_gguf(path)
    try:
        return parse_header(buf, spath).metadata
    finally:
        close_gguf(buf)
