"""Weight-only quantization of the dense layers: the format, the host quantizers, the matmul.

Data flow: a float weight W [(L,) K, N] (``x @ W``, layers stacked on axis 0) ->
``quantize_weight`` (host numpy, once per leaf at load; or a pre-quantized checkpoint's values
taken as they are: GGUF blocks, `gguf_quant`; compressed-tensors, `compressed_tensors`) ->
``QuantizedWeight``: values + one scale (and for int4 one zero) per group of G consecutive
input rows and output column -> the step's ``_linear``
(`llama.py`) calls ``QuantizedWeight.matmul``: the values are converted and scaled inside the
jitted computation, one layer at a time (XLA fuses the conversion into the dot's operand on
TPU / GPU), so no float copy of the weights is ever stored. On a CPU host the engine packs
them instead for the C++ kernel (`packing.py`, `kernels_pallas.dense_quant_cpu`).

Schemes (vLLM's names):
  int8: symmetric, q in [-127, 127] (a pre-quantized checkpoint's may use all of int8: -128
        in compressed-tensors, -32..31 for GGUF Q6_K), W = q * s; default one group per output
        column (W8A16).
  fp8:  e4m3fn values, W = fp8(q) * s, per column; with ``act_fp8`` the activations are
        quantized per token to e4m3fn as well and the dot runs in fp8 (W8A8, for platforms
        with fp8 matmuls: H100 / H200); otherwise weight-only.
  int4: asymmetric, q in [0, 15], W = q * s + z, groups of 32 / 64 / 128 input rows, two rows
        packed per byte (row 2i in the low nibble); GGUF Q4_0 / Q4_1 map onto it exactly.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import struct

from jaxserve.config import QUANTIZATION_SCHEMES, QUANTIZATIONS

from ..kernels_pallas.dense_quant_cpu import apply_scales, decode_values


SCHEMES = QUANTIZATION_SCHEMES
# "auto": a pre-quantized checkpoint keeps its scheme, a float one stays float; "none":
# everything dequantized to the model dtype.
CHOICES = QUANTIZATIONS
INT4_GROUPS = (128, 64, 32)  # int4's default: the first that divides K
FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448


@dataclasses.dataclass(frozen=True)
class WeightQuant:
    """How the dense weights are stored (built from EngineConfig at the edge)."""

    scheme: str = "auto"  # one of CHOICES
    group_size: int | None = None  # None: int8 / fp8 per column, int4 INT4_GROUPS
    lm_head: bool = False  # also the lm_head (a tied embedding: both its uses)
    act_fp8: bool = False  # fp8 only: W8A8 (activations quantized per token)
    # The platform runs fp8 dots (and fp8 activations are not turned off): under "auto", a
    # checkpoint made for dynamic fp8 activations (compressed-tensors W8A8) keeps them.
    fp8_matmuls: bool = False

    def __post_init__(self) -> None:
        if self.scheme not in CHOICES:
            raise ValueError(f"quantization={self.scheme!r} must be one of {CHOICES}")
        g = self.group_size
        if g is not None and (not isinstance(g, int) or g < 2 or g % 2):
            raise ValueError(f"quantization_group_size={g!r} must be an even integer >= 2")
        if self.act_fp8 and self.scheme != "fp8":
            raise ValueError(f"fp8 activations need quantization='fp8', not {self.scheme!r}")
        if self.act_fp8 and g is not None:
            raise ValueError("fp8 activations (W8A8) take per-column weight scales: leave "
                             f"quantization_group_size unset (got {g})")

    @property
    def quantizes(self) -> bool:
        """True when float weights are quantized at load (an explicit scheme)."""
        return self.scheme in SCHEMES


@struct.dataclass
class QuantizedWeight:
    """A quantized linear weight W [(L,) K, N] (or a stack of them); ``x @ W`` is `matmul`."""

    values: jax.Array  # int8: i8[(L,) K, N]; fp8: f8e4m3fn[(L,) K, N];
    #                    int4: u8[(L,) K // 2, N] (row 2i in the low nibble, 2i + 1 high)
    scales: jax.Array  # f32[(L,) K // G, N]
    zeros: jax.Array | None = None  # f32[(L,) K // G, N]: int4 only (W = q * s + z)
    scheme: str = struct.field(pytree_node=False, default="int8")
    act_fp8: bool = struct.field(pytree_node=False, default=False)

    @property
    def shape(self) -> tuple[int, ...]:
        """The float weight's shape [(L,) K, N]."""
        *lead, k, n = self.values.shape
        return (*lead, k * 2 if self.scheme == "int4" else k, n)

    @property
    def group_size(self) -> int:
        return self.shape[-2] // self.scales.shape[-2]

    def dequantize(self, dtype: jnp.dtype = jnp.float32) -> jax.Array:
        """The float weight [(L,) K, N] (tests, and the XLA path of grouped schemes)."""
        q = decode_values(self.values, self.scheme, -2)
        return apply_scales(q, self.scales, self.zeros, -2).astype(dtype)

    def matmul(self, x: jax.Array) -> jax.Array:
        """x [..., K] @ W -> [..., N] in x's dtype (one layer: no leading L)."""
        per_column = self.scales.shape[-2] == 1 and self.zeros is None
        if self.act_fp8:
            return _fp8_dot(x, self)
        if per_column:  # scale after the dot: the dot's operand is the converted values
            y = jnp.einsum("...k,kn->...n", x, self.values.astype(x.dtype),
                           preferred_element_type=jnp.float32)
            return (y * self.scales[0]).astype(x.dtype)
        return jnp.einsum("...k,kn->...n", x, self.dequantize(x.dtype),
                          preferred_element_type=jnp.float32).astype(x.dtype)

    def columns(self, ids: jax.Array) -> jax.Array:
        """W[:, ids]^T -> f32[..., K]: a tied embedding's lookup (the lm_head is W)."""
        def pick(a: jax.Array) -> jax.Array:  # [K', N] -> [..., K']
            return jnp.moveaxis(jnp.take(a, ids, axis=-1), 0, -1)

        zeros = None if self.zeros is None else pick(self.zeros)
        q = decode_values(pick(self.values), self.scheme, -1)
        return apply_scales(q, pick(self.scales), zeros, -1)


