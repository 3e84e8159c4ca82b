"""Dense projections on CPU as integer dot products: int8 / int4 weights times activations
quantized to int8 per group on the fly (csrc/dense_qdot_cpu.cc; llama.cpp's way with its Q4 /
Q8 blocks).

Data flow: a quantized weight in the models' layout (``jaxserve.models.quant``: int8 values
s8[..., K, N] or int4 bytes u8[..., K / 2, N], scales f32[..., K / G, N], int4's zeros) ->
``pack_qdot`` once, at load, into 16-column panels of "quads" (the line layout of VNNI's
vpdpbusd: 4 consecutive k of each of 16 columns in 64 bytes; int8 as w + 128, int4 two quads
per line in the nibbles) -> each step ``dense_qdot_packed(x, packed, layer, N)``: x f32[..., K]
-> one FFI custom call that quantizes each row of x in groups of ``act_group`` (d = max|x| /
127, xq = round(x / d)), sums xq times the weights exactly in s32 per group and scales the sum
-> f32[..., N].

Numerics: against x @ W in float the one error is the activations' rounding, at most d / 2
per element, so |y - x @ W| <= sum over groups of d_g / 2 * sum_k |W[k, j]| (``error_bound``),
plus float rounding of the scaling. Each row is quantized alone, so a row's result does not
depend on the batch it is in. ``dense_qdot_reference`` computes the same in jnp (the
integer sums exactly): the tests' oracle, and the path where the library cannot be built.

Where it runs (``qdot_scheme_supported``): int8 and int4 with AVX-512 VNNI; int4 also with
AVX-512BW or AVX2 (vpmaddubsw); an activation group must divide the weight group (G) and be a
multiple of 4 (int8) or 8 (int4): G itself up to the configured size (8, 16 or 32; default
32, llama.cpp's Q8 activation blocks), else that size.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from .cpu_build import DENSE_QDOT_TARGETS, QUANTIZE_ROWS_TARGET, dense_target
from .dense_cpu import PANEL

QUAD = 4  # k per 32-bit lane of vpdpbusd
LINE = PANEL * QUAD  # bytes per line: 16 columns x 4 k
STEP = {"int8": 4, "int4": 8}  # k per stored line
# Activation group sizes (EngineConfig.int8_activation_group_size): smaller groups round
# less (an outlier coarsens only its own group) and cost more (an epilogue per group).
ACT_GROUPS = (8, 16, 32)
# The ISAs whose library runs a scheme's integer dots (cpu_build.dense_variants names).
ISAS = {"int8": ("avx512_vnni",), "int4": ("avx512_vnni", "avx512", "avx2")}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QdotPanels:
    """One int8 / int4 weight (or a stack of L) in 16-column panels of quads."""

    values: jax.Array  # int8: u8[(L,) P, K / 4, 64] (w + 128); int4: u8[(L,) P, K / 8, 64]
    #                    (line i: k 8i..8i+3 in the low nibbles, 8i+4..8i+7 in the high ones)
    scales: jax.Array  # f32[(L,) P, K / G, 16]
    zeros: jax.Array | None  # f32[(L,) P, K / G, 16]: int4 only (W = q * scale + zero)
    scheme: str = dataclasses.field(metadata=dict(static=True))
    act_group: int = dataclasses.field(metadata=dict(static=True))  # k per activation scale

    @property
    def in_features(self) -> int:
        return self.values.shape[-2] * STEP[self.scheme]


def act_group_for(group_size: int, max_group: int = 32) -> int | None:
    """The activation group for weight groups of `group_size` k: the group itself up to
    `max_group`, else `max_group` where it divides the group; None where neither fits (the
    float path runs)."""
    a = group_size if group_size <= max_group else max_group
    return a if group_size % a == 0 and a % QUAD == 0 else None


def qdot_scheme_supported(scheme: str, group_size: int, isa: str | None,
                          max_group: int = 32) -> str | None:
    """None if a `scheme` weight in groups of `group_size` runs the integer dots on dense ISA
    `isa` (a cpu_build.dense_variants name) with activation groups of up to `max_group`,
    else why not."""
    if scheme not in ISAS:
        return f"scheme {scheme!r} has no integer dot path (int8 and int4 do)"
    if isa not in ISAS[scheme]:
        return f"{scheme} integer dots need one of the ISAs {ISAS[scheme]}, not {isa!r}"
    a = act_group_for(group_size, max_group)
    if a is None or a % STEP[scheme]:
        return (f"{scheme} weights in groups of {group_size} have no activation group (a "
                f"divisor of the group, a multiple of {STEP[scheme]}, at most {max_group})")
    return None


def _panel_lines(q: np.ndarray) -> np.ndarray:
    """Integer values [..., K, N] -> [..., P, K / 4, 16, 4] (zero columns past N)."""
    *lead, k, n = q.shape
    p = -(-n // PANEL)
    if p * PANEL != n:
        q = np.concatenate([q, np.zeros((*lead, k, p * PANEL - n), q.dtype)], axis=-1)
    q = q.reshape(*lead, k // QUAD, QUAD, p, PANEL)  # [..., K/4, 4, P, 16]
    return np.moveaxis(np.swapaxes(q, -1, -3), -2, -4)  # [..., P, K/4, 16, 4]


def _panelize(a: np.ndarray) -> np.ndarray:
    """Scales [..., R, N] -> [..., P, R, 16] (zero columns past N)."""
    *lead, r, n = a.shape
    p = -(-n // PANEL)
    if p * PANEL != n:
        a = np.concatenate([a, np.zeros((*lead, r, p * PANEL - n), a.dtype)], axis=-1)
    return np.ascontiguousarray(np.moveaxis(a.reshape(*lead, r, p, PANEL), -2, -3))


def unpack_int4_rows(values: np.ndarray) -> np.ndarray:
    """The models' int4 bytes u8[..., K / 2, N] (row 2i low nibble, 2i + 1 high) -> q
    u8[..., K, N] in 0..15."""
    v = np.asarray(values, np.uint8)
    q = np.stack([v & 15, v >> 4], axis=-2)  # [..., K/2, 2, N]
    return q.reshape(*v.shape[:-2], v.shape[-2] * 2, v.shape[-1])


def pack_qdot(values: np.ndarray, scales: np.ndarray, zeros: np.ndarray | None,
              scheme: str, max_group: int = 32) -> QdotPanels:
    """Host arrays in the models' layout -> quad panels (numpy leaves; the caller places them),
    activations to be quantized in groups of up to `max_group`. A ValueError where the weight
    has no activation group (qdot_scheme_supported)."""
    if scheme not in STEP:
        raise ValueError(f"scheme={scheme!r} must be one of {tuple(STEP)}")
    if (zeros is None) != (scheme != "int4"):
        raise ValueError(f"scheme={scheme!r}: zeros must be given exactly for int4")
    raw = np.asarray(values)
    if scheme == "int8":
        if raw.dtype != np.int8:
            raise ValueError(f"int8 takes int8 values, got {raw.dtype}")
        q = (raw.astype(np.int16) + 128).astype(np.uint8)
    else:
        if raw.dtype.itemsize != 1:
            raise ValueError(f"int4 takes packed bytes (uint8), got {raw.dtype}")
        q = unpack_int4_rows(raw.view(np.uint8))
    s = np.asarray(scales, np.float32)
    k = q.shape[-2]
    if k % s.shape[-2]:
        raise ValueError(f"scales shape {s.shape} does not divide K={k} into equal groups")
    group = k // s.shape[-2]
    a = act_group_for(group, max_group)
    if a is None or a % STEP[scheme] or k % STEP[scheme]:
        raise ValueError(f"{scheme} weight [K={k}] in groups of {group}: no activation group "
                         f"(a multiple of {STEP[scheme]} dividing the group, <= {max_group})")
    lines = _panel_lines(q)  # [..., P, K/4, 16, 4]
    if scheme == "int4":  # quads 2i (low nibble) and 2i + 1 (high) share a line
        pairs = lines.reshape(*lines.shape[:-3], k // 8, 2, PANEL, QUAD)
        lines = pairs[..., 0, :, :] | (pairs[..., 1, :, :] << 4)
    packed = np.ascontiguousarray(lines.reshape(*lines.shape[:-2], LINE))
    return QdotPanels(packed, _panelize(s),
                      None if zeros is None else _panelize(np.asarray(zeros, np.float32)),
                      scheme, a)


def weight_values(w: QdotPanels, layer: jax.Array | None = None) -> jax.Array:
    """The stored integers as f32 [(L,) P, K, 16] (int8: w; int4: q in 0..15); with `layer`,
    that layer's [P, K, 16]."""
    v = w.values
    if v.ndim == 4 and layer is not None:
        v = v[jnp.reshape(layer, ())]
    v = v.reshape(*v.shape[:-1], PANEL, QUAD).astype(jnp.int32)  # [..., P, lines, 16, 4]
    if w.scheme == "int4":
        v = jnp.stack([v & 15, v >> 4], axis=-3)  # [..., P, lines, 2, 16, 4]
        v = v.reshape(*v.shape[:-4], v.shape[-4] * 2, PANEL, QUAD)
    else:
        v = v - 128
    q = jnp.swapaxes(v, -1, -2)  # [..., P, K/4, 4, 16]
    return q.reshape(*q.shape[:-3], q.shape[-3] * QUAD, PANEL).astype(jnp.float32)


