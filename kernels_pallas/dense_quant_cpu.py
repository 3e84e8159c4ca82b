"""Dense projections on CPU over quantized, panel-packed weights (csrc/dense_quant_cpu.cc).

Data flow: a quantized weight in the models' layout (``jaxserve.models.quant``): values
[..., K', N] (int8: K' = K, s8; fp8: K' = K, e4m3fn; int4: K' = K / 2 bytes, two 4-bit rows
each), scales f32[..., K / G, N] (and int4's zeros, the same shape) -> ``pack_quant`` once, at
load: each cut into 16-column panels the way ``dense_cpu.pack_panels`` cuts a float weight
(values [..., P, K', 16] as bytes, scales [..., P, K / G, 16]) -> each step
``dense_quant_packed(x, packed, layer, N)``: x f32[..., K] -> one FFI custom call that reads
the layer's panels as they lie and multiplies through the scales group by group -> f32[..., N].

``dense_quant_reference`` computes the same from the packed arrays in jnp (unpack, dequantize,
matmul): the oracle of the tests, and what runs where the C++ library cannot be built.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from .cpu_build import DENSE_QUANT_TARGETS, dense_target
from .dense_cpu import PANEL, unpack_panels

SCHEMES = tuple(DENSE_QUANT_TARGETS)
_VALUE_DTYPES = {"int8": np.dtype(np.int8), "fp8": np.dtype(np.uint8), "int4": np.dtype(np.uint8)}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantPanels:
    """One quantized weight (or a stack of L) in 16-column panels."""

    values: jax.Array  # int8: s8[(L,) P, K, 16]; fp8: u8[(L,) P, K, 16] (e4m3fn bytes);
    #                    int4: u8[(L,) P, K / 2, 16] (row 2i low nibble, 2i + 1 high)
    scales: jax.Array  # f32[(L,) P, K / G, 16]
    zeros: jax.Array | None  # f32[(L,) P, K / G, 16]: int4 only (W = q * scale + zero)
    scheme: str = dataclasses.field(metadata=dict(static=True))
    # The few-row (decode) path's per-group sums (csrc/dense_quant_cpu.cc `kFast`): faster
    # at a decode, but a row's bits then depend on its step's row count. False: row invariant.
    fast: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @property
    def in_features(self) -> int:
        return self.values.shape[-2] * (2 if self.scheme == "int4" else 1)


def _panelize(a: np.ndarray) -> np.ndarray:
    """[..., R, N] -> [..., ceil(N / 16), R, 16] in a's dtype (zero columns past N)."""
    *lead, r, n = a.shape
    p = -(-n // PANEL)
    if p * PANEL != n:
        a = np.concatenate([a, np.zeros((*lead, r, p * PANEL - n), a.dtype)], axis=-1)
    return np.ascontiguousarray(np.moveaxis(a.reshape(*lead, r, p, PANEL), -2, -3))


def pack_quant(values: np.ndarray, scales: np.ndarray, zeros: np.ndarray | None,
               scheme: str, fast: bool = False) -> QuantPanels:
    """Host arrays in the models' layout -> panels (numpy leaves; the caller places them).
    `fast`: `QuantPanels.fast`."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme={scheme!r} must be one of {SCHEMES}")
    if (zeros is None) != (scheme != "int4"):
        raise ValueError(f"scheme={scheme!r}: zeros must be given exactly for int4")
    raw = np.asarray(values)
    raw = raw.view(np.uint8) if raw.dtype.itemsize == 1 and scheme != "int8" else raw
    if raw.dtype != _VALUE_DTYPES[scheme]:
        raise ValueError(f"scheme={scheme!r} takes {_VALUE_DTYPES[scheme]} values, got {raw.dtype}")
    s = np.asarray(scales, np.float32)
    return QuantPanels(_panelize(raw), _panelize(s),
                       None if zeros is None else _panelize(np.asarray(zeros, np.float32)),
                       scheme, fast)


def _check(x: jax.Array, w: QuantPanels, n: int) -> None:
    nd = w.values.ndim
    if nd not in (3, 4) or w.values.shape[-1] != PANEL or w.scales.ndim != nd:
        raise ValueError(f"values must be [(L,) P, K', {PANEL}] and scales of the same rank, got "
                         f"{tuple(w.values.shape)} and {tuple(w.scales.shape)}")
    p, k = w.values.shape[-3], w.in_features
    if x.shape[-1] != k:
        raise ValueError(f"x's last dim {x.shape[-1]} != the weight's in_features {k} "
                         f"({w.scheme} values shape {tuple(w.values.shape)})")
    groups = w.scales.shape[-2]
    if (w.scales.shape[:-2] != w.values.shape[:-2] or k % groups
            or (w.scheme == "int4" and (k // groups) % 2)):
        raise ValueError(f"scales shape {tuple(w.scales.shape)} does not fit values shape "
                         f"{tuple(w.values.shape)} ({w.scheme}: K={k} in equal groups"
                         f"{', of even size' if w.scheme == 'int4' else ''})")
    if w.zeros is not None and w.zeros.shape != w.scales.shape:
        raise ValueError(f"zeros shape {tuple(w.zeros.shape)} != scales shape "
                         f"{tuple(w.scales.shape)}")
    if not (p - 1) * PANEL < n <= p * PANEL:
        raise ValueError(f"out_features={n} does not fit {p} panels of {PANEL} columns")
    if x.dtype != jnp.float32:
        raise ValueError(f"x must be float32, got {x.dtype}")


def decode_values(values: jax.Array, scheme: str, axis: int) -> jax.Array:
    """Stored values -> f32 q, the K axis at `axis` (int4: each byte is two rows of it)."""
    if scheme == "int4":
        q = jnp.stack([values & 15, values >> 4], axis=axis)
        shape = list(values.shape)
        shape[axis] *= 2
        return q.reshape(shape).astype(jnp.float32)
    if scheme == "fp8" and values.dtype != jnp.float8_e4m3fn:  # packed: the bytes
        values = jax.lax.bitcast_convert_type(values, jnp.float8_e4m3fn)
    return values.astype(jnp.float32)


def apply_scales(q: jax.Array, scales: jax.Array, zeros: jax.Array | None,
                 axis: int) -> jax.Array:
    """q * scale (+ zero), each scale repeated over its group of the K axis at `axis`."""
    g = q.shape[axis] // scales.shape[axis]
    out = q * jnp.repeat(scales, g, axis=axis)
    return out if zeros is None else out + jnp.repeat(zeros, g, axis=axis)


def dequantize_panels(w: QuantPanels, layer: jax.Array | None) -> jax.Array:
    """Layer `layer`'s weight as f32 [P, K, 16] panels (the reference's first step)."""
    values, scales, zeros = w.values, w.scales, w.zeros
    if values.ndim == 4:
        i = 0 if layer is None else jnp.reshape(layer, ())
        values, scales = values[i], scales[i]
        zeros = None if zeros is None else zeros[i]
    return apply_scales(decode_values(values, w.scheme, -2), scales, zeros, -2)


def dequantize_columns(w: QuantPanels, ids: jax.Array) -> jax.Array:
    """Columns `ids` of one (unstacked) quantized weight -> f32[..., K] (a tied embedding's
    lookup: the rows of W^T)."""
    p, c = ids // PANEL, ids % PANEL
    zeros = None if w.zeros is None else w.zeros[p, :, c]
    q = decode_values(w.values[p, :, c], w.scheme, -1)
    return apply_scales(q, w.scales[p, :, c], zeros, -1)


def dense_quant_reference(x: jax.Array, w: QuantPanels, layer: jax.Array | None,
                          n: int) -> jax.Array:
    """x f32[..., K] @ (layer `layer` of) the quantized weight -> f32[..., n], in jnp."""
    _check(x, w, n)
    return x @ unpack_panels(dequantize_panels(w, layer), n)


def dense_quant_packed(x: jax.Array, w: QuantPanels, layer: jax.Array | None,
                       n: int, isa: str | None = None) -> jax.Array:
    """x f32[..., K] @ (layer `layer`, an i32 scalar, of) the quantized weight -> f32[..., n].

    isa: as dense_cpu.dense_packed's (None: the best this CPU runs)."""
    _check(x, w, n)
    target = dense_target(DENSE_QUANT_TARGETS[w.scheme], isa)
    if target is None:
        return dense_quant_reference(x, w, layer, n)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    idx = jnp.zeros((), jnp.int32) if layer is None else jnp.reshape(layer, ()).astype(jnp.int32)
    args = (x2, w.values, w.scales) + (() if w.zeros is None else (w.zeros,)) + (idx,)
    y = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x2.shape[0], n), jnp.float32))(
        *args, fast=w.fast)
    return y.reshape(*lead, n)
