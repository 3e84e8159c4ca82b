"""N-gram speculation (prompt lookup): propose the tokens that followed an earlier occurrence of
a sequence's last n tokens, for many sequences at once, on the host (numpy, no jax).

Data flow: the engine keeps each speculating sequence's token ids (prompt + output so far) and
passes them as one padded array `token_ids` [B, T] with `num_tokens` [B]; `propose_ngram`
returns `drafts` [B, k] and `num_drafts` [B], which become the proposed query tokens of each
row's verification step (a row with 0 drafts decodes plainly).

The rule is vLLM v1's `NgramProposer` (vllm/v1/spec_decode/ngram_proposer.py,
`_find_longest_matched_ngram_and_propose_tokens`, which runs KMP over the reversed tokens),
matched case for case, for a sequence of n tokens t[0..n-1]:
- the n-gram length L is the longest in [prompt_lookup_min, prompt_lookup_max] whose suffix
  t[n-L..n-1] also occurs starting at some s < n - L (an earlier occurrence; it may overlap
  the suffix itself, as in a run of one repeated token);
- of those occurrences the earliest (smallest s) is taken (vLLM's test "always pick the first
  one");
- the proposal is t[s+L : s+L+c] with c = min(k, max_model_len - n, n - (s+L)): never past
  the sequence's end nor past max_model_len tokens in all; so at least one token when a
  match exists and max_model_len - n >= 1;
- nothing is proposed when no L in range matches, when n < prompt_lookup_min, or when
  max_model_len - n <= 0.

How: instead of KMP per sequence (a Python loop per token), every position j <= n-2 whose
token equals the last token is a candidate end of an occurrence; each candidate's match length
is extended backwards one offset at a time (prompt_lookup_max - 1 vectorised passes over the
surviving candidates), and per row the candidate with the greatest (length, -j) wins. The
work is one compare over the padded array plus passes over the few candidates that survive.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxserve.spec_config import SpeculativeConfig


def pack(sequences: Sequence[Sequence[int] | np.ndarray], width: int | None = None
         ) -> tuple[np.ndarray, np.ndarray]:
    """Ragged token lists -> (`token_ids` [B, width] int32, zero-padded; `num_tokens` [B]
    int64). `width` None: the longest sequence."""
    lens = np.fromiter((len(s) for s in sequences), np.int64, len(sequences))
    width = int(lens.max(initial=1)) if width is None else width
    out = np.zeros((len(sequences), max(width, 1)), np.int32)
    for i, s in enumerate(sequences):
        out[i, :len(s)] = s
    return out, lens


def propose_ngram(token_ids: np.ndarray, num_tokens: np.ndarray, *, k: int, min_n: int,
                  max_n: int, max_model_len: int | None = None
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Prompt-lookup proposals for every row (the module docstring states the rule).

    token_ids [B, T] integer: row b's first num_tokens[b] entries are its tokens, the rest
    padding (never read). Returns (drafts [B, k] int32, zero past each row's count;
    num_drafts [B] int32 in [0, k]). max_model_len None: no cap besides the sequence's end.
    """
    if not (isinstance(k, int) and k >= 1 and 1 <= min_n <= max_n):
        raise ValueError(f"k={k!r} must be >= 1 and 1 <= min_n={min_n!r} <= max_n={max_n!r}")
    tok = np.asarray(token_ids)
    if tok.ndim != 2:
        raise ValueError(f"token_ids must be [B, T], got shape {tok.shape}")
    bsz, width = tok.shape
    n = np.asarray(num_tokens, np.int64)
    if n.shape != (bsz,) or (bsz and (n.min() < 0 or n.max() > width)):
        raise ValueError(f"num_tokens must be [B={bsz}] in [0, T={width}]")
    drafts = np.zeros((bsz, k), np.int32)
    counts = np.zeros(bsz, np.int32)
    # Room left for drafts: k, less what max_model_len leaves (vLLM's cap).
    room = np.full(bsz, k, np.int64) if max_model_len is None else np.minimum(
        k, max_model_len - n)
    rows = np.flatnonzero((n >= max(min_n, 2)) & (room > 0))
    if rows.size == 0 or width < 2:
        return drafts, counts
    sub = tok if rows.size == bsz else tok[rows]
    nr = n[rows]
    last = sub[np.arange(rows.size), nr - 1]
    # Candidate occurrence ends j in [0, n-2] holding the last token.
    hit = sub[:, :-1] == last[:, None]
    hit &= np.arange(width - 1) < (nr - 1)[:, None]
    found = np.count_nonzero(hit)
    if found == 0:
        return drafts, counts
    # Few candidates (real vocabularies): extend only those. Many (a repeated token, a tiny
    # vocabulary): whole-array passes, whose cost does not grow with the candidate count.
    if found * _DENSE_FRACTION > hit.size:
        br, end = _longest_dense(sub, nr, hit, min_n, max_n)
    else:
        br, end = _longest_sparse(sub, nr, hit, min_n, max_n)
    if br.size == 0:
        return drafts, counts
    first = end + 1  # the token after the occurrence
    cnt = np.minimum(room[rows][br], nr[br] - first)
    offs = np.arange(k)
    take = offs < cnt[:, None]
    pos = np.minimum(first[:, None] + offs, width - 1)
    vals = np.where(take, sub[br[:, None], pos], 0)
    out_rows = rows[br]
    drafts[out_rows] = vals
    counts[out_rows] = cnt
    return drafts, counts


