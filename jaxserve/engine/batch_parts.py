"""The per-feature parts of a `StepBatch`, each packed from the scheduled rows by its packer.

Plain numpy (no jax). A step's arrays are grouped by the feature that reads them, so a feature
is one dataclass here (its arrays, each with its shape / dtype), one packer (`pack_*`: from the
`SchedulerOutput` rows to the padded arrays of the step's (T_b tokens, S_b sequences) bucket)
and one all-padding constructor (`padding`: what warmup compiles with and what a follower
process fills from the leader's broadcast). What moves a part off the host walks
`batch.parts` / `batch.leaves` instead of naming fields, so adding a part is a local change:
the part, its packer, its line in `StepBatch` and in `build_batch` / `empty_batch`, and where
the device reads it (`model_runner.to_step_inputs`; the sampler's parts are themselves
fields of `device.sampler.SamplingTensors`, registered there as pytrees).

Class attributes every part declares (read by the walkers and the multi-host broadcast):
  WIRE   which broadcast it travels in over several hosts (`device/multihost.py`): the parts
         of one broadcast share the dimensions their shapes vary with, so each broadcast is
         compiled once per warmed shape; a new broadcast means a new collective per step
  LATE   fields that do not travel with the step (the grammar bitmask: sent once the
         previous step's tokens are in)

Parts here: `ForwardInputs` (the model's ragged inputs), `LoraRows` (each token's adapter
slot), `SamplingRows`, `PenaltyRows`, `LogitBiasRows`; the token mask
(`batch_mask.TokenMaskRows`) and prompt logprobs
(`prompt_logprobs.PromptLogprobRows`) live with the rest of their feature.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, ClassVar, Mapping

import numpy as np

from jaxserve.engine.sampling_params import MAX_LOGIT_BIAS, PAD_ROW
from jaxserve.engine.scheduled import SchedulerOutput

if TYPE_CHECKING:
    from jaxserve.engine.batch import BatchShape

# Padding id of the bias arrays: above any vocabulary, so the sampler's scatter (mode="drop")
# skips it; padding entries then cost nothing on device (no updates piled onto token 0).
BIAS_PAD_ID = np.iinfo(np.int32).max


@dataclasses.dataclass
class ForwardInputs:
    """The forward's ragged inputs, in vLLM's vocabulary (T = T_b, S = S_b). With KV groups
    (`BatchShape.num_kv_groups` G > 1: a model with sliding-window and global layers)
    slot_mapping and block_tables carry a leading G axis: group g's slots and tables
    (`Sequence.pages`, then `Sequence.group_pages`; a sliding group's slid-out pages are the
    trash page 0)."""

    WIRE: ClassVar[str] = "forward"
    LATE: ClassVar[tuple[str, ...]] = ()
    token_ids: np.ndarray  # i32[T] the new tokens, sequence after sequence (0 where fed)
    feed_rows: np.ndarray  # i32[T] -1, or for a token still in flight (`ScheduledSeq.fed`)
    #                        the previous step's batch row that sampled it: the device takes
    #                        the token from that step's sampler output
    positions: np.ndarray  # i32[T]
    slot_mapping: np.ndarray  # i32[T] or i32[G, T] page * page_size + offset of each new
    #                           token's K/V; padding tokens write into the trash page 0
    block_tables: np.ndarray  # i32[S, max_pages_per_seq] or i32[G, S, ...] pages, 0-padded
    kv_lens: np.ndarray  # i32[S] context + new tokens (0 for padding sequences)
    cu_q_lens: np.ndarray  # i32[S + 1] query offsets (padding sequences have length 0)
    num_seqs: np.ndarray  # i32[1] live sequences
    logits_indices: np.ndarray  # i32[S] which token's logits each sequence samples from

    @classmethod
    def padding(cls, shape: "BatchShape", num_tokens: int, num_seqs: int) -> "ForwardInputs":
        groups = () if shape.num_kv_groups == 1 else (shape.num_kv_groups,)
        T, S, i32 = num_tokens, num_seqs, np.int32
        return cls(token_ids=np.zeros(T, i32), feed_rows=np.full(T, -1, i32),
                   positions=np.zeros(T, i32), slot_mapping=np.zeros(groups + (T,), i32),
                   block_tables=np.zeros(groups + (S, shape.max_pages_per_seq), i32),
                   kv_lens=np.zeros(S, i32), cu_q_lens=np.zeros(S + 1, i32),
                   num_seqs=np.zeros(1, i32), logits_indices=np.zeros(S, i32))


def pack_forward(out: SchedulerOutput, shape: "BatchShape", num_tokens: int, num_seqs: int,
                 prev_rows: Mapping[int, int] | None) -> ForwardInputs:
    """The step's tokens, positions, KV slots and tables. `prev_rows`: seq_id -> row in the
    step dispatched before, the source of each fed row's token (ValueError when missing).

    Per-row Python work is kept to list appends; the arrays are built with a few vectorised
    numpy calls (this runs every step, for hundreds of sequences)."""
    T, S, ps, num = num_tokens, num_seqs, shape.page_size, out.num_seqs
    tok: list[int] = []
    feeds: list[tuple[int, int]] = []  # (token index, previous step's row)
    pos: list[int] = []
    slot: list[int] = []
    q_lens: list[int] = []
    kv_lens_l: list[int] = []
    G = shape.num_kv_groups
    block_tables = np.zeros((S, shape.max_pages_per_seq), np.int32) if G == 1 else \
        np.zeros((G, S, shape.max_pages_per_seq), np.int32)
    group_slots: list[list[int]] = [[] for _ in range(G - 1)]  # groups 1.. (G > 1)
    tok_append, pos_append, slot_append = tok.append, pos.append, slot.append
    for row, seq in enumerate(out.seqs):
        req = seq.sequence
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
            if seq.spec_token_ids:  # a verification row: its last token, then the proposals
                tok_append(req.all_token_ids[start])
                tok.extend(seq.spec_token_ids)
            else:
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
    return ForwardInputs(token_ids, feed_rows, positions, slot_mapping, block_tables, kv_lens,
                         cu_q_lens, np.array([num], np.int32), logits_indices)


@dataclasses.dataclass
class LoraRows:
    """Each token's LoRA adapter slot (`lora_slots.LoraSlots`), the row index into the
    device's adapter stacks of every LoRA-targeted projection. Slot 0 is "no adapter" (all
    zeros): base-model rows, padding, and every token when LoRA is off (the device then
    ignores the part). Data, never a static argument: mixing adapters never recompiles."""

    WIRE: ClassVar[str] = "forward"  # its shape varies with T only, as the forward's do
    LATE: ClassVar[tuple[str, ...]] = ()
    token_slots: np.ndarray  # i32[T] slot of the sequence each token belongs to

    @classmethod
    def padding(cls, num_tokens: int) -> "LoraRows":
        return cls(np.zeros(num_tokens, np.int32))


def pack_lora(out: SchedulerOutput, num_tokens: int, cu_q_lens: np.ndarray) -> LoraRows:
    """Each row's `ScheduledSeq.lora_slot` over its query tokens (`cu_q_lens`: the forward's
    i32[S + 1] query offsets)."""
    part = LoraRows.padding(num_tokens)
    num = out.num_seqs
    slots = [s.lora_slot for s in out.seqs]
    if any(slots):
        t = int(cu_q_lens[num])
        q_lens = np.diff(cu_q_lens[:num + 1])
        part.token_slots[:t] = np.repeat(np.asarray(slots, np.int32), q_lens)
    return part


_PAD_ROW = np.asarray(PAD_ROW, np.float32)  # f32[K]


def pad_rows(num_seqs: int) -> np.ndarray:
    """f32[num_seqs, K]: padding rows of the sampling matrix (greedy, no filter, no penalty,
    no logprobs)."""
    return np.tile(_PAD_ROW, (num_seqs, 1))


@dataclasses.dataclass
class SamplingRows:
    """Every row's sampling knobs and random key (see `jaxserve.device.sampler`)."""

    WIRE: ClassVar[str] = "sampler"
    LATE: ClassVar[tuple[str, ...]] = ()
    knobs: np.ndarray  # f32[S, K] one column per device sampling field
    #                    (`sampling_params.DEVICE_FIELDS`); padding rows are `PAD_ROW`
    rng_key: np.ndarray  # u32[S, 2] threefry key data of this row's draw (`rng_key_data`)

    @classmethod
    def padding(cls, num_seqs: int) -> "SamplingRows":
        return cls(pad_rows(num_seqs), np.zeros((num_seqs, 2), np.uint32))


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


