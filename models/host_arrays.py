"""Host-side parameter leaves that are read one device's slice at a time.

Placement (`models/placement.py`) hands every leaf the index box of one device's shard, a
tuple of slices in the params' own layout, exactly as `jax.make_array_from_callback` passes it,
and copies what `leaf[box]` returns onto that device. Anything with `shape`, `dtype` and such
a `__getitem__` is a leaf source (`HostArray`): a numpy array or memmap, a `jax.Array`, or the
lazy views here, which translate a box in the params' layout into reads of the checkpoint:

  `LazyLeaf`:      the per-layer tensors of one field in checkpoint (HF) layout presented as
                   the stacked, transposed `[L, in, out]` leaf: a box reads, for each layer it
                   covers, only the rows/columns it covers of that layer's tensor (from a memmap
                   or a lazy GGUF tensor), then stacks and casts those; nothing else is touched.
  `RepeatedHeads`: `[..., Hkv * D]` seen as `[..., Hkv * rep * D]` (each head repeated `rep`
                   times, for tensor parallelism wider than the KV heads): a box maps back to
                   the original heads it covers and reads only those.
  `PaddedHeads`:   one axis of heads seen with each head repeated and zero-padded to a wider
                   head (the narrower layers of a model whose layers differ in head size or
                   KV-head count): a box reads only the original entries it covers.

The host therefore holds, per leaf, at most the slices asked for, never the stacked leaf nor a
replicated copy (unless a box asks for the whole leaf: replicated leaves).
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import numpy as np

Box = tuple[slice, ...]


class HostArray(Protocol):
    """A leaf source: shape, dtype, and the data of one index box."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> Any: ...

    def __getitem__(self, index: Any) -> Any: ...


def normalize_box(index: object, shape: tuple[int, ...], what: str = "array") -> Box:
    """`index` (slices, maybe with one Ellipsis) as one unit-step slice per dimension."""
    parts = index if isinstance(index, tuple) else (index,)
    if any(p is Ellipsis for p in parts):
        at = next(i for i, p in enumerate(parts) if p is Ellipsis)
        fill = (slice(None),) * (len(shape) - len(parts) + 1)
        parts = parts[:at] + fill + parts[at + 1:]
    parts = parts + (slice(None),) * (len(shape) - len(parts))
    if len(parts) != len(shape) or not all(isinstance(p, slice) for p in parts):
        raise ValueError(f"{what}: index {index!r} is not a box of slices for shape {shape}")
    box = []
    for p, n in zip(parts, shape):
        start, stop, step = p.indices(n)
        if step != 1:
            raise ValueError(f"{what}: index {index!r} has a step; only unit-step boxes are read")
        box.append(slice(start, max(start, stop)))
    return tuple(box)


def full_box(shape: tuple[int, ...]) -> Box:
    return tuple(slice(0, n) for n in shape)


def read_all(leaf: HostArray) -> np.ndarray:
    """The whole leaf on the host (the unsharded load path)."""
    return np.asarray(leaf[full_box(tuple(leaf.shape))])


class LazyLeaf:
    """One params leaf assembled on demand from checkpoint tensors.

    `parts`: one tensor per layer (`stacked`) or a single tensor, each in checkpoint layout,
    i.e. transposed relative to the leaf when `transpose` (HF linears are [out, in]).
    """

    def __init__(self, name: str, parts: Sequence[HostArray], shape: tuple[int, ...],
                 dtype: np.dtype, transpose: bool, stacked: bool) -> None:
        if not stacked and len(parts) != 1:
            raise ValueError(f"{name}: an unstacked leaf takes one tensor, got {len(parts)}")
        self.name, self.parts, self.transpose, self.stacked = name, tuple(parts), transpose, stacked
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __getitem__(self, index: object) -> np.ndarray:
        box = normalize_box(index, self.shape, self.name)
        if not self.stacked:
            return self._read(self.parts[0], box)
        layers = range(box[0].start, box[0].stop)
        if not layers:
            return np.zeros((0, *(s.stop - s.start for s in box[1:])), self.dtype)
        return np.stack([self._read(self.parts[i], box[1:]) for i in layers])

    def _read(self, part: HostArray, box: Box) -> np.ndarray:
        if self.transpose:  # the box is in [in, out]; the tensor is [out, in]
            return np.ascontiguousarray(np.asarray(part[box[::-1]], dtype=self.dtype).T)
        return np.array(part[box], dtype=self.dtype)  # a copy: never a view of a mapped file

    def __repr__(self) -> str:
        return f"LazyLeaf({self.name}, shape={self.shape}, dtype={self.dtype})"


