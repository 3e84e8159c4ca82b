"""The grouped expert MLP with expert biases and the activation as spec data (gpt-oss).

`moe_block.moe_mlp` takes this path only for an `MoESpec` with `expert_bias` or an
activation other than SwiGLU; the SwiGLU experts of Qwen3-MoE / Mixtral keep
`moe_block.grouped_mlp` untouched. Same contract as `grouped_mlp`: rows xs [M, hidden]
sorted by expert (`sizes` i32[E] rows each), stacked weights [E, hidden, I] (gate, up),
[E, I, hidden] (down), plus biases [E, I] (gate, up) and [E, hidden] (down):

  gate = xs @ W_gate[e] + b_gate[e], up = xs @ W_up[e] + b_up[e]   (e: the row's expert)
  h = act(gate, up)                                                (`expert_activation`)
  out = h @ W_down[e] + b_down[e]

chosen where the step is lowered, as `grouped_mlp` is: on TPU / GPU XLA's ragged dot, each
row's expert bias gathered by the row's group (from the cumulative sizes); on CPU the loop
over row tiles (each tile one expert: its bias rows read in place). Rows past sum(sizes) are
not read by the caller.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from .config import MoESpec


def expert_activation(spec: MoESpec, gate: jax.Array, up: jax.Array) -> jax.Array:
    """The expert MLP's gated activation: SwiGLU silu(gate) * up, or gpt-oss's clamped
    SwiGLU: gate <= limit, up in [-limit, limit], (up + 1) * gate * sigmoid(alpha * gate)."""
    if spec.activation == "silu":
        return jax.nn.silu(gate) * up
    if spec.activation == "swiglu_clamped":
        limit = spec.swiglu_limit
        gate = jnp.minimum(gate, jnp.asarray(limit, gate.dtype))
        up = jnp.clip(up, -limit, limit)
        glu = gate * jax.nn.sigmoid(gate * jnp.asarray(spec.swiglu_alpha, gate.dtype))
        return (up + 1) * glu
    raise ValueError(f"unknown expert activation {spec.activation!r}")  # ModelConfig checks


def _dot(x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32)


def _biased_ragged(spec: MoESpec, xs: jax.Array, sizes: jax.Array, w_gate: jax.Array,
                   w_up: jax.Array, w_down: jax.Array, b_gate: jax.Array, b_up: jax.Array,
                   b_down: jax.Array) -> jax.Array:
    num_experts = w_gate.shape[0]
    row = jnp.arange(xs.shape[0], dtype=jnp.int32)
    expert = jnp.minimum(jnp.searchsorted(jnp.cumsum(sizes), row, side="right"),
                         num_experts - 1)

    def grouped(x: jax.Array, w: jax.Array, b: jax.Array) -> jax.Array:
        y = jax.lax.ragged_dot(x, w.astype(x.dtype), sizes, preferred_element_type=jnp.float32)
        return (y + jnp.take(b, expert, axis=0).astype(jnp.float32)).astype(x.dtype)

    h = expert_activation(spec, grouped(xs, w_gate, b_gate), grouped(xs, w_up, b_up))
    return grouped(h, w_down, b_down)


def _biased_tiled(spec: MoESpec, xs: jax.Array, sizes: jax.Array, w_gate: jax.Array,
                  w_up: jax.Array, w_down: jax.Array, b_gate: jax.Array, b_up: jax.Array,
                  b_down: jax.Array) -> jax.Array:
    """`moe_block.grouped_mlp_tiled`'s row-tile loop (its layout and tile size) with the
    tile's expert's biases and `expert_activation`."""
    from .moe_block import tile_rows

    m, hidden = xs.shape
    num_experts = w_gate.shape[0]
    t = tile_rows(m, num_experts)
    slots = -(-(m + num_experts * (t - 1)) // t) * t
    padded = (sizes + t - 1) // t * t
    ends, padded_ends = jnp.cumsum(sizes), jnp.cumsum(padded)
    row = jnp.arange(m, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(ends, row, side="right"), num_experts - 1)
    pos = (padded_ends - padded)[group] + row - (ends - sizes)[group]
    xp = jnp.zeros((slots, hidden), xs.dtype).at[pos].set(xs)
    tile_group = jnp.minimum(jnp.searchsorted(padded_ends, jnp.arange(0, slots, t),
                                              side="right"), num_experts - 1)

    def step(i: jax.Array, yp: jax.Array) -> jax.Array:
        def w(stack: jax.Array) -> jax.Array:  # the tile's expert's slice, read in place
            return jax.lax.dynamic_index_in_dim(stack, tile_group[i], keepdims=False)

        def lin(x: jax.Array, weight: jax.Array, bias: jax.Array) -> jax.Array:
            return (_dot(x, w(weight)) + w(bias).astype(jnp.float32)).astype(x.dtype)

        xt = jax.lax.dynamic_slice_in_dim(xp, i * t, t)
        h = expert_activation(spec, lin(xt, w_gate, b_gate), lin(xt, w_up, b_up))
        return jax.lax.dynamic_update_slice_in_dim(yp, lin(h, w_down, b_down), i * t, 0)

    yp = jax.lax.fori_loop(0, padded_ends[-1] // t, step, jnp.zeros((slots, hidden), xs.dtype))
    return jnp.take(yp, pos, axis=0)


def grouped_mlp_biased(spec: MoESpec, lp: Any) -> Any:
    """A `moe_block.GroupedMLP` for one layer's params `lp` (fields `be_gate`, `be_up`,
    `be_down` when `spec.expert_bias`; zeros otherwise): the biased expert MLP above, chosen
    per backend where the step is lowered."""
    def bias(name: str, w: jax.Array, axis: int) -> jax.Array:
        if spec.expert_bias:
            return getattr(lp, name)
        return jnp.zeros((w.shape[0], w.shape[axis]), w.dtype)

    def mlp(xs: jax.Array, sizes: jax.Array, w_gate: jax.Array, w_up: jax.Array,
            w_down: jax.Array) -> jax.Array:
        biases = (bias("be_gate", w_gate, 2), bias("be_up", w_up, 2), bias("be_down", w_down, 2))
        return jax.lax.platform_dependent(
            xs, sizes, w_gate, w_up, w_down, *biases,
            cpu=functools.partial(_biased_tiled, spec),
            default=functools.partial(_biased_ragged, spec))
    return mlp
