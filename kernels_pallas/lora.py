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
    the row's own adapter. XLA's path on every backend for now.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


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


def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, slots: jax.Array,
               layer: jax.Array) -> jax.Array:
    """The LoRA delta of a projection (see the module docstring), per backend."""
    check_lora_operands(x, a, b, slots, layer)
    return lora_delta_masked(x, a, b, slots, layer)
