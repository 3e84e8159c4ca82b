"""Top-k / top-p / min-p cut-offs and the random draw, without sorting the vocabulary.

Data flow (inside `sampler.sample`'s draw branch): f32[S, V] biased, penalised, masked
logits -> divided by each row's temperature -> `cutoffs`: one f32[S, 1] threshold per row
(keep x >= threshold) -> `filter_logits` sets everything below it, and below min-p's floor,
to -inf -> `inverse_cdf_draw`: one uniform per row picks a token from the cumulative mass of
exp(filtered - max), over 32-token words first and then inside the chosen word.

Why no sort. A full sort of f32[32, 49152] costs about 275 ms on a 2-core XLA:CPU host (a
greedy decode step of the bundled model is ~100-150 ms), and a vocabulary-wide sort is slow on
TPU and GPU too. The cut-offs only need one value per row: the k-th largest logit, and the
smallest logit of the shortest prefix (in descending order) whose mass reaches top_p.

On CPU, where the C++ library is built, `cutoffs` is one custom call instead
(`kernels_pallas.nucleus_cpu`: per row, one exp pass and a histogram of the values below the
row's maximum, recursing into the bucket where the count or mass crosses; ~1 ms at 32 rows of
49k whatever the nucleus' width, against 2.5 ms for the candidates alone and ~12-17 ms with
the bisection). TPU and GPU, and a CPU without the library, run the jnp path below.

Semantics (exact, with no opt-in approximation): the definitions are the ones the sort
gave, ties at a boundary kept (a value equal to the cut-off stays) so nothing depends on an
order among equal logits; top-p's mass is that of the whole tempered distribution (not
renormalised after top-k), as before. Two ways to the same value:
- the fast path: the CANDIDATES (64) largest values per row by a bounded selection, not a
  sort: `lax.top_k` (XLA's TopK; 2.5 ms at 32 rows of 49k on XLA:CPU), or on TPU, where an
  exact top-k is a sort, `lax.approx_max_k` checked for exactness per row (a row whose
  approximate set is not the exact top 64, or ties its 64th value, is not settled and takes
  the fallback), so the approximation changes the cost, never the result. It is exact
  whenever the kept set fits: top_k <= CANDIDATES gives the k-th value directly; top-p is
  exact when the candidates' mass (over the full vocabulary's normaliser) already reaches
  top_p, since the prefix then ends among them.
- the fallback, for rows the candidates do not settle (top_k in (CANDIDATES, V), or a nucleus
  wider than CANDIDATES: top_p 0.95 at temperature 1 on a small model often is): a bisection
  over the logits' float32 order. Each float maps to a uint32 key with the same order; each
  pass halves a row's [lo, hi) (by value, or by key once values stop halving it) keeping
  count(x >= lo) >= k (or mass(x >= lo) >= top_p * mass(all)) and not at hi, starting from
  the 64th candidate, and stops once the bracket holds at most 64 entries; a bounded top-k of
  the row masked to the bracket then walks them in order to the exact cut-off (on TPU the
  halving goes on to a single key instead: no exact top-k there). It is exact (the result
  is a value present in the row), not a tolerance: ~13 passes at 32 flat rows of 49k, ~20 ms
  on XLA:CPU against ~2.5 ms for the candidates; it runs under a lax.cond, only in steps
  where some row needs it, and its answer is taken only for those rows (`where`).
The two agree up to the order in which float32 masses are summed (the sort summed a
cumulative sum, these sum a masked total), which only matters when top_p falls within
rounding of a prefix's mass: the sort had the same sensitivity.

Why one uniform, not Gumbel noise. Gumbel-max needs a threefry draw per vocabulary entry (7
ms at 32 rows of 49k alone, 20 ms in the sampler as it was fused; and a pass writing
f32[S, V]); the inverse CDF needs one uniform
per row and two reductions the draw shares with the filter: the mass of each 32-token word
(a vectorised sum), a cumulative sum over the W = V / 32 word masses (small), and one over
the 32 entries of the chosen word. The key of a row is the request's own (its seed, or the
engine's stream, folded with its output position on the host, `engine.batch`), never its row
index, so a seeded request draws the same token whatever else is in its batch.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from jaxserve.kernels_pallas import nucleus_cpu

CANDIDATES = 64  # the fast path's bounded top-k width: top_k <= 64 and nuclei of <= 64 tokens


def order_keys(x: jax.Array) -> jax.Array:
    """u32 keys with the order of the float32 values x (-inf lowest): the sign bit flipped for
    non-negative floats, every bit flipped for negative ones."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    negative = (bits >> 31) == 1
    return jnp.where(negative, ~bits, bits | jnp.uint32(0x80000000))