def pack_sampling(out: SchedulerOutput, num_seqs: int) -> SamplingRows:
    part = SamplingRows.padding(num_seqs)
    if not out.seqs:
        return part
    reqs = [s.sequence for s in out.seqs]
    part.knobs[:len(reqs)] = [r.sampling_params.row for r in reqs]
    # Draw number = output tokens before the one sampled here (counting any in flight),
    # the same whether or not the step overlapped the previous one.
    counters = [max(s.start + s.num_new_tokens - r.num_prompt_tokens, 0)
                for s, r in zip(out.seqs, reqs)]
    part.rng_key[:len(reqs)] = rng_key_data(np.array([r.seed for r in reqs], np.uint64),
                                            np.array(counters, np.uint64))
    return part


@dataclasses.dataclass
class PenaltyRows:
    """Token history of the rows under repetition / presence / frequency penalties."""

    WIRE: ClassVar[str] = "sampler"
    LATE: ClassVar[tuple[str, ...]] = ()
    history: np.ndarray  # i32[S, Ph] prompt + output token ids, -1 padded; Ph = 0 when no
    #                      row of the step uses penalties (nothing sent), else history_len
    history_is_output: np.ndarray  # bool[S, Ph] True where history holds a generated token

    @classmethod
    def padding(cls, num_seqs: int, history_len: int) -> "PenaltyRows":
        return cls(np.full((num_seqs, history_len), -1, np.int32),
                   np.zeros((num_seqs, history_len), bool))


