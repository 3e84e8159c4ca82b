"""The multi-LoRA delta of one projection: contract, jnp reference and the per-backend choice.

    lora_delta(x [T, in], a [L, S, in, R], b [L, S, R, out], slots i32[T], layer i32[])
        -> [T, out] in x's dtype, float32 accumulation

Row t gets (x[t] @ a[layer, slots[t]]) @ b[layer, slots[t]]: the low-rank update of its own
adapter (the scaling alpha / r is folded into b when the adapter is loaded). The stacks hold
every layer (L) and every adapter slot (S); slot 0 is "no adapter" and its rows come out
exactly zero. `slots` and `layer` are data, never shapes: one compiled step serves any mix of
adapters, and loading an adapter into a slot is an update of the stacks' values.

The stacks are passed whole with the layer as an index (as the packed dense weights are,
`models/linear.py`): a per-layer slice taken outside would be a copy of the layer's S slots
every step.

Implementations (chosen where the step is lowered, so an export for TPU / CUDA from a CPU
host gets that platform's):
  - `lora_delta_reference`: by the definition, each row's adapter gathered per row (tests).
  - `lora_delta_masked`: every row times every slot's A, the other slots' products masked to
    zero, then one dense [T, S * R] @ [S * R, out] matmul: no gather, S times the work of
    the row's own adapter, every slot's weights read. Other backends, and TPU / CUDA where
    `grouped_pays` says so.
  - `lora_delta_cpu` (lora_cpu.py, csrc/lora_cpu.cc): CPU. Rows counting-sorted by slot,
    each adapter's A and B read once per 16 of its rows, only the row's own adapter's FMAs.
  - `lora_delta_grouped` (Punica's SGMV): rows sorted by slot on the device (stable), the
    slot-0 rows last and outside every group, then the Pallas grouped matmul
    (grouped_matmul_tpu.py / grouped_matmul_gpu.py) twice, shrink x @ A[slot] -> [T, R] and
    expand -> [T, out], over the layer's [S, in, R] / [S, R, out] (the layer indexed out, a
    copy of S slots: small next to the projection), then un-sorted. The slot-0 rows lie past
    sum(group sizes), so the kernels write them as zeros without a matmul.

TPU / CUDA: grouped or masked? (not measured: no TPU or GPU was at hand; `grouped_pays`
is the estimate, each backend's figures in _ACCEL). The masked path's cost is every slot's
weights, S * R * (in + out) elements, and T * S * R * (in + out) multiply-adds; the grouped
path reads only the slots its rows use and does T * R * (in + out) of them, but adds its
own fixed cost: a sort, two gathers, a scatter, the tile metadata of both calls and two
kernel launches (the bundled model's shapes lowered, bf16: 465 StableHLO ops for TPU, 415
for CUDA, against the masked path's 38 with its 2 dots), guessed at ~25 us on a GPU, where
every launch counts, and ~10 us on TPU. Its products are also narrow: the shrink's N and
the expand's K are R (16), while a TPU MXU works in 128-wide passes, so up to S * R = 128
the masked path's wide matmul costs no more MXU passes than the grouped one's narrow ones
(tensor cores are 16 wide). For the bundled model (in 576, out 1536, 9 slots of rank 16:
0.6 MB of bf16 adapters per projection and layer, under a microsecond of HBM time) the
fixed cost dominates: masked on both. The grouped path pays where the slots' weights are
large (64 slots of rank 64 on an 8B model's gate projection: 153 MB per layer, 2.4 MB an
adapter, of which a prefill of a few prompts reads a few) or prefill makes S times the
FLOPs count. The GPU kernel's power-of-two tiles also need in, R and out multiples of 16
(Triton's dot), else masked.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from .grouped_matmul_gpu import gpu_tiles_fit, grouped_matmul_gpu
from .grouped_matmul_tpu import grouped_matmul_tpu


def check_lora_operands(x: jax.Array, a: jax.Array, b: jax.Array, slots: jax.Array,
                        layer: jax.Array) -> None:
    """Trace-time shape / dtype checks; ValueError naming the bad operand."""
    if x.ndim != 2:
        raise ValueError(f"lora_delta: x must be [T, in], got shape {tuple(x.shape)}")
    if a.ndim != 4 or b.ndim != 4:
        raise ValueError(f"lora_delta: a must be [L, S, in, R] and b [L, S, R, out], got "
                         f"{tuple(a.shape)} and {tuple(b.shape)}")
    L, S, k, r = a.shape
    if k != x.shape[1]:
        raise ValueError(f"lora_delta: x has {x.shape[1]} input features, a {tuple(a.shape)} "
                         f"expects {k}")
    if b.shape[:3] != (L, S, r):
        raise ValueError(f"lora_delta: b {tuple(b.shape)} must be [L={L}, S={S}, R={r}, out] "
                         f"to match a {tuple(a.shape)}")
    if slots.shape != (x.shape[0],) or slots.dtype != jnp.int32:
        raise ValueError(f"lora_delta: slots must be int32[{x.shape[0]}] (one per row of x), "
                         f"got {slots.dtype}{list(slots.shape)}")
    if jnp.shape(layer) != () or jnp.asarray(layer).dtype != jnp.int32:
        raise ValueError(f"lora_delta: layer must be an int32 scalar, got "
                         f"{jnp.asarray(layer).dtype}{list(jnp.shape(layer))}")


def _layer(w: jax.Array, layer: jax.Array) -> jax.Array:
    return jax.lax.dynamic_index_in_dim(w, layer, 0, keepdims=False)


def lora_delta_reference(x: jax.Array, a: jax.Array, b: jax.Array, slots: jax.Array,
                         layer: jax.Array) -> jax.Array:
    """lora_delta by the definition: each row's adapter matrices gathered for that row
    (T copies of an adapter: the oracle of the tests, not a serving path)."""
    check_lora_operands(x, a, b, slots, layer)
    al, bl = _layer(a, layer), _layer(b, layer)
    u = jnp.einsum("ti,tir->tr", x.astype(jnp.float32), al[slots].astype(jnp.float32))
    y = jnp.einsum("tr,tro->to", u, bl[slots].astype(jnp.float32))
    return jnp.where((slots > 0)[:, None], y, 0.0).astype(x.dtype)


def lora_delta_masked(x: jax.Array, a: jax.Array, b: jax.Array, slots: jax.Array,
                      layer: jax.Array) -> jax.Array:
    """lora_delta as two dense matmuls: x @ every slot's A -> [T, S, R], rows' other slots
    (and slot 0) zeroed, then @ the slots' B stacked [S * R, out]. Zeros added to a float
    sum are exact, so each row gets its own adapter's product (summed in another order)."""
    check_lora_operands(x, a, b, slots, layer)
    al, bl = _layer(a, layer), _layer(b, layer)
    S, _, R = al.shape
    dt = jnp.promote_types(x.dtype, al.dtype)
    u = jnp.einsum("ti,sir->tsr", x.astype(dt), al.astype(dt),
                   preferred_element_type=jnp.float32)
    own = (jnp.arange(S, dtype=jnp.int32)[None, :] == slots[:, None]) & (slots > 0)[:, None]
    u = jnp.where(own[:, :, None], u, 0.0).reshape(x.shape[0], S * R)
    y = jnp.dot(u.astype(dt), bl.reshape(S * R, -1).astype(dt),
                preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


GroupedMatmul = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def lora_delta_grouped(x: jax.Array, a: jax.Array, b: jax.Array, slots: jax.Array,
                       layer: jax.Array, matmul: GroupedMatmul) -> jax.Array:
    """lora_delta through a grouped matmul `matmul(x [M, K], w [G, K, N], sizes i32[G])`
    (grouped_matmul.py's contract: rows sorted by group, rows past sum(sizes) zero):
    rows sorted by slot with slot 0 (and any slot outside [0, S), as the masked path) last
    and in no group, shrink, expand, un-sort."""
    check_lora_operands(x, a, b, slots, layer)
    al, bl = _layer(a, layer), _layer(b, layer)
    S = al.shape[0]
    dt = jnp.promote_types(x.dtype, al.dtype)
    key = jnp.where((slots > 0) & (slots < S), slots, S)
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    sizes = jnp.zeros((S,), jnp.int32).at[key].add(1, mode="drop")  # sizes[0] = 0
    u = matmul(jnp.take(x.astype(dt), order, axis=0), al.astype(dt), sizes)  # [T, R]
    ys = matmul(u, bl.astype(dt), sizes)                                    # [T, out]
    rows = jnp.arange(x.shape[0], dtype=jnp.int32)
    inverse = jnp.zeros_like(order).at[order].set(rows)  # sorted position of each row
    return jnp.take(ys, inverse, axis=0).astype(x.dtype)


# Estimates (datasheet figures, not measurements) for `grouped_pays`: dense bf16 FLOP/s,
# HBM bytes/s, the grouped path's fixed cost in seconds (its extra XLA ops and launches),
# the matmul unit's width (a product narrower than this costs as much as this wide) and the
# grouped kernel's largest row tile (a tile a group boundary cuts is visited once per group).
_ACCEL = {"tpu": (197e12, 819e9, 10e-6, 128, 128),  # v5e: MXU 128 x 128
          "cuda": (989e12, 3.35e12, 25e-6, 16, 64)}  # H100 SXM: wgmma n >= 8, k = 16


def grouped_pays(backend: str, t: int, s: int, r: int, k: int, n: int, itemsize: int
                 ) -> bool:
    """Whether the grouped path is estimated faster than the masked one on `backend`
    ("tpu" / "cuda") for T = t rows, S = s slots of rank r, in = k, out = n: each path's
    time is the larger of its bytes over bandwidth and its FLOPs over peak (products
    narrower than the unit padded to it), the grouped path's plus its fixed cost. Static:
    the shapes decide, never the data."""
    peak, bandwidth, fixed, width, tile = _ACCEL[backend]
    adapter = r * (k + n)  # one slot's A and B, elements
    masked = max(s * adapter * itemsize / bandwidth,
                 2 * t * -(-s * r // width) * width * (k + n) / peak)
    used = min(t, s - 1)  # at most one adapter per row, slot 0 never read
    rows = t + (used - 1) * min(t, tile)  # each group boundary: one more tile visit
    grouped = fixed + max(used * adapter * itemsize / bandwidth,
                          2 * rows * -(-r // width) * width * (k + n) / peak)
    return grouped < masked


def _grouped_or_masked(backend: str, matmul: GroupedMatmul) -> Callable[..., jax.Array]:
    def run(x: jax.Array, a: jax.Array, b: jax.Array, slots: jax.Array,
            layer: jax.Array) -> jax.Array:
        _, s, k, r = a.shape
        n = b.shape[3]
        itemsize = jnp.promote_types(x.dtype, a.dtype).itemsize
        fits = backend != "cuda" or (gpu_tiles_fit(k, r) and gpu_tiles_fit(r, n))
        if fits and grouped_pays(backend, x.shape[0], s, r, k, n, itemsize):
            return lora_delta_grouped(x, a, b, slots, layer, matmul)
        return lora_delta_masked(x, a, b, slots, layer)

    run.__name__ = f"lora_delta_{backend}"
    return run


lora_delta_tpu = _grouped_or_masked("tpu", grouped_matmul_tpu)
lora_delta_cuda = _grouped_or_masked("cuda", grouped_matmul_gpu)


def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, slots: jax.Array,
               layer: jax.Array) -> jax.Array:
    """The LoRA delta of a projection (see the module docstring), per backend: the C++
    kernel on CPU, grouped or masked (`grouped_pays`) on TPU and CUDA, masked elsewhere."""
    check_lora_operands(x, a, b, slots, layer)
    from .lora_cpu import lora_delta_cpu  # lora_cpu builds on this module's contract

    return jax.lax.platform_dependent(x, a, b, slots, layer, cpu=lora_delta_cpu,
                                      tpu=lora_delta_tpu, cuda=lora_delta_cuda,
                                      default=lora_delta_masked)