def quantize_rows(x: jax.Array, act_group: int) -> tuple[jax.Array, ...]:
    """x f32[M, K] -> (xq s8[M, K], d f32[M, K / A], sum of xq s32[M, K / A], sum of x
    f32[M, K / A]): the kernel's step 1 in jnp. A non-finite group gets d = NaN, xq = 0."""
    m, k = x.shape
    g = x.reshape(m, k // act_group, act_group)
    amax = jnp.max(jnp.abs(g), axis=-1)
    total = jnp.sum(g, axis=-1)
    finite = jnp.isfinite(total) & jnp.isfinite(amax)
    inv = jnp.where(finite & (amax > 0), jnp.float32(127.0) / jnp.where(amax > 0, amax, 1.0), 0.0)
    q = jnp.clip(jnp.round(g * inv[..., None]), -127, 127)
    q = jnp.where(finite[..., None], q, 0.0).astype(jnp.int8)
    d = jnp.where(finite, amax * jnp.float32(1.0 / 127.0), jnp.nan)  # the kernel's product
    return (q.reshape(m, k), d, jnp.sum(q.astype(jnp.int32), axis=-1), total)


def quantize_rows_kernel(x: jax.Array, act_group: int, isa: str | None = None):
    """The kernel library's step 1 alone (the tests compare it with quantize_rows)."""
    if dense_target(DENSE_QDOT_TARGETS["int4"], isa) is None:
        raise RuntimeError("the C++ dense kernels could not be built")
    m, k = x.shape
    target = QUANTIZE_ROWS_TARGET if isa is None else f"{QUANTIZE_ROWS_TARGET}_{isa}"
    na = k // act_group
    shapes = (jax.ShapeDtypeStruct((m, k), jnp.int8), jax.ShapeDtypeStruct((m, na), jnp.float32),
              jax.ShapeDtypeStruct((m, na), jnp.int32), jax.ShapeDtypeStruct((m, na), jnp.float32))
    return jax.ffi.ffi_call(target, shapes)(x, act_group=np.int64(act_group))


def _check(x: jax.Array, w: QdotPanels, n: int) -> None:
    nd = w.values.ndim
    if nd not in (3, 4) or w.values.shape[-1] != LINE or w.scales.ndim != nd:
        raise ValueError(f"values must be [(L,) P, K / {STEP.get(w.scheme)}, {LINE}] and scales "
                         f"of the same rank, got {tuple(w.values.shape)} and "
                         f"{tuple(w.scales.shape)}")
    p, k = w.values.shape[-3], w.in_features
    if x.shape[-1] != k:
        raise ValueError(f"x's last dim {x.shape[-1]} != the weight's in_features {k}")
    groups = w.scales.shape[-2]
    if (w.scales.shape[:-2] != w.values.shape[:-2] or k % groups
            or (k // groups) % w.act_group or w.act_group % STEP[w.scheme]):
        raise ValueError(f"scales shape {tuple(w.scales.shape)} / act_group {w.act_group} do "
                         f"not fit values shape {tuple(w.values.shape)}")
    if w.zeros is not None and w.zeros.shape != w.scales.shape:
        raise ValueError(f"zeros shape {tuple(w.zeros.shape)} != scales shape "
                         f"{tuple(w.scales.shape)}")
    if not (p - 1) * PANEL < n <= p * PANEL:
        raise ValueError(f"out_features={n} does not fit {p} panels of {PANEL} columns")
    if x.dtype != jnp.float32:
        raise ValueError(f"x must be float32, got {x.dtype}")


def _layer_arrays(w: QdotPanels, layer: jax.Array | None):
    scales, zeros = w.scales, w.zeros
    if w.values.ndim == 4:
        i = 0 if layer is None else jnp.reshape(layer, ())
        scales = scales[i]
        zeros = None if zeros is None else zeros[i]
        layer = jnp.asarray(i)
    return weight_values(w, layer), scales, zeros


def dense_qdot_reference(x: jax.Array, w: QdotPanels, layer: jax.Array | None,
                         n: int) -> jax.Array:
    """x f32[..., K] @ (layer `layer` of) the weight -> f32[..., n], as the kernel computes it
    (activations quantized per group, integer sums exact), in jnp."""
    _check(x, w, n)
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    q, d, qsum, xsum = quantize_rows(x2, w.act_group)
    values, scales, zeros = _layer_arrays(w, layer)  # [P, K, 16], [P, K / G, 16]
    a, na = w.act_group, k // w.act_group
    group = k // scales.shape[-2]
    qi = values.astype(jnp.int32).reshape(values.shape[0], na, a, PANEL)
    xi = q.astype(jnp.int32).reshape(-1, na, a)
    dots = jnp.einsum("mak,pakc->mapc", xi, qi,
                      preferred_element_type=jnp.int32).astype(jnp.float32)  # [M, na, P, 16]
    s = jnp.repeat(scales, group // a, axis=-2)  # [P, na, 16]
    y = jnp.einsum("mapc,pac,ma->mpc", dots, s, d)
    if zeros is not None:
        y = y + jnp.einsum("pac,ma->mpc", jnp.repeat(zeros, group // a, axis=-2), xsum)
    y = y.reshape(x2.shape[0], -1)[:, :n]
    return y.reshape(*lead, n)


def dequantized(w: QdotPanels, layer: jax.Array | None = None) -> jax.Array:
    """The weight as floats [P, K, 16] (layer `layer` of a stack)."""
    values, scales, zeros = _layer_arrays(w, layer)
    g = values.shape[-2] // scales.shape[-2]
    out = values * jnp.repeat(scales, g, axis=-2)
    return out if zeros is None else out + jnp.repeat(zeros, g, axis=-2)


def error_bound(x: np.ndarray, w_float: np.ndarray, act_group: int) -> np.ndarray:
    """|y - x @ W| bound [M, N] from the activations' rounding alone: per group, d / 2 times
    the group's sum of |W[k, j]| (W f32[K, N] as floats)."""
    m, k = x.shape
    g = np.asarray(x, np.float64).reshape(m, k // act_group, act_group)
    d = np.abs(g).max(-1) / 127.0  # [M, na]
    wabs = np.abs(np.asarray(w_float, np.float64)).reshape(k // act_group, act_group, -1).sum(1)
    return d / 2 @ wabs


def qdot_columns(w: QdotPanels, ids: jax.Array) -> jax.Array:
    """Columns `ids` of one (unstacked) weight -> f32[..., K] (a tied embedding's lookup: the
    rows of W^T), dequantized exactly as stored."""
    p, c = ids // PANEL, ids % PANEL
    lines = w.values[p].reshape(*ids.shape, -1, PANEL, QUAD)  # [..., lines, 16, 4]
    col = jnp.take_along_axis(lines, c[..., None, None, None], axis=-2)[..., 0, :]
    col = col.astype(jnp.int32)  # [..., lines, 4]
    if w.scheme == "int4":
        col = jnp.stack([col & 15, col >> 4], axis=-2)  # [..., lines, 2, 4]
    else:
        col = col - 128
    q = col.reshape(*ids.shape, -1).astype(jnp.float32)  # [..., K]
    scales = w.scales[p, :, c]  # [..., K / G]
    g = q.shape[-1] // scales.shape[-1]
    out = q * jnp.repeat(scales, g, axis=-1)
    return out if w.zeros is None else out + jnp.repeat(w.zeros[p, :, c], g, axis=-1)


def dense_qdot_packed(x: jax.Array, w: QdotPanels, layer: jax.Array | None, n: int,
                      isa: str | None = None) -> jax.Array:
    """x f32[..., K] @ (layer `layer`, an i32 scalar, of) the weight -> f32[..., n].

    isa: as dense_cpu.dense_packed's (None: the best this CPU runs); the reference where the
    library cannot be built."""
    _check(x, w, n)
    target = dense_target(DENSE_QDOT_TARGETS[w.scheme], isa)
    if target is None:
        return dense_qdot_reference(x, w, layer, n)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    idx = jnp.zeros((), jnp.int32) if layer is None else jnp.reshape(layer, ()).astype(jnp.int32)
    args = (x2, w.values, w.scales) + (() if w.zeros is None else (w.zeros,)) + (idx,)
    y = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x2.shape[0], n), jnp.float32))(
        *args, act_group=np.int64(w.act_group))
    return y.reshape(*lead, n)
