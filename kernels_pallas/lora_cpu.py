"""The multi-LoRA delta on CPU: one XLA FFI call into csrc/lora_cpu.cc (lora.py's contract).

Data flow: x [T, in] (cast to float32 here), the whole stacks a [L, S, in, R] and
b [L, S, R, out] (float32 or bfloat16, passed as they lie: the kernel reads layer `layer`'s
slots in place, no per-layer copy), slots i32[T], layer i32[] -> the C++ kernel: rows
counting-sorted by slot, each adapter's A then B applied to its rows in jobs of up to 16
rows (so an adapter's matrices are read once per 16 of its rows, not once per row), slot-0
rows zeroed without reading a weight -> y f32[T, out] -> x's dtype. bfloat16 stacks on a
CPU with AVX512_BF16 (the avx512_vnni build) run as bfloat16 dot products, x and x @ A
rounded to bfloat16 first (csrc/lora_bf16_dot.h); float32 stacks are exact float32 products.

Where the C++ library cannot be built (cpu_build logs why once), or for stacks of another
dtype (float16, or a and b of different dtypes), ``lora_delta_cpu`` computes the same with
``lora_delta_masked`` (XLA). ``isa=`` forces an instruction set (cpu_build.dense_isas()),
as the dense kernels' wrappers do; the plain call runs the best this CPU has.

Measured (scripts/bench/bench_lora_delta.py, 2-vCPU EPYC shared with other jobs, load ~2-4,
AVX-512; per layer, medians of per-round ratios; the bundled model's 576 x 1536 projection,
9 slots of rank 16): 32 decode rows over 8 adapters 0.15x the base projection's time
(bfloat16 stacks 0.11x), against the masked path's 0.60x (3.5x the kernel); 512 prefill rows
on 2 adapters 0.07x against 0.35x (5.0x); 32 rows all on slot 0 0.02x (the output's zeros).
Since then (scripts/bench/bench_lora_step.py, a whole decode step's 7 projections x 30
layers, 32 rows on 8 adapters): 8.4 -> 6.7 ms float32, 6.3 -> 4.1 ms bfloat16 (fetching the
next adapter ahead; bfloat16 dot products).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .cpu_build import LORA_TARGETS, dense_target
from .lora import check_lora_operands, lora_delta_masked


def lora_cpu_target(a: jax.Array, b: jax.Array, isa: str | None = None) -> str | None:
    """The FFI target for stacks a / b (forced to `isa` if given), or None where the kernel
    does not run them (no library, or a dtype it does not read)."""
    if a.dtype != b.dtype or str(a.dtype) not in LORA_TARGETS:
        return None
    return dense_target(LORA_TARGETS[str(a.dtype)], isa)


def lora_delta_cpu(x: jax.Array, a: jax.Array, b: jax.Array, slots: jax.Array,
                   layer: jax.Array, isa: str | None = None) -> jax.Array:
    """lora_delta through the C++ kernel (module docstring); -> [T, out] in x's dtype.

    isa: the kernel's instruction set, None for the best this CPU runs; one it cannot run
    is a ValueError (cpu_build.dense_target)."""
    check_lora_operands(x, a, b, slots, layer)
    target = lora_cpu_target(a, b, isa)
    if target is None:
        return lora_delta_masked(x, a, b, slots, layer)
    out = jax.ShapeDtypeStruct((x.shape[0], b.shape[3]), jnp.float32)
    y = jax.ffi.ffi_call(target, out)(x.astype(jnp.float32), a, b, slots,
                                      jnp.reshape(layer, ()).astype(jnp.int32))
    return y.astype(x.dtype)