# Above 1/_DENSE_FRACTION of the positions being candidates, the dense passes are cheaper
# (bench_ngram.py: a repeated-token run of 256 x 2048 takes ~90 ms sparse).
_DENSE_FRACTION = 16


def _longest_sparse(sub, nr, hit, min_n, max_n) -> tuple[np.ndarray, np.ndarray]:
    """(rows of `sub` with a match of length >= min_n, the end j of each one's chosen
    occurrence), extending each candidate end backwards offset by offset."""
    width = sub.shape[1]
    cr, cj = np.nonzero(hit)  # row-major: sorted by row
    length = np.ones(cr.size, np.int64)
    alive = np.arange(cr.size)
    for m in range(1, max_n):
        if alive.size == 0:
            break
        r, j = cr[alive], cj[alive]
        # j - m >= 0 implies n-1-m >= 1 (as j <= n-2): both reads are inside the row.
        ok = j >= m
        r, j, alive = r[ok], j[ok], alive[ok]
        alive = alive[sub[r, j - m] == sub[r, nr[r] - 1 - m]]
        length[alive] += 1
    keep = length >= min_n
    cr, cj, length = cr[keep], cj[keep], length[keep]
    if cr.size == 0:
        return cr, cj
    # Per row: the longest match, then the earliest end (hence earliest start) among those.
    score = length * (width + 1) + (width - cj)
    starts = np.flatnonzero(np.r_[True, cr[1:] != cr[:-1]])
    best = np.maximum.reduceat(score, starts)
    return cr[starts], width - best % (width + 1)


def _longest_dense(sub, nr, hit, min_n, max_n) -> tuple[np.ndarray, np.ndarray]:
    """As `_longest_sparse`, with one pass over the whole [B, T-1] array per offset."""
    alive = hit  # consumed: hit is not used again
    length = alive.astype(np.int32)
    last_col = alive.shape[1]
    rows = np.arange(sub.shape[0])
    for m in range(1, min(max_n, last_col)):
        # Ends j < m have no token m back; j = m-1 is the one column this offset removes.
        alive[:, m - 1] = False
        # Rows with n-1-m < 0 have no alive j >= m (j <= n-2), so the clipped read is unused.
        sfx = sub[rows, np.maximum(nr - 1 - m, 0)]
        alive[:, m:] &= sub[:, :last_col - m] == sfx[:, None]
        length += alive
    best = length.max(axis=1)
    has = best >= min_n
    br = np.flatnonzero(has)
    # argmax of a boolean row: the first (earliest) end holding the longest match.
    end = np.argmax(length[br] == best[br, None], axis=1)
    return br, end


class NgramProposer:
    """The engine's handle: a SpeculativeConfig's k and n-gram bounds plus max_model_len."""

    def __init__(self, k: int, min_n: int, max_n: int, max_model_len: int | None = None):
        if not (isinstance(k, int) and k >= 1 and 1 <= min_n <= max_n):
            raise ValueError(f"k={k!r} must be >= 1 and 1 <= min_n={min_n!r} <= "
                             f"max_n={max_n!r}")
        self.k, self.min_n, self.max_n, self.max_model_len = k, min_n, max_n, max_model_len

    @classmethod
    def from_config(cls, spec: SpeculativeConfig, max_model_len: int | None) -> "NgramProposer":
        if spec.method != "ngram":
            raise ValueError(f"NgramProposer needs method 'ngram', not {spec.method!r}")
        assert spec.prompt_lookup_min is not None and spec.prompt_lookup_max is not None
        return cls(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max,
                   max_model_len)

    def propose_arrays(self, token_ids: np.ndarray, num_tokens: np.ndarray
                       ) -> tuple[np.ndarray, np.ndarray]:
        return propose_ngram(token_ids, num_tokens, k=self.k, min_n=self.min_n,
                             max_n=self.max_n, max_model_len=self.max_model_len)

    def propose(self, sequences: Sequence[Sequence[int] | np.ndarray]) -> list[list[int]]:
        """One list of proposed tokens per sequence (empty: none)."""
        drafts, counts = self.propose_arrays(*pack(sequences))
        return [drafts[i, :c].tolist() for i, c in enumerate(counts)]
