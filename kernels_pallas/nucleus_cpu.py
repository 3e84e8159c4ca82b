"""The sampler's top-k / top-p cut-offs on CPU (csrc/nucleus_cpu.cc), and their reference.

Data flow: tempered logits x f32[S, V], k i32[S] (in [1, V]; V = off) and top_p f32[S] (>= 1
= off) -> ``nucleus_cutoffs(x, k, top_p)``: one XLA FFI custom call -> f32[S], the threshold
of each row (keep x >= it): the larger of the k-th largest value and the top-p cut-off (the
smallest value of the shortest descending prefix whose mass, over the whole row's softmax,
reaches top_p); -inf where both are off. The C++ file says how (a radix select over the
floats' order keys) and why (XLA:CPU's sort, bounded TopK and bisection all cost 5-100x more).

``nucleus_cutoffs_reference`` is the definition in jnp: a full sort of each row and a
cumulative sum in float64 when x64 is on (else float32). It is the oracle of the tests, too
slow to serve (a sort of the vocabulary). The sampler's own jnp path (TPU, GPU, and a CPU
without the library) is ``jaxserve.device.nucleus``'s candidates + bisection, tested against
both.

The kernel sums the mass in double and the reference in its own order, so the two can differ
only where top_p lies within rounding of a prefix's mass (the tests check that this is the
only way they differ).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .cpu_build import nucleus_kernel_target


def _check(x: jax.Array, k: jax.Array, top_p: jax.Array) -> None:
    if x.ndim != 2:
        raise ValueError(f"x must be f32[S, V], got shape {tuple(x.shape)}")
    if x.dtype != jnp.float32:
        raise ValueError(f"x must be float32, got {x.dtype}")
    S = x.shape[0]
    if k.shape != (S,) or top_p.shape != (S,):
        raise ValueError(f"k and top_p must be [{S}] (one per row of x), got "
                         f"{tuple(k.shape)} and {tuple(top_p.shape)}")


def nucleus_cutoffs_reference(x: jax.Array, k: jax.Array, top_p: jax.Array) -> jax.Array:
    """f32[S]: each row's threshold by a full sort (the definition; see the module)."""
    _check(x, k, top_p)
    S, V = x.shape
    desc = -jnp.sort(-x, axis=-1)  # f32[S, V] descending
    kth = jnp.take_along_axis(desc, (jnp.clip(k, 1, V) - 1)[:, None], axis=-1)[:, 0]
    kth = jnp.where(k >= V, -jnp.inf, kth)
    wide = jnp.float64 if jax.config.jax_enable_x64 else jnp.float32
    p = jnp.exp((desc - desc[:, :1]).astype(wide))
    cum = jnp.cumsum(p, axis=-1)
    need = top_p.astype(wide) * cum[:, -1]
    first = jnp.minimum(jnp.sum(cum < need[:, None], axis=-1), V - 1)  # first reaching need
    pth = jnp.take_along_axis(desc, first[:, None], axis=-1)[:, 0]
    pth = jnp.where(top_p >= 1.0, -jnp.inf, pth)
    return jnp.maximum(kth, pth)


def nucleus_cutoffs(x: jax.Array, k: jax.Array, top_p: jax.Array) -> jax.Array:
    """f32[S]: each row's threshold by the C++ kernel. The library must be available
    (``available()``); callers pick their jnp path otherwise."""
    _check(x, k, top_p)
    target = nucleus_kernel_target()
    if target is None:
        raise RuntimeError("the CPU cut-off kernel is unavailable (cpu_build logged why)")
    return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0],), jnp.float32),
                            vmap_method="sequential")(
        x, k.astype(jnp.int32), top_p.astype(jnp.float32))


def available() -> bool:
    """Whether the kernel's library was built and registered (at most one build per process)."""
    return nucleus_kernel_target() is not None