def key_value(key: jax.Array) -> jax.Array:
    """The float32 whose `order_keys` is `key` (the inverse map)."""
    negative = (key >> 31) == 0
    bits = jnp.where(negative, ~key, key & jnp.uint32(0x7FFFFFFF))
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def bisect_cutoffs(x: jax.Array, k: jax.Array, top_p: jax.Array,
                   rows: tuple[jax.Array, jax.Array] | None = None,
                   upper: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(kth, pth) f32[S]: each row's k-th largest value of x f32[S, V] (k i32[S] in [1, V]),
    and the smallest value of the shortest descending prefix whose softmax mass reaches top_p
    f32[S] (the row's minimum when top_p >= 1). Exact. `rows`: (bool[S], bool[S]) the rows
    whose kth / pth is wanted (default all); the others' values are unspecified. `upper`
    f32[S]: a value both answers lie at or below in the wanted rows (the C-th candidate, of
    rows the candidates do not settle), which starts the search closer."""
    keys = order_keys(x)  # u32[S, V]
    p = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))  # f32[S, V], 0 where x is -inf
    ones = jnp.ones_like(p)
    want_k, want_p = rows if rows is not None else (jnp.ones(k.shape, bool),) * 2
    top = None if upper is None else order_keys(upper) + jnp.uint32(1)
    # On TPU, where an exact top-k is a sort, the halving runs to a single key (32 passes
    # at most, each a read of S x V at HBM speed); elsewhere to a bracket of CANDIDATES entries.
    C = min(CANDIDATES, x.shape[-1])

    def bisect(*args: jax.Array) -> jax.Array:
        return jax.lax.platform_dependent(*args, tpu=partial(_bisect, bracket=1),
                                          default=partial(_bisect, bracket=C))

    kth = bisect(keys, x, ones, k.astype(jnp.float32), want_k, top)
    pth = bisect(keys, x, p, top_p * jnp.sum(p, axis=-1), want_p, top)
    return kth, pth


def _bisect(keys: jax.Array, x: jax.Array, weight: jax.Array, need: jax.Array,
            want: jax.Array, top: jax.Array | None, bracket: int) -> jax.Array:
    """f32[S]: the largest value t of each row of x f32[S, V] with sum(weight[x >= t]) >= need
    (weight f32[S, V] >= 0: ones for top-k's count, the unnormalised probabilities for
    top-p's mass; need f32[S]), for the rows `want` bool[S]; `top` u32[S] a key where the
    condition fails (default: above the row's largest). `bracket` (static): the entries left
    between lo and hi at which the halving stops (1: a single key, no top-k).

    Halving [lo, hi) in key space keeps pred(lo) true and pred(hi) false (pred being the sum
    condition at key t, monotone in t), and stops for a row once it holds at most `bracket`
    entries (or only ties: hi = lo + 1); a steady distribution halves the entries in the
    bracket at each pass, so ~13 passes of 49k (flat rows), not 32. Those entries (a bounded top-k
    of the row masked to the bracket) are then walked in descending order from the weight
    above the bracket to the first that reaches `need`: a value present in the row."""
    S, V = x.shape
    C = bracket if bracket > 1 else 0  # 1: halve down to hi = lo + 1, where lo is an entry's
    # From the least key of positive weight (all of the row's weight lies at or above it:
    # a grammar's -inf entries, which would add a dozen binades to the range, are skipped
    # for top-p) to one where the condition fails. +inf's key is 0xff800000: no overflow.
    lo = jnp.min(jnp.where(weight > 0, keys, jnp.uint32(0xFFFFFFFF)), axis=-1)
    hi = jnp.max(keys, axis=-1) + 1 if top is None else top
    lo, hi = jnp.where(want, lo, 0).astype(jnp.uint32), jnp.where(want, hi, 1).astype(jnp.uint32)
    zero = jnp.zeros((S,), jnp.float32)
    # (lo, hi, entries >= lo, entries >= hi, weight >= hi, passes)
    init = (lo, hi, jnp.where(want, float(V), 0.0), zero, zero, jnp.int32(0))

    def open_rows(c: tuple) -> jax.Array:
        lo, hi, n_lo, n_hi = c[:4]
        return (n_lo - n_hi > C) & (hi - lo > 1)

    def halve(c: tuple) -> tuple:
        lo, hi, n_lo, n_hi, w_hi, i = c
        # The midpoint of the values where it lies strictly inside the key range, for the
        # first 48 passes, else of the keys: halving the keys alone spends ~30 passes in the
        # near-zero floats of a row whose logits cross zero (real logits do); the keys'
        # halves then end it in 32 more at most, so the cap of 96 passes is never reached.
        vmid = order_keys((key_value(lo) + key_value(hi)) * 0.5)
        mid = jnp.where((vmid > lo) & (vmid < hi) & (i < 48), vmid, lo + (hi - lo) // 2)
        above = keys >= mid[:, None]
        n_mid = jnp.sum(above.astype(jnp.float32), axis=-1)
        w_mid = jnp.sum(jnp.where(above, weight, 0.0), axis=-1)
        go = open_rows(c)
        up, down = go & (w_mid >= need), go & (w_mid < need)
        return (jnp.where(up, mid, lo), jnp.where(down, mid, hi), jnp.where(up, n_mid, n_lo),
                jnp.where(down, n_mid, n_hi), jnp.where(down, w_mid, w_hi), i + 1)

    lo, hi, n_lo, n_hi, w_hi, _ = jax.lax.while_loop(
        lambda c: (c[-1] < 96) & jnp.any(open_rows(c)), halve, init)
    if bracket == 1:  # hi = lo + 1: lo is the key of an entry (or of ties)
        return key_value(lo)
    inside = (keys >= lo[:, None]) & (keys < hi[:, None])
    vals, idx = jax.lax.top_k(jnp.where(inside, x, -jnp.inf), C)
    vals, idx = _kept_whole(vals), _kept_whole(idx)
    w = jnp.take_along_axis(weight, idx, axis=-1)  # f32[S, C]
    reached = w_hi[:, None] + jnp.cumsum(w, axis=-1) >= need[:, None]
    n_in = jnp.clip(n_lo - n_hi, 1, C).astype(jnp.int32)
    # the first entry reaching `need`; rounding aside, the bracket's last entry reaches it
    first = jnp.minimum(jnp.argmax(reached, axis=-1), n_in - 1)
    first = jnp.where(jnp.any(reached, axis=-1), first, n_in - 1)
    found = jnp.take_along_axis(vals, first[:, None], axis=-1)[:, 0]
    return jnp.where(hi - lo > 1, found, key_value(lo))  # hi = lo + 1: ties, all of value lo


def _candidates(x: jax.Array, C: int) -> tuple[jax.Array, jax.Array]:
    """(f32[S, C] the C largest values of each row, descending; bool[S] True): an exact
    bounded top-k (XLA's TopK on CPU and GPU, not a sort)."""
    # The barrier keeps XLA's TopK whole: without it, XLA:CPU's simplifier folded the later
    # slices of the values (vals[:, :1], ...) into the TopK's reference decomposition (a sort
    # and a slice), no longer recognised it as a TopK and ran the sort of the whole
    # vocabulary: 230 ms at 32 rows of 49k instead of 2.5 (the export tests check the text).
    vals = _kept_whole(jax.lax.top_k(x, C)[0])
    return vals, jnp.ones((x.shape[0],), bool)


def _kept_whole(out: jax.Array) -> jax.Array:
    """One output of a TopK behind an optimization barrier (see `_candidates`). A barrier per
    output, not one over the (values, indices) pair: XLA folds a tuple of a TopK's two
    outputs back into the TopK itself, and the SPMD partitioner's TopK decomposition (a
    vocabulary-sharded LM head under tensor parallelism) then finds a barrier where it
    expects a get-tuple-element and aborts the compile (hlo_casting_utils Check failed)."""
    return jax.lax.optimization_barrier(out)


def _tpu_candidates(x: jax.Array, C: int) -> tuple[jax.Array, jax.Array]:
    """`_candidates` by TPU's approximate top-k (an exact top-k is a sort there), checked: the
    C values returned are the top C exactly when no other entry reaches the smallest of them
    (a missed larger entry would be counted), so a row is `settled` only when its count of
    entries >= that value is C; the other rows take the bisection."""
    return checked_candidates(x, jax.lax.approx_max_k(x, C, recall_target=0.95)[0])


def checked_candidates(x: jax.Array, vals: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(vals sorted descending, settled bool[S]) for C values f32[S, C] taken from distinct
    positions of each row of x f32[S, V]: settled where they are exactly its C largest."""
    vals = -jnp.sort(-vals, axis=-1)  # a sort of C values, not of the vocabulary
    settled = jnp.sum((x >= vals[:, -1:]).astype(jnp.int32), axis=-1) == vals.shape[-1]
    return vals, settled


def cutoffs(x: jax.Array, k: jax.Array, top_p: jax.Array) -> jax.Array:
    """f32[S, 1]: keep x >= it, for top-k (k i32[S] in [1, V]; V = off) and top-p (f32[S]; >= 1
    off) over the tempered logits x f32[S, V]. On CPU, the C++ radix select
    (`kernels_pallas.nucleus_cpu`: one pass of exp and three small histograms per row, ~20x
    cheaper than the bisection at 32 flat rows of 49k) where its library is built; elsewhere
    (and without it) `jnp_cutoffs`."""
    if x.dtype == jnp.float32 and nucleus_cpu.available():
        return jax.lax.platform_dependent(
            x, k, top_p, cpu=lambda x, k, t: nucleus_cpu.nucleus_cutoffs(x, k, t)[:, None],
            default=jnp_cutoffs)
    return jnp_cutoffs(x, k, top_p)


def jnp_cutoffs(x: jax.Array, k: jax.Array, top_p: jax.Array) -> jax.Array:
    """`cutoffs` in jnp: the candidates' answer where it is exact, the bisection's for the
    rows where it is not (see the module docstring)."""
    S, V = x.shape
    C = min(CANDIDATES, V)
    vals, settled = jax.lax.platform_dependent(
        x, tpu=partial(_tpu_candidates, C=C), default=partial(_candidates, C=C))
    kth = jnp.take_along_axis(vals, (jnp.minimum(k, C) - 1)[:, None], axis=-1)[:, 0]
    kth = jnp.where(k >= V, -jnp.inf, kth)
    top = vals[:, :1]
    total = jnp.sum(jnp.exp(x - top), axis=-1)  # f32[S]: the full normaliser
    pc = jnp.exp(vals - top)  # f32[S, C]
    before = jnp.cumsum(pc, axis=-1) - pc  # the mass strictly above each candidate
    need = top_p * total
    last = jnp.maximum(jnp.sum(before < need[:, None], axis=-1) - 1, 0)
    pth = jnp.take_along_axis(vals, last[:, None], axis=-1)[:, 0]
    p_fits = jnp.sum(pc, axis=-1) >= need
    pth = jnp.where(top_p >= 1.0, -jnp.inf, pth)
    k_slow = ((k > C) & (k < V)) | ((k < V) & ~settled)
    p_slow = (top_p < 1.0) & (~p_fits | ~settled)
    slow = k_slow | p_slow  # bool[S]

    def exact(_: None) -> tuple[jax.Array, jax.Array]:
        bk, bp = bisect_cutoffs(x, k, top_p, (k_slow, p_slow), jnp.where(settled, vals[:, -1],
                                                                         jnp.inf))
        return jnp.where(k_slow, bk, kth), jnp.where(p_slow, bp, pth)

    kth, pth = jax.lax.cond(jnp.any(slow), exact, lambda _: (kth, pth), None)
    return jnp.maximum(kth, pth)[:, None]


def filter_logits(logits: jax.Array, temperature: jax.Array, top_k: jax.Array,
                  top_p: jax.Array, min_p: jax.Array) -> jax.Array:
    """Temperature-scaled logits f32[S, V] with everything outside top-k / top-p / min-p set to
    -inf (knobs f32[S]: temperature <= 0 reads as 1, top_k <= 0 or >= V as off, top_p >= 1
    off, min_p <= 0 off). Ties at a boundary are kept."""
    V = logits.shape[-1]
    t = jnp.where(temperature > 0, temperature, 1.0)[:, None]
    scaled = logits / t
    # f32 top_k is exact for integers < 2**24; <= 0: the whole vocabulary
    k = jnp.where((top_k <= 0) | (top_k >= V), V, top_k).astype(jnp.int32)  # i32[S] in [1, V]
    needs_cut = jnp.any((k < V) | (top_p < 1.0))
    thresh = jax.lax.cond(needs_cut, lambda x: cutoffs(x, k, top_p),
                          lambda x: jnp.full((x.shape[0], 1), -jnp.inf, x.dtype), scaled)

    # min-p: p >= min_p * p_max  <=>  logit >= max_logit + log(min_p) (log(0) = -inf: off), no
    # softmax. Under a cond, as before this module: a step with no min-p row runs no max
    # pass for it (a pass XLA:CPU may fuse the penalties' elementwise chain into again).
    def min_p_floor(x: jax.Array) -> jax.Array:
        return jnp.max(x, axis=-1, keepdims=True) + jnp.log(jnp.maximum(min_p, 0.0))[:, None]

    floor = jax.lax.cond(jnp.any(min_p > 0), min_p_floor,
                         lambda x: jnp.full((x.shape[0], 1), -jnp.inf, x.dtype), scaled)
    return jnp.where(scaled >= jnp.maximum(thresh, floor), scaled, -jnp.inf)


def _first_above(cum: jax.Array, target: jax.Array, mass: jax.Array) -> jax.Array:
    """i32[S]: the first index whose inclusive cumulative mass cum f32[S, N] exceeds target
    f32[S] (>= 0), clipped to the last index of positive mass (mass f32[S, N]) where rounding
    leaves target at or above the total. An entry of zero mass is never the answer."""
    N = cum.shape[-1]
    idx = jnp.sum(cum <= target[:, None], axis=-1)
    last = N - 1 - jnp.argmax((mass > 0)[:, ::-1], axis=-1)
    return jnp.minimum(idx, last).astype(jnp.int32)


def inverse_cdf_draw(filtered: jax.Array, rng_key: jax.Array) -> jax.Array:
    """i32[S]: one token per row of filtered f32[S, V] (-inf = excluded; each row has a finite
    entry), drawn with probability softmax(filtered), from one uniform per row (rng_key u32[S,
    2] raw threefry key data). Two levels: the word whose cumulative mass passes u * total,
    then the token inside it whose cumulative mass passes what is left."""
    S, V = filtered.shape
    W = -(-V // 32)
    p = jnp.exp(filtered - jnp.max(filtered, axis=-1, keepdims=True))  # f32[S, V]
    if V != W * 32:
        p = jnp.pad(p, ((0, 0), (0, W * 32 - V)))
    p = p.reshape(S, W, 32)
    word_mass = jnp.sum(p, axis=-1)  # f32[S, W]
    cum = jnp.cumsum(word_mass, axis=-1)  # f32[S, W]
    u = jax.vmap(lambda k: jax.random.uniform(jax.random.wrap_key_data(k), ()))(rng_key)
    target = u * cum[:, -1]  # f32[S] in [0, total)
    word = _first_above(cum, target, word_mass)
    rest = jnp.maximum(target - jnp.take_along_axis(cum - word_mass, word[:, None], 1)[:, 0], 0.0)
    inner = jnp.take_along_axis(p, word[:, None, None], axis=1)[:, 0, :]  # f32[S, 32]
    j = _first_above(jnp.cumsum(inner, axis=-1), rest, inner)
    return word * 32 + j
