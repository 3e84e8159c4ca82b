"""Speculative verification in the ordinary step: a row's proposed tokens become sampler rows.

Plain numpy (no jax). A decode row that verifies proposals p1..pj (`ScheduledSeq.
spec_token_ids`) is one (1 + j)-token query of the ragged step (its last token, then the
proposals); every one of its positions is sampled, each as its own sampler row, exactly as if
that position were the step's one sampling position:
  position m (0..j): logits of the query's token m (which predicts the token after it);
  knobs, logit bias: the sequence's own, repeated;
  random key: draw number num_output_tokens + m (the draw of output token num_output + m,
    the same key the non-speculative engine would use for it, so a seeded request samples
    the same tokens with or without speculation);
  penalties history: the tokens so far then p1..pm (what it would be had p1..pm been
    generated);
  token mask: the grammar advanced over p1..pm (a copy of the matcher), the token filter
    with p1..pm appended to the output.
So the step samples y_m from the target's distribution given the prefix with p1..pm, for
every m, in one forward. `Speculator.verify` then accepts p_{m+1} while y_m == p_{m+1}
and emits the accepted proposals plus the first y_m that differs (or y_j, the bonus token,
when all were accepted): the rejection-sampling rule for a proposal that is a point mass
(accept with probability p(x), else draw from p with x removed, renormalised), which keeps
the output distribution exactly the target's at every temperature and under every sampling
transform (top-k/p, min-p, penalties, bias, masks), since each y_m is an ordinary sample of
that position.

Rows: sequence i's sampler rows are contiguous, in `out.seqs` order (`sampler_rows`); a step
needs `out.num_rows` rows of its seqs bucket (`bucket_for(num_tokens, num_rows)`, and the
engine's sizing makes the buckets wide enough). `expand` rewrites the sampler parts of a batch
packed one row per sequence into this layout, in place.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from jaxserve.engine.batch_parts import rng_key_data
from jaxserve.engine.scheduled import SchedulerOutput

if TYPE_CHECKING:
    from jaxserve.engine.batch import StepBatch


def sampler_rows(out: SchedulerOutput) -> tuple[np.ndarray, np.ndarray]:
    """(src i32[R], offset i32[R]): the sequence (index in `out.seqs`) and the query position
    among its proposals (0..j) of each of the step's R = `out.num_rows` sampler rows."""
    counts = np.fromiter((1 + len(s.spec_token_ids) for s in out.seqs), np.int32,
                         len(out.seqs))
    src = np.repeat(np.arange(len(out.seqs), dtype=np.int32), counts)
    first = np.cumsum(counts) - counts
    return src, (np.arange(len(src), dtype=np.int32) - first[src]).astype(np.int32)


def first_rows(out: SchedulerOutput) -> list[int]:
    """The sampler row of each sequence's first sampled position (its only one when it does
    not verify proposals)."""
    rows, r = [], 0
    for s in out.seqs:
        rows.append(r)
        r += 1 + len(s.spec_token_ids)
    return rows


def expand(batch: "StepBatch", out: SchedulerOutput) -> None:
    """Rewrite `batch` (packed one sampler row per sequence) so that each verifying row's
    positions are sampler rows of their own (module docstring)."""
    src, off = sampler_rows(out)
    R = len(src)
    if R > batch.num_seqs_bucket:
        raise ValueError(f"{R} sampler rows exceed the step's seqs bucket "
                         f"{batch.num_seqs_bucket}")
    j = np.fromiter((len(s.spec_token_ids) for s in out.seqs), np.int32, len(out.seqs))
    f = batch.forward
    # Row r samples query token (last - (j - m)) of its sequence.
    f.logits_indices[:] = 0
    f.logits_indices[:R] = f.cu_q_lens[src + 1] - 1 - (j[src] - off)
    s = batch.sampling
    s.knobs[:R] = s.knobs[src]
    seqs = [x.sequence for x in out.seqs]
    seeds = np.array([seqs[i].seed for i in src], np.uint64)
    # Draw number of position m: the output tokens before the row's first sampled one (as
    # `pack_sampling` counts them, in-flight ones included), plus m.
    first = np.array([max(x.start + x.num_new_tokens - x.sequence.num_prompt_tokens, 0)
                      - len(x.spec_token_ids) for x in out.seqs], np.int64)
    counters = first[src] + off
    s.rng_key[:R] = rng_key_data(seeds, counters.astype(np.uint64))
    b = batch.bias
    if b.ids.shape[1]:
        b.ids[:R], b.values[:R] = b.ids[src], b.values[src]
    p = batch.penalties
    if p.history.shape[1]:
        _expand_penalties(p.history, p.history_is_output, out, src, off)
    m = batch.mask
    if m.bitmask is not None:
        m.bitmask[:R], m.constrained[:R] = m.bitmask[src], m.constrained[src]
        _expand_masks(m.bitmask, out, src, off)
    elif m.constrained.any():
        raise ValueError("a step that verifies proposals cannot take its token mask late")


def _expand_penalties(history: np.ndarray, is_output: np.ndarray, out: SchedulerOutput,
                      src: np.ndarray, off: np.ndarray) -> None:
    """Each penalised row's history as if its earlier proposals had been generated."""
    P = history.shape[1]
    history[:len(src)], is_output[:len(src)] = history[src], is_output[src]
    for r in np.flatnonzero(off > 0):
        sched = out.seqs[src[r]]
        seq = sched.sequence
        if not seq.sampling_params.uses_penalties:
            continue
        ids = (seq.all_token_ids + list(sched.spec_token_ids[:off[r]]))[-P:]
        history[r] = -1
        is_output[r] = False
        history[r, :len(ids)] = ids
        n_out = min(seq.num_output_tokens + int(off[r]), len(ids))
        is_output[r, len(ids) - n_out: len(ids)] = True


def _expand_masks(bitmask: np.ndarray, out: SchedulerOutput, src: np.ndarray,
                  off: np.ndarray) -> None:
    """Each masked verifying row's mask at positions 1..j: its grammar (a copy) advanced
    over the proposals before it, its token filter with them appended to the output. The
    proposals are valid grammar moves (`Speculator` cuts them where the grammar refuses or
    ends), so every position has a mask."""
    grammars: dict[int, object] = {}
    for r in np.flatnonzero(off > 0):
        i = int(src[r])
        sched = out.seqs[i]
        seq = sched.sequence
        if not seq.masks_tokens:
            continue
        before = list(sched.spec_token_ids[:off[r]])
        if seq.grammar is not None:
            g = grammars.get(i)
            if g is None:
                g = grammars[i] = seq.grammar.copy()
            if not g.accept(before[-1]):  # type: ignore[attr-defined]
                raise ValueError(f"sequence {seq.seq_id}: proposal {before[-1]} is not a move "
                                 f"of its grammar ({g.error})")  # type: ignore[attr-defined]
            g.fill(bitmask, int(r))  # type: ignore[attr-defined]
        if seq.token_filter is not None:
            seq.token_filter.fill(bitmask, int(r), seq.output_token_ids + before,
                                  combine=seq.grammar is not None)
        if not bitmask[r].any():
            raise ValueError(f"sequence {seq.seq_id}: no token is allowed after proposal "
                             f"{before[-1]}")
