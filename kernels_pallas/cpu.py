"""Ragged paged attention on CPU through the C++ kernel (csrc/paged_attention_cpu.cc).

Data flow: q [T, Hq, Dq] (cast to f32, small) + kv_pages [P, 2 * Hkv, page_size, D] (f32,
bf16 or f16, passed to the kernel as they are: no copy, no gather) + the metadata arrays ->
one XLA FFI custom call -> out f32 [T, Hq, Dq] -> q's dtype. The kernel reads each sequence's
K/V straight from its pages through the block table, fuses QK, online softmax and PV per
(sequence, kv head, query tile) in f32 and runs on XLA's intra-op thread pool without the
GIL. Only the first Dq columns of the pages are read, so pages padded to a wider head dim
need no padding of q. Where the kernel cannot be built (cpu_build logs why), this function
returns the jnp reference's result instead.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from .common import AttentionMetadata, check_attention_inputs
from .cpu_build import cpu_kernel_target
from .reference import ragged_paged_attention_reference


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap"))
def ragged_paged_attention_cpu(q: jax.Array, kv_pages: jax.Array, md: AttentionMetadata, *,
                               sm_scale: float, sliding_window: int | None = None,
                               soft_cap: float | None = None) -> jax.Array:
    """out [T, Hq, Dq] in q's dtype: causal ragged paged attention (see module docstring)."""
    geom = check_attention_inputs(q, kv_pages, md, sm_scale=sm_scale,
                                  sliding_window=sliding_window, soft_cap=soft_cap)
    if geom.group > 64:
        raise ValueError(f"the CPU kernel takes at most 64 query heads per kv head, got "
                         f"{geom.group} (q shape {tuple(q.shape)}, kv_pages shape "
                         f"{tuple(kv_pages.shape)})")
    target = cpu_kernel_target()
    if target is None:
        return ragged_paged_attention_reference(q, kv_pages, md, sm_scale=sm_scale,
                                                sliding_window=sliding_window,
                                                soft_cap=soft_cap)
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    out = call(q.astype(jnp.float32), kv_pages, md.block_tables, md.kv_lens, md.cu_q_lens,
               md.num_seqs, sm_scale=np.float32(sm_scale),
               sliding_window=np.int64(sliding_window or 0),
               soft_cap=np.float32(soft_cap or 0.0))
    return out.astype(q.dtype)
