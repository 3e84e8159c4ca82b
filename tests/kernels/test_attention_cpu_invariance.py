"""The C++ CPU attention's batch invariance: a query row's output, bit for bit, whatever else
the call holds.

Why: greedy decoding with speculation must give the non-speculative tokens (issue #33). The
token at position p is attended as a decode (a one-token tile, the short path of
csrc/block_math.h) without speculation and inside a verification of 1 + k tokens (a tall
tile, csrc/tile_math.h, once the tile has more than 8 rows) with it; a prefill chunk puts it
in a tall tile too, a step's padding and other sequences around it. With int8 activations
or bfloat16 K/V one differing bit can flip a rounding and grow into another token, so
"close" is not enough: the oracle is the same row computed alone (the decode), and every
other placement must equal it exactly. The cases: float32 / bfloat16 / int8 pages, GQA 3
(SmolLM2's 9 / 3 heads) and 8, plus a soft cap and a sliding window (whose first key
depends on the tile's first token).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels_pallas import AttentionMetadata, cpu_build
from jaxserve.kernels_pallas.cpu import ragged_paged_attention_cpu
from support.kernel_cases import quantized_pages

PS, PAGES = 16, 72  # page size; pages per sequence (up to 1,152 keys)


def _layout(seqs: list[tuple[int, int, int]], t_pad: int) -> AttentionMetadata:
    """Sequences (kv_len, q_len, first page) end to end, the token axis padded to t_pad; page
    0 is the trash page."""
    cu = np.concatenate([[0], np.cumsum([q for _, q, _ in seqs])]).astype(np.int32)
    tables = np.stack([first + np.arange(PAGES) for _, _, first in seqs])
    return AttentionMetadata(
        slot_mapping=jnp.zeros(t_pad, jnp.int32),
        block_tables=jnp.asarray(tables, jnp.int32),
        kv_lens=jnp.asarray([k for k, _, _ in seqs], jnp.int32),
        cu_q_lens=jnp.asarray(cu), num_seqs=jnp.asarray([len(seqs)], jnp.int32))


def _placements(pos: int) -> list[tuple[str, list[tuple[int, int, int]], int, int]]:
    """(name, sequences, t_pad, token index of the row): the token at position `pos` of the
    sequence on pages 1.. (the others' on pages PAGES + 1..), keys 0..pos visible to it."""
    mine, other = 1, PAGES + 1
    return [
        ("decode", [(pos + 1, 1, mine)], 1, 0),
        ("decode, padded", [(pos + 1, 1, mine)], 8, 0),
        ("verify 1 + 3", [(pos + 4, 4, mine)], 4, 0),
        ("verify, last row", [(pos + 1, 4, mine)], 4, 3),
        ("verify 1 + 5 beside a decode", [(pos + 6, 6, mine), (40, 1, other)], 16, 0),
        ("prefill chunk of 30", [(pos + 20, 30, mine)], 32, 10),
        ("behind another sequence", [(90, 3, other), (pos + 1, 4, mine)], 8, 3 + 3),
        ("beside a long one", [(pos + 1, 1, mine), (PAGES * PS - 5, 2, other)], 4, 0),
    ]


@pytest.mark.parametrize("isa", [isa for isa, _ in cpu_build.attention_variants()])
@pytest.mark.parametrize("dtype,hq,hkv,window,cap,pos", [
    ("float32", 9, 3, None, None, 100),  # keys in four blocks of 32, a partial last one
    ("bfloat16", 9, 3, None, None, 100),
    ("int8", 9, 3, None, None, 100),
    ("bfloat16", 8, 1, None, None, 100),
    ("float32", 4, 2, 37, 30.0, 100),
    # Past the kernel's key-range cut at 1,024 (attention_plan.h's kSplitKeys): 1,023 alone
    # is one part, in a verification its tile's range crosses the cut; 1,100 is two parts.
    ("float32", 9, 3, None, None, 1023),
    ("bfloat16", 9, 3, None, None, 1100),
])
def test_a_row_is_the_same_in_every_tile(dtype: str, hq: int, hkv: int, window: int | None,
                                          cap: float | None, pos: int, isa: str) -> None:
    rng = np.random.default_rng(7)
    d = 64
    num_pages = 1 + 2 * PAGES
    pages = jnp.asarray(rng.normal(size=(num_pages, 2 * hkv, PS, d)), jnp.float32)
    pages = (quantized_pages(pages, jnp.int8) if dtype == "int8"
             else pages.astype(dtype))
    query = rng.normal(size=(hq, d)).astype(np.float32) * 2.0  # the row under test
    outs = {}
    for name, seqs, t_pad, tok in _placements(pos):
        q = rng.normal(size=(t_pad, hq, d)).astype(np.float32)  # other rows: anything
        q[tok] = query
        # Float pages take q in their dtype (the engine's cast); int8 pages take float32.
        qd = jnp.asarray(q, jnp.float32 if dtype == "int8" else dtype)
        out = ragged_paged_attention_cpu(qd, pages, _layout(seqs, t_pad),
                                         sm_scale=d ** -0.5, sliding_window=window,
                                         soft_cap=cap, isa=isa)
        outs[name] = np.asarray(out.astype(jnp.float32))[tok]
    want = outs["decode"]
    assert np.isfinite(want).all() and np.abs(want).max() > 0
    for name, got in outs.items():
        diff = np.abs(got - want).max()
        assert np.array_equal(got, want), f"{name}: differs from the decode by up to {diff}"
