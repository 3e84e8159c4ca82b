"""One GGUF tensor as a lazy, HF-layout, float32 array: dequantizes only the boxes asked of it.

Data flow: the memory-mapped file + one tensor-table entry -> (checked now: known GGML type,
inner dim a multiple of the quant block, data inside the file) -> `tensor[box]`:
  2-D tensors (all linears and embeddings): the box's rows are mapped to the stored rows (for
  llama-arch q/k projections, llama.cpp's per-head interleaving of the two RoPE halves is undone
  by this row mapping; a head-aligned row range maps onto the same head's stored rows), only the
  stored rows between the first and last needed are sliced out of the file, and of those only
  the quant blocks covering the box's columns; `gguf.quants.dequantize` turns those bytes into
  float32 and the box is cut out of the result. So a per-device read dequantizes that device's
  rows x (its columns rounded out to whole blocks), never the whole tensor.
  1-D tensors (norms, biases: small) and any other rank: dequantized whole, then sliced.
A tensor opened with a `shift` (Gemma's RMSNorm weights, which llama.cpp's converter stores as
1 + w: the family's `GGUF_NORM_SHIFTS`) has it subtracted in float32 right after
dequantization, on every read path alike, so a per-device box and the whole tensor agree.
The whole-tensor read (`tensor[:]`) is what `read_gguf` returns for every tensor.
"""

from __future__ import annotations

import math
import mmap
from typing import NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from .host_arrays import normalize_box
from .safetensors_io import CheckpointError


class TensorInfo(NamedTuple):
    name: str
    shape: tuple[int, ...]  # numpy order (outermost first)
    ggml_type: int  # raw id; validated when the tensor is opened
    offset: int  # relative to the data section


