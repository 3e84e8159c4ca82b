"""Quantized expert stacks in the MoE block's grouped matmuls (`models/moe_block.py`): the
stack type and the pieces each grouped path uses to run over it.

A quantized stack is a `quant.QuantizedWeight` with a leading expert axis (values [E, in,
out], int4 [E, in / 2, out]; scales, and int4 zeros, [E, in / G, out]; G = in for
per-column scales), made at load by `quantized_params.quantize_experts`. Per path:
  - the CPU tile loop indexes one expert's arrays per tile and multiplies through
    `grouped_dot` (per-column: `QuantizedWeight.matmul`, the scale after the dot; groups:
    the scales broadcast by a reshape, int4's nibbles against x's even / odd columns), so no
    other expert's values are converted;
  - XLA's ragged dot and the Pallas kernels (`over_quantized`): per-column scales multiply
    each row's output by its expert's scales (`row_groups`) after a dot over the converted
    values; grouped scales dequantize the whole layer stack before it (every expert, each
    step: the cost docs/quantization.md states);
  - under tensor parallelism's shard_map, `stack_spec` splits the scales with the values.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as PS

from ..kernels_pallas.dense_quant_cpu import decode_values
from .quant import QuantizedWeight

# A layer's stacked expert weights: float [E, in, out], or quantized per expert (`quant`'s
# format with a leading E axis: values [E, in, out] (int4: [E, in / 2, out]), scales (and
# int4 zeros) [E, in / G, out], G = in for per-column scales). moe_block's grouped paths take
# either; a backend kernel recognises the quantized form by its type.
ExpertWeight = jax.Array | QuantizedWeight


def expert_floats(w: ExpertWeight, dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """The whole stack as float [E, in, out] (references and tests: every expert)."""
    return w.dequantize(dtype) if isinstance(w, QuantizedWeight) else w.astype(dtype)


def per_column(w: QuantizedWeight) -> bool:
    return w.scales.shape[-2] == 1 and w.zeros is None


def row_groups(group_sizes: jax.Array, rows: int) -> jax.Array:
    """i32[rows]: each sorted row's group (rows past the sizes' sum: the last group)."""
    ends = jnp.cumsum(group_sizes)
    group = jnp.searchsorted(ends, jnp.arange(rows), side="right")
    return jnp.minimum(group, group_sizes.shape[0] - 1)


def grouped_dot(x: jax.Array, w: QuantizedWeight) -> jax.Array:
    """x [t, in] @ one expert's weight of grouped scales (int4, GGUF blocks). Each group's
    scale (and zero) is broadcast over the group by a reshape, and int4's two rows per byte
    meet x's even and odd columns in two dots, rather than `QuantizedWeight.dequantize`'s
    interleave and repeat: inside XLA:CPU's loop body those ran 10x slower (measured with
    scripts/bench/bench_moe_quant_cpu.py)."""
    k, n = w.shape
    groups = w.scales.shape[-2]

    def scaled(q: jax.Array) -> jax.Array:  # [rows, n], groups of rows // groups rows
        f = q.reshape(groups, -1, n).astype(jnp.float32) * w.scales[:, None, :]
        if w.zeros is not None:
            f = f + w.zeros[:, None, :]
        return f.reshape(-1, n).astype(x.dtype)

    def dot(a: jax.Array, b: jax.Array) -> jax.Array:
        return jnp.dot(a, b, preferred_element_type=jnp.float32)

    if w.scheme == "int4":  # byte i: row 2i in the low nibble, 2i + 1 in the high one
        y = dot(x[:, 0::2], scaled(w.values & 15)) + dot(x[:, 1::2], scaled(w.values >> 4))
    else:
        y = dot(x, scaled(decode_values(w.values, w.scheme, -2)))
    return y.astype(x.dtype)


def over_quantized(matmul: Callable[..., jax.Array], x: jax.Array, w: ExpertWeight,
                   sizes: jax.Array) -> jax.Array:
    """`matmul` over a float or quantized stack: per-column scales multiply each row's
    output after a dot over the converted values; grouped scales dequantize the whole
    stack first (every expert of the layer, each step: the cost `grouped_matmul` notes)."""
    if isinstance(w, QuantizedWeight) and per_column(w):
        y = matmul(x, w.values.astype(x.dtype), sizes).astype(jnp.float32)
        return (y * w.scales[row_groups(sizes, x.shape[0]), 0]).astype(x.dtype)
    return matmul(x, expert_floats(w, x.dtype), sizes)


def stack_spec(w: ExpertWeight, split: PS, tp: int) -> PS | QuantizedWeight:
    """The shard_map spec of an expert stack: `split` for a float one; for a quantized one,
    its values split so and its scales (and zeros) alike, except a row split (down's input
    rows) of per-column scales [E, 1, out], which every device needs whole. Groups of rows
    that the split would cut (tp not dividing the group count) are refused: a device's rows
    would not start on a group."""
    if not isinstance(w, QuantizedWeight):
        return split
    scales = split
    if split[1] is not None and w.scales.shape[-2] % tp:
        if not per_column(w):
            raise ValueError(f"tensor_parallel_size={tp} does not divide the "
                             f"{w.scales.shape[-2]} groups of {w.group_size} input rows of a "
                             "quantized expert stack; choose quantization_group_size so "
                             "that it does")
        scales = PS()
    return QuantizedWeight(split, scales, None if w.zeros is None else scales, w.scheme,
                           w.act_fp8)
