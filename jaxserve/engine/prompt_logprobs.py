"""Prompt logprobs, host side: which of a step's tokens to score, and where the scores go.

Plain numpy (no jax). A prefill chunk of a sequence that wants prompt logprobs
(`Sequence.wants_prompt_logprobs`) computes positions [start, start + n); the hidden state at
position j predicts token j + 1, so each j with j + 1 < num_prompt_tokens scores prompt token
j + 1 (the last prompt position predicts the first generated token: the sampler's job).

  spans(out)        -> one `Span` per such row: its first scored position and how many
  pack_prompt_logprobs(out, T_b, cu_q_lens)
                    -> PromptLogprobRows, the step batch's part: i32[L] flat token index of
                       each scored position (row after row, in span order), i32[L] the prompt
                       token it predicts, i32[1] the count; what
                       `jaxserve.device.prompt_logprobs` reads. L = 0 when no row wants prompt
                       logprobs (the runner then skips that pass), else T_b
  unpack(out, ...)  -> the device's (logprob, top ids, top logprobs) rows written into each
                       request's `prompt_logprobs[j + 1]` as {target: logprob, top-N...}

A recomputed prefill (after preemption) scores the same positions again and overwrites them
with the same values. Prefix-cached positions are never computed, so such requests skip the
prefix cache (`PrefixCache.match`).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Sequence as GenericSequence

import numpy as np

from jaxserve.engine.scheduled import SchedulerOutput


@dataclasses.dataclass(frozen=True)
class Span:
    row: int  # batch row
    first: int  # first scored position (its hidden state predicts prompt token first + 1)
    count: int  # scored positions: first .. first + count - 1
    flat: int  # flat token index of position `first` in the step's token_ids


def spans(out: SchedulerOutput, rows: GenericSequence[int] | None = None,
          cu_q_lens: np.ndarray | None = None) -> list[Span]:
    """The step's scored positions, row by row (empty when no row wants prompt logprobs).
    `rows` / `cu_q_lens`: the candidate rows (those whose request asked for prompt logprobs)
    and the step's query offsets, when the caller has them (the batch build, every step);
    else every row is looked at."""
    if rows is None or cu_q_lens is None:
        rows = range(len(out.seqs))
        cu_q_lens = np.concatenate([[0], np.cumsum([s.num_new_tokens for s in out.seqs])])
    found = []
    for row in rows:
        seq = out.seqs[row]
        req = seq.sequence
        if req.wants_prompt_logprobs:
            end = min(seq.start + seq.num_new_tokens, req.num_prompt_tokens - 1)
            if end > seq.start:
                found.append(Span(row, seq.start, end - seq.start, int(cu_q_lens[row])))
    return found


@dataclasses.dataclass
class PromptLogprobRows:
    """The step batch's prompt logprobs part (L = 0: no row scores prompt tokens; sent and
    run only when L > 0)."""

    WIRE: ClassVar[str] = "prompt_logprobs"
    LATE: ClassVar[tuple[str, ...]] = ()
    indices: np.ndarray  # i32[L] flat token index of each scored position (padding 0)
    targets: np.ndarray  # i32[L] the prompt token it predicts (padding 0)
    num: np.ndarray  # i32[1] how many leading entries are real

    @classmethod
    def padding(cls, length: int) -> "PromptLogprobRows":
        return cls(np.zeros(length, np.int32), np.zeros(length, np.int32),
                   np.zeros(1, np.int32))

    @property
    def present(self) -> bool:
        """Whether the step runs the prompt logprobs pass (and, over hosts, sends these)."""
        return len(self.indices) > 0


def pack_prompt_logprobs(out: SchedulerOutput, num_tokens: int, cu_q_lens: np.ndarray
                         ) -> PromptLogprobRows:
    """The part of a step of `num_tokens` padded tokens with query offsets `cu_q_lens`."""
    rows = [i for i, s in enumerate(out.seqs)
            if s.sequence.sampling_params.prompt_logprobs is not None]
    found = spans(out, rows, cu_q_lens) if rows else []
    return pack(out, found, num_tokens if found else 0)


def pack(out: SchedulerOutput, found: list[Span], num_tokens: int) -> PromptLogprobRows:
    """`found`'s entries in arrays of length `num_tokens` (padding 0)."""
    part = PromptLogprobRows.padding(num_tokens)
    k = 0
    for s in found:
        ids = out.seqs[s.row].sequence.prompt_token_ids
        part.indices[k:k + s.count] = np.arange(s.flat, s.flat + s.count)
        part.targets[k:k + s.count] = ids[s.first + 1: s.first + 1 + s.count]
        k += s.count
    part.num[0] = k
    return part


def unpack(out: SchedulerOutput, found: list[Span], logprob: np.ndarray, top_ids: np.ndarray,
           top_logprobs: np.ndarray) -> None:
    """Write the scored rows (`logprob` f32[>= total], `top_ids` / `top_logprobs`
    [>= total, MAX_LOGPROBS], in `pack`'s order) into each request's prompt_logprobs."""
    k = 0
    for s in found:
        req = out.seqs[s.row].sequence
        n_top = req.sampling_params.prompt_logprobs or 0
        if req.prompt_logprobs is None:
            req.prompt_logprobs = [None] * req.num_prompt_tokens
        ids = req.prompt_token_ids
        for i in range(s.count):
            entry = {int(ids[s.first + 1 + i]): float(logprob[k])}
            for tid, lp in zip(top_ids[k][:n_top].tolist(), top_logprobs[k][:n_top].tolist()):
                entry.setdefault(tid, lp)
            req.prompt_logprobs[s.first + 1 + i] = entry
            k += 1