class RepeatedHeads:
    """`base[..., Hkv * D]` with each of its `num_heads` heads repeated `rep` times."""

    def __init__(self, base: HostArray, num_heads: int, rep: int) -> None:
        width = base.shape[-1]
        if rep < 1 or num_heads < 1 or width % num_heads:
            raise ValueError(f"cannot repeat {num_heads} heads x{rep} of a last axis of {width}")
        self.base, self.num_heads, self.rep = base, num_heads, rep
        self.head_dim = width // num_heads
        self.shape = (*base.shape[:-1], width * rep)
        self.dtype = base.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __getitem__(self, index: object) -> Any:
        box = normalize_box(index, self.shape, "replicated KV heads")
        cols = np.arange(box[-1].start, box[-1].stop)
        d = self.head_dim
        orig = (cols // (self.rep * d)) * d + cols % d  # column j of the copy -> of the base
        if not cols.size:
            return self.base[box[:-1] + (slice(0, 0),)]
        lo, hi = int(orig.min()), int(orig.max()) + 1
        block = self.base[box[:-1] + (slice(lo, hi),)]  # only the original heads it covers
        if np.array_equal(orig, np.arange(lo, hi)):
            return block
        return block[..., orig - lo]  # numpy or jax: the same fancy index on the last axis

    def __repr__(self) -> str:
        return f"RepeatedHeads({self.base!r}, heads={self.num_heads}, rep={self.rep})"


class PaddedHeads:
    """`base` whose axis `axis` holds `num_heads` heads of `head_dim` entries, seen as
    `num_heads * rep` heads of `width` >= head_dim entries: head g is base head g // rep,
    zero-padded at its end. A narrower layer's weights in the stacked shape of a model whose
    layers differ in head size or KV-head count (`LayerSpec.head_dim` / `num_kv_heads`)."""

    def __init__(self, base: HostArray, axis: int, num_heads: int, rep: int,
                 width: int) -> None:
        n = base.shape[axis]
        if rep < 1 or num_heads < 1 or n % num_heads or width < n // num_heads:
            raise ValueError(f"cannot pad {num_heads} heads of an axis of {n} to x{rep} heads "
                             f"of {width}")
        self.base, self.axis, self.rep, self.width = base, axis % len(base.shape), rep, width
        self.head_dim = n // num_heads
        shape = list(base.shape)
        shape[self.axis] = num_heads * rep * width
        self.shape, self.dtype = tuple(shape), base.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __getitem__(self, index: object) -> np.ndarray:
        box = normalize_box(index, self.shape, "padded heads")
        a, d = self.axis, self.head_dim
        idx = np.arange(box[a].start, box[a].stop)
        within = idx % self.width
        real = within < d
        src = (idx // self.width // self.rep) * d + within  # where a real entry comes from
        out_shape = [s.stop - s.start for s in box]
        out = np.zeros(out_shape, np.dtype(self.dtype))
        if not real.any():
            return out
        lo, hi = int(src[real].min()), int(src[real].max()) + 1
        block = np.asarray(self.base[box[:a] + (slice(lo, hi),) + box[a + 1:]])
        picked = np.take(block, src[real] - lo, axis=a)
        where = [slice(None)] * len(out_shape)
        where[a] = np.nonzero(real)[0]
        out[tuple(where)] = picked
        return out

    def __repr__(self) -> str:
        return f"PaddedHeads({self.base!r}, axis={self.axis}, rep={self.rep}, width={self.width})"