def pack_penalties(out: SchedulerOutput, num_seqs: int, history_len: int) -> PenaltyRows:
    rows = [i for i, s in enumerate(out.seqs) if s.sequence.sampling_params.uses_penalties]
    P = history_len if rows else 0
    part = PenaltyRows.padding(num_seqs, P)
    for row in rows:
        req = out.seqs[row].sequence
        ids = req.all_token_ids[-P:]
        part.history[row, : len(ids)] = ids
        n_out = min(req.num_output_tokens, len(ids))
        part.history_is_output[row, len(ids) - n_out: len(ids)] = True
    return part


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


@dataclasses.dataclass
class LogitBiasRows:
    """Each row's logit_bias entries, padded with (BIAS_PAD_ID, 0.0), an id outside every
    vocabulary that the sampler's scatter drops. B = 0 when no row of the step has a bias
    (nothing sent, no scatter compiled in), else `sampling_params.MAX_LOGIT_BIAS` whatever the
    entry counts, so a bias never recompiles: 8 * S * B bytes sent (600 KiB at S = 256) and
    an S x B scatter-add on such steps only."""

    WIRE: ClassVar[str] = "sampler"
    LATE: ClassVar[tuple[str, ...]] = ()
    ids: np.ndarray  # i32[S, B] token ids (BIAS_PAD_ID where padded)
    values: np.ndarray  # f32[S, B] their biases (0.0 where padded)

    @classmethod
    def padding(cls, num_seqs: int, biased: bool) -> "LogitBiasRows":
        return cls(*pad_bias(num_seqs, biased))


def pack_logit_bias(out: SchedulerOutput, num_seqs: int) -> LogitBiasRows:
    rows = [i for i, s in enumerate(out.seqs) if s.sequence.sampling_params.logit_bias]
    part = LogitBiasRows.padding(num_seqs, bool(rows))
    for row in rows:
        ids, values = out.seqs[row].sequence.logit_bias_arrays
        part.ids[row, : len(ids)] = ids
        part.values[row, : len(ids)] = values
    return part