class GGUFTensor:
    """`info`'s data in `buf` as a float32 array of shape `info.shape` (HF layout).

    `permute_heads`: for llama-arch q/k projections, the number of heads whose stored rows
    llama.cpp interleaved (None: stored as in HF). `shift`: a constant the file adds to every
    value (0.0: none), subtracted on read.
    """

    dtype = np.dtype(np.float32)

    def __init__(self, buf: mmap.mmap, info: TensorInfo, data_start: int, path: str,
                 permute_heads: int | None = None, shift: float = 0.0) -> None:
        try:
            self.qtype = GGMLQuantizationType(info.ggml_type)
        except ValueError:
            raise CheckpointError(f"{path}: tensor {info.name!r} has unknown GGML type id "
                                  f"{info.ggml_type}") from None
        if not all(d > 0 for d in info.shape):
            raise CheckpointError(f"{path}: tensor {info.name!r} has an empty dimension in its "
                                  f"shape {list(info.shape)}")
        self.block, self.type_size = GGML_QUANT_SIZES[self.qtype]
        inner = info.shape[-1]
        if inner % self.block:
            raise CheckpointError(f"{path}: tensor {info.name!r} ({self.qtype.name}) has inner dim "
                                  f"{inner} not divisible by its block size {self.block}")
        self.rows = math.prod(info.shape[:-1])
        self.row_bytes = inner // self.block * self.type_size
        start = data_start + info.offset
        end = start + self.rows * self.row_bytes
        if end > len(buf):
            raise CheckpointError(f"{path}: data of tensor {info.name!r} ends at byte {end} past "
                                  f"the end of the file ({len(buf)} bytes): the file is truncated")
        n = info.shape[0]
        if permute_heads is not None and (n % (2 * permute_heads) or len(info.shape) > 2):
            raise CheckpointError(f"{path}: tensor {info.name!r} with {n} rows cannot hold "
                                  f"{permute_heads} heads of two RoPE halves")
        self.buf, self.start, self.info, self.path = buf, start, info, path
        self.shape, self.permute_heads = info.shape, permute_heads
        self.shift = float(shift)
        self.type_name = self.qtype.name

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def _raw(self) -> np.ndarray:
        """The stored bytes as [rows, row_bytes] (a view of the mapping: nothing read yet)."""
        raw = np.frombuffer(self.buf, dtype=np.uint8, count=self.rows * self.row_bytes,
                            offset=self.start)
        return raw.reshape(self.rows, self.row_bytes)

    def _dequantize(self, raw: np.ndarray) -> np.ndarray:
        try:
            # Contiguous first: a column range of the rows is a strided view (F32/F16 re-view it).
            out = quants.dequantize(np.ascontiguousarray(raw), self.qtype)
        except NotImplementedError:
            raise CheckpointError(f"{self.path}: tensor {self.info.name!r} has GGML type "
                                  f"{self.qtype.name}, which cannot be dequantized (unsupported "
                                  "by gguf.quants)") from None
        # F32 comes back as a view of the mapped file: copy so the arrays outlive the mapping.
        out = np.array(out, dtype=np.float32, copy=True)
        if self.shift:
            out -= np.float32(self.shift)  # as transformers' loader does: float32, after dequant
        return out

    def _stored_rows(self, hf_rows: np.ndarray) -> np.ndarray:
        """HF row index -> stored row index (llama.cpp: HF row t*half + j is stored j*2 + t)."""
        if self.permute_heads is None:
            return hf_rows
        per_head = self.shape[0] // self.permute_heads
        half = per_head // 2
        head, r = np.divmod(hf_rows, per_head)
        return head * per_head + (r % half) * 2 + r // half

    def __getitem__(self, index: object) -> np.ndarray:
        box = normalize_box(index, self.shape, f"{self.path}: tensor {self.info.name!r}")
        if len(self.shape) != 2:
            whole = self._dequantize(self._raw()).reshape(self.shape)
            if self.permute_heads is not None:  # 1-D q/k biases: entries are the "rows"
                whole = whole[self._stored_rows(np.arange(self.shape[0]))]
            return whole[box]
        rows = self._stored_rows(np.arange(box[0].start, box[0].stop))
        c0, c1 = box[1].start, box[1].stop
        if not rows.size or c0 == c1:
            return np.zeros((rows.size, c1 - c0), np.float32)
        lo, hi = int(rows.min()), int(rows.max()) + 1
        b0, b1 = c0 // self.block, -(-c1 // self.block)  # the quant blocks covering the columns
        raw = self._raw()[lo:hi, b0 * self.type_size:b1 * self.type_size]
        out = self._dequantize(raw)
        return out[rows - lo, c0 - b0 * self.block:c1 - b0 * self.block]

    def __repr__(self) -> str:
        shift = f", shift={self.shift}" if self.shift else ""
        return f"GGUFTensor({self.info.name}, {self.type_name}, shape={self.shape}{shift})"


def split_experts(info: TensorInfo, path: str) -> list[TensorInfo]:
    """A merged expert tensor (llama.cpp's `ffn_*_exps`: numpy [E, out, in], the experts'
    [out, in] matrices one after another) as E 2-D tensor entries over the same bytes, expert
    e's starting e * out rows in. Nothing is read; each entry is checked when opened."""
    if len(info.shape) != 3:
        raise CheckpointError(f"{path}: expert tensor {info.name!r} has shape {list(info.shape)}; "
                              "expected 3 dims [experts, out, in]")
    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(info.ggml_type)]
    except (ValueError, KeyError):
        raise CheckpointError(f"{path}: tensor {info.name!r} has unknown GGML type id "
                              f"{info.ggml_type}") from None
    experts, out, inner = info.shape
    if inner % block:
        raise CheckpointError(f"{path}: tensor {info.name!r} has inner dim {inner} not "
                              f"divisible by its block size {block}")
    stride = out * (inner // block) * type_size
    return [TensorInfo(f"{info.name}[{e}]", (out, inner), info.ggml_type, info.offset + e * stride)
            for e in range(experts)]
