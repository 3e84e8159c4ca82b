"""The sampler's C++ top-k / top-p cut-off kernel (kernels_pallas/nucleus_cpu.py) against a
float64 numpy oracle written here (a full sort and a cumulative sum), and its jnp reference.

Exact for top-k (a count); for top-p the kernel sums float32 probabilities in double, the
oracle exact float64 ones, so they may differ only where top_p lies within rounding of a
prefix's mass: a relative margin of 1e-6 is ten times the kernel's error (its exp is ~1e-7
relative per entry, so the total and every prefix are too, whatever the number of entries;
the double sums add nothing near that). A point falls inside the margin with probability
~2e-6 / (the mass of the entry at the cut), so the checks skip few points, and an off-by-one
entry (a whole entry's mass) is far outside it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels_pallas import nucleus_cpu

pytestmark = pytest.mark.skipif(not nucleus_cpu.available(),
                                reason="the CPU kernel library could not be built")
MARGIN = 1e-6


def oracle(x: np.ndarray, k: int, top_p: float) -> tuple[float, float]:
    """(the threshold, top-p's margin: how far top_p * total lies from the nearest prefix
    mass, relative to the total; inf where top-p is off)."""
    V = x.size
    desc = np.sort(x.astype(np.float64))[::-1]
    kth = desc[k - 1] if k < V else -np.inf
    if top_p >= 1.0:
        return float(kth), np.inf
    p = np.exp(desc - desc[0])
    cum = np.cumsum(p)
    need = np.float64(np.float32(top_p)) * cum[-1]
    j = min(int(np.sum(cum < need)), V - 1)
    below = cum[j - 1] if j > 0 else 0.0
    margin = min(cum[j] - need, need - below) / cum[-1]
    return float(max(kth, desc[j])), margin


def rows(rng: np.random.Generator, S: int, V: int) -> np.ndarray:
    kind = rng.integers(0, 6, S)
    x = np.empty((S, V), np.float32)
    for r in range(S):
        if kind[r] == 0:
            x[r] = rng.normal(0, rng.choice([0.3, 3.0, 12.0]), V)
        elif kind[r] == 1:  # Zipf: logit = -a log rank
            x[r] = -rng.choice([1.0, 2.0]) * np.log(rng.permutation(V) + 1.0)
        elif kind[r] == 2:  # a coarse grid: many ties at the cut
            x[r] = np.round(rng.normal(0, 2, V) * 2) / 2
        elif kind[r] == 3:  # a grammar's -inf entries
            x[r] = rng.normal(0, 2, V)
            x[r, rng.random(V) < 0.7] = -np.inf
            x[r, rng.integers(V)] = 1.0
        elif kind[r] == 4:  # one value dominating by far, the rest below the first level
            x[r] = rng.normal(-60, 5, V)
            x[r, rng.integers(V)] = 0.0
        else:  # positive logits far from zero, a tiny spread
            x[r] = 40.0 + rng.normal(0, 1e-4, V)
    return x


@pytest.mark.parametrize("S,V,seed", [(24, 1000, 0), (24, 97, 1), (4, 49152, 2), (6, 3, 3),
                                      (3, 1, 4)])
def test_kernel_matches_float64_oracle(S: int, V: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    x = rows(rng, S, V)
    k = np.where(rng.random(S) < 0.5, V, rng.integers(1, V + 1, S)).astype(np.int32)
    k[0] = 1
    top_p = rng.choice([0.0, 1e-6, 0.1, 0.5, 0.9, 0.95, 0.999, 1.0], S).astype(np.float32)
    got = np.asarray(jax.jit(nucleus_cpu.nucleus_cutoffs)(jnp.asarray(x), jnp.asarray(k),
                                                          jnp.asarray(top_p)))
    ref = np.asarray(jax.jit(nucleus_cpu.nucleus_cutoffs_reference)(
        jnp.asarray(x), jnp.asarray(k), jnp.asarray(top_p)))
    for r in range(S):
        want, margin = oracle(x[r], int(k[r]), float(top_p[r]))
        if margin >= MARGIN:
            assert got[r] == want, (r, k[r], top_p[r], got[r], want)
            assert ref[r] == want, (r, k[r], top_p[r], ref[r], want)
        assert got[r] in set(x[r].tolist()) | {-np.inf}, r  # a value present in the row


def test_top_k_alone_is_exact_everywhere() -> None:
    """Counts are exact: every k of a row with ties and -inf entries, no tolerance."""
    rng = np.random.default_rng(5)
    V = 300
    x = np.round(rng.normal(0, 1, V) * 3).astype(np.float32) / 3
    x[:40] = -np.inf
    ks = np.arange(1, V + 1, dtype=np.int32)
    got = np.asarray(nucleus_cpu.nucleus_cutoffs(jnp.asarray(np.tile(x, (V, 1))),
                                                 jnp.asarray(ks), jnp.ones(V, jnp.float32)))
    want = np.sort(x)[::-1]
    want = np.where(ks < V, want[ks - 1], -np.inf)
    np.testing.assert_array_equal(got, want)


def test_top_p_sweep_on_one_row_is_monotone_and_exact() -> None:
    """top_p from 0 to 1 on one flat row: the cut falls monotonically, and equals the oracle
    wherever top_p is not within rounding of a prefix's mass."""
    rng = np.random.default_rng(6)
    V = 500
    x = rng.normal(0, 0.5, V).astype(np.float32)
    ps = np.linspace(0, 0.9999, 400).astype(np.float32)
    got = np.asarray(nucleus_cpu.nucleus_cutoffs(
        jnp.asarray(np.tile(x, (ps.size, 1))), jnp.full(ps.size, V, jnp.int32), jnp.asarray(ps)))
    assert np.all(np.diff(got) <= 0)
    checked = 0
    for g, p in zip(got, ps):
        want, margin = oracle(x, V, float(p))
        if margin >= MARGIN:
            assert g == want, p
            checked += 1
    assert checked > 380  # ~2e-6 / 2e-3 of the points skipped


def test_vmap_and_empty_batch() -> None:
    rng = np.random.default_rng(7)
    x = rng.normal(0, 2, (3, 2, 50)).astype(np.float32)
    k = np.full((3, 2), 10, np.int32)
    tp = np.full((3, 2), 0.8, np.float32)
    got = jax.vmap(nucleus_cpu.nucleus_cutoffs)(jnp.asarray(x), jnp.asarray(k), jnp.asarray(tp))
    want = nucleus_cpu.nucleus_cutoffs_reference(jnp.asarray(x.reshape(6, 50)),
                                                 jnp.asarray(k.reshape(6)),
                                                 jnp.asarray(tp.reshape(6)))
    np.testing.assert_array_equal(np.asarray(got).reshape(6), np.asarray(want))
    empty = nucleus_cpu.nucleus_cutoffs(jnp.zeros((0, 50)), jnp.zeros(0, jnp.int32),
                                        jnp.zeros(0))
    assert empty.shape == (0,)


@pytest.mark.parametrize("args,match", [
    ((np.zeros(5, np.float32), np.ones(1, np.int32), np.ones(1, np.float32)), "f32\\[S, V\\]"),
    ((np.zeros((2, 5), np.float16), np.ones(2, np.int32), np.ones(2, np.float32)), "float32"),
    ((np.zeros((2, 5), np.float32), np.ones(3, np.int32), np.ones(2, np.float32)), "\\[2\\]"),
])
def test_bad_inputs_name_the_problem(args: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        nucleus_cpu.nucleus_cutoffs(*map(jnp.asarray, args))
