"""The jnp reference attention with uniform tiles ('reference_invariant', batch-invariant
mode on accelerators): at one fixed step shape, a query row's output bit for bit whatever
else the call holds and however its token is run (decode, verification, prefill chunk,
behind other sequences).

Oracle: the row decoded alone in the step shape (T = 32 tokens, padded). The plain reference
attends a decode in a G-row tile of a vectorised pass and a prefill token in a taller tile
of another pass, other einsum shapes. Called alone, as here, XLA:CPU happens to give those
the same bits in these placements; compiled into the engine's step it did not (a preempted
request's recompute changed logprobs: tests/serving/test_batch_invariant.py's
test_fixed_shape_path fails with the plain reference), so the mode runs uniform tiles.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels_pallas import AttentionMetadata
from jaxserve.kernels_pallas.reference import ragged_paged_attention_reference

PS, PAGES, T = 16, 12, 32


def _layout(seqs: list[tuple[int, int, int]]) -> AttentionMetadata:
    """Sequences (kv_len, q_len, first page) end to end in a step of T tokens (4 rows)."""
    cu = np.concatenate([[0], np.cumsum([q for _, q, _ in seqs])]).astype(np.int32)
    tables = np.stack([first + np.arange(PAGES) for _, _, first in seqs] +
                      [np.zeros(PAGES, int)] * (4 - len(seqs)))
    cu = np.concatenate([cu, np.full(4 - len(seqs), cu[-1])]).astype(np.int32)
    kv = [k for k, _, _ in seqs] + [0] * (4 - len(seqs))
    return AttentionMetadata(
        slot_mapping=jnp.zeros(T, jnp.int32), block_tables=jnp.asarray(tables, jnp.int32),
        kv_lens=jnp.asarray(kv, jnp.int32), cu_q_lens=jnp.asarray(cu),
        num_seqs=jnp.asarray([len(seqs)], jnp.int32))


def _rows(uniform: bool, window: int | None) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    hq, hkv, d, pos = 9, 3, 64, 100
    pages = jnp.asarray(rng.normal(size=(1 + 2 * PAGES, 2 * hkv, PS, d)), jnp.float32)
    query = rng.normal(size=(hq, d)).astype(np.float32) * 2.0
    mine, other = 1, PAGES + 1
    placements = [
        ("decode", [(pos + 1, 1, mine)], 0),
        ("decode beside decodes", [(40, 1, other), (pos + 1, 1, mine), (70, 1, other)], 1),
        ("verify 1 + 3", [(pos + 4, 4, mine)], 0),
        ("prefill chunk of 20", [(pos + 12, 20, mine)], 8),
        ("behind a prefill", [(90, 10, other), (pos + 1, 4, mine)], 10 + 3),
    ]
    out = {}
    for name, seqs, tok in placements:
        q = rng.normal(size=(T, hq, d)).astype(np.float32)
        q[tok] = query
        o = ragged_paged_attention_reference(jnp.asarray(q), pages, _layout(seqs),
                                             sm_scale=d ** -0.5, sliding_window=window,
                                             uniform_tiles=uniform)
        out[name] = np.asarray(o)[tok]
    return out


@pytest.mark.parametrize("window", [None, 37])
def test_uniform_tiles_row_is_the_same_everywhere(window: int | None) -> None:
    rows = _rows(True, window)
    for name, row in rows.items():
        assert np.array_equal(row, rows["decode"]), name
    plain = _rows(False, window)["decode"]
    np.testing.assert_allclose(rows["decode"], plain, rtol=0, atol=1e-5)
