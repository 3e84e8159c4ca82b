"""Ragged paged attention on CPU through the C++ kernel (csrc/paged_attention_cpu.cc).

Data flow: q [T, Hq, Dq] (cast to f32, small) + kv_pages [P, 2 * Hkv, page_size, D] (f32,
bf16 or f16, passed to the kernel as they are: no copy, no gather) + the metadata arrays ->
one XLA FFI custom call -> out f32 [T, Hq, Dq] -> q's dtype. The kernel reads each sequence's
K/V straight from its pages through the block table, fuses QK, online softmax and PV per
(sequence, kv head, query tile) in f32 and runs on XLA's intra-op thread pool without the
GIL. Only the first Dq columns of the pages are read, so pages padded to a wider head dim
need no padding of q. Where the kernel cannot be built (cpu_build logs why), these functions
return the jnp reference's result instead.

``write_kv_and_attend_cpu`` is the engine's per-layer call: the same custom call first stores
the step's K/V rows into their slots, the pages aliased from input to output
(``input_output_aliases``), so under jit with the pages donated (the engine's scan carry)
nothing but the T new rows is written -- XLA:CPU's scatter (``write_kv``) does not always
manage that (with bfloat16 pages it rewrote the whole cache every layer).

Quantized pages (``QuantizedKV``: int8 / float8_e4m3fn values + f32 row scales): the same two
calls, with the scales passed beside the pages (and, for the write, aliased and returned
beside them); the kernel quantizes the new rows as ``write_kv`` does and dequantizes on the
fly (kv_quant.h). k_new / v_new then stay in the model's dtype.

Attention sinks (``sinks`` f32[Hq], gpt-oss): one more FFI buffer, folded into each row's
softmax denominator where the kernel normalises (attention_plan.h ``inv_denominator``); without
sinks an empty f32[0] buffer goes in its place and the kernel skips the fold.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from .common import (AttentionMetadata, KVPages, QuantizedKV, check_attention_inputs,
                     write_kv)
from .cpu_build import (QUANT_TARGET, TARGET, WRITE_QUANT_TARGET, WRITE_TARGET,
                        attention_target, cpu_kernel_target)
from .reference import ragged_paged_attention_reference


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "isa"))
def ragged_paged_attention_cpu(q: jax.Array, kv_pages: KVPages, md: AttentionMetadata, *,
                               sm_scale: float, sliding_window: int | None = None,
                               soft_cap: float | None = None, isa: str | None = None,
                               sinks: jax.Array | None = None) -> jax.Array:
    """out [T, Hq, Dq] in q's dtype: causal ragged paged attention (see module docstring).
    isa: force the library built for that instruction set (cpu_build.attention_target);
    sinks: f32[Hq] attention-sink logits or None."""
    _check(q, kv_pages, md, sm_scale, sliding_window, soft_cap, sinks)
    if cpu_kernel_target() is None:
        return ragged_paged_attention_reference(q, kv_pages, md, sm_scale=sm_scale,
                                                sliding_window=sliding_window,
                                                soft_cap=soft_cap, sinks=sinks)
    quantized = isinstance(kv_pages, QuantizedKV)
    call = jax.ffi.ffi_call(attention_target(QUANT_TARGET if quantized else TARGET, isa),
                            jax.ShapeDtypeStruct(q.shape, jnp.float32))
    pages = (kv_pages.pages, kv_pages.scales) if quantized else (kv_pages,)
    out = call(q.astype(jnp.float32), *pages, md.block_tables, md.kv_lens, md.cu_q_lens,
               md.num_seqs, _sink_buffer(sinks), **_attrs(sm_scale, sliding_window, soft_cap))
    return out.astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "isa"))
def write_kv_and_attend_cpu(q: jax.Array, k_new: jax.Array, v_new: jax.Array,
                            kv_pages: KVPages, md: AttentionMetadata, *, sm_scale: float,
                            sliding_window: int | None = None, soft_cap: float | None = None,
                            isa: str | None = None, sinks: jax.Array | None = None
                            ) -> tuple[jax.Array, KVPages]:
    """(out [T, Hq, Dq] in q's dtype, kv_pages with k_new/v_new [T, Hkv, <= D] stored at
    md.slot_mapping): write_kv then attention, as one custom call (see module docstring);
    isa and sinks as ragged_paged_attention_cpu's."""
    _check(q, kv_pages, md, sm_scale, sliding_window, soft_cap, sinks)
    # write_kv's own checks, traced only (it names the bad shape or dtype).
    jax.eval_shape(write_kv, kv_pages, k_new, v_new, md.slot_mapping)
    if cpu_kernel_target() is None:
        kv_pages = write_kv(kv_pages, k_new, v_new, md.slot_mapping)
        return ragged_paged_attention_reference(q, kv_pages, md, sm_scale=sm_scale,
                                                sliding_window=sliding_window,
                                                soft_cap=soft_cap, sinks=sinks), kv_pages
    metadata = (md.slot_mapping, md.block_tables, md.kv_lens, md.cu_q_lens, md.num_seqs,
                _sink_buffer(sinks))
    out_q = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    if isinstance(kv_pages, QuantizedKV):
        pages, scales = kv_pages.pages, kv_pages.scales
        call = jax.ffi.ffi_call(attention_target(WRITE_QUANT_TARGET, isa), (
            out_q, jax.ShapeDtypeStruct(pages.shape, pages.dtype),
            jax.ShapeDtypeStruct(scales.shape, scales.dtype)), input_output_aliases={3: 1, 4: 2})
        out, pages, scales = call(q.astype(jnp.float32), k_new, v_new, pages, scales, *metadata,
                                  **_attrs(sm_scale, sliding_window, soft_cap))
        return out.astype(q.dtype), QuantizedKV(pages, scales)
    call = jax.ffi.ffi_call(attention_target(WRITE_TARGET, isa), (out_q,
                                           jax.ShapeDtypeStruct(kv_pages.shape, kv_pages.dtype)),
                            input_output_aliases={3: 1})
    out, kv_pages = call(q.astype(jnp.float32), k_new, v_new, kv_pages, *metadata,
                         **_attrs(sm_scale, sliding_window, soft_cap))
    return out.astype(q.dtype), kv_pages


def _sink_buffer(sinks: jax.Array | None) -> jax.Array:
    """The kernel's sinks argument: f32[Hq], or f32[0] for none."""
    return jnp.zeros((0,), jnp.float32) if sinks is None else sinks


def _attrs(sm_scale: float, sliding_window: int | None,
           soft_cap: float | None) -> dict[str, np.generic]:
    """The custom call's attributes; 0 means 'none' for the window and the cap."""
    return dict(sm_scale=np.float32(sm_scale), sliding_window=np.int64(sliding_window or 0),
                soft_cap=np.float32(soft_cap or 0.0))


def _check(q: jax.Array, kv_pages: KVPages, md: AttentionMetadata, sm_scale: float,
           sliding_window: int | None, soft_cap: float | None,
           sinks: jax.Array | None) -> None:
    geom = check_attention_inputs(q, kv_pages, md, sm_scale=sm_scale,
                                  sliding_window=sliding_window, soft_cap=soft_cap,
                                  sinks=sinks)
    if geom.group > 64:
        raise ValueError(f"the CPU kernel takes at most 64 query heads per kv head, got "
                         f"{geom.group} (q shape {tuple(q.shape)}, kv_pages shape "
                         f"{tuple(kv_pages.shape)})")
