"""The token mask part of a `StepBatch`: which next tokens each constrained row may sample.

Plain numpy (no jax). A row is constrained by a grammar (`SequenceGrammar.fill`) and / or
vLLM's allowed_token_ids / bad_words (`TokenFilter.fill`, ANDed into the grammar's): bit
t % 32 of word t // 32 set = token t allowed, W = ceil(vocab / 32) words per row.

  pack_token_mask(out, ...) -> TokenMaskRows   at build time (`batch.build_batch`), or with
                               fill=False only the `constrained` rows, the mask itself then
                               coming from
  late_bitmask(out, ...)                       once the previous step's tokens have advanced
                               the grammars (the engine's `runner.LateMask`, called while the
                               forward runs)

A step where no row is constrained sends no mask (bitmask None): the runner hands the sampler a
device-resident mask of that shape instead, and `constrained` (all False) makes it skip the
masking at run time (one executable either way, no recompile).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Sequence as GenericSequence

import numpy as np

from jaxserve.engine.sequence import Sequence
from jaxserve.engine.scheduled import SchedulerOutput
from jaxserve.engine.token_filter import bitmask_words


@dataclasses.dataclass
class TokenMaskRows:
    """The step's token mask. `bitmask` is LATE: over several hosts it travels after the
    forward is queued (`device/multihost.py`), `constrained` with the sampler's arrays."""

    WIRE: ClassVar[str] = "sampler"
    LATE: ClassVar[tuple[str, ...]] = ("bitmask",)
    bitmask: np.ndarray | None  # i32[S, W] allowed tokens of the constrained rows; None: none
    constrained: np.ndarray  # bool[S] the rows the bitmask applies to

    @classmethod
    def padding(cls, num_seqs: int) -> "TokenMaskRows":
        return cls(None, np.zeros(num_seqs, bool))


def pack_token_mask(out: SchedulerOutput, num_seqs: int, vocab_size: int,
                    fill: bool = True) -> TokenMaskRows:
    """The mask of the rows that sample under one; `fill=False`: only mark them `constrained`
    (the runner gets their mask late, `late_bitmask`)."""
    rows = [(i, s.sequence) for i, s in enumerate(out.seqs)
            if s.samples and s.sequence.masks_tokens]
    if fill:
        return TokenMaskRows(*fill_bitmask(num_seqs, vocab_size, rows))
    part = TokenMaskRows.padding(num_seqs)
    part.constrained[[row for row, _ in rows]] = True
    return part


def fill_bitmask(num_seqs: int, vocab_size: int, rows: GenericSequence[tuple[int, Sequence]],
                 errors: list[tuple[Sequence, str]] | None = None
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


def _no_token_left(req: Sequence, empty: bool) -> str | None:
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
                 errors: list[tuple[Sequence, str]]) -> tuple[np.ndarray | None, np.ndarray]:
    """The mask of a step built with `fill_grammars=False`, filled once the previous step's
    tokens have advanced the grammars (and are in the outputs token filters read): rows
    whose sequence has finished meanwhile (its grammar ended, a stop string) are left free
    (their token is discarded)."""
    rows = [(i, s.sequence) for i, s in enumerate(out.seqs) if s.samples and
            s.sequence.masks_tokens and not s.sequence.is_finished]
    return fill_bitmask(num_seqs, vocab_size, rows, errors)
