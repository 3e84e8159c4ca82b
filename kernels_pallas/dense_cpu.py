"""Dense projections on CPU over panel-packed weights (csrc/dense_cpu.cc), and their reference.

Data flow: a weight W f32[..., K, N] (``x @ W``; optionally a stack of layers on the leading
axis) is packed once, at load, by ``pack_panels`` into 16-column panels f32[..., P, K, 16]
(P = ceil(N / 16), zero columns past N) -> each step, ``dense_packed(x, panels, layer, N)``:
x f32[..., K] -> one XLA FFI custom call that reads layer ``layer``'s panels where they lie
in the stack -> y f32[..., N]. The C++ file says why the layout and the call beat XLA:CPU's
dot here (no per-layer copy out of the stack, no packing per call, sequential reads).

``dense_packed_reference`` is the same product in jnp (unpack, matmul): the oracle of the
tests, and what ``dense_packed`` computes where the C++ library cannot be built (cpu_build
logs why once). The kernel runs the best instruction set this CPU has (AVX-512, else AVX2:
cpu_build's runtime check); ``isa=`` forces one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .cpu_build import dense_kernel_target

PANEL = 16  # columns per panel: two 8-float vectors, one 64-byte cache line per row


def packed_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """[..., K, N] -> [..., ceil(N / 16), K, 16]."""
    *lead, k, n = shape
    return (*lead, -(-n // PANEL), k, PANEL)


def pack_panels(w: jax.Array | np.ndarray) -> np.ndarray:
    """[..., K, N] -> f32 [..., ceil(N / 16), K, 16], on the host (runs once, at load)."""
    w = np.asarray(w, dtype=np.float32)
    *lead, k, n = w.shape
    p = -(-n // PANEL)
    if p * PANEL != n:
        w = np.concatenate([w, np.zeros((*lead, k, p * PANEL - n), np.float32)], axis=-1)
    w = w.reshape(*lead, k, p, PANEL)
    return np.ascontiguousarray(np.moveaxis(w, -2, -3))


def unpack_panels(panels: jax.Array, n: int) -> jax.Array:
    """The inverse of pack_panels: [..., P, K, 16] -> [..., K, n]."""
    *lead, p, k, _ = panels.shape
    return jnp.moveaxis(panels, -3, -2).reshape(*lead, k, p * PANEL)[..., :n]


def _check(x: jax.Array, panels: jax.Array, n: int) -> None:
    if panels.ndim not in (3, 4) or panels.shape[-1] != PANEL:
        raise ValueError(f"panels must be [L, P, K, {PANEL}] or [P, K, {PANEL}], got "
                         f"{tuple(panels.shape)}")
    p, k = panels.shape[-3:-1]
    if x.shape[-1] != k:
        raise ValueError(f"x's last dim {x.shape[-1]} != the panels' K {k} "
                         f"(panels shape {tuple(panels.shape)})")
    if not (p - 1) * PANEL < n <= p * PANEL:
        raise ValueError(f"out_features={n} does not fit {p} panels of {PANEL} columns")
    if x.dtype != jnp.float32 or panels.dtype != jnp.float32:
        raise ValueError(f"the packed dense product is float32 only, got x {x.dtype}, "
                         f"panels {panels.dtype}")


def dense_packed_reference(x: jax.Array, panels: jax.Array, layer: jax.Array | None,
                           n: int) -> jax.Array:
    """x f32[..., K] @ (layer `layer` of) the packed weight -> f32[..., n], in jnp."""
    _check(x, panels, n)
    if panels.ndim == 4:
        panels = panels[0 if layer is None else jnp.reshape(layer, ())]
    return x @ unpack_panels(panels, n)


def dense_packed(x: jax.Array, panels: jax.Array, layer: jax.Array | None,
                 n: int, isa: str | None = None) -> jax.Array:
    """x f32[..., K] @ (layer `layer`, an i32 scalar, of) the packed weight -> f32[..., n].

    isa: the kernel's instruction set ("avx512", "avx2"; cpu_build.dense_isas() lists what
    this CPU runs), None for the best this CPU runs; one it cannot run is a ValueError."""
    _check(x, panels, n)
    target = dense_kernel_target(isa)
    if target is None:
        return dense_packed_reference(x, panels, layer, n)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    idx = jnp.zeros((), jnp.int32) if layer is None else jnp.reshape(layer, ()).astype(jnp.int32)
    y = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x2.shape[0], n), jnp.float32))(
        x2, panels, idx)
    return y.reshape(*lead, n)
