"""Random ragged batches for the attention tests (numpy, seeded).

A batch is built the way the engine builds a step: every live sequence owns random pages
(never the trash page 0) holding its context K/V; the step's new K/V arrive in k_new/v_new
with a slot_mapping into those pages (padding tokens -> trash-page slots). Everything a
correct reader must never look at -- pages nobody owns, the trash page, the unused tail of a
sequence's last page, padding queries -- is filled with NaN, so a stray read shows up as NaN.
The dense per-sequence K/V (context + new, float32 after rounding to the batch dtype) are kept
for oracles that need no paging at all.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax.numpy as jnp
import numpy as np

from jaxserve.kernels_pallas.common import TRASH_PAGE, AttentionMetadata, kv_pages_shape

if TYPE_CHECKING:
    from jaxserve.kernels_pallas.common import QuantizedKV


@dataclasses.dataclass(frozen=True)
class RaggedBatch:
    q: jnp.ndarray                 # [T, Hq, D]; padding tokens NaN
    k_new: jnp.ndarray             # [T, Hkv, D]
    v_new: jnp.ndarray
    kv_pages: jnp.ndarray          # before write_kv: context K/V only, the rest NaN
    md: AttentionMetadata
    specs: tuple[tuple[int, int], ...]   # live (context_len, q_len) pairs
    seq_q: tuple[np.ndarray, ...]        # float32 [q_len, Hq, D] per live sequence
    seq_k: tuple[np.ndarray, ...]        # float32 [kv_len, Hkv, D] (context + new)
    seq_v: tuple[np.ndarray, ...]
    owned_pages: np.ndarray              # page ids owned by live sequences


def _rounded(rng: np.random.Generator, shape: tuple[int, ...], dtype: jnp.dtype) -> np.ndarray:
    """Normal values already rounded to `dtype`, returned as float32."""
    return np.asarray(jnp.asarray(rng.standard_normal(shape, np.float32), dtype), np.float32)


def random_batch(rng: np.random.Generator, specs: Sequence[tuple[int, int]], *,
                 num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                 dtype: jnp.dtype = jnp.float32, num_tokens: int | None = None,
                 num_seqs: int | None = None, max_pages_per_seq: int | None = None,
                 spare_pages: int = 3, fill_nan: bool = True) -> RaggedBatch:
    """Build a step for live sequences ``specs = [(context_len, q_len), ...]``.

    num_tokens / num_seqs are the bucket sizes (>= the live totals); extra rows are padding.
    """
    specs = tuple((int(c), int(n)) for c, n in specs)
    total_q = sum(n for _, n in specs)
    num_tokens = num_tokens or max(total_q, 1)
    num_seqs = num_seqs or len(specs)
    if num_tokens < total_q or num_seqs < len(specs):
        raise ValueError(f"bucket T={num_tokens}, S={num_seqs} too small for {specs}")
    kv_lens = [c + n for c, n in specs]
    pages_needed = [-(-kl // page_size) for kl in kv_lens]
    max_pages = max_pages_per_seq or max([1, *pages_needed])
    num_pages = 1 + sum(pages_needed) + spare_pages
    fill = np.nan if fill_nan else 0.0

    perm = rng.permutation(np.arange(1, num_pages))          # random, non-contiguous pages
    pages = np.full(kv_pages_shape(num_pages, page_size, num_kv_heads, head_dim), fill,
                    np.float32)
    block_tables = np.zeros((num_seqs, max_pages), np.int32)
    q = np.full((num_tokens, num_q_heads, head_dim), fill, np.float32)
    k_new = np.full((num_tokens, num_kv_heads, head_dim), fill, np.float32)
    v_new = np.full_like(k_new, fill)
    slot_mapping = rng.integers(0, page_size, num_tokens).astype(np.int32) + TRASH_PAGE * page_size
    cu = np.zeros(num_seqs + 1, np.int32)
    seq_q, seq_k, seq_v, used = [], [], [], 0
    for s, (ctx, n) in enumerate(specs):
        own = perm[used:used + pages_needed[s]]
        used += pages_needed[s]
        block_tables[s, : len(own)] = own
        k = _rounded(rng, (ctx + n, num_kv_heads, head_dim), dtype)
        v = _rounded(rng, (ctx + n, num_kv_heads, head_dim), dtype)
        for pos in range(ctx):                                  # context already paged
            page, off = own[pos // page_size], pos % page_size
            pages[page, 0::2, off] = k[pos]
            pages[page, 1::2, off] = v[pos]
        t0 = cu[s]
        cu[s + 1] = t0 + n
        q_s = _rounded(rng, (n, num_q_heads, head_dim), dtype)
        q[t0:t0 + n] = q_s
        k_new[t0:t0 + n], v_new[t0:t0 + n] = k[ctx:], v[ctx:]
        for i in range(n):
            pos = ctx + i
            slot_mapping[t0 + i] = own[pos // page_size] * page_size + pos % page_size
        seq_q.append(q_s)
        seq_k.append(k)
        seq_v.append(v)
    # Padding sequences: empty query ranges; alternate the two conventions an engine might use.
    cu[len(specs) + 1:] = cu[len(specs)] if rng.integers(2) else num_tokens
    kv_lens_arr = np.zeros(num_seqs, np.int32)
    kv_lens_arr[: len(specs)] = kv_lens
    md = AttentionMetadata(slot_mapping=jnp.asarray(slot_mapping),
                           block_tables=jnp.asarray(block_tables),
                           kv_lens=jnp.asarray(kv_lens_arr), cu_q_lens=jnp.asarray(cu),
                           num_seqs=jnp.asarray([len(specs)], jnp.int32))
    return RaggedBatch(q=jnp.asarray(q, dtype), k_new=jnp.asarray(k_new, dtype),
                       v_new=jnp.asarray(v_new, dtype), kv_pages=jnp.asarray(pages, dtype), md=md,
                       specs=specs, seq_q=tuple(seq_q), seq_k=tuple(seq_k), seq_v=tuple(seq_v),
                       owned_pages=np.sort(perm[:used]))


# ------------------------------------------------ the kernel cases every backend runs
def draw_specs(kind: str, rng: np.random.Generator, ps: int) -> list[tuple[int, int]]:
    """Live (context_len, q_len) pairs of one kind; sizes kept small for the interpreters."""
    if kind == "decode":      # one kv_len exactly on a page boundary
        specs = [(int(rng.integers(0, 4 * ps)), 1) for _ in range(int(rng.integers(2, 5)))]
        return specs + [(int(rng.integers(1, 4)) * ps - 1, 1)]
    if kind == "prefill":     # one chunk exactly two pages long
        specs = [(0, int(rng.integers(1, 3 * ps))) for _ in range(int(rng.integers(1, 3)))]
        return specs + [(0, 2 * ps)]
    if kind == "mixed":       # chunk from mid-page to a page boundary + decodes + a prefill
        ctx = int(rng.integers(1, 3)) * ps + int(rng.integers(1, ps))
        chunk = (ctx, (ctx // ps + 2) * ps - ctx)
        decodes = [(int(rng.integers(0, 3 * ps)), 1) for _ in range(int(rng.integers(1, 4)))]
        specs = [chunk, *decodes, (0, int(rng.integers(1, ps + 5)))]
        return [specs[i] for i in rng.permutation(len(specs))]
    if kind == "q1":
        return [(int(rng.integers(0, 5 * ps)), 1)]
    raise ValueError(kind)


# (kind, page_size, Hq, Hkv, head_dim, dtype, sliding_window, soft_cap)
CASES = [
    ("decode", 16, 8, 8, 64, "float32", None, None),
    ("decode", 32, 8, 2, 128, "bfloat16", None, None),
    ("prefill", 16, 4, 2, 128, "float32", None, None),
    ("prefill", 64, 8, 1, 64, "bfloat16", None, None),
    ("mixed", 16, 8, 2, 64, "bfloat16", None, None),
    ("mixed", 32, 16, 2, 128, "float32", None, None),
    ("mixed", 64, 4, 4, 128, "bfloat16", None, None),
    ("mixed", 32, 4, 2, 64, "float32", None, None),
    ("q1", 64, 4, 2, 64, "float32", None, None),
    ("q1", 16, 8, 1, 128, "bfloat16", None, None),
    ("mixed", 16, 4, 2, 64, "float32", 19, 4.0),
    ("mixed", 32, 8, 2, 64, "bfloat16", 40, None),
    ("mixed", 16, 6, 2, 64, "float32", None, None),          # GQA 3: not a power of two
]
CASE_IDS = [f"{c[0]}-ps{c[1]}-g{c[2] // c[3]}-d{c[4]}-{c[5]}" + ("-win" if c[6] else "")
            + ("-cap" if c[7] else "") for c in CASES]

# The cases every kernel runs in the default tier (an interpreted case costs 2-20 s on 2 CPU
# cores, a CPU-kernel case ~5 s, mostly the reference's compile for its shapes): together
# every kind, page size, GQA ratio (3 too), head dim, dtype, the sliding window and the soft
# cap. The other cases run with JAXSERVE_RUN_SLOW=1 (interpreted and on the CPU kernel), and
# compiled on a device.
INTERPRET_BY_DEFAULT = {"decode-ps16-g1-d64-float32", "decode-ps32-g4-d128-bfloat16",
                        "prefill-ps64-g8-d64-bfloat16", "q1-ps16-g8-d128-bfloat16",
                        "mixed-ps16-g2-d64-float32-win-cap", "mixed-ps16-g3-d64-float32"}
assert INTERPRET_BY_DEFAULT <= set(CASE_IDS)


def expected_pages_after_write(batch: RaggedBatch) -> np.ndarray:
    """What write_kv must produce: the input pages with exactly the live new rows set."""
    pages = np.array(jnp.asarray(batch.kv_pages, jnp.float32))
    slots = np.asarray(batch.md.slot_mapping)
    page_size = pages.shape[2]
    k = np.asarray(jnp.asarray(batch.k_new, jnp.float32))
    v = np.asarray(jnp.asarray(batch.v_new, jnp.float32))
    for t, slot in enumerate(slots):
        page, off = divmod(int(slot), page_size)
        pages[page, 0::2, off] = k[t]
        pages[page, 1::2, off] = v[t]
    return pages


def quantized_pages(pages: jnp.ndarray, dtype: jnp.dtype) -> "QuantizedKV":
    """`pages` (float, NaN where nobody may read) quantized row by row: NaN rows get NaN
    scales (and garbage values), so a stray read of a quantized page still shows as NaN."""
    from jaxserve.kernels_pallas.common import QuantizedKV, quantize_rows
    values, scales = quantize_rows(jnp.asarray(pages, jnp.float32), dtype)
    return QuantizedKV(values, scales)
