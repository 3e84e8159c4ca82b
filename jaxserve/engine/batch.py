"""SchedulerOutput -> StepBatch: flat ragged numpy arrays padded to a (token, seq) bucket.

Plain numpy (no jax); `model_runner` is the only place these cross to the device. Layout, in
vLLM's vocabulary, for the T_b padded tokens of the S_b padded sequences of one step:
  token_ids, positions   i32[T_b]  the new tokens, sequence after sequence
  feed_rows              i32[T_b]  -1, or for a token still in flight (`ScheduledSeq.fed`:
                                    sampled by the previous dispatched step, not yet on the
                                    host) that step's batch row: the device takes the token
                                    from that step's sampler output (token_ids holds 0 there)
  slot_mapping           i32[T_b]  page * page_size + offset where each new token's K/V goes;
                                    padding tokens write into the trash page 0
  block_tables           i32[S_b, max_pages_per_seq]  each sequence's pages (0-padded)
                                    With KV groups (`BatchShape.num_kv_groups` G > 1, a model
                                    with sliding-window and global layers): slot_mapping is
                                    i32[G, T_b] and block_tables i32[G, S_b, max_pages_per_seq],
                                    group g's slots and tables (`Request.pages`, then
                                    `Request.group_pages`; a sliding group's slid-out pages
                                    are the trash page 0)
  kv_lens                i32[S_b]  context + new tokens (0 for padding sequences)
  cu_q_lens              i32[S_b + 1]  query offsets (padding sequences have length 0)
  num_seqs               i32[1]
  logits_indices         i32[S_b]  which token's logits each sequence samples from
  sampling               f32[S_b, K]  one row per sequence, one column per device sampling
                                    field (`sampling_params.DEVICE_FIELDS`); padding rows are
                                    `sampling_params.PAD_ROW` (greedy, nothing filtered)
  bias_ids, bias_values  i32/f32[S_b, B]  each row's logit_bias entries, padded with
                                    (BIAS_PAD_ID, 0.0), an id outside every vocabulary that
                                    the sampler's scatter drops. B = 0 when no row of the step
                                    has a bias (nothing sent, no scatter compiled in), else
                                    `sampling_params.MAX_LOGIT_BIAS` whatever the entry counts,
                                    so a bias never recompiles: 8 * S_b * B bytes sent (600 KiB
                                    at S_b = 256) and an S_b x B scatter-add on such steps only.
  bitmask                i32[S_b, W] or None  the allowed next tokens of each row under a grammar
                                    and / or vLLM's allowed_token_ids / bad_words (the
                                    grammar's `SequenceGrammar.fill`, ANDed with the request's
                                    `TokenFilter.fill`: bit t % 32 of word t // 32
                                    set = token t allowed; W = ceil(vocab / 32)); None when no
                                    row is constrained: nothing is sent, the runner hands the
                                    sampler a device-resident mask of that shape instead, and
                                    `constrained` (all False) makes it skip the masking at run
                                    time (one executable either way, no recompile)
  constrained            bool[S_b]  the rows the bitmask applies to (a grammar or a filter)
  prompt_lp_indices, prompt_lp_targets  i32[L]  the tokens whose next-token logprob is a
                                    prompt logprob, and that next prompt token; num_prompt_lp
                                    i32[1] the count (`engine.prompt_logprobs.pack`). L = 0 when
                                    no row wants prompt logprobs (the runner then skips that
                                    pass), else T_b.
  rng_key, history, history_is_output  derived per-row sampler inputs (see
                                    `jaxserve.device.sampler.SamplingTensors`)
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Mapping, Sequence

import numpy as np

from jaxserve.engine import prompt_logprobs
from jaxserve.engine.request import Request
from jaxserve.engine.sampling_params import MAX_LOGIT_BIAS, PAD_ROW
from jaxserve.engine.scheduler import SchedulerOutput
from jaxserve.engine.token_filter import bitmask_words

# Padding id of the bias arrays: above any vocabulary, so the sampler's scatter (mode="drop")
# skips it; padding entries then cost nothing on device (no updates piled onto token 0).
BIAS_PAD_ID = np.iinfo(np.int32).max


def bucket_for(num_tokens: int, num_seqs: int,
               buckets: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """Smallest compiled (tokens, seqs) bucket holding the step (buckets sorted by tokens)."""
    i = bisect.bisect_left(buckets, (num_tokens, 0))
    for t, s in buckets[i:]:
        if s >= num_seqs:
            return t, s
    raise ValueError(f"a step of {num_tokens} tokens in {num_seqs} sequences exceeds every "
                     f"compiled bucket (largest {buckets[-1]})")


def default_buckets(limit: int, smallest: int) -> tuple[int, ...]:
    """Powers of two from `smallest` up to `limit`, with `limit` itself as the last bucket."""
    out = []
    b = smallest
    while b < limit:
        out.append(b)
        b *= 2
    out.append(limit)
    return tuple(out)


# Default token buckets (`default_token_buckets`): powers of two up to 8, then steps of
# max(8, 1/STEPS_PER_OCTAVE of the octave): 8, 16, 24, ..., 64, 80, ..., 128, 160, ..., 256,
# 320, ... Why (scripts/bench/bench_buckets.py and docs/benchmarks/index.md "Buckets", bundled model
# on a 2-core CPU):
# a step's cost is about a + b*T + r*S (T tokens, S sequence rows) with a fixed part a (the
# weights are read whatever T is) worth ~70 tokens, so below 64 tokens the next multiple of
# 8 costs a decode step under ~12% of its time; above, the cost is nearly linear in T and the
# gap between buckets is the padding: a quarter octave keeps a step with its seqs bucket full
# under ~16% padded (8 per octave: ~12%, for 12 more compiled forwards at a budget of 512
# and a slower start) where powers of two padded up to ~45% (a 257-token step ran as 512).
# Each token bucket is one compile of the whole model (and of the prompt-logprobs pass).
FINE_FROM = 8
FINE_STEP = 8
STEPS_PER_OCTAVE = 4


def default_token_buckets(limit: int, steps_per_octave: int = STEPS_PER_OCTAVE
                          ) -> tuple[int, ...]:
    """Token buckets up to a step budget of `limit` tokens (the last is `limit` itself)."""
    if limit < 1 or steps_per_octave < 1:
        raise ValueError(f"limit={limit} and steps_per_octave={steps_per_octave} must be >= 1")
    out = []
    b = 1
    while b < limit:
        out.append(b)
        if b < FINE_FROM:
            b *= 2
        else:
            octave = 1 << (b.bit_length() - 1)  # the power of two at or below b
            b += max(FINE_STEP, octave // steps_per_octave)
    out.append(limit)
    return tuple(out)


def rng_key_data(seeds: np.ndarray, counters: np.ndarray) -> np.ndarray:
    """u32[N, 2] threefry key data for draw number `counters[i]` of a request seeded
    `seeds[i]` (both u64[N]).

    A splitmix64 finaliser over (seed, counter): depends on nothing else, so a seeded request
    draws the same numbers whatever shares its batch, step after step. uint64 arithmetic
    wraps modulo 2**64, exactly as the finaliser wants.
    """
    with np.errstate(over="ignore"):
        z = seeds * np.uint64(0x9E3779B97F4A7C15) + counters * np.uint64(0xBF58476D1CE4E5B9) \
            + np.uint64(0x94D049BB133111EB)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    return np.stack([(z >> np.uint64(32)).astype(np.uint32), z.astype(np.uint32)], axis=1)


@dataclasses.dataclass
class StepBatch:
    token_ids: np.ndarray  # i32[T_b]
    feed_rows: np.ndarray  # i32[T_b] -1, or the previous step's row whose token this is
    positions: np.ndarray  # i32[T_b]
    slot_mapping: np.ndarray  # i32[T_b]
    block_tables: np.ndarray  # i32[S_b, max_pages_per_seq]
    kv_lens: np.ndarray  # i32[S_b]
    cu_q_lens: np.ndarray  # i32[S_b + 1]
    num_seqs: np.ndarray  # i32[1]
    logits_indices: np.ndarray  # i32[S_b]
    sampling: np.ndarray  # f32[S_b, K] columns: sampling_params.DEVICE_FIELDS
    rng_key: np.ndarray  # u32[S_b, 2]
    history: np.ndarray  # i32[S_b, P] (P = 0 when no row uses penalties)
    history_is_output: np.ndarray  # bool[S_b, P]
    bias_ids: np.ndarray  # i32[S_b, B] (B = 0 when no row has a logit_bias, else MAX_LOGIT_BIAS)
    bias_values: np.ndarray  # f32[S_b, B]
    bitmask: np.ndarray | None  # i32[S_b, W] allowed tokens of constrained rows; None: no row
    constrained: np.ndarray  # bool[S_b] rows under a grammar (the bitmask applies)
    prompt_lp_indices: np.ndarray  # i32[L] (L = 0 when no row wants prompt logprobs, else T_b)
    prompt_lp_targets: np.ndarray  # i32[L]
    num_prompt_lp: np.ndarray  # i32[1]


@dataclasses.dataclass(frozen=True)
class BatchShape:
    # (tokens, seqs) pairs compiled at warmup, sorted; by default one sequence bucket per
    # token bucket, min(tokens, max_num_seqs): a step cannot hold more sequences than tokens.
    buckets: tuple[tuple[int, int], ...]
    page_size: int
    max_pages_per_seq: int
    vocab_size: int
    history_len: int  # P when penalties are on (max_model_len)
    num_kv_groups: int = 1  # G: block tables per sequence (`models/kv_groups.py`)


def build_batch(out: SchedulerOutput, shape: BatchShape,
                prev_rows: Mapping[int, int] | None = None,
                fill_grammars: bool = True) -> StepBatch:
    """Pack one scheduled step; rows follow `out.seqs` order. `prev_rows`: seq_id -> batch
    row in the step dispatched before this one, for the sequences it sampled (the source of
    each fed row's token; ValueError when a fed row's sequence is not there).
    `fill_grammars=False`: the masked rows are only marked `constrained`, and the runner
    gets their mask late (`late_bitmask`, once the previous step's tokens are in).

    Per-row Python work is kept to list appends; the arrays are built with a few vectorised
    numpy calls (this runs every step, for hundreds of sequences).
    """
    T, S = bucket_for(out.num_tokens, out.num_seqs, shape.buckets)
    ps = shape.page_size
    num = out.num_seqs
    tok: list[int] = []
    feeds: list[tuple[int, int]] = []  # (token index, previous step's row)
    pos: list[int] = []
    slot: list[int] = []
    q_lens: list[int] = []
    kv_lens_l: list[int] = []
    rows: list[tuple] = []
    seeds: list[int] = []
    counters: list[int] = []
    G = shape.num_kv_groups
    block_tables = np.zeros((S, shape.max_pages_per_seq), np.int32) if G == 1 else \
        np.zeros((G, S, shape.max_pages_per_seq), np.int32)
    group_slots: list[list[int]] = [[] for _ in range(G - 1)]  # groups 1.. (G > 1)
    penalised: list[int] = []
    biased: list[int] = []
    masked: list[tuple[int, Request]] = []  # rows that sample under a token mask
    scoring: list[int] = []  # rows whose request asked for prompt logprobs
    tok_append, pos_append, slot_append = tok.append, pos.append, slot.append
    for row, seq in enumerate(out.seqs):
        req = seq.request
        n = seq.num_new_tokens
        start = seq.start
        pages = req.pages
        if seq.fed:
            if prev_rows is None or req.seq_id not in prev_rows:
                raise ValueError(f"sequence {req.seq_id} feeds on a token the previous step "
                                 "did not sample")
            feeds.append((len(tok), prev_rows[req.seq_id]))
            tok_append(0)
            pos_append(start)
            slot_append(pages[start // ps] * ps + start % ps)
        elif n == 1:
            tok_append(req.all_token_ids[start])
            pos_append(start)
            slot_append(pages[start // ps] * ps + start % ps)
        else:
            p = np.arange(start, start + n)
            tok.extend(req.all_token_ids[start:start + n])
            pos.extend(p.tolist())
            slot.extend((np.asarray(pages)[p // ps] * ps + p % ps).tolist())
        if G == 1:
            block_tables[row, : len(pages)] = pages
        else:
            block_tables[0, row, : len(pages)] = pages
            p = np.arange(start, start + n)
            for g, table in enumerate(req.group_pages, 1):
                block_tables[g, row, : len(table)] = table
                group_slots[g - 1].extend((np.asarray(table)[p // ps] * ps + p % ps).tolist())
        q_lens.append(n)
        kv_lens_l.append(start + n)
        sp = req.sampling_params
        rows.append(sp.row)
        seeds.append(req.seed)
        # Draw number = output tokens before the one sampled here (counting any in flight),
        # the same whether or not the step overlapped the previous one.
        counters.append(max(start + n - req.num_prompt_tokens, 0))
        if sp.uses_penalties:
            penalised.append(row)
        if sp.logit_bias:
            biased.append(row)
        if req.masks_tokens and seq.samples:
            masked.append((row, req))
        if sp.prompt_logprobs is not None:
            scoring.append(row)
    t = len(tok)
    token_ids = np.zeros(T, np.int32)
    positions = np.zeros(T, np.int32)
    slot_mapping = np.zeros(T if G == 1 else (G, T), np.int32)  # padding -> trash page 0
    token_ids[:t] = tok
    feed_rows = np.full(T, -1, np.int32)
    for i, r in feeds:
        feed_rows[i] = r
    positions[:t] = pos
    if G == 1:
        slot_mapping[:t] = slot
    else:
        slot_mapping[0, :t] = slot
        for g, slots in enumerate(group_slots, 1):
            slot_mapping[g, :t] = slots
    kv_lens = np.zeros(S, np.int32)
    kv_lens[:num] = kv_lens_l
    cu_q_lens = np.zeros(S + 1, np.int32)
    cu_q_lens[1:num + 1] = np.cumsum(q_lens)
    cu_q_lens[num + 1:] = t
    logits_indices = np.maximum(cu_q_lens[1:] - 1, 0).astype(np.int32)

    sampling = pad_rows(S)
    if num:
        sampling[:num] = rows
    rng_key = np.zeros((S, 2), np.uint32)
    if num:
        rng_key[:num] = rng_key_data(np.array(seeds, np.uint64), np.array(counters, np.uint64))

    P = shape.history_len if penalised else 0
    history = np.full((S, P), -1, np.int32)
    is_output = np.zeros((S, P), bool)
    for row in penalised:
        req = out.seqs[row].request
        ids = req.all_token_ids[-P:]
        history[row, : len(ids)] = ids
        n_out = min(req.num_output_tokens, len(ids))
        is_output[row, len(ids) - n_out: len(ids)] = True
    bias_ids, bias_values = pad_bias(S, bool(biased))
    for row in biased:
        ids, values = out.seqs[row].request.logit_bias_arrays
        bias_ids[row, : len(ids)] = ids
        bias_values[row, : len(ids)] = values
    if fill_grammars:
        bitmask, constrained = fill_bitmask(S, shape.vocab_size, masked)
    else:
        bitmask, constrained = None, np.zeros(S, bool)
        constrained[[row for row, _ in masked]] = True
    scored = prompt_logprobs.spans(out, scoring, cu_q_lens) if scoring else []
    lp_indices, lp_targets, num_lp = prompt_logprobs.pack(out, scored, T if scored else 0)
    return StepBatch(token_ids, feed_rows, positions, slot_mapping, block_tables, kv_lens,
                     cu_q_lens, np.array([num], np.int32), logits_indices, sampling=sampling,
                     rng_key=rng_key, history=history, history_is_output=is_output,
                     bias_ids=bias_ids, bias_values=bias_values, bitmask=bitmask,
                     constrained=constrained, prompt_lp_indices=lp_indices,
                     prompt_lp_targets=lp_targets, num_prompt_lp=num_lp)


def fill_bitmask(num_seqs: int, vocab_size: int, rows: Sequence[tuple[int, Request]],
                 errors: list[tuple[Request, str]] | None = None
                 ) -> tuple[np.ndarray | None, np.ndarray]:
    """(i32[S, W] or None, bool[S]): the allowed next tokens of each (row, sequence) under a
    grammar and / or a token filter (`token_filter`: ANDed into the grammar's). A sequence
    for which no token is left (a grammar no token can continue: llguidance then allows only
    EOS and reports an error; or a filter that leaves nothing the grammar allows) raises
    ValueError (the engine fails that row alone with the reason, see `Recovery.build`), or
    with `errors` is added there and left unconstrained."""
    constrained = np.zeros(num_seqs, bool)
    if not rows:
        return None, constrained
    bitmask = np.zeros((num_seqs, bitmask_words(vocab_size)), np.int32)
    for row, req in rows:
        if req.grammar is not None:
            req.grammar.fill(bitmask, row)
        if req.token_filter is not None:
            req.token_filter.fill(bitmask, row, req.output_token_ids,
                                  combine=req.grammar is not None)
        constrained[row] = True
    empty = ~bitmask[constrained].any(axis=1)
    for (row, req), none in zip(rows, empty):
        message = _no_token_left(req, bool(none))
        if message is not None:
            if errors is None:
                raise ValueError(message)
            errors.append((req, message))
            constrained[row] = False
    return bitmask, constrained


def _no_token_left(req: Request, empty: bool) -> str | None:
    """Why `req` cannot sample its next token (None: it can): its grammar's error, or no
    token left by its mask (`empty`)."""
    error = req.grammar.error if req.grammar is not None else None
    if error is None and not empty:
        return None
    where = f"after {req.num_output_tokens} output tokens"
    if error is None and req.token_filter is not None:
        also = " and the grammar" if req.grammar is not None else ""
        return (f"allowed_token_ids / bad_words{also} leave no token of the vocabulary to "
                f"sample {where}")
    return (f"structured_outputs: no token of the vocabulary can continue the grammar "
            f"{where} (llguidance: {(error or 'no token allowed').splitlines()[0]})")


def late_bitmask(out: SchedulerOutput, num_seqs: int, vocab_size: int,
                 errors: list[tuple[Request, str]]) -> tuple[np.ndarray | None, np.ndarray]:
    """The mask of a step built with `fill_grammars=False`, filled once the previous step's
    tokens have advanced the grammars (and are in the outputs token filters read): rows
    whose sequence has finished meanwhile (its grammar ended, a stop string) are left free
    (their token is discarded)."""
    rows = [(i, s.request) for i, s in enumerate(out.seqs) if s.samples and
            s.request.masks_tokens and not s.request.is_finished]
    return fill_bitmask(num_seqs, vocab_size, rows, errors)


_PAD_ROW = np.asarray(PAD_ROW, np.float32)  # f32[K]


def pad_rows(num_seqs: int) -> np.ndarray:
    """f32[num_seqs, K]: padding rows of the sampling matrix (greedy, no filter, no penalty,
    no logprobs)."""
    return np.tile(_PAD_ROW, (num_seqs, 1))


def bias_width(biased: bool) -> int:
    """B of a step's bias arrays: 0 when no row has a logit_bias, else the one static width
    (each width is a sampler executable per seqs bucket, warmed up front)."""
    return MAX_LOGIT_BIAS if biased else 0


def pad_bias(num_seqs: int, biased: bool) -> tuple[np.ndarray, np.ndarray]:
    """(i32, f32)[num_seqs, bias_width(biased)]: rows with no logit bias (every entry is
    (BIAS_PAD_ID, 0.0), dropped by the sampler)."""
    width = bias_width(biased)
    return (np.full((num_seqs, width), BIAS_PAD_ID, np.int32),
            np.zeros((num_seqs, width), np.float32))
