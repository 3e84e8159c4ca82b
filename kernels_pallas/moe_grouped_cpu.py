"""The MoE block's grouped SwiGLU expert MLP on CPU over panel-packed expert weights
(csrc/moe_grouped_cpu.cc), and its reference.

Data flow: an expert stack W [..., E, K, N] (gate / up [.., E, hidden, I], down
[.., E, I, hidden]; optionally stacked over layers on the leading axis) is packed once, at
load, by ``pack_expert_panels`` into 16-column panels [..., E, ceil(N / 16), K, 16] in float32
or bfloat16 (the dense kernel's panel layout per expert, `dense_cpu.py`) -> each step,
``grouped_mlp_packed(xs, sizes, gate, up, down, layer)``: rows xs [M, hidden] sorted by
expert, group sizes i32[E] (data) -> one XLA FFI custom call: for each expert's rows
silu(x @ Wg) * (x @ Wu) @ Wd, only the experts that have rows read (layer ``layer``'s
panels where they lie in the stack) -> y [M, hidden] in xs' dtype (float32 inside); rows
past sum(sizes) are zero. Against XLA:CPU, which lowers ``ragged_dot`` as every row times
every expert, and the MoE block's tile loop (`models/moe_block.py`),
scripts/bench/bench_moe_cpu.py measures it.

``grouped_mlp_packed_reference`` computes the same in jnp, one expert at a time over all
rows, masked (E times the work; memory of one expert's rows): what ``grouped_mlp_packed``
runs where the C++ library cannot be built (cpu_build logs why once). The kernel runs the
best instruction set this CPU has; ``isa=`` forces one (cpu_build.dense_isas()).
Quantized experts are not packed here (another scheme's panels would be their own dtype and
FFI target beside these two).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .cpu_build import MOE_GROUPED_TARGETS, dense_target
from .dense_cpu import PANEL

WEIGHT_DTYPES = ("float32", "bfloat16")  # the panels' dtypes the kernel reads


def pack_expert_panels(w: jax.Array | np.ndarray, dtype: str = "float32") -> np.ndarray:
    """[..., E, K, N] -> [..., E, ceil(N / 16), K, 16] in `dtype` (float32 / bfloat16), on
    the host (runs once, at load); columns past N are zero."""
    if dtype not in WEIGHT_DTYPES:
        raise ValueError(f"expert panel dtype={dtype!r} must be one of {WEIGHT_DTYPES}")
    w = np.asarray(w).astype(jnp.dtype(dtype))
    if w.ndim < 3:
        raise ValueError(f"an expert stack is [..., E, K, N], got shape {w.shape}")
    *lead, k, n = w.shape
    p = -(-n // PANEL)
    if p * PANEL != n:
        w = np.concatenate([w, np.zeros((*lead, k, p * PANEL - n), w.dtype)], axis=-1)
    return np.ascontiguousarray(np.moveaxis(w.reshape(*lead, k, p, PANEL), -2, -3))


def unpack_expert_panels(panels: jax.Array, n: int) -> jax.Array:
    """The inverse of pack_expert_panels: [..., P, K, 16] -> [..., K, n]."""
    *lead, p, k, _ = panels.shape
    return jnp.moveaxis(panels, -3, -2).reshape(*lead, k, p * PANEL)[..., :n]


def _check(xs: jax.Array, sizes: jax.Array, gate: jax.Array, up: jax.Array,
           down: jax.Array, intermediate: int) -> None:
    if xs.ndim != 2:
        raise ValueError(f"xs must be [M, hidden], got shape {tuple(xs.shape)}")
    hidden = xs.shape[1]
    if gate.ndim not in (4, 5) or gate.shape[-1] != PANEL:
        raise ValueError(f"gate panels must be [L, E, PI, hidden, {PANEL}] or "
                         f"[E, PI, hidden, {PANEL}], got {tuple(gate.shape)}")
    if up.shape != gate.shape:
        raise ValueError(f"up panels {tuple(up.shape)} != gate panels {tuple(gate.shape)}")
    lead, (e, pi, k) = gate.shape[:-4], gate.shape[-4:-1]
    if k != hidden:
        raise ValueError(f"xs' hidden {hidden} != the gate panels' K {k} "
                         f"(gate shape {tuple(gate.shape)})")
    if not (pi - 1) * PANEL < intermediate <= pi * PANEL:
        raise ValueError(f"intermediate={intermediate} does not fit {pi} panels of {PANEL}")
    want = (*lead, e, -(-hidden // PANEL), intermediate, PANEL)
    if tuple(down.shape) != want:
        raise ValueError(f"down panels must be {want} for hidden {hidden}, intermediate "
                         f"{intermediate}, got {tuple(down.shape)}")
    if sizes.shape != (e,) or sizes.dtype != jnp.int32:
        raise ValueError(f"sizes must be int32[{e}] (one per expert), got {sizes.dtype}"
                         f"{list(sizes.shape)}")
    dtypes = {str(a.dtype) for a in (gate, up, down)}
    if len(dtypes) != 1 or not dtypes <= set(WEIGHT_DTYPES):
        raise ValueError(f"expert panels must share one dtype of {WEIGHT_DTYPES}, got "
                         f"gate {gate.dtype}, up {up.dtype}, down {down.dtype}")
    if not jnp.issubdtype(xs.dtype, jnp.floating):
        raise ValueError(f"xs must be floating point, got {xs.dtype}")


def _layer_of(panels: jax.Array, layer: jax.Array | None) -> jax.Array:
    return panels if panels.ndim == 4 else panels[0 if layer is None else jnp.reshape(layer, ())]


def grouped_mlp_packed_reference(xs: jax.Array, sizes: jax.Array, gate: jax.Array,
                                 up: jax.Array, down: jax.Array, layer: jax.Array | None,
                                 intermediate: int) -> jax.Array:
    """grouped_mlp_packed in jnp: each expert's MLP on every row, kept where the row is the
    expert's (float32)."""
    _check(xs, sizes, gate, up, down, intermediate)
    hidden = xs.shape[1]
    g, u, d = (_layer_of(p, layer) for p in (gate, up, down))
    ends = jnp.cumsum(jnp.maximum(sizes, 0))
    row = jnp.arange(xs.shape[0])
    group = jnp.searchsorted(ends, row, side="right")  # E for rows past the groups
    x = xs.astype(jnp.float32)

    def expert(e: jax.Array, y: jax.Array) -> jax.Array:
        def w(p: jax.Array, n: int) -> jax.Array:
            return unpack_expert_panels(p[e], n).astype(jnp.float32)

        h = jax.nn.silu(x @ w(g, intermediate)) * (x @ w(u, intermediate))
        return jnp.where((group == e)[:, None], h @ w(d, hidden), y)

    y = jax.lax.fori_loop(0, g.shape[0], expert, jnp.zeros(x.shape, jnp.float32))
    return y.astype(xs.dtype)


def grouped_mlp_packed(xs: jax.Array, sizes: jax.Array, gate: jax.Array, up: jax.Array,
                       down: jax.Array, layer: jax.Array | None, intermediate: int,
                       isa: str | None = None) -> jax.Array:
    """The grouped SwiGLU expert MLP of rows xs [M, hidden] sorted by expert (`sizes`
    i32[E] rows each) over packed panels (`pack_expert_panels`; layer `layer`, an i32
    scalar, of a stack) -> [M, hidden] in xs' dtype.

    isa: the kernel's instruction set (cpu_build.dense_isas()), None for the best this CPU
    runs; one it cannot run is a ValueError."""
    _check(xs, sizes, gate, up, down, intermediate)
    target = dense_target(MOE_GROUPED_TARGETS[str(gate.dtype)], isa)
    if target is None:
        return grouped_mlp_packed_reference(xs, sizes, gate, up, down, layer, intermediate)
    idx = jnp.zeros((), jnp.int32) if layer is None else jnp.reshape(layer, ()).astype(jnp.int32)
    y = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(xs.shape, jnp.float32))(
        xs.astype(jnp.float32), sizes, gate, up, down, idx)
    return y.astype(xs.dtype)