def _fp8_dot(x: jax.Array, w: QuantizedWeight) -> jax.Array:
    """W8A8: x quantized per token to e4m3fn, an fp8 x fp8 dot accumulated in f32."""
    xf = x.astype(jnp.float32)
    sx = jnp.maximum(jnp.max(jnp.abs(xf), axis=-1, keepdims=True), 1e-12) / FP8_MAX
    xq = (xf / sx).astype(jnp.float8_e4m3fn)
    y = jnp.einsum("...k,kn->...n", xq, w.values, preferred_element_type=jnp.float32)
    return (y * sx * w.scales[0]).astype(x.dtype)


def has_fp8_matmuls(device: jax.Device) -> bool:
    """Whether XLA runs fp8 x fp8 dots natively on `device` (CUDA compute capability >= 8.9)."""
    if device.platform != "gpu":
        return False
    cc = str(getattr(device, "compute_capability", "0.0"))
    major, _, minor = cc.partition(".")
    try:
        return (int(major), int(minor or 0)) >= (8, 9)
    except ValueError:
        return False


def weight_quant(scheme: str, group_size: int | None, lm_head: bool, fp8_activations: str,
                 device: jax.Device) -> WeightQuant:
    """The WeightQuant of the engine options (fp8_activations auto | on | off)."""
    fp8_matmuls = fp8_activations != "off" and has_fp8_matmuls(device)
    act = fp8_activations == "on" or (fp8_activations == "auto" and scheme == "fp8"
                                      and group_size is None and fp8_matmuls)
    return WeightQuant(scheme, group_size, lm_head, act, fp8_matmuls)


# ------------------------------------------------------------------ host quantizers (numpy)
def default_group(scheme: str, k: int, group_size: int | None) -> int:
    """The group size for a weight with K input rows (K: one group per column)."""
    if group_size is not None:
        return group_size
    if scheme != "int4":
        return k
    for g in INT4_GROUPS:
        if k % g == 0:
            return g
    raise ValueError(f"int4: no group size of {INT4_GROUPS} divides in_features={k}; set "
                     "quantization_group_size")


def pack_int4(q: np.ndarray) -> np.ndarray:
    """u8 [..., K, N] of 0..15 -> [..., K // 2, N], rows 2i | 2i + 1 << 4."""
    return (q[..., 0::2, :] | (q[..., 1::2, :] << 4)).astype(np.uint8)


def quantize_weight(w: np.ndarray, scheme: str, group_size: int | None = None,
                    act_fp8: bool = False, name: str = "weight") -> QuantizedWeight:
    """A float weight [(L,) K, N] -> a QuantizedWeight of numpy arrays (round to nearest)."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme={scheme!r} must be one of {SCHEMES}")
    w = np.asarray(w, np.float32)
    *lead, k, n = w.shape
    g = default_group(scheme, k, group_size)
    if k % g or g % 2:
        raise ValueError(f"{name}: quantization group size {g} must be even and divide "
                         f"in_features={k}")
    wg = w.reshape(*lead, k // g, g, n)
    if scheme == "int4":
        lo, hi = wg.min(axis=-2), wg.max(axis=-2)
        s = (hi - lo) / 15.0
        s = np.where(s > 0, s, 1.0).astype(np.float32)
        q = np.clip(np.rint((wg - lo[..., None, :]) / s[..., None, :]), 0, 15).astype(np.uint8)
        return QuantizedWeight(pack_int4(q.reshape(w.shape)), s, lo.astype(np.float32), "int4")
    top = 127.0 if scheme == "int8" else FP8_MAX
    amax = np.abs(wg).max(axis=-2)
    s = np.where(amax > 0, amax / top, 1.0).astype(np.float32)
    scaled = wg / s[..., None, :]
    if scheme == "int8":
        q = np.clip(np.rint(scaled), -127, 127).astype(np.int8)
    else:
        q = scaled.astype(ml_dtypes.float8_e4m3fn)
    return QuantizedWeight(q.reshape(w.shape), s, None, scheme, act_fp8)


def weight_bytes(tree: object) -> int:
    """Bytes of every array leaf of a params tree (quantized or not)."""
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
               for x in jax.tree_util.tree_leaves(tree))
