"""Shared contract of the attention kernels: step metadata, KV page layout, input checks, KV writes.

Data flow of one engine step (per layer)::

    k_new, v_new [T, Hkv, D] --write_kv(slot_mapping)--> kv_pages (updated in place if donated)
    q [T, Hq, D] + kv_pages + AttentionMetadata --ragged_paged_attention--> out [T, Hq, D]

KV page layout (all implementations): ``kv_pages`` is ``[num_pages, 2 * Hkv, page_size, D]``;
K of kv head ``h`` sits at index ``2h`` of axis 1 and V at ``2h + 1``. The head axis comes
before the token axis (rather than ``[num_pages, page_size, 2 * Hkv, D]``) because then one
(page, kv head) pair is a contiguous ``[2, page_size, D]`` slab: the TPU kernel DMAs
``[2 * heads_per_block, page_size, D]`` per page without strided de-interleaving and the GPU
kernel's TMA copies are dense ``[page_size, D]`` boxes. A token's K/V is then
scattered over 2 * Hkv rows of a page, which costs the (small, T-sized) write nothing extra.
Page 0 is the trash page: padding tokens write there and unused block-table entries point
there; no live sequence may own it.

Quantized pages (``QuantizedKV``: int8 or float8_e4m3fn values plus one f32 scale per token,
KV head and K-or-V, ``scales [num_pages, 2 * Hkv, page_size]``, the page layout minus D):
``write_kv`` quantizes each new row symmetrically (scale = max|row| / 127 for int8, / 448 for
fp8) and scatters values and scales to the same slots; readers dequantize on the fly (scores
times the K scale of their key, softmax weights times the V scale before ``p @ v``), never
making a full-precision copy of the pages. Float pages stay a plain array.

Head dims other than the kernels' (on GPU multiples of 16, of 32 for 8-bit pages; the engine
allocates multiples of 64 there) go through padding: allocate the
pages with ``padded_head_dim(D)``; ``write_kv`` zero-pads K/V and the attention zero-pads q
and slices the output, which leaves q.k and p.v unchanged (pass ``sm_scale`` for the true D).

Attention sinks (gpt-oss): an optional ``sinks`` f32[Hq] per layer, one learned logit per
query head that joins each row's softmax denominator but brings no value:
``out = sum_j e^(s_j - m) v_j / (e^(sink - m) + sum_j e^(s_j - m))``. Every implementation
takes it (None: no sink, the unchanged code path); they start the online softmax's running
max at the sink and its running sum at 1, or fold the sink in when they normalise.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# Finite "minus infinity" for masked logits: exp(MASK_VALUE - m) underflows to 0 while
# MASK_VALUE - MASK_VALUE stays 0, so no NaN appears for rows that see no key (padding rows).
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
TRASH_PAGE = 0
_FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# Quantized page dtype -> the largest magnitude a quantized value takes (symmetric scales).
QUANT_MAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedKV:
    """KV pages stored quantized, their scales beside them: row r of (page, 2h | 2h+1, slot)
    holds ``pages[...] * scales[..., None]``. What the model step carries and donates.

    pages: int8 | float8_e4m3fn[num_pages, 2 * Hkv, page_size, D]  (the float pages' layout)
    scales: f32[num_pages, 2 * Hkv, page_size]  one per (token, KV head, K-or-V); 0 for an
        all-zero row.
    """

    pages: jax.Array
    scales: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        """The pages' shape (what every reader sizes itself from)."""
        return tuple(self.pages.shape)

    @property
    def dtype(self) -> jnp.dtype:
        return self.pages.dtype

    def is_deleted(self) -> bool:
        return self.pages.is_deleted() or self.scales.is_deleted()


KVPages = jax.Array | QuantizedKV  # float pages, or quantized pages with their scales


def is_quantized_dtype(dtype: object) -> bool:
    """Whether pages of `dtype` are quantized (int8 / float8_e4m3fn, with scales)."""
    try:
        return jnp.dtype(dtype) in QUANT_MAX
    except TypeError:
        return False


def quantize_rows(x: jax.Array, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """x [..., D] float -> (values [..., D] of `dtype`, f32 scales [...]), symmetric per row.

    scale = max|row| * (1 / QUANT_MAX); values = row * (QUANT_MAX / max|row|) clipped to
    +-QUANT_MAX, rounded half to even (int8) or to the nearest float8_e4m3fn. An all-zero row
    gets scale 0 and zeros. The C++ CPU kernel's write does the same f32 operations in the
    same order (a reciprocal, then one multiply), so both writes store the same bits."""
    qmax = QUANT_MAX[jnp.dtype(dtype)]
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1)
    inv = jnp.where(amax > 0, jnp.float32(qmax) / jnp.where(amax > 0, amax, 1.0), 0.0)
    y = jnp.clip(xf * inv[..., None], -qmax, qmax)
    if jnp.dtype(dtype) == jnp.int8:
        y = jnp.round(y)
    # amax * (1 / qmax), not amax / qmax: XLA turns division by a constant into that multiply
    # anyway, and the C++ write must match it bit for bit.
    return y.astype(dtype), (amax * jnp.float32(1.0 / qmax)).astype(jnp.float32)


def dequantize(kv: QuantizedKV, dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """The float pages `kv` stands for (a full copy: for tests and oracles, not for serving)."""
    return (kv.pages.astype(jnp.float32) * kv.scales[..., None]).astype(dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Per-step metadata; every shape is fixed by the step's bucket (T tokens, S sequences).

    slot_mapping: i32[T]  flat slot ``page * page_size + offset`` of each token's new K/V;
        padding tokens map to slots of the trash page 0.
    block_tables: i32[S, max_pages_per_seq]  page ids per sequence (unused entries 0).
    kv_lens: i32[S]  context + new tokens (0 for padding sequences).
    cu_q_lens: i32[S + 1]  offsets of each sequence's queries in the flat token axis.
    num_seqs: i32[1]  number of live sequences; sequences at and beyond it are padding.
    """

    slot_mapping: jax.Array
    block_tables: jax.Array
    kv_lens: jax.Array
    cu_q_lens: jax.Array
    num_seqs: jax.Array


def kv_pages_shape(num_pages: int, page_size: int, num_kv_heads: int,
                   head_dim: int) -> tuple[int, int, int, int]:
    """Shape of one layer's KV page array in the layout all implementations read."""
    return (num_pages, 2 * num_kv_heads, page_size, head_dim)


def padded_head_dim(head_dim: int, multiple: int = 64) -> int:
    """Head dim rounded up to `multiple` (64: pages every kernel takes at full swizzle)."""
    return -(-head_dim // multiple) * multiple


def init_kv_pages(num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                  dtype: jnp.dtype = jnp.bfloat16) -> KVPages:
    """Zero-filled pages (zeros keep the trash page finite for every reader); a QuantizedKV
    (zero values and scales) for int8 / float8_e4m3fn."""
    shape = kv_pages_shape(num_pages, page_size, num_kv_heads, head_dim)
    if is_quantized_dtype(dtype):
        return QuantizedKV(jnp.zeros(shape, dtype), jnp.zeros(shape[:3], jnp.float32))
    return jnp.zeros(shape, dtype)


def _check_int_vector(name: str, x: jax.Array, shape: tuple[int, ...]) -> None:
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got shape {tuple(x.shape)}")
    if x.dtype != jnp.int32:
        raise ValueError(f"{name} must be int32, got dtype {x.dtype}")


def check_kv_pages(kv_pages: KVPages) -> tuple[int, int, int, int]:
    """Validate the page array (or QuantizedKV); returns (num_pages, num_kv_heads, page_size,
    head_dim)."""
    if len(kv_pages.shape) != 4 or kv_pages.shape[1] % 2:
        raise ValueError(
            "kv_pages must be [num_pages, 2 * num_kv_heads, page_size, head_dim], got shape "
            f"{tuple(kv_pages.shape)}")
    if isinstance(kv_pages, QuantizedKV):
        if jnp.dtype(kv_pages.dtype) not in QUANT_MAX:
            raise ValueError(f"QuantizedKV pages dtype must be int8/float8_e4m3fn, got "
                             f"{kv_pages.dtype}")
        if (tuple(kv_pages.scales.shape) != kv_pages.shape[:3]
                or kv_pages.scales.dtype != jnp.float32):
            raise ValueError(f"QuantizedKV scales must be float32{list(kv_pages.shape[:3])} "
                             f"(the pages' shape {kv_pages.shape} minus head_dim), got "
                             f"{kv_pages.scales.dtype}{list(kv_pages.scales.shape)}")
    elif jnp.dtype(kv_pages.dtype) not in _FLOAT_DTYPES:
        raise ValueError(f"kv_pages dtype must be float32/bfloat16/float16 (int8 / "
                         f"float8_e4m3fn pages come as a QuantizedKV), got {kv_pages.dtype}")
    num_pages, two_hkv, page_size, head_dim = kv_pages.shape
    if num_pages < 2:
        raise ValueError(f"kv_pages needs the trash page 0 plus live pages, got shape "
                         f"{tuple(kv_pages.shape)}")
    return num_pages, two_hkv // 2, page_size, head_dim


def check_metadata(md: AttentionMetadata, num_tokens: int) -> tuple[int, int]:
    """Validate metadata shapes/dtypes against T; returns (S, max_pages_per_seq)."""
    if md.block_tables.ndim != 2:
        raise ValueError("block_tables must be [S, max_pages_per_seq], got shape "
                         f"{tuple(md.block_tables.shape)}")
    num_seqs_max, max_pages = md.block_tables.shape
    _check_int_vector("block_tables", md.block_tables, (num_seqs_max, max_pages))
    _check_int_vector("slot_mapping", md.slot_mapping, (num_tokens,))
    _check_int_vector("kv_lens", md.kv_lens, (num_seqs_max,))
    _check_int_vector("cu_q_lens", md.cu_q_lens, (num_seqs_max + 1,))
    _check_int_vector("num_seqs", md.num_seqs, (1,))
    return num_seqs_max, max_pages


class KernelGeometry(NamedTuple):
    """The static sizes that decide whether a kernel can run a model's attention at all (a
    step's bucket sizes never do): what the selector asks each kernel's contract about
    (``tpu_plan.kernel_refusal``, ``gpu_plan.kernel_refusal``) before 'auto' picks it."""

    head_dim: int  # of the KV pages as allocated (padded_head_dim where the caller pads)
    page_size: int  # tokens per page
    kv_dtype: object  # the pages' dtype: float32 / bfloat16 / float16, int8 / float8_e4m3fn
    group: int = 1  # query heads per kv head


def kernel_geometry(q: jax.Array, kv_pages: KVPages) -> KernelGeometry | None:
    """The KernelGeometry of one attention call's q [T, Hq, D] and pages; None for shapes
    that are not that (the implementation's own checks then name what is wrong)."""
    if len(q.shape) != 3 or len(kv_pages.shape) != 4 or kv_pages.shape[1] < 2:
        return None
    return KernelGeometry(int(kv_pages.shape[3]), int(kv_pages.shape[2]),
                          jnp.dtype(kv_pages.dtype), max(1, q.shape[1] // (kv_pages.shape[1] // 2)))


class AttentionGeometry(NamedTuple):
    """Static sizes of one attention call, derived once from the checked inputs."""

    num_tokens: int
    num_q_heads: int
    q_head_dim: int
    num_kv_heads: int
    page_size: int
    head_dim: int  # of the pages (>= q_head_dim)
    group: int  # query heads per kv head
    num_seqs_max: int
    max_pages: int


def check_attention_inputs(q: jax.Array, kv_pages: KVPages, md: AttentionMetadata, *,
                           sm_scale: float, sliding_window: int | None,
                           soft_cap: float | None,
                           sinks: jax.Array | None = None) -> AttentionGeometry:
    """Trace-time checks shared by every implementation; raise ValueError naming the culprit.

    Returns the call's static sizes so each implementation derives them the same way."""
    if q.ndim != 3:
        raise ValueError(f"q must be [T, Hq, D], got shape {tuple(q.shape)}")
    if jnp.dtype(q.dtype) not in _FLOAT_DTYPES:
        raise ValueError(f"q dtype must be float32/bfloat16/float16, got {q.dtype}")
    _, num_kv_heads, _, head_dim = check_kv_pages(kv_pages)
    num_tokens, num_q_heads, q_head_dim = q.shape
    if num_tokens < 1:
        raise ValueError(f"q must hold at least one token, got shape {tuple(q.shape)}")
    if not isinstance(kv_pages, QuantizedKV) and q.dtype != kv_pages.dtype:
        raise ValueError(f"q dtype {q.dtype} differs from kv_pages dtype {kv_pages.dtype}")
    if q_head_dim > head_dim:
        raise ValueError(f"q head_dim {q_head_dim} (shape {tuple(q.shape)}) exceeds the pages' "
                         f"head_dim {head_dim} (shape {tuple(kv_pages.shape)})")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"q heads {num_q_heads} (shape {tuple(q.shape)}) are not a multiple of "
                         f"kv heads {num_kv_heads} (kv_pages shape {tuple(kv_pages.shape)})")
    check_metadata(md, num_tokens)
    if not isinstance(sm_scale, (int, float)) or isinstance(sm_scale, bool):
        raise ValueError(f"sm_scale must be a Python float, got {sm_scale!r}")
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    if soft_cap is not None and (not isinstance(soft_cap, (int, float)) or soft_cap <= 0):
        raise ValueError(f"soft_cap must be a positive float or None, got {soft_cap!r}")
    if sinks is not None and (tuple(sinks.shape) != (num_q_heads,)
                              or sinks.dtype != jnp.float32):
        raise ValueError(f"sinks must be float32[{num_q_heads}] (one logit per query head of q "
                         f"shape {tuple(q.shape)}), got {sinks.dtype}{list(sinks.shape)}")
    _, _, page_size, _ = kv_pages.shape
    num_seqs_max, max_pages = md.block_tables.shape
    return AttentionGeometry(num_tokens, num_q_heads, q_head_dim, num_kv_heads, page_size,
                             head_dim, num_q_heads // num_kv_heads, num_seqs_max, max_pages)


def sink_rows(sinks: jax.Array, num_kv_heads: int, rows: int) -> jax.Array:
    """f32[Hq] sinks -> f32[Hkv, rows]: the sink of each row of a kv head's query tile (row r
    is query head r % G of the group, tiling.gather_q_tiles' order)."""
    group = sinks.shape[0] // num_kv_heads
    per_head = sinks.astype(jnp.float32).reshape(num_kv_heads, group)
    return per_head[:, np.arange(rows) % group]


def pad_head_dim(x: jax.Array, head_dim: int) -> jax.Array:
    """Zero-pad the last axis to head_dim (zeros leave dot products unchanged)."""
    if x.shape[-1] == head_dim:
        return x
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, head_dim - x.shape[-1])])


def write_kv(kv_pages: KVPages, k_new: jax.Array, v_new: jax.Array,
             slot_mapping: jax.Array) -> KVPages:
    """Scatter the step's new K/V [T, Hkv, D] into their slots; exact for float pages (no
    arithmetic), quantized per row (``quantize_rows``) for a QuantizedKV, whose values and
    scales are scattered to the same slots.

    One XLA scatter writes each token's 2 * Hkv rows; under jit with ``kv_pages`` donated XLA
    updates the buffer in place, so the cost is O(T * Hkv * D) whatever the cache size.
    Padding tokens must map to trash-page slots; out-of-range slots are dropped, never wrapped.
    """
    _, num_kv_heads, page_size, head_dim = check_kv_pages(kv_pages)
    quantized = isinstance(kv_pages, QuantizedKV)
    for name, x in (("k_new", k_new), ("v_new", v_new)):
        if x.ndim != 3 or x.shape[1] != num_kv_heads or x.shape[2] > head_dim:
            raise ValueError(f"{name} must be [T, {num_kv_heads}, <= {head_dim}] to match kv_pages "
                             f"shape {tuple(kv_pages.shape)}, got shape {tuple(x.shape)}")
        if quantized and jnp.dtype(x.dtype) not in _FLOAT_DTYPES:
            raise ValueError(f"{name} dtype must be float32/bfloat16/float16, got {x.dtype}")
        if not quantized and x.dtype != kv_pages.dtype:
            raise ValueError(f"{name} dtype {x.dtype} differs from kv_pages dtype {kv_pages.dtype}")
    if k_new.shape != v_new.shape:
        raise ValueError(f"k_new shape {tuple(k_new.shape)} differs from v_new shape "
                         f"{tuple(v_new.shape)}")
    _check_int_vector("slot_mapping", slot_mapping, (k_new.shape[0],))
    # [T, Hkv, 2, D] -> [T, 2*Hkv, D]: K of head h lands on row 2h, V on 2h + 1.
    kv = jnp.stack([pad_head_dim(k_new, head_dim), pad_head_dim(v_new, head_dim)], axis=2)
    kv = kv.reshape(k_new.shape[0], 2 * num_kv_heads, head_dim)
    # Negative slots would wrap around under numpy indexing rules: send them out of range.
    page = jnp.where(slot_mapping < 0, kv_pages.shape[0], slot_mapping // page_size)
    offset = slot_mapping % page_size
    rows = jnp.arange(2 * num_kv_heads, dtype=jnp.int32)
    where = (page[:, None], rows[None, :], offset[:, None])
    if not quantized:
        return kv_pages.at[where].set(kv, mode="drop")
    values, scales = quantize_rows(kv, kv_pages.dtype)          # [T, 2Hkv, D], [T, 2Hkv]
    pages = kv_pages.pages
    if pages.dtype != jnp.int8:
        # float8 scattered as its bytes: XLA:CPU converts a whole float8 array to scatter into
        # it (profile_step's write_only step, S=32 at context 1024: 10 s; as uint8 2.6 s, still
        # far from int8's 9 ms, so the CPU engine writes fp8 pages in its C++ kernel).
        u8 = jax.lax.bitcast_convert_type(pages, jnp.uint8).at[where].set(
            jax.lax.bitcast_convert_type(values, jnp.uint8), mode="drop")
        pages = jax.lax.bitcast_convert_type(u8, pages.dtype)
    else:
        pages = pages.at[where].set(values, mode="drop")
    return QuantizedKV(pages, kv_pages.scales.at[where].set(scales, mode="drop"))
